"""Attention of packed sequences for the target forwards (Llama family and DeepSeek-V3/Kimi alike):
causal over each sequence for extraction, against a KV cache for decoding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def sdpa(q, k, v, **kw) -> torch.Tensor:
    """q/k/v [n, heads, D] -> [n, heads, Dv]. SDPA's fused (flash) kernels take only 4-D inputs:
    3-D ones silently run the math path, which materializes the scores (much slower)."""
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], enable_gqa=q.shape[1] != k.shape[1],
                                          **kw)[0].transpose(0, 1)


def causal_attention_packed(q, k, v, cu_seqlens, scale=None):
    """Causal attention of each packed sequence on its own: q/k [T, heads, D], v [T, Hkv, Dv]
    -> [T, Hq, Dv]. A v narrower than q/k (MLA: 128 < 192) runs as it is under cuDNN where cuDNN
    takes the sequence (no padded copy; forward only: extraction and decoding); elsewhere it is
    zero-padded to D, since flash attention needs equal head dims."""
    dv = v.shape[-1]
    pad = max(0, q.shape[-1] - dv)    # v wider than q/k (no model here) runs as it is
    out = q.new_empty(q.shape[0], q.shape[1], dv)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = q[a:b], k[a:b], v[a:b]
        if pad and cudnn_takes(qs, ks, vs):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                out[a:b] = sdpa(qs, ks, vs, is_causal=True, scale=scale)
        else:
            out[a:b] = sdpa(qs, ks, F.pad(vs, (0, pad)) if pad else vs, is_causal=True, scale=scale)[..., :dv]
    return out


def cudnn_takes(q, k, v) -> bool:
    """Whether cuDNN's fused attention runs these causal q/k/v [T, heads, D] (in sdpa's layout)."""
    if not q.is_cuda:
        return False
    as_4d = [x.transpose(0, 1)[None] for x in (q, k, v)]
    params = torch.backends.cuda.SDPAParams(*as_4d, None, 0.0, True, q.shape[1] != k.shape[1])
    return torch.backends.cuda.can_use_cudnn_attention(params)


def cached_attention_packed(q, k, v, cu_seqlens, caches, scale=None):
    """Decoding step of several sequences: segment i of q/k/v [T, heads, D] continues caches[i].
    `caches` is either one dict per sequence (attention one sequence at a time) or a batched pass
    over a shared KV pool (incremental.LayerPass: its `attend` writes and attends for all at once)."""
    if not isinstance(caches, list):
        return caches.attend(q, k, v, scale)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    bounds = cu_seqlens.tolist()
    for a, b, cache in zip(bounds[:-1], bounds[1:], caches):
        out[a:b] = cached_attention(q[a:b], *extend_cache(cache, k=k[a:b], v=v[a:b]), scale=scale)
    return out


def extend_cache(cache: dict, **new: torch.Tensor) -> list[torch.Tensor]:
    """Append this step's tensors (token axis first) to a layer's decoding cache; return all."""
    for name, tensor in new.items():
        cache[name] = tensor if name not in cache else torch.cat([cache[name], tensor])
    return [cache[name] for name in new]


def cached_attention(q, k, v, scale=None):
    """The last q.shape[0] positions of one sequence attending to all k/v [n, Hkv, D]: causal,
    aligned to the end (query i sees keys 0 .. n - T + i)."""
    T, n = q.shape[0], k.shape[0]
    visible = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - T, n, device=q.device)[:, None]
    return sdpa(q, k, v, attn_mask=visible, scale=scale)


def causal_cached_attention(q, k, v, scale=None):
    """cached_attention where the cache held nothing before these queries (k/v [T, Hkv, D]):
    plain causal attention, which the fused kernels run without a mask."""
    return sdpa(q, k, v, is_causal=True, scale=scale)


def padded_cached_attention(q, k_cache, v_cache, rows, pad_index, mask, scale=None):
    """Attention of a few new tokens of each of R sequences against their cached keys, in one call.

    q [t, Hq, D]: the tokens, packed; pad_index [t]: where each goes in the padded [R * n] rows
    (row r * n + i: query i of sequence r); k/v_cache [slots, capacity, Hkv, D|Dv]: the pool's
    buffers, new keys already written; rows: the R slots (a slice: a view, no copy; or an index
    tensor: gathered); mask [R, 1, n * G, L] additive or bool, G = Hq / Hkv: query i of head
    h * G + g is row i * G + g of kv head h (GQA folded into the query length: no repeated
    keys, and any fused kernel applies). -> [t, Hq, Dv]. Padded queries are zeros and see at
    least key 0: every row stays finite."""
    R, _, rows_per_head, L = mask.shape
    Hq, Hkv, D = q.shape[1], k_cache.shape[2], q.shape[2]
    G = Hq // Hkv
    n = rows_per_head // G
    padded = q.new_zeros(R * n, Hq, D).index_copy_(0, pad_index, q)
    folded = padded.view(R, n, Hkv, G, D).transpose(1, 2).reshape(R, Hkv, n * G, D)
    k, v = k_cache[rows, :L].transpose(1, 2), v_cache[rows, :L].transpose(1, 2)    # [R, Hkv, L, D]
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)  # [R, Hkv, n * G, Dv]
    out = out.view(R, Hkv, n, G, -1).transpose(1, 2).reshape(R * n, Hq, -1)
    return out.index_select(0, pad_index)
