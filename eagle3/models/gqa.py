"""Decoders of grouped-query attention, one layer at a time (see `streaming`), as a family's `Layout` composes
them: attention with or without biases, qk-norm per head or over the whole projection, rotary on part of the
head, sinks and sliding windows; a dense SwiGLU or a mixture of experts (`moe`) per layer."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3.ops import apply_rope, compiled, draft_rope, rms_norm, rope_cos_sin, swiglu
from eagle3.models import moe, quant
from eagle3.models.attention import causal_attention_packed
from eagle3.models.weights import Checkpoint, TargetError

SWIGLU = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Attention:
    """`qk_norm`: None, "head" (RMSNorm of each head's q and k) or "whole" (of the whole q and k projections,
    before the head split); `rotary_dim`: the leading dims of a head that rotate; `windows[i]`: layer i's sliding
    window (0: every key); `sinks`: a learned logit per head in each softmax's denominator."""
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None
    sinks: bool = False
    windows: tuple[int, ...] = ()


@dataclass(frozen=True)
class Experts:
    """A MoE block: its router under `gate` (`gate.bias` added to the logits if `logit_bias`; `correction`: the
    name of a bias that only chooses), the experts' linears `experts.N.{projs}` (or gpt-oss's fused tensors when
    `projs` is empty) of width `inter`, shared experts' width `shared` (0: none), the activation."""
    router: moe.Router
    prefix: str
    gate: str
    inter: int
    projs: tuple[str, ...] = SWIGLU
    correction: str | None = None
    logit_bias: bool = False
    shared: int = 0
    clamp: float = 0.0   # gpt-oss's clamped SwiGLU of interleaved gate / up rows when > 0


@dataclass(frozen=True)
class Layout:
    """A family's decoder: its attention, and per layer its MoE block or None (a dense SwiGLU of `dense_inter`)."""
    attention: Attention
    experts: tuple[Experts | None, ...]
    dense_inter: int


class GqaTarget:
    """`cfg`, `layer_shapes(i)`, `load_layer(i)`, `layer_forward(...)`, as `DeepseekTarget`."""

    def __init__(self, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, layout: Layout):
        self.ckpt, self.cfg, self.device, self.dtype, self.layout = ckpt, ckpt.config, device, dtype, layout
        a, c = layout.attention, self.cfg
        try:
            self.inv_freq, self.rope_scale = draft_rope(a.rotary_dim, c.rope_theta, c.rope_scaling)
        except ValueError as e:
            raise TargetError(f"{c.source}: {e}") from None
        self.scale = a.head_dim ** -0.5
        clamp = max((e.clamp for e in layout.experts if e is not None), default=0.0)
        act = functools.partial(moe.weighted_clamped_swiglu, limit=clamp) if clamp else moe.weighted_swiglu
        # on a GPU one fused kernel each, as DeepSeek's: eagerly their fp32 chains move several times their input
        self.norm, self.expert_act = (compiled(rms_norm), compiled(act)) if device.type == "cuda" else (rms_norm, act)

    def _linears(self, i: int) -> dict[str, tuple[int, int]]:
        """[out, in] of each plain linear of layer i (without `.weight`)."""
        a, H, e = self.layout.attention, self.cfg.hidden_size, self.layout.experts[i]
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        shapes = {"self_attn.q_proj": (q, H), "self_attn.k_proj": (kv, H), "self_attn.v_proj": (kv, H),
                  "self_attn.o_proj": (H, q)}
        mlps = {"mlp.": self.layout.dense_inter} if e is None else {e.prefix + "shared_experts.": e.shared}
        for p, inter in mlps.items():
            if inter:
                shapes.update({p + "gate_proj": (inter, H), p + "up_proj": (inter, H), p + "down_proj": (H, inter)})
        return shapes

    def _vectors(self, i: int) -> dict[str, int]:
        """Norms, biases, sinks and router biases of layer i (full names) -> width."""
        a, H, e = self.layout.attention, self.cfg.hidden_size, self.layout.experts[i]
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        out = {"input_layernorm.weight": H, "post_attention_layernorm.weight": H}
        if a.qkv_bias:
            out.update({"self_attn.q_proj.bias": q, "self_attn.k_proj.bias": kv, "self_attn.v_proj.bias": kv})
        if a.o_bias:
            out["self_attn.o_proj.bias"] = H
        if a.qk_norm:
            whole = a.qk_norm == "whole"
            out.update({"self_attn.q_norm.weight": q if whole else a.head_dim,
                        "self_attn.k_norm.weight": kv if whole else a.head_dim})
        if a.sinks:
            out["self_attn.sinks"] = a.heads
        if e is not None:
            out.update({f"{e.prefix}{name}": e.router.experts for name, on in (
                (e.correction, e.correction), (f"{e.gate}.bias", e.logit_bias)) if on})
        return out

    def layer_shapes(self, i: int) -> dict[str, list[int] | quant.GroupedShape]:
        """Every tensor layer i's forward reads, as stored -> the shape the config implies."""
        p, e, H = f"layers.{i}.", self.layout.experts[i], self.cfg.hidden_size
        shapes = {p + n: [d] for n, d in self._vectors(i).items()}
        for name, shape in self._linears(i).items():
            shapes.update(self.ckpt.linear_shapes(p + name, shape))
        if e is None:
            return shapes
        E = e.router.experts
        shapes[f"{p}{e.prefix}{e.gate}.weight"] = [E, H]
        if not e.projs:
            return shapes | {f"{p}{e.prefix}experts.{k}": s for k, s in self._fused_shapes(i, e).items()}
        for n in range(E):
            for proj, shape in zip(e.projs, ((e.inter, H), (e.inter, H), (H, e.inter))):
                shapes.update(self.ckpt.linear_shapes(f"{p}{e.prefix}experts.{n}.{proj}", shape))
        return shapes

    def _fused_shapes(self, i: int, e: Experts) -> dict[str, list[int]]:
        """gpt-oss's experts as stored: MXFP4 [E, out, in/32, 16] blocks, or bf16 [E, in, out] (transposed)."""
        E, H, I = e.router.experts, self.cfg.hidden_size, e.inter
        out = {"gate_up_proj_bias": [E, 2 * I], "down_proj_bias": [E, H]}
        if self.ckpt.has(f"layers.{i}.{e.prefix}experts.gate_up_proj_blocks"):
            for proj, (o, n) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
                out.update({f"{proj}_{k}": s for k, s in quant.mxfp4_shapes(E, o, n).items()})
            return out
        return out | {"gate_up_proj": [E, H, 2 * I], "down_proj": [E, I, H]}

    def load_layer(self, i: int) -> dict:
        p, dev, e = f"layers.{i}.", self.device, self.layout.experts[i]
        w = {n: self.ckpt.linear(p + n, s, dev, self.dtype) for n, s in self._linears(i).items()}
        w.update({n: self.ckpt.get(p + n).to(dev, torch.float32 if "sinks" in n or e and n.startswith(e.prefix)
                                             else self.dtype) for n in self._vectors(i)})
        w["window"] = self.layout.attention.windows[i] if self.layout.attention.windows else 0
        if e is not None:
            w["moe"], w["router"] = e, self.ckpt.get(f"{p}{e.prefix}{e.gate}.weight").to(dev, torch.float32)
            w.update(self._load_experts(i, e))
        return w

    def _load_experts(self, i: int, e: Experts) -> dict[str, torch.Tensor]:
        """`experts.gate_up.*` [E, 2I, ...], `experts.down.*` [E, H, ...] (+ `.bias`), as `moe.routed` reads them."""
        p, dev = f"layers.{i}.{e.prefix}experts.", self.device
        if e.projs:
            return moe.load_experts(self.ckpt, p, e.projs, e.router.experts, e.inter, self.cfg.hidden_size, dev,
                                    self.dtype)
        out = {f"experts.{key}.bias": self.ckpt.get(f"{p}{key}_proj_bias").to(dev, self.dtype)
               for key in ("gate_up", "down")}
        for key in ("gate_up", "down"):
            if self.ckpt.has(f"{p}{key}_proj_blocks"):   # kept packed: dequantized per active block
                out.update({f"experts.{key}.{k}": self.ckpt.get(f"{p}{key}_proj_{k}").to(dev)
                            for k in ("blocks", "scales")})
            else:   # transformers' [E, in, out] -> [E, out, in]
                w = self.ckpt.get(f"{p}{key}_proj").to(dev, self.dtype)
                out[f"experts.{key}.weight"] = w.transpose(1, 2).contiguous()
        return out

    def layer_forward(self, w: dict, h: torch.Tensor, positions: torch.Tensor,
                      cu_seqlens: torch.Tensor, cache=None) -> torch.Tensor:
        """h [T, H] packed sequences -> h after the block; decoding with `cache` (an `incremental.LayerPass`)."""
        eps = self.cfg.rms_norm_eps
        h = h + self._attention(w, self.norm(h, w["input_layernorm.weight"], eps), positions, cu_seqlens, cache)
        x = self.norm(h, w["post_attention_layernorm.weight"], eps)
        if "router" not in w:
            return h + swiglu(x, w["mlp.gate_proj"], w["mlp.up_proj"], w["mlp.down_proj"])
        return h + self._moe(w, x)

    def _attention(self, w, x, positions, cu_seqlens, cache):
        a, T, eps = self.layout.attention, x.shape[0], self.cfg.rms_norm_eps
        q, k, v = (F.linear(x, w[f"self_attn.{n}_proj"], w.get(f"self_attn.{n}_proj.bias")) for n in "qkv")
        if a.qk_norm == "whole":
            q, k = self.norm(q, w["self_attn.q_norm.weight"], eps), self.norm(k, w["self_attn.k_norm.weight"], eps)
        q, k, v = q.view(T, a.heads, -1), k.view(T, a.kv_heads, -1), v.view(T, a.kv_heads, -1)
        if a.qk_norm == "head":
            q, k = self.norm(q, w["self_attn.q_norm.weight"], eps), self.norm(k, w["self_attn.k_norm.weight"], eps)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale)
        r = a.rotary_dim
        q, k = (torch.cat([apply_rope(t[..., :r], cos, sin), t[..., r:]], -1) if r < a.head_dim
                else apply_rope(t, cos, sin) for t in (q, k))
        sinks = w.get("self_attn.sinks")
        out = (causal_attention_packed(q, k, v, cu_seqlens, self.scale, w["window"], sinks) if cache is None
               else cache.attend(q, k, v, self.scale, w["window"], sinks))
        return F.linear(out.reshape(T, -1), w["self_attn.o_proj"], w.get("self_attn.o_proj.bias"))

    def _moe(self, w, x):
        e = w["moe"]
        logits = F.linear(x.float(), w["router"], w.get(f"{e.prefix}{e.gate}.bias"))
        idx, weights = moe.route(logits, w[e.prefix + e.correction] if e.correction else None, e.router)
        out = moe.routed(w, x, idx, weights, e.router.experts, self.expert_act, self.dtype, self.ckpt.block_cols)
        if e.shared:
            p = e.prefix + "shared_experts."
            out = out + swiglu(x, w[p + "gate_proj"], w[p + "up_proj"], w[p + "down_proj"])
        return out
