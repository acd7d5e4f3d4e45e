"""fp8 training GEMMs (`train.float8`, `train.float8_head`): scaled fp8 matmuls, one dynamic scale per tensor, e4m3
forward and e5m2 gradients, dX and dW from the forward's fp8 copies; fp32 masters; rows zero-padded to 16s."""
from __future__ import annotations

import functools
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from eagle3.config import ConfigError
from eagle3.linear import casts_reused, compute_dtype, dense_linear, reused

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ w.T with w [n, k] as fp8 GEMMs, in `compute_dtype(x)`; a view of the padded product
    (not to be modified in place). Without autograd (evaluation) the dense path: the draft as served."""
    if not torch.is_grad_enabled() or x.numel() == 0:   # nothing to cast: a step-0 batch with no trained row
        return dense_linear(x, w)
    y = _Float8Linear.apply(x.reshape(-1, x.shape[-1]), w, *cast(x, E4M3), *cast(w, E4M3), compute_dtype(x))
    return y.reshape(*x.shape[:-1], w.shape[0])


def linears(x: torch.Tensor, *ws: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(`linear`(x, w) for w in ws): layers reading one input, cast once for all of them."""
    return tuple(linear(x, w) for w in ws)


def cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """t [..., k] -> (q [m16, k], qᵀ [k, m16], scale), reused inside `linear.casts_reused`: a weight for the
    scope, an activation until the next call (one input to k, v, q cast once)."""
    from eagle3.kernels import fp8_cast   # Triton on first use, as the other kernels
    fn = fp8_cast.to_fp8 if t.is_cuda else fp8_cast.to_fp8_reference
    slot = ("fp8", id(t)) if isinstance(t, torch.nn.Parameter) else ("fp8", "activation")
    return reused(slot, t, dtype, lambda: fn(t.detach(), dtype))


def scaled_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
        out_dtype: torch.dtype) -> torch.Tensor:
    """a [m, k] row-major @ b [k, n] column-major, times both scales."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, xq, xq_t, sx, wq, wq_t, sw, out_dtype):   # x [m, k], w [n, k]; their casts
        ctx.save_for_backward(xq_t, sx, wq_t, sw)   # fp8 copies: half the memory of bf16 ones
        ctx.rows, ctx.x_dtype, ctx.w_dtype = x.shape[0], x.dtype, w.dtype
        return scaled_mm(xq, sx, wq.t(), sw, out_dtype)[:x.shape[0]]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xq_t, sx, wq_t, sw = ctx.saved_tensors
        gq, gq_t, sg = cast(grad.reshape(ctx.rows, grad.shape[-1]), E5M2)   # [m16, n], [n, m16]
        dx = dw = None
        if ctx.needs_input_grad[0]:   # not for fc: the aux states need none
            dx = scaled_mm(gq, sg, wq_t.t(), sw, ctx.x_dtype)[:ctx.rows]       # [m, k] = dY @ W
        if ctx.needs_input_grad[1]:
            dw = scaled_mm(gq_t, sg, xq_t.t(), sx, torch.float32).to(ctx.w_dtype)   # [n, k] = dYᵀ @ X
        return dx, dw, *[None] * 7


def layer_shapes(spec) -> dict[str, tuple[int, int]]:
    """[out, in] of a draft's first layer's linears (its attention reads 2H) and fc, by name: its GEMMs."""
    H, I, heads = spec.hidden_size, spec.intermediate_size, spec.num_attention_heads
    if getattr(spec, "attention", "gqa") == "mla":
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        attn = {"q_a_proj": (spec.q_lora_rank, 2 * H), "q_b_proj": (heads * qk, spec.q_lora_rank),
                "kv_a_proj_with_mqa": (spec.kv_lora_rank + spec.qk_rope_head_dim, 2 * H),
                "kv_b_proj": (heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
                "o_proj": (H, heads * spec.v_head_dim)}
    else:
        q, kv = heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
        attn = {"q_proj": (q, 2 * H), "k_proj": (kv, 2 * H), "v_proj": (kv, 2 * H), "o_proj": (H, q)}
    return {**{f"self_attn.{n}": s for n, s in attn.items()},
            **{f"mlp.{n}": s for n, s in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))},
            "fc": (H, 3 * spec.target_hidden_size)}


def gemm_widths(spec) -> dict[str, int]:
    """The widths of a draft's GEMMs by the settings that give them (fp8 GEMMs want multiples of 16)."""
    widths = {"hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
              "3 x target_hidden_size": 3 * spec.target_hidden_size}
    heads = spec.num_attention_heads
    if getattr(spec, "attention", "gqa") != "mla":
        return {**widths, "num_attention_heads x head_dim": heads * spec.head_dim,
                "num_key_value_heads x head_dim": spec.num_key_value_heads * spec.head_dim}
    return {**widths, "q_lora_rank": spec.q_lora_rank, "kv_lora_rank": spec.kv_lora_rank,
            "kv_lora_rank + qk_rope_head_dim": spec.kv_lora_rank + spec.qk_rope_head_dim,
            "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)":
                heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim),
            "num_attention_heads x (qk_nope_head_dim + v_head_dim)": heads * (spec.qk_nope_head_dim + spec.v_head_dim),
            "num_attention_heads x v_head_dim": heads * spec.v_head_dim}


def choose(setting: bool | None, device: torch.device, spec, where: str, say: bool = True, tokens: int = 16384,
           agree=bool) -> bool:
    """train.float8: `true` checked, `false`, or auto: on where the device and widths allow and one draft
    layer's fp8 GEMMs time faster than bf16 at `tokens` rows (`agree`: every rank's vote), said when `say`."""
    dims = gemm_widths(spec)
    if setting is not None:
        if setting:
            check_device(device, where)
            check_dims(dims, where)
        return setting
    odd = _odd(dims)
    why = (f"{device.type}: fp8 GEMMs need a GPU" if device.type != "cuda" else
           "ROCm: not supported" if torch.version.hip is not None else   # its fp8 formats are the fnuz ones
           f"no fp8 tensor cores on {torch.cuda.get_device_name(device)}"
           if torch.cuda.get_device_capability(device) < (8, 9) else
           f"widths not multiples of 16: {', '.join(odd)}" if odd else None)
    return _auto("train.float8", why, spec, tokens, device, "layer", say, agree)


def head_loss(setting: bool | None, draft_float8: bool, loss_steps, device: torch.device, spec, where: str,
              say: bool = True, tokens: int = 16384, agree=bool):
    """train.float8_head -> the loss: `loss_steps`, or the Triton one with fp8 lm_head GEMMs; auto: on with
    train.float8 and the Triton loss on a GPU where the head's widths allow and it times faster at `tokens` rows."""
    from eagle3.kernels.ttt_loss import ttt_loss_steps
    triton_gpu = loss_steps is ttt_loss_steps and device.type == "cuda"
    dims = {"hidden_size": spec.hidden_size, "draft_vocab_size": spec.draft_vocab_size}
    if setting:
        if not triton_gpu:
            raise ConfigError(f"{where}: train.float8_head = true needs the Triton loss on a GPU (debug.kernels "
                              "\"auto\" or \"triton\" on CUDA)")
        check_device(device, where, "train.float8_head")
        check_dims(dims, where, "train.float8_head")
    elif setting is None:
        odd = _odd(dims)
        why = ("train.float8 is off" if not draft_float8 else "not the Triton loss on a GPU" if not triton_gpu
               else f"widths not multiples of 16: {', '.join(odd)}" if odd else None)
        setting = _auto("train.float8_head", why, spec, tokens, device, "head", say, agree)
    return functools.partial(ttt_loss_steps, float8=True) if setting else loss_steps


MARGIN = 0.95   # fp8 only where clearly faster: timing noise must not flip a run's choice


def _auto(key: str, why: str | None, spec, tokens: int, device: torch.device, part: str, say: bool, agree) -> bool:
    """`key` = auto: on where nothing rules fp8 out (`why`) and `part` times faster in fp8, by every rank's vote."""
    on = False
    if why is None:
        on, why = faster(spec, tokens, device, part)
        on = agree(on)
    if say:
        print(f"{key} = auto: {'on' if on else 'off'} ({why})", file=sys.stderr)
    return on


def faster(spec, tokens: int, device: torch.device, part: str) -> tuple[bool, str]:
    """(whether fp8 beats bf16 for `part` at the draft's shapes, the times as said at start-up): a small
    draft's casts cost more than its GEMMs save. `timings` measures once per GPU, versions, shape, tokens."""
    t = timings(spec, tokens, device, part)
    what = "one layer's GEMMs" if part == "layer" else "the lm_head loss"
    return t["fp8_ms"] < MARGIN * t["bf16_ms"], (f"{what} at {tokens} tokens: fp8 {t['fp8_ms']:.2f} ms, bf16 "
                                                 f"{t['bf16_ms']:.2f} ms; timed once, {cache_path()}")


def cache_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3" / "float8.json"


def timings(spec, tokens: int, device: torch.device, part: str) -> dict[str, float]:
    """{"bf16_ms", "fp8_ms"}: forward and backward of `part` ("layer": one draft layer's linears and fc;
    "head": the fused loss's lm_head GEMMs), read from the cache or timed on `device` and cached."""
    import triton
    shape = tuple(layer_shapes(spec).values()) if part == "layer" else (spec.hidden_size, spec.draft_vocab_size)
    key = (f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}|triton {triton.__version__}"
           f"|{part} {shape}|{tokens}")
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = {f"{name}_ms": _median_ms(_workload(part, spec, tokens, device, fp8), device)
                      for name, fp8 in (("bf16", False), ("fp8", True))}
        try:   # ranks may write at once: each through its own temporary name
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, path)
        except OSError as e:
            print(f"note: the fp8 timing could not be cached in {path} ({e}); the next run times it again",
                  file=sys.stderr)
    return cache[key]


def _workload(part: str, spec, tokens: int, device: torch.device, fp8: bool):
    """A step's worth of `part` as a function; its own generator, so the run's random stream is untouched."""
    g = torch.Generator(device=device).manual_seed(0)
    randn = functools.partial(torch.randn, device=device, generator=g)
    if part == "head":
        from eagle3.kernels.ttt_loss import ttt_loss_steps
        V, H = spec.draft_vocab_size, spec.hidden_size
        w, h = (randn(V, H) * H ** -0.5).bfloat16(), randn(tokens, H, dtype=torch.bfloat16, requires_grad=True)
        p = torch.softmax(randn(tokens, V), -1).bfloat16()
        return lambda: ttt_loss_steps([h], w, [p], float8=fp8)[0].backward()
    layer = layer_shapes(spec)
    shapes = list(layer.values())
    ws = [randn(n, k, requires_grad=True) for n, k in shapes]
    xs = [randn(tokens, k, dtype=torch.bfloat16, requires_grad=name != "fc") for name, (_, k) in layer.items()]
    gs = [randn(tokens, n, dtype=torch.bfloat16) for n, _ in shapes]
    fn = linear if fp8 else dense_linear

    def step():
        with torch.autocast(device.type, torch.bfloat16), casts_reused():
            for x, w, gy in zip(xs, ws, gs):
                fn(x, w).backward(gy)
    return step


def _median_ms(step, device: torch.device, reps: int = 5) -> float:
    """Median CUDA-event time of `step` after one warm-up call; host-bound gaps count, as in training."""
    step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del step
    torch.cuda.empty_cache()
    return statistics.median(times)


def _odd(dims: dict[str, int]) -> list[str]:
    return [name for name, size in dims.items() if size % 16]


def check_device(device: torch.device, where: str, key: str = "train.float8") -> None:
    """fp8 GEMMs need fp8 tensor cores on a GPU: said at start-up, not at the first step."""
    if device.type == "cuda" and torch.version.hip is not None:
        raise ConfigError(f"{where}: {key} = true is not supported on ROCm (its fp8 formats are the fnuz ones, "
                          "not e4m3fn / e5m2)")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(f"{where}: {key} = true needs a GPU with fp8 tensor cores (compute capability "
                          f">= 8.9: Ada, Hopper, Blackwell); {torch.cuda.get_device_name(device)} has "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")


def check_dims(dims: dict[str, int], where: str, key: str = "train.float8") -> None:
    """torch._scaled_mm wants every matrix dimension a multiple of 16 (rows are padded here)."""
    if odd := _odd(dims):
        raise ConfigError(f"{where}: {key} = true needs the draft's widths to be multiples of 16; "
                          + ", ".join(f"{name} = {dims[name]}" for name in odd))
