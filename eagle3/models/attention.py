"""Attention of packed sequences for the target forwards: causal over each sequence for extraction,
against a KV cache for decoding (`incremental.LayerPass`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def sdpa(q, k, v, **kw) -> torch.Tensor:
    """q/k/v [n, heads, D] -> [n, heads, Dv], in 4-D: with 3-D inputs SDPA silently takes the math path."""
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)[0].transpose(0, 1)


def causal_attention_packed(q, k, v, cu_seqlens, scale=None):
    """Causal attention of each packed sequence: q/k [T, heads, D], v [T, Hkv, Dv] -> [T, Hq, Dv]; a narrower v
    (MLA) runs as it is under cuDNN where cuDNN takes it, else zero-padded (flash needs equal head dims)."""
    dv = v.shape[-1]
    pad = max(0, q.shape[-1] - dv)
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
    """Whether cuDNN's fused attention runs these causal q/k/v [T, heads, D]."""
    if not q.is_cuda:
        return False
    params = torch.backends.cuda.SDPAParams(*[x.transpose(0, 1)[None] for x in (q, k, v)], None, 0.0, True,
                                            q.shape[1] != k.shape[1])
    return torch.backends.cuda.can_use_cudnn_attention(params)


def cached_attention(q, k, v, scale=None, window: int = 0):
    """The last q.shape[0] positions of a sequence attending to all its k/v [n, Hkv, D], causally (with `window`
    > 0: the keys less than `window` positions back)."""
    T, n = q.shape[0], k.shape[0]
    back = torch.arange(n - T, n, device=q.device)[:, None] - torch.arange(n, device=q.device)[None, :]   # [T, n]
    visible = (back >= 0) & (back < window) if window else back >= 0
    return sdpa(q, k, v, attn_mask=visible, scale=scale)


def padded_cached_attention(q, k_cache, v_cache, rows, pad_index, mask, scale=None):
    """New tokens q [t, Hq, D] of R sequences (padded rows pad_index = r * n + i) against their cached keys
    k/v_cache[rows, :L] in one call -> [t, Hq, Dv]. GQA is folded into the query length of mask [R, 1, n * G, L]
    so any fused kernel applies; padded queries (zeros) see key 0 at least: every row stays finite."""
    R, _, rows_per_head, L = mask.shape
    Hq, Hkv, D = q.shape[1], k_cache.shape[2], q.shape[2]
    G = Hq // Hkv
    n = rows_per_head // G
    padded = q.new_zeros(R * n, Hq, D).index_copy_(0, pad_index, q)
    folded = padded.view(R, n, Hkv, G, D).transpose(1, 2).reshape(R, Hkv, n * G, D)
    k, v = k_cache[rows, :L].transpose(1, 2), v_cache[rows, :L].transpose(1, 2)    # [R, Hkv, L, D]
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)  # [R, Hkv, n * G, Dv]
    return out.view(R, Hkv, n, G, -1).transpose(1, 2).reshape(R * n, Hq, -1).index_select(0, pad_index)
