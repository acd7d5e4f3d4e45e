"""The draft's dense linear layers: inside `casts_reused` (one TTT forward) each fp32 master is cast once and every
use adds its dYᵀ·X into one fp32 sum by the GEMM (beta = 1): no add kernels, no bf16 partial sums."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

_scope: dict | None = None


@contextlib.contextmanager
def casts_reused():
    """Inside: a weight is cast once while unchanged (its version) and its uses share one gradient sum."""
    global _scope
    outer, _scope = _scope, {}
    try:
        yield
    finally:
        _scope = outer


def reused(slot, t: torch.Tensor, key, make):
    """`make()` for `t` under `key`, kept in the scope's `slot` while `t` is unchanged (outside a scope: anew)."""
    if _scope is None:
        return make()
    held = _scope.get(slot)
    if held is None or held[0] is not t or held[1] != (t._version, key):
        held = _scope[slot] = (t, (t._version, key), make())
    return held[2]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes in: autocast's where autocast is on, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ w.T with w [n, k] (an fp32 master), in `compute_dtype(x)`."""
    return dense_linears(x, w)[0]


def dense_linears(x: torch.Tensor, *ws: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(x @ w.T for w in ws): layers reading one input, their input gradients summed in the GEMMs too."""
    dtype = compute_dtype(x)
    if not (torch.is_grad_enabled() and all(w.requires_grad for w in ws)):
        # no weight gradient to sum: F.linear, with autocast's own weight casts where it is on
        return tuple(F.linear(x, w if torch.is_autocast_enabled(x.device.type) else w.to(dtype)) for w in ws)
    casts = [reused(("dense", id(w)), w, dtype, lambda w=w: _cast(w, dtype)) for w in ws]
    return _Linears.apply(x.to(dtype), tuple(total for _, total in casts), *(w for w, _ in casts))


class _Sum:
    """One cast's uses' weight gradient, summed in fp32, and the cast's autograd node, which hands it on."""
    __slots__ = ("grad", "node")

    def __init__(self):
        self.grad = self.node = None


def _cast(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, _Sum]:
    total = _Sum()
    w_cast = _Cast.apply(w, dtype, total)
    total.node = w_cast.grad_fn
    return w_cast, total


class _Cast(torch.autograd.Function):
    """The master weight in the compute dtype; its backward returns the summed gradient of every use."""

    @staticmethod
    def forward(ctx, w, dtype, total):
        ctx.set_materialize_grads(False)   # the uses hand back no gradient: no zeros to make
        ctx.total, ctx.w_dtype = total, w.dtype
        return w.to(dtype) if w.dtype != dtype else w.view_as(w)

    @staticmethod
    @once_differentiable
    def backward(ctx, _unused):
        grad, ctx.total.grad = ctx.total.grad, None
        return (None if grad is None else grad.to(ctx.w_dtype)), None, None


class _Linears(torch.autograd.Function):
    """y_i = x w_iᵀ for casts w_i sharing x; the backward adds each dy_iᵀ x into its cast's fp32 sum."""

    @staticmethod
    def forward(ctx, x, totals, *ws):   # x [..., k], ws [n_i, k], all in one dtype
        ctx.set_materialize_grads(False)   # an output nobody used adds nothing
        ctx.save_for_backward(x, *ws)
        ctx.totals = totals
        return tuple(F.linear(x, w) for w in ws)

    @staticmethod
    @once_differentiable
    def backward(ctx, *dys):
        x, *ws = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        dx = None
        with torch.autocast(x.device.type, enabled=False):   # the sums' dtypes are chosen here
            for dy, w, total in zip(dys, ws, ctx.totals):
                if dy is None:
                    continue
                dy = dy.reshape(-1, dy.shape[-1])
                if ctx.needs_input_grad[0]:
                    dx = dy.mm(w) if dx is None else dx.addmm_(dy, w)   # [m, k]
                # only when this backward runs the cast: a sum left behind would go into the next backward's
                if torch._C._will_engine_execute_node(total.node):
                    _accumulate(total, dy.t(), x2)
        return None if dx is None else dx.reshape(x.shape), None, *[None] * len(ws)


def _accumulate(total: _Sum, a: torch.Tensor, b: torch.Tensor) -> None:
    """total.grad (+)= a @ b [n, k] in fp32: by the GEMM itself on CUDA where it can, operands widened on the CPU."""
    wide, g = torch.promote_types(a.dtype, torch.float32), total.grad
    if a.dtype == wide or not a.is_cuda:
        a, b = a.to(wide), b.to(wide)
        total.grad = a @ b if g is None else g.addmm_(a, b)
    elif _gemm_sums_wide(a.device, a.dtype):
        total.grad = torch.mm(a, b, out_dtype=wide) if g is None else torch.addmm(g, a, b, out_dtype=wide, out=g)
    else:
        total.grad = torch.mm(a, b).to(wide) if g is None else g.add_(torch.mm(a, b))


@functools.cache
def _gemm_sums_wide(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch and GPU run a narrow x narrow -> fp32 GEMM adding into its output."""
    try:
        a = torch.ones(16, 16, device=device, dtype=dtype)
        out = torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
        return bool((out == 32).all())
    except (RuntimeError, TypeError):
        return False
