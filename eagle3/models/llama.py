"""Llama / Qwen2 / Qwen3 forward for extraction, one layer at a time (see `streaming`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3.ops import apply_rope, llama_inv_freq, rms_norm, rope_cos_sin, swiglu
from eagle3.models.checkpoint import Checkpoint, TargetError

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


class LlamaTarget:
    """Pre-norm decoder blocks with GQA, rotate-half RoPE and SwiGLU; Qwen2 q/k/v biases and
    Qwen3 per-head q/k norms are picked up from the tensors present."""

    def __init__(self, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype):
        self.ckpt, self.cfg, self.device, self.dtype = ckpt, ckpt.config, device, dtype
        c = self.cfg
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        try:
            self.inv_freq = llama_inv_freq(self.head_dim, c.rope_theta, c.rope_scaling)
        except ValueError as e:
            raise TargetError(f"{c.source}: {e}") from None
        self.has_bias = ckpt.has("layers.0.self_attn.q_proj.bias")
        self.has_qk_norm = ckpt.has("layers.0.self_attn.q_norm.weight")

    def layer_tensor_names(self, i: int) -> list[str]:
        p = f"layers.{i}."
        names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [f"{p}self_attn.{n}.weight" for n in _ATTN]
        names += [f"{p}mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        if self.has_bias:
            names += [f"{p}self_attn.{n}.bias" for n in _ATTN[:3]]
        if self.has_qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def load_layer(self, i: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{i}."
        return {n[len(prefix):]: self.ckpt.get(n).to(self.device, self.dtype, non_blocking=True)
                for n in self.layer_tensor_names(i)}

    def layer_forward(self, w: dict, h: torch.Tensor, positions: torch.Tensor,
                      cu_seqlens: torch.Tensor, cache: list[dict] | None = None) -> torch.Tensor:
        """h [T, H] packed sequences -> h after the block. With `cache` (decoding: one dict per
        packed sequence), each sequence's new keys/values are appended to its cache and its
        queries also see the cached ones."""
        h = h + self._attention(w, rms_norm(h, w["input_layernorm.weight"], self.cfg.rms_norm_eps),
                                positions, cu_seqlens, cache)
        x = rms_norm(h, w["post_attention_layernorm.weight"], self.cfg.rms_norm_eps)
        return h + swiglu(x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])

    def _attention(self, w, x, positions, cu_seqlens, cache):
        T = x.shape[0]

        def proj(name, heads):
            return F.linear(x, w[f"self_attn.{name}.weight"], w.get(f"self_attn.{name}.bias")).view(
                T, heads, self.head_dim)

        q, k, v = proj("q_proj", self.heads), proj("k_proj", self.kv_heads), proj("v_proj", self.kv_heads)
        if self.has_qk_norm:
            q = rms_norm(q, w["self_attn.q_norm.weight"], self.cfg.rms_norm_eps)
            k = rms_norm(k, w["self_attn.k_norm.weight"], self.cfg.rms_norm_eps)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            out = causal_attention_packed(q, k, v, cu_seqlens)
        else:
            out = cached_attention_packed(q, k, v, cu_seqlens, cache)
        return F.linear(out.reshape(T, -1), w["self_attn.o_proj.weight"])


def sdpa(q, k, v, **kw) -> torch.Tensor:
    """q/k/v [n, heads, D] -> [n, heads, Dv]. SDPA's fused (flash) kernels take only 4-D inputs:
    3-D ones silently run the math path, which materializes the scores (20x slower on an H200)."""
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], enable_gqa=q.shape[1] != k.shape[1],
                                          **kw)[0].transpose(0, 1)


def causal_attention_packed(q, k, v, cu_seqlens, scale=None):
    """Causal attention of each packed sequence on its own: q [T, Hq, D], k/v [T, Hkv, D|Dv]."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[a:b] = sdpa(q[a:b], k[a:b], v[a:b], is_causal=True, scale=scale)
    return out


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
