"""Small numerical building blocks shared by the target forward and the draft."""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from eagle3.kernels import reference

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the reference models compute it: in fp32, cast back, then scale."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm as training runs it: a Triton kernel each way on a GPU, elsewhere torch.compile."""
    if x.is_cuda:
        from eagle3.kernels import rms_norm as kernel   # Triton on first use, as the other kernels
        if x.shape[-1] <= kernel.MAX_WIDTH:
            return kernel.rms_norm(x, weight, eps)
    return compiled(rms_norm)(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(silu_mul(F.linear(x, gate), F.linear(x, up)), down)


@functools.cache
def compiled(fn):
    """`fn` under torch.compile, one graph per width: only the row count (dim 0 of the first tensor argument
    and of every other with as many rows) is dynamic, as Inductor's reductions run faster static."""
    # a graph per width, dtype and grad mode (the setting's name before torch 2.7: cache_size_limit)
    dynamo = torch._dynamo.config
    limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, limit, max(getattr(dynamo, limit), 32))
    # casts rounded where the code rounds (Inductor otherwise skips a bf16 round trip in a kernel)
    from torch._inductor import config as inductor
    exact = {"emulate_precision_casts": True} if hasattr(inductor, "emulate_precision_casts") else {}
    graph = torch.compile(fn, dynamic=False, options=exact)

    @functools.wraps(fn)
    def rows_dynamic(*args):
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim()]
        for a in tensors:
            if a.shape[0] == tensors[0].shape[0]:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return graph(*args)
    return rows_dynamic


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE's inverse frequencies [head_dim/2], in fp32 as vLLM, SGLang and transformers compute them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def llama_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of rotate-half RoPE with the config's scaling (none, linear, llama3), in fp32 in the
    engines' order of operations (vLLM's llama3_rope.py, SGLang's Llama3RotaryEmbedding)."""
    inv = default_inv_freq(head_dim, theta)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low) if low != high else 0
        mid = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(wavelen < old / high, inv, torch.where(wavelen > old / low, inv / factor, mid))
    raise ValueError(f"rope_type '{kind}' is not supported for Llama-family RoPE "
                     "(supported: default, linear, llama3)")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_bounds(dim: int, base: float, original: int, beta_fast: float, beta_slow: float,
                truncate: bool = True) -> tuple[float, float]:
    """The first and last rotary pair index of the ramp between extrapolated and interpolated (whole numbers unless
    `truncate` is off, as gpt-oss's config asks)."""
    def pair(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = pair(beta_fast), pair(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_attention_factor(scaling: dict) -> float:
    """The cos/sin multiplier of YaRN as vLLM's YaRNScalingRotaryEmbedding takes it: attention_factor, else the
    mscale / mscale_all_dim ratio, else 0.1 ln(factor) + 1 (the only rule older vLLM and SGLang apply)."""
    f = float(scaling["factor"])
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(f, float(scaling["mscale"])) / yarn_mscale(f, float(scaling["mscale_all_dim"]))
    return yarn_mscale(f)


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's rotate-half inverse frequencies, in fp32 in vLLM's and SGLang's order of operations."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (scaling["factor"] * pos_freqs)
    low, high = yarn_bounds(head_dim, theta, scaling["original_max_position_embeddings"],
                            scaling.get("beta_fast", 32), scaling.get("beta_slow", 1), scaling.get("truncate", True))
    high += 0.001 if low == high else 0
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp   # each pair's extrapolated share, rounded as the engines round it
    return interpolated * (1 - keep) + extrapolated * keep


# what the draft's rotary keeps of the target's scaling: the keys every engine version reads alike (docs/training.md)
DRAFT_ROPE_KEYS = {"linear": ("factor",),
                   "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                   "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")}
YARN_BETAS = {"beta_fast": 32, "beta_slow": 1}


def draft_rope_scaling(target: dict | None) -> dict | None:
    """The draft layer's rope scaling for a target's (`rope_settings`' dict): its type and frequency keys; YaRN's
    magnitude keys (mscale, mscale_all_dim, attention_factor) are dropped, so every engine applies 0.1 ln(f) + 1."""
    if target is None:
        return None
    kind = "yarn" if target["rope_type"] == "deepseek_yarn" else target["rope_type"]
    if kind not in DRAFT_ROPE_KEYS:
        raise ValueError(f"rope_type '{kind}' has no rule for the draft's rotary (supported: none, "
                         f"{', '.join(DRAFT_ROPE_KEYS)})")
    given = {**YARN_BETAS, **target} if kind == "yarn" else target
    if missing := [k for k in DRAFT_ROPE_KEYS[kind] if k not in given]:
        raise ValueError(f"rope_type '{kind}' needs {missing[0]}")
    # gpt-oss's untruncated YaRN ramp: vLLM's get_rope and SGLang's rotary factory read `truncate` alike
    truncate = {"truncate": bool(target["truncate"])} if kind == "yarn" and "truncate" in target else {}
    return {"rope_type": kind, **{k: given[k] for k in DRAFT_ROPE_KEYS[kind]}, **truncate}


def draft_rope(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] fp32, cos/sin multiplier) of a Llama-style layer with `scaling` (none, linear, llama3,
    yarn), as vLLM's and SGLang's get_rope compute them."""
    if scaling is not None and scaling.get("rope_type") == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling), yarn_attention_factor(scaling)
    return llama_inv_freq(head_dim, theta, scaling), 1.0


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D] (rotate-half layout: the D/2 frequencies repeated twice), times `scale` (YaRN's)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [T, heads, D] with cos/sin [T, D], computed in fp32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each packed token inside its own sequence: [T] int64."""
    starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff(), output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def scatter_rows(t: torch.Tensor, index: torch.Tensor | None, total: int, fill=0) -> torch.Tensor:
    """t [n, ...] into [total, ...] filled with `fill`, at distinct rows `index` (t itself when None)."""
    if index is None:
        return t
    return _ScatterRows.apply(t, index, total, fill) if t.requires_grad else _spread(t, index, total, fill)


def _spread(t: torch.Tensor, index: torch.Tensor, total: int, fill) -> torch.Tensor:
    """scatter_rows without autograd: one Triton pass on a GPU, torch elsewhere."""
    if t.is_cuda and t.dim() >= 2 and t.dtype.is_floating_point:
        from eagle3.kernels.rows import spread_rows   # Triton on first use, as the other kernels
        return spread_rows(t, index, total, fill)
    return reference.spread_rows(t, index, total, fill)


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, index, total, fill):
        ctx.save_for_backward(index)
        return _spread(t, index, total, fill)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None, None


class _GatherRows(torch.autograd.Function):
    """x[index] for distinct rows; its backward spreads the gradient rows (advanced indexing's sorts them)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return _spread(grad, index, ctx.rows, 0), None


def gather_rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Rows `index` of x [n, ...] (x itself when None); distinct rows: the inverse of `scatter_rows`."""
    if index is None:
        return x
    return _GatherRows.apply(x, index) if x.requires_grad else x.index_select(0, index)
