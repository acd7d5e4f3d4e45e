"""DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 forward, one layer at a time: MLA with interleaved YaRN RoPE, MoE with a
sigmoid noaux_tc router; int4 experts stay packed, those that received tokens dequantized a block at a time.
The same room runs GLM-4.7-Flash (`glm4_moe_lite`: rotate-half rotary when `rope_interleave` is false, dense layers
from `mlp_layer_types`), DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`) with the DSA indexer (`indexer`)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3.ops import apply_rope, compiled, rms_norm, rope_cos_sin, swiglu, yarn_bounds, yarn_mscale
from eagle3.models import indexer, moe, quant
from eagle3.models.weights import Checkpoint, TargetError, TextConfig, require
from eagle3.models.attention import Prefix, causal_attention_packed


# the router's fields where a config leaves them out (or null): the defaults of the family's transformers 5.25 config
# class (DeepseekV3Config, DeepseekV32Config, Glm4MoeLiteConfig, GlmMoeDsaConfig), which the engines load it through
ROUTER_FIELDS = (("n_group", int), ("topk_group", int), ("norm_topk_prob", bool), ("routed_scaling_factor", float))
ROUTER_DEFAULTS = {"DeepSeek-V3": (8, 4, True, 2.5), "DeepSeek-V3.2": (8, 4, True, 2.5),
                   "GLM-4.7-Flash": (1, 1, True, 1.8), "GLM-5": (1, 1, True, 2.5)}


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
    rope_interleave: bool = True          # false (DeepSeek-V3, GLM-4.7-Flash may say so): rotate-half on the rope dims
    mlp_layer_types: tuple[str, ...] | None = None   # "dense" / "sparse" per layer, over first_k_dense_replace
    index: indexer.IndexerSpec | None = None         # the DSA indexer (DeepSeek-V3.2, GLM-5)

    @classmethod
    def from_config(cls, c: TextConfig) -> DeepseekSpec:
        """`read_config` has checked the fields the family needs; the rest are checked here."""
        raw, where = c.raw, c.source
        dsa = "index_topk" in c.family.fields
        q_lora = raw.get("q_lora_rank")   # null or absent: q_proj instead of q_a/q_b (DeepSeek-V2-Lite)
        s = cls(q_lora_rank=None if q_lora is None else require(raw, "q_lora_rank", where, c.needs),
                **{k: raw[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                       "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")},
                **{k: int(raw.get(k) or default) for k, default in (("first_k_dense_replace", 0),
                                                                   ("moe_layer_freq", 1), ("n_shared_experts", 0))},
                **{k: kind(default if raw.get(k) is None else raw[k]) for (k, kind), default in
                   zip(ROUTER_FIELDS, ROUTER_DEFAULTS[c.family.name])},
                topk_method=str(raw.get("topk_method", "noaux_tc")),
                # transformers 5.24's DeepSeek-V3.2 and GLM-5 rotate adjacent pairs whatever rope_interleave says
                rope_interleave=dsa or bool(raw.get("rope_interleave", True)),
                mlp_layer_types=None if raw.get("mlp_layer_types") is None else tuple(raw["mlp_layer_types"]),
                index=indexer.IndexerSpec.from_config(c, raw["qk_rope_head_dim"]) if dsa else None)
        if raw.get("attention_bias"):
            raise TargetError(f"{where}: attention_bias true is not supported (the published MLA checkpoints have none)")
        if s.mlp_layer_types is not None and (len(s.mlp_layer_types) != c.num_hidden_layers
                                              or set(s.mlp_layer_types) - {"dense", "sparse"}):
            raise TargetError(f"{where}: mlp_layer_types {list(s.mlp_layer_types)}; expected 'dense' or 'sparse' for "
                              f"each of the {c.num_hidden_layers} layers")
        scoring = raw.get("scoring_func", "sigmoid")
        if s.n_routed_experts and scoring != "sigmoid":
            raise TargetError(f"{where}: scoring_func '{scoring}' is not supported (DeepSeek-V3 layout: sigmoid)")
        if s.n_routed_experts and s.topk_method not in ("noaux_tc", "greedy"):
            raise TargetError(f"{where}: topk_method '{s.topk_method}' is not supported (supported: noaux_tc, greedy)")
        moe.check_groups(s.router, where)
        if s.qk_rope_head_dim % 2:
            raise TargetError(f"{where}: qk_rope_head_dim {s.qk_rope_head_dim} must be even")
        return s

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe(self, i: int) -> bool:
        if self.mlp_layer_types is not None:   # transformers 5.24's rule where the config lists them
            return bool(self.n_routed_experts) and self.mlp_layer_types[i] == "sparse"
        return bool(self.n_routed_experts) and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def has_indexer(self, i: int) -> bool:
        """Whether layer i runs an indexer of its own (GLM-5's 'shared' layers reuse an earlier one's keys)."""
        return self.index is not None and self.index.source[i] == i

    @property
    def router(self) -> moe.Router:
        """Sigmoid scores chosen with the correction bias within the topk_group best groups."""
        return moe.Router("sigmoid", self.n_routed_experts, self.num_experts_per_tok, self.norm_topk_prob,
                          self.routed_scaling_factor, self.n_group, self.topk_group)


def rope_tables(c: TextConfig, spec: DeepseekSpec) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [d/2] fp32, cos/sin multiplier, softmax scale) for rope dim d = qk_rope_head_dim."""
    try:
        return yarn_rope(spec.qk_rope_head_dim, spec.qk_head_dim, c.rope_theta, c.rope_scaling)
    except ValueError as e:
        raise TargetError(f"{c.source}: {e}") from None


def yarn_settings(scaling: dict | None) -> dict | None:
    """The keys of a (normalized) rope_scaling that DeepSeek's YaRN reads (`yarn_rope`), None without scaling."""
    keys = ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
            "mscale_all_dim")
    return scaling and {k: scaling[k] for k in keys if k in scaling}


def yarn_rope(d: int, qk_head_dim: int, base: float, s: dict | None) -> tuple[torch.Tensor, float, float]:
    """DeepSeek's rotary for rope dim d and query/key head dim `qk_head_dim` under rope scaling `s` (YaRN or
    None; `rope_type` normalized): (inv_freq [d/2] fp32, cos/sin multiplier, softmax scale)."""
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    scale = qk_head_dim ** -0.5
    if s is None:
        return inv.float(), 1.0, scale
    if s["rope_type"] != "yarn":
        raise ValueError(f"rope_scaling type '{s['rope_type']}' is not supported for the DeepSeek-V3 layout "
                         "(supported: yarn or none)")
    f = float(s["factor"])
    low, high = yarn_bounds(d, base, int(s["original_max_position_embeddings"]),
                            float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1)))
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    inv = inv / f * ramp + inv * (1 - ramp)
    all_dim = yarn_mscale(f, float(s.get("mscale_all_dim", 0)))
    return inv.float(), yarn_mscale(f, float(s.get("mscale", 1))) / all_dim, scale * all_dim ** 2


def interleaved_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float):
    """cos/sin [T, d/2] of positions [T] for `apply_rope_interleaved`, times YaRN's multiplier."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None]
    return freqs.cos() * mscale, freqs.sin() * mscale


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2j], x[2j+1]) of x [T, heads, d] by cos/sin [T, d/2], in fp32."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2).to(x.dtype)


class DeepseekTarget:
    """`LlamaTarget`'s interface: `cfg`, `load_layer(i)`, `layer_forward(...)`, `layer_shapes(i)`."""

    def __init__(self, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype):
        self.ckpt, self.cfg, self.device, self.dtype = ckpt, ckpt.config, device, dtype
        self.spec = DeepseekSpec.from_config(self.cfg)
        self.heads = self.cfg.num_attention_heads
        self.inv_freq, self.rope_mscale, self.softmax_scale = rope_tables(self.cfg, self.spec)
        # on a GPU one fused kernel each: eagerly their fp32 chains move ~7x the bytes of their input
        self.expert_act = compiled(moe.weighted_swiglu) if device.type == "cuda" else moe.weighted_swiglu
        self.norm = compiled(rms_norm) if device.type == "cuda" else rms_norm
        self._kept: dict = {}             # the keys the last full DSA layer chose, for the shared layers after it
        self._kept_source: int | None = None

    def layer_shapes(self, i: int) -> dict[str, list[int] | quant.GroupedShape]:
        """Every tensor layer i's forward reads, as stored -> the shape the config implies."""
        p, s, H = f"layers.{i}.", self.spec, self.cfg.hidden_size
        shapes = {f"{p}{n}.weight": [d] for n, d in self._norms().items()}
        if s.has_indexer(i):
            shapes[f"{p}self_attn.indexer.k_norm.bias"] = [s.index.head_dim]
            shapes[f"{p}self_attn.indexer.k_norm.weight"] = [s.index.head_dim]
        for name, shape in self._shapes(i).items():
            shapes.update(self.ckpt.linear_shapes(p + name, shape))
        if not s.is_moe(i):
            return shapes
        shapes[p + "mlp.gate.weight"] = [s.n_routed_experts, H]
        if s.topk_method == "noaux_tc":
            shapes[p + "mlp.gate.e_score_correction_bias"] = [s.n_routed_experts]
        for e in range(s.n_routed_experts):
            for proj, shape in self._expert_shapes().items():
                shapes.update(self.ckpt.linear_shapes(f"{p}mlp.experts.{e}.{proj}", shape))
        return shapes

    def _norms(self) -> dict[str, int]:
        """Each RMSNorm of a layer (without `.weight`) -> its width."""
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
        if s.has_indexer(i):
            shapes.update(indexer.shapes(s.index, H, s.q_lora_rank))
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
        # the indexer's head weights in fp32, as transformers keeps them (`_keep_in_fp32_modules`)
        w = {name: self.ckpt.linear(p + name, shape, dev, torch.float32 if name.endswith("weights_proj") else self.dtype)
             for name, shape in self._shapes(i).items()}
        w.update({n: self.ckpt.get(p + n + ".weight").to(dev, self.dtype) for n in self._norms()})
        if self.spec.index is not None:
            w["indexer.source"] = self.spec.index.source[i]
        if self.spec.has_indexer(i):
            q = p + "self_attn.indexer."
            w.update({q[len(p):] + n: self.ckpt.get(q + n).to(dev, self.dtype) for n in ("k_norm.weight", "k_norm.bias")})
        if self.spec.is_moe(i):
            w["mlp.gate"] = self.ckpt.get(p + "mlp.gate.weight").to(dev, torch.float32)
            if self.spec.topk_method == "noaux_tc":
                w["mlp.gate.bias"] = self.ckpt.get(p + "mlp.gate.e_score_correction_bias").to(dev, torch.float32)
            w.update(moe.load_experts(self.ckpt, f"{p}mlp.experts.", tuple(self._expert_shapes()),
                                      self.spec.n_routed_experts, self.spec.moe_intermediate_size,
                                      self.cfg.hidden_size, dev, self.dtype))
        return w

    def layer_forward(self, w: dict, h: torch.Tensor, positions: torch.Tensor,
                      cu_seqlens: torch.Tensor, cache=None) -> torch.Tensor:
        """h [T, H] packed sequences -> h after the block; decoding with `cache` (an `incremental.LayerPass`)."""
        eps = self.cfg.rms_norm_eps
        h = h + self._attention(w, self.norm(h, w["input_layernorm"], eps), positions, cu_seqlens, cache)
        x = self.norm(h, w["post_attention_layernorm"], eps)
        if "mlp.gate" not in w:
            return h + swiglu(x, w["mlp.gate_proj"], w["mlp.up_proj"], w["mlp.down_proj"])
        return h + self._moe(w, x)

    def _attention(self, w, x, positions, cu_seqlens, cache):
        s, T, nh, eps = self.spec, x.shape[0], self.heads, self.cfg.rms_norm_eps
        if s.q_lora_rank is not None:
            q_resid = self.norm(F.linear(x, w["self_attn.q_a_proj"]), w["self_attn.q_a_layernorm"], eps)
            q = F.linear(q_resid, w["self_attn.q_b_proj"])
        else:
            q = F.linear(x, w["self_attn.q_proj"])
        q_nope, q_pe = q.view(T, nh, s.qk_head_dim).split([s.qk_nope_head_dim, s.qk_rope_head_dim], -1)
        c, k_pe = F.linear(x, w["self_attn.kv_a_proj_with_mqa"]).split([s.kv_lora_rank, s.qk_rope_head_dim], -1)
        c = self.norm(c, w["self_attn.kv_a_layernorm"], eps)                          # the latent [T, kv_lora_rank]
        rope = self._rotary(positions, s.rope_interleave)
        q = torch.cat([q_nope, rope(q_pe)], -1)
        k_pe = rope(k_pe[:, None])[:, 0]                                             # [T, rope], shared by all heads
        index = ()   # a full DSA layer's indexer queries [T, heads, D], keys [T, D], head weights [T, heads]
        if "self_attn.indexer.wk" in w:
            index = indexer.queries_and_keys(w, x, q_resid, self._rotary(positions, s.index.interleaved), s.index)
        if isinstance(cache, Prefix):   # a chunk of a long sequence: the earlier chunks left their latents
            c, k_pe, *keys = cache.extend(c, k_pe, *index[1:2])
            expand = functools.partial(self._expand, w, c, k_pe)
            if s.index is None or cache.filled <= s.index.topk:   # every key chosen: dense MLA
                out = cache.attend_heads(q, expand, self.softmax_scale)
            else:
                chosen = self._chosen(w, (int(positions[0]), T), lambda: indexer.select(
                    index[0], index[2], keys[0], positions, s.index.topk))
                out = indexer.sparse_attention(q, positions, chosen, cache.filled, expand, self.softmax_scale)
        elif cache is None:
            out = self._sequences(w, q, c, k_pe, index, positions, cu_seqlens)
        else:
            k, v = self._expand(w, c, k_pe, 0, nh)
            # the cache keeps v padded to the q/k head dim: the fused kernels want equal head dims
            v = F.pad(v, (0, s.qk_head_dim - s.v_head_dim)) if s.v_head_dim < s.qk_head_dim else v
            out = cache.attend(q, k, v, self.softmax_scale)[..., :s.v_head_dim]
            if s.index is not None:
                self._decode_sparse(w, q, index, positions, cache, out)
        return F.linear(out.reshape(T, nh * s.v_head_dim), w["self_attn.o_proj"])          # out [T, nh, v_head_dim]

    def _rotary(self, positions: torch.Tensor, interleaved: bool):
        """x [T, n, rope] -> x rotated at `positions`: adjacent pairs (DeepSeek) or the two halves (rotate-half)."""
        if interleaved:
            cos, sin = interleaved_cos_sin(positions, self.inv_freq, self.rope_mscale)
            return lambda x: apply_rope_interleaved(x, cos, sin)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_mscale)
        return lambda x: apply_rope(x, cos, sin)

    def _sequences(self, w, q, c, k_pe, index, positions, cu_seqlens):
        """Causal attention of packed sequences; with the DSA indexer, those longer than index_topk sparse."""
        s, nh = self.spec, self.heads
        if s.index is None:
            return causal_attention_packed(q, *self._expand(w, c, k_pe, 0, nh), cu_seqlens, self.softmax_scale)
        out = q.new_empty(*q.shape[:2], s.v_head_dim)
        bounds = cu_seqlens.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            expand = functools.partial(self._expand, w, c[a:b], k_pe[a:b])
            if b - a <= s.index.topk:
                out[a:b] = causal_attention_packed(q[a:b], *expand(0, nh), torch.tensor([0, b - a]), self.softmax_scale)
                continue
            chosen = self._chosen(w, (a, b), lambda: indexer.select(
                index[0][a:b], index[2][a:b], index[1][a:b], positions[a:b], s.index.topk))
            out[a:b] = indexer.sparse_attention(q[a:b], positions[a:b], chosen, b - a, expand, self.softmax_scale)
        return out

    def _decode_sparse(self, w, q, index, positions, cache, out) -> None:
        """Decoding with the DSA indexer: the indexer's keys kept in the pool beside k/v; the rows of sequences past
        index_topk keys attend again, to their chosen keys only, into `out` [T, nh, v_head_dim]."""
        s = self.spec
        kept = cache.keep(index[1]) if index else None          # [slots, capacity, D]
        if int(positions.max()) < s.index.topk:                 # every key chosen everywhere: dense was exact
            return
        for a, b, slot, start in cache.sequences():
            n = start + b - a
            if n <= s.index.topk:
                continue
            chosen = self._chosen(w, (a, b), lambda: indexer.select(
                index[0][a:b], index[2][a:b], kept[slot, :n], positions[a:b], s.index.topk))
            k, v = cache.cached(slot, n)
            out[a:b] = indexer.sparse_attention(q[a:b], positions[a:b], chosen, n, lambda h0, h1: (
                k[:, h0:h1], v[:, h0:h1]), self.softmax_scale)[..., :s.v_head_dim]

    def _chosen(self, w, key: tuple, choose) -> torch.Tensor:
        """The keys a DSA layer's queries keep, `key` naming the rows in this pass: chosen by its own indexer
        (kept for the GLM-5 'shared' layers after it), or the ones its full layer chose."""
        source = w["indexer.source"]
        if "self_attn.indexer.wk" in w:
            chosen = choose()
            if self.spec.index.source.count(source) > 1:
                if self._kept_source != source or key in self._kept:   # another layer, or a new pass
                    self._kept, self._kept_source = {}, source
                self._kept[key] = chosen
            return chosen
        if self._kept_source != source or key not in self._kept:
            raise TargetError(f"{self.cfg.source}: a 'shared' DSA layer reuses the keys layer {source} chose, which "
                              "did not run before it here (a pipeline stage starts between them)")
        return self._kept[key]

    def _expand(self, w, c, k_pe, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Heads a..b's keys [L, b - a, dqk] = [k_nope | k_pe] and values [L, b - a, dv] from the latent
        c [L, kv_lora_rank] and the roped k_pe [L, rope]: kv_b's rows of those heads only."""
        s, L = self.spec, c.shape[0]
        kv_b = w["self_attn.kv_b_proj"].view(self.heads, -1, s.kv_lora_rank)[a:b].flatten(0, 1)
        k_nope, v = F.linear(c, kv_b).view(L, b - a, s.qk_nope_head_dim + s.v_head_dim).split(
            [s.qk_nope_head_dim, s.v_head_dim], -1)
        return torch.cat([k_nope, k_pe[:, None].expand(L, b - a, s.qk_rope_head_dim)], -1), v

    def _moe(self, w, x):
        idx, weights = moe.route(F.linear(x.float(), w["mlp.gate"]), w.get("mlp.gate.bias"), self.spec.router)
        out = moe.routed(w, x, idx, weights, self.spec.n_routed_experts, self.expert_act, self.dtype,
                         self.ckpt.block_cols)
        if self.spec.n_shared_experts:
            out = out + swiglu(x, w["mlp.shared_experts.gate_proj"], w["mlp.shared_experts.up_proj"],
                               w["mlp.shared_experts.down_proj"])
        return out
