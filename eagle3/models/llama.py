"""Llama / Mistral / Qwen2 / Qwen3 forward, one layer at a time (see `streaming`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3.ops import apply_rope, llama_inv_freq, rms_norm, rope_cos_sin, swiglu
from eagle3.models.attention import causal_attention_packed
from eagle3.models.weights import Checkpoint, TargetError


class LlamaTarget:
    """Pre-norm blocks with GQA, rotate-half RoPE and SwiGLU; Qwen2 biases and Qwen3 q/k norms if present."""

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

    def _linears(self) -> dict[str, tuple[int, int]]:
        """[out, in] of each linear of a layer."""
        H, I = self.cfg.hidden_size, self.cfg.intermediate_size
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"self_attn.q_proj": (q, H), "self_attn.k_proj": (kv, H), "self_attn.v_proj": (kv, H),
                "self_attn.o_proj": (H, q), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}

    def _others(self, i: int) -> dict[str, list[int]]:
        """Layer i's norms and biases -> shape."""
        p, H = f"layers.{i}.", self.cfg.hidden_size
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H]}
        if self.has_bias:
            shapes.update({p + "self_attn.q_proj.bias": [q], p + "self_attn.k_proj.bias": [kv],
                           p + "self_attn.v_proj.bias": [kv]})
        if self.has_qk_norm:
            shapes.update({p + f"self_attn.{n}_norm.weight": [self.head_dim] for n in ("q", "k")})
        return shapes

    def layer_shapes(self, i: int) -> dict:
        """Every tensor layer i's forward reads, as stored -> the shape the config implies."""
        shapes = self._others(i)
        for name, shape in self._linears().items():
            shapes.update(self.ckpt.linear_shapes(f"layers.{i}.{name}", shape))
        return shapes

    def load_layer(self, i: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{i}."
        w = {n[len(prefix):]: self.ckpt.get(n).to(self.device, self.dtype, non_blocking=True) for n in self._others(i)}
        w.update({f"{name}.weight": self.ckpt.linear(prefix + name, shape, self.device, self.dtype)
                  for name, shape in self._linears().items()})
        return w

    def layer_forward(self, w: dict, h: torch.Tensor, positions: torch.Tensor,
                      cu_seqlens: torch.Tensor, cache=None) -> torch.Tensor:
        """h [T, H] packed sequences -> h after the block; decoding with `cache` (an `incremental.LayerPass`)."""
        eps = self.cfg.rms_norm_eps
        h = h + self._attention(w, rms_norm(h, w["input_layernorm.weight"], eps), positions, cu_seqlens, cache)
        x = rms_norm(h, w["post_attention_layernorm.weight"], eps)
        return h + swiglu(x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])

    def _attention(self, w, x, positions, cu_seqlens, cache):
        T, eps = x.shape[0], self.cfg.rms_norm_eps
        q, k, v = (F.linear(x, w[f"self_attn.{n}_proj.weight"], w.get(f"self_attn.{n}_proj.bias")).view(T, nh, -1)
                   for n, nh in (("q", self.heads), ("k", self.kv_heads), ("v", self.kv_heads)))
        if self.has_qk_norm:
            q, k = rms_norm(q, w["self_attn.q_norm.weight"], eps), rms_norm(k, w["self_attn.k_norm.weight"], eps)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = causal_attention_packed(q, k, v, cu_seqlens) if cache is None else cache.attend(q, k, v)
        return F.linear(out.reshape(T, -1), w["self_attn.o_proj.weight"])
