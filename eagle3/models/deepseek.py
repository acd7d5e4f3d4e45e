"""DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 forward for extraction, one layer at a time.

MLA attention with interleaved-pair RoPE (YaRN) on the rope part only, dense first layers, and MoE
layers with a sigmoid router, noaux_tc group-limited top-k, shared experts and int4 routed experts.
Routed experts stay packed on the device; `layer_forward` dequantizes only the experts that received
tokens, a few at a time, and runs each expert's tokens as one matmul.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from eagle3.ops import compiled, rms_norm, silu_mul, swiglu
from eagle3.models import quant
from eagle3.models.weights import Checkpoint, TargetError, TextConfig, require
from eagle3.models.attention import cached_attention_packed, causal_attention_packed

# experts dequantized into one buffer at a time: 32 Kimi experts are 2.8 GB of bf16, a small
# transient next to a 64k-token chunk's activations
EXPERT_BLOCK = 32


@dataclass
class DeepseekSpec:
    """The text config fields the DeepSeek-V3 forward needs, checked."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    topk_method: str

    @classmethod
    def from_config(cls, c: TextConfig) -> DeepseekSpec:
        """From a DeepSeek-V3 family config: `read_config` has checked the fields the family needs."""
        raw = c.raw
        q_lora = raw.get("q_lora_rank")   # null or absent: q_proj instead of q_a/q_b (DeepSeek-V2-Lite)
        spec = cls(
            q_lora_rank=None if q_lora is None else require(raw, "q_lora_rank", c.source, c.needs),
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
            moe_layer_freq=int(raw.get("moe_layer_freq", 1)),
            n_routed_experts=raw["n_routed_experts"],
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=raw["num_experts_per_tok"],
            moe_intermediate_size=raw["moe_intermediate_size"],
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            topk_method=str(raw.get("topk_method", "noaux_tc")),
        )
        spec._validate(raw, c.source)
        return spec

    def _validate(self, raw: dict, where: str) -> None:
        scoring = raw.get("scoring_func", "sigmoid")
        if self.n_routed_experts and scoring != "sigmoid":
            raise TargetError(f"{where}: scoring_func '{scoring}' is not supported (DeepSeek-V3 layout: sigmoid)")
        if self.n_routed_experts and self.topk_method not in ("noaux_tc", "greedy"):
            raise TargetError(f"{where}: topk_method '{self.topk_method}' is not supported "
                              "(supported: noaux_tc, greedy)")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise TargetError(f"{where}: n_routed_experts {self.n_routed_experts} must split into n_group "
                              f"{self.n_group} groups and topk_group {self.topk_group} <= n_group")
        if self.qk_rope_head_dim % 2:
            raise TargetError(f"{where}: qk_rope_head_dim {self.qk_rope_head_dim} must be even")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe(self, i: int) -> bool:
        return bool(self.n_routed_experts) and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


# ---------------------------------------------------------------------------------------------
# RoPE with YaRN

def yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_bounds(dim: int, base: float, original: int, beta_fast: float, beta_slow: float) -> tuple[int, int]:
    """The first and last rotary pair index of the ramp between extrapolated and interpolated."""
    def pair(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    return max(math.floor(pair(beta_fast)), 0), min(math.ceil(pair(beta_slow)), dim - 1)


def rope_tables(c: TextConfig, spec: DeepseekSpec) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [d/2] fp32, cos/sin multiplier, softmax scale) for rope dim d = qk_rope_head_dim."""
    d, base, s = spec.qk_rope_head_dim, c.rope_theta, c.rope_scaling
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    scale = spec.qk_head_dim ** -0.5
    if s is None:
        return inv.float(), 1.0, scale
    if s["rope_type"] != "yarn":
        raise TargetError(f"{c.source}: rope_scaling type '{s['rope_type']}' is not supported for the "
                          "DeepSeek-V3 layout (supported: yarn or none)")
    f = float(s["factor"])
    low, high = yarn_bounds(d, base, int(s["original_max_position_embeddings"]),
                            float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1)))
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    inv = inv / f * ramp + inv * (1 - ramp)
    all_dim = yarn_mscale(f, float(s.get("mscale_all_dim", 0)))
    return inv.float(), yarn_mscale(f, float(s.get("mscale", 1))) / all_dim, scale * all_dim ** 2


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2j], x[2j+1]) of x [T, heads, d] by cos/sin [T, d/2], in fp32."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Routing and the experts' matmuls

def route(logits: torch.Tensor, bias: torch.Tensor | None, spec: DeepseekSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits [T, E] -> (expert ids [T, k] int64, weights [T, k] fp32).

    Experts are chosen by the biased scores (after keeping the topk_group best groups, each group
    scored by the sum of its two best biased scores); they are weighted by the unbiased ones."""
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if spec.n_group > 1:
        T, E = choice.shape
        groups = choice.view(T, spec.n_group, E // spec.n_group)
        best = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)             # [T, G]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(
            1, best.topk(spec.topk_group, dim=-1).indices, True)
        choice = groups.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    idx = choice.topk(spec.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, idx)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return idx, weights * spec.routed_scaling_factor


def weighted_swiglu(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[n, 2I] gate | up of each (token, expert) pair -> silu(gate) · up · the pair's routing weight [n]
    (scaling the [n, I] activation rather than the [n, H] output: cheaper)."""
    I = gate_up.shape[1] // 2
    return silu_mul(gate_up[:, :I], gate_up[:, I:]).float().mul_(weight[:, None]).to(gate_up.dtype)


def _select(stacked: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """stacked[experts] along the expert axis: a view for a run of consecutive experts (at a
    64k-token chunk every Kimi expert is active, so no copy), a gathered copy otherwise."""
    if experts == list(range(experts[0], experts[0] + len(experts))):
        return stacked[experts[0]:experts[0] + len(experts)]
    return stacked.index_select(0, torch.tensor(experts).to(stacked.device, non_blocking=True))


def expert_matmul(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """x [n, K] with rows grouped by expert (sizes[j] rows for expert j), w [B, N, K] the experts'
    weights -> [n, N], each group times its expert's w[j].T: one matmul per expert."""
    return torch.cat([F.linear(part, w[j]) for j, part in enumerate(x.split(sizes))])


# ---------------------------------------------------------------------------------------------
# Loading

def _where(ckpt: Checkpoint, name: str) -> str:
    full = ckpt.full_name(name)
    return f"{ckpt.dir / ckpt.weight_map[full]}: {full}"


def _load_packed(ckpt: Checkpoint, base: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    packed, scale = ckpt.get(base + ".weight_packed"), ckpt.get(base + ".weight_scale")
    try:
        quant.check_packed(packed, scale, ckpt.get(base + ".weight_shape"), shape)
    except ValueError as e:
        full = ckpt.full_name(base + ".weight_packed")
        raise TargetError(f"{ckpt.dir / ckpt.weight_map[full]}: {ckpt.full_name(base)}.{e}") from None
    return packed, scale


def _load_dense(ckpt: Checkpoint, base: str, shape: tuple[int, int], device, dtype) -> torch.Tensor:
    """A linear's weight [out, in] on device in dtype, dequantized if it is stored packed."""
    if quant.is_packed(ckpt.has, base):
        packed, scale = _load_packed(ckpt, base, shape)
        return quant.dequantize_int4(packed.to(device), scale.to(device), dtype)
    w = ckpt.get(base + ".weight")
    if list(w.shape) != list(shape):
        raise TargetError(f"{_where(ckpt, base + '.weight')}: shape {list(w.shape)}; expected {list(shape)}")
    return w.to(device, dtype, non_blocking=True)


class DeepseekTarget:
    """The interface of `LlamaTarget`: `cfg`, `load_layer(i)`, `layer_forward(...)`, `layer_shapes(i)`."""

    def __init__(self, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype):
        self.ckpt, self.cfg, self.device, self.dtype = ckpt, ckpt.config, device, dtype
        self.spec = DeepseekSpec.from_config(self.cfg)
        # int4 experts dequantised by the Triton kernel on CUDA; off for a benchmark or a device where it misbehaves
        self.triton_dequant = True
        self.heads = self.cfg.num_attention_heads
        self.inv_freq, self.rope_mscale, self.softmax_scale = rope_tables(self.cfg, self.spec)
        # on a GPU one fused kernel each: eagerly their fp32 chains move ~7x the bytes of their input
        self.expert_act = compiled(weighted_swiglu) if device.type == "cuda" else weighted_swiglu
        self.norm = compiled(rms_norm) if device.type == "cuda" else rms_norm

    def layer_shapes(self, i: int) -> dict[str, list[int] | quant.GroupedShape]:
        """Every tensor layer i's forward reads (names relative to the text model, linears as stored:
        `.weight` or the int4 parts) and the shape the config implies (the shapes `load_layer` expects)."""
        p, s, H = f"layers.{i}.", self.spec, self.cfg.hidden_size
        shapes = {f"{p}{n}.weight": [d] for n, d in self._norms().items()}
        for name, shape in self._shapes(i).items():
            shapes.update(quant.linear_shapes(self.ckpt.has, p + name, shape))
        if not s.is_moe(i):
            return shapes
        shapes[p + "mlp.gate.weight"] = [s.n_routed_experts, H]
        if s.topk_method == "noaux_tc":
            shapes[p + "mlp.gate.e_score_correction_bias"] = [s.n_routed_experts]
        for e in range(s.n_routed_experts):
            for proj, shape in self._expert_shapes().items():
                shapes.update(quant.linear_shapes(self.ckpt.has, f"{p}mlp.experts.{e}.{proj}", shape))
        return shapes

    # -- loading: runs in the prefetch thread ------------------------------------------------------

    def _norms(self) -> dict[str, int]:
        """Each RMSNorm weight of a layer (without `.weight`) -> its width."""
        s, H = self.spec, self.cfg.hidden_size
        norms = {"input_layernorm": H, "post_attention_layernorm": H, "self_attn.kv_a_layernorm": s.kv_lora_rank}
        if s.q_lora_rank is not None:
            norms["self_attn.q_a_layernorm"] = s.q_lora_rank
        return norms

    def _expert_shapes(self) -> dict[str, tuple[int, int]]:
        """[out, in] of each routed expert's linears."""
        H, I = self.cfg.hidden_size, self.spec.moe_intermediate_size
        return {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}

    def _shapes(self, i: int) -> dict[str, tuple[int, int]]:
        s, H, nh = self.spec, self.cfg.hidden_size, self.heads
        shapes = {"self_attn.kv_a_proj_with_mqa": (s.kv_lora_rank + s.qk_rope_head_dim, H),
                  "self_attn.kv_b_proj": (nh * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
                  "self_attn.o_proj": (H, nh * s.v_head_dim)}
        if s.q_lora_rank is not None:
            shapes["self_attn.q_a_proj"] = (s.q_lora_rank, H)
            shapes["self_attn.q_b_proj"] = (nh * s.qk_head_dim, s.q_lora_rank)
        else:
            shapes["self_attn.q_proj"] = (nh * s.qk_head_dim, H)
        mlps = {}
        if not s.is_moe(i):
            mlps["mlp."] = self.cfg.intermediate_size
        elif s.n_shared_experts:
            mlps["mlp.shared_experts."] = s.moe_intermediate_size * s.n_shared_experts
        for p, inter in mlps.items():
            shapes.update({p + "gate_proj": (inter, H), p + "up_proj": (inter, H), p + "down_proj": (H, inter)})
        return shapes

    def load_layer(self, i: int) -> dict[str, torch.Tensor]:
        p, dev = f"layers.{i}.", self.device
        w = {name: _load_dense(self.ckpt, p + name, shape, dev, self.dtype)
             for name, shape in self._shapes(i).items()}
        w.update({n: self.ckpt.get(p + n + ".weight").to(dev, self.dtype) for n in self._norms()})
        if self.spec.is_moe(i):
            w["mlp.gate"] = self.ckpt.get(p + "mlp.gate.weight").to(dev, torch.float32)
            if self.spec.topk_method == "noaux_tc":
                w["mlp.gate.bias"] = self.ckpt.get(p + "mlp.gate.e_score_correction_bias").to(dev, torch.float32)
            w.update(self._load_experts(i))
        return w

    def _load_experts(self, i: int) -> dict[str, torch.Tensor]:
        """Stacked routed experts: `experts.gate_up.*` [E, 2I, ...] (gate rows first) and
        `experts.down.*` [E, H, ...]; int4 stays packed, unless some expert is stored dense."""
        experts, shapes = range(self.spec.n_routed_experts), self._expert_shapes()
        packed = all(quant.is_packed(self.ckpt.has, f"layers.{i}.mlp.experts.{e}.{proj}")
                     for e in experts for proj in shapes)
        stack = self._stack_packed if packed else self._stack_dense
        out = {}
        for key, projs in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
            bases = [[f"layers.{i}.mlp.experts.{e}.{p}" for p in projs] for e in experts]
            out.update({f"experts.{key}.{n}": t for n, t in stack(bases, shapes[projs[0]]).items()})
        return out

    def _stack_packed(self, bases: list[list[str]], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        """bases[e] = the linears of expert e stacked along rows -> packed [E, rows, in/8], scales."""
        rows = shape[0] * len(bases[0])
        packed = scale = None
        for e, names in enumerate(bases):
            for j, base in enumerate(names):
                pk, sc = _load_packed(self.ckpt, base, shape)
                if packed is None:  # allocated on first sight: the scale dtype is the file's
                    packed = torch.empty(len(bases), rows, pk.shape[1], dtype=pk.dtype, device=self.device)
                    scale = torch.empty(len(bases), rows, sc.shape[1], dtype=sc.dtype, device=self.device)
                packed[e, j * shape[0]:(j + 1) * shape[0]].copy_(pk)
                scale[e, j * shape[0]:(j + 1) * shape[0]].copy_(sc)
        return {"weight_packed": packed, "weight_scale": scale}

    def _stack_dense(self, bases: list[list[str]], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        """Like _stack_packed for experts of which some are stored dense: all dense in self.dtype."""
        w = torch.stack([torch.cat([_load_dense(self.ckpt, b, shape, self.device, self.dtype) for b in names])
                         for names in bases])
        return {"weight": w}

    # -- forward -------------------------------------------------------------------------------

    def layer_forward(self, w: dict, h: torch.Tensor, positions: torch.Tensor,
                      cu_seqlens: torch.Tensor, cache: list[dict] | None = None) -> torch.Tensor:
        """h [T, H] packed sequences -> h after the block. With `cache` (decoding: one dict per
        packed sequence), each sequence's new keys/values are appended to its cache and its
        queries also see the cached ones."""
        eps = self.cfg.rms_norm_eps
        h = h + self._attention(w, self.norm(h, w["input_layernorm"], eps), positions, cu_seqlens, cache)
        x = self.norm(h, w["post_attention_layernorm"], eps)
        if "mlp.gate" not in w:
            return h + swiglu(x, w["mlp.gate_proj"], w["mlp.up_proj"], w["mlp.down_proj"])
        return h + self._moe(w, x)

    def _attention(self, w, x, positions, cu_seqlens, cache):
        s, T, nh = self.spec, x.shape[0], self.heads
        eps = self.cfg.rms_norm_eps
        if s.q_lora_rank is not None:
            q = F.linear(self.norm(F.linear(x, w["self_attn.q_a_proj"]), w["self_attn.q_a_layernorm"], eps),
                         w["self_attn.q_b_proj"])
        else:
            q = F.linear(x, w["self_attn.q_proj"])
        q_nope, q_pe = q.view(T, nh, s.qk_head_dim).split([s.qk_nope_head_dim, s.qk_rope_head_dim], -1)
        c, k_pe = F.linear(x, w["self_attn.kv_a_proj_with_mqa"]).split([s.kv_lora_rank, s.qk_rope_head_dim], -1)
        kv = F.linear(self.norm(c, w["self_attn.kv_a_layernorm"], eps), w["self_attn.kv_b_proj"])
        k_nope, v = kv.view(T, nh, s.qk_nope_head_dim + s.v_head_dim).split([s.qk_nope_head_dim, s.v_head_dim], -1)
        freqs = positions.float()[:, None] * self.inv_freq.to(x.device)[None]
        cos, sin = freqs.cos() * self.rope_mscale, freqs.sin() * self.rope_mscale
        q = torch.cat([q_nope, apply_rope_interleaved(q_pe, cos, sin)], -1)
        k_pe = apply_rope_interleaved(k_pe[:, None], cos, sin).expand(T, nh, s.qk_rope_head_dim)
        k = torch.cat([k_nope, k_pe], -1)
        if cache is None:
            out = causal_attention_packed(q, k, v, cu_seqlens, self.softmax_scale)       # [T, nh, v_head_dim]
        else:
            # the cache keeps v padded to the q/k head dim: the fused kernels want equal head dims
            v = F.pad(v, (0, s.qk_head_dim - s.v_head_dim)) if s.v_head_dim < s.qk_head_dim else v
            out = cached_attention_packed(q, k, v, cu_seqlens, cache, self.softmax_scale)[..., :s.v_head_dim]
        return F.linear(out.reshape(T, nh * s.v_head_dim), w["self_attn.o_proj"])

    def _moe(self, w, x):
        idx, weights = route(F.linear(x.float(), w["mlp.gate"]), w.get("mlp.gate.bias"), self.spec)
        out = self._routed(w, x, idx, weights)
        if self.spec.n_shared_experts:
            out = out + swiglu(x, w["mlp.shared_experts.gate_proj"], w["mlp.shared_experts.up_proj"],
                               w["mlp.shared_experts.down_proj"])
        return out

    def _routed(self, w, x, idx, weights):
        """Σ_k weights[t, k] · expert_idx[t, k](x_t), [T, H] in x's dtype: (token, slot) pairs sorted by
        expert; per block of EXPERT_BLOCK active experts, their weights dequantized into one buffer
        and one matmul per expert and projection; each pair's output lands in its (token, slot) row,
        and the k slots of a token are summed once at the end (fewer bytes than an fp32 index_add)."""
        T, k = idx.shape
        order = idx.flatten().argsort(stable=True)
        token, pair_w = order // k, weights.flatten()[order]
        counts = torch.bincount(idx.flatten(), minlength=self.spec.n_routed_experts).tolist()  # one sync
        starts = list(itertools.accumulate(counts, initial=0))
        pairs = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=x.device)   # row t·k + slot
        for rows, gate_up, down in self._blocks(w, counts, starts):
            h = self.expert_act(gate_up(x[token[rows]]), pair_w[rows])                          # [n, I]
            pairs.index_copy_(0, order[rows], down(h))                                          # [n, H]
        return pairs.view(T, k, x.shape[1]).sum(1)   # summed in fp32 (the reduction's accumulator), stored in x's dtype

    def _blocks(self, w, counts, starts):
        """(rows, gate_up, down) per block of EXPERT_BLOCK active experts: their weights dequantized
        into one buffer, one matmul per expert and projection over the block's rows."""
        active = [e for e, n in enumerate(counts) if n]
        for b in range(0, len(active), EXPERT_BLOCK):
            block = active[b:b + EXPERT_BLOCK]
            sizes = [counts[e] for e in block]
            yield (slice(starts[block[0]], starts[block[-1] + 1]),
                   *(partial(self._dequantized_matmul, w=w, key=key, block=block, sizes=sizes)
                     for key in ("gate_up", "down")))

    def _dequantized_matmul(self, x, w, key, block, sizes):
        """x's rows times their experts' `key` projection, dequantized just for this call (one
        projection's buffer alive at a time)."""
        return expert_matmul(x, self._expert_weights(w, key, block), sizes)

    def _expert_weights(self, w, key: str, experts: list[int]) -> torch.Tensor:
        """Dense [len(experts), out, in] weights of the chosen experts."""
        if f"experts.{key}.weight" in w:
            return _select(w[f"experts.{key}.weight"], experts)
        return quant.dequantize_int4(_select(w[f"experts.{key}.weight_packed"], experts),
                                     _select(w[f"experts.{key}.weight_scale"], experts), self.dtype,
                                     self.triton_dequant)
