"""The draft's dense linear layers: x @ wᵀ, with each weight's gradient summed inside the GEMMs.

A TTT forward passes every weight through K steps. Left to autocast and autograd, each step's
weight gradient comes out of its GEMM in bf16, the K of them are added up by K-1 more passes over
the whole gradient (bf16 adds: each rounds), and the sum is cast to the fp32 master's dtype. Here,
inside `casts_reused` (one TTT forward), each master is cast once while it is unchanged, every use
adds its dYᵀ·X into one fp32 sum by the GEMM itself (beta = 1, `torch.addmm(..., out_dtype=fp32)`
on CUDA with torch >= 2.8; before, a GEMM and an fp32 add), and the cast's backward hands that sum to
the master: no add kernels, no bf16 rounding of the partial sums. Outside the scope each call is its
own cast and sum. Without autograd (held-out evaluation, decoding) it is `F.linear` as autocast runs
it. On an H200 the Kimi-size step's add kernels fell from 15.5 to 6.1 ms (bench/RESULTS.md).

The scope also holds `eagle3.float8`'s casts (`reused`): one TTT forward reuses a weight's fp8 copy
the same way.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

_scope: dict | None = None


@contextlib.contextmanager
def casts_reused():
    """Inside: a weight is cast once while it is unchanged (its version) and its uses share one
    gradient sum; `reused` serves the fp8 casts. Leaving the scope drops what it holds."""
    global _scope
    outer, _scope = _scope, {}
    try:
        yield
    finally:
        _scope = outer


def reused(slot, t: torch.Tensor, key, make):
    """`make()` for tensor `t` under `key`, remembered in the scope's `slot` while `t` is the same
    tensor at the same version (outside a scope: made anew each call)."""
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
    """(x @ w.T for w in ws): layers reading one input (k, v, q; gate, up). Their backward sums
    the input gradient inside the GEMMs too (beta = 1) instead of adding the layers' gradients."""
    dtype = compute_dtype(x)
    if not (torch.is_grad_enabled() and all(w.requires_grad for w in ws)):
        # no weight gradient to sum: F.linear, with autocast's own weight casts where it is on
        return tuple(F.linear(x, w if torch.is_autocast_enabled(x.device.type) else w.to(dtype)) for w in ws)
    casts = [reused(("dense", id(w)), w, dtype, lambda w=w: _cast(w, dtype)) for w in ws]
    return _Linears.apply(x.to(dtype), tuple(total for _, total in casts), *(w for w, _ in casts))


class _Sum:
    """The weight gradient of one cast's uses, summed in fp32 (the compute dtype when wider), and the
    cast's autograd node, which hands the sum to the master."""
    __slots__ = ("grad", "node")

    def __init__(self):
        self.grad = self.node = None


def _cast(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, _Sum]:
    total = _Sum()
    w_cast = _Cast.apply(w, dtype, total)
    total.node = w_cast.grad_fn
    return w_cast, total


class _Cast(torch.autograd.Function):
    """The master weight in the compute dtype, once per scope; its backward returns the summed
    gradient of every use (the uses return none: `_Linears`)."""

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
    """y_i = x w_iᵀ for casts w_i that share x; the backward sums dx over the layers and adds each
    dy_iᵀ x into its cast's fp32 sum, in the GEMMs."""

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
                # only for a backward that will hand the sum on (torch.autograd.grad towards x
                # alone, or backward(inputs=...), skip the cast: a sum left behind would be added
                # into the next backward's)
                if torch._C._will_engine_execute_node(total.node):
                    _accumulate(total, dy.t(), x2)
        return None if dx is None else dx.reshape(x.shape), None, *[None] * len(ws)


def _accumulate(total: _Sum, a: torch.Tensor, b: torch.Tensor) -> None:
    """total.grad (+)= a @ b [n, k], in fp32 when a, b are narrower: by the GEMM itself on CUDA
    (torch >= 2.8); with an older torch a GEMM in a's dtype and an fp32 add; on the CPU the operands
    widened (exact sums; its speed does not matter)."""
    wide = torch.promote_types(a.dtype, torch.float32)
    if a.dtype == wide or not a.is_cuda:
        a, b = a.to(wide), b.to(wide)
        if total.grad is None:
            total.grad = a @ b
        else:
            total.grad.addmm_(a, b)
    elif _gemm_sums_wide(a.device, a.dtype):
        if total.grad is None:
            total.grad = torch.mm(a, b, out_dtype=wide)
        else:
            torch.addmm(total.grad, a, b, out_dtype=wide, out=total.grad)
    elif total.grad is None:
        total.grad = torch.mm(a, b).to(wide)
    else:
        total.grad.add_(torch.mm(a, b))


@functools.cache
def _gemm_sums_wide(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch and GPU run a narrow x narrow -> fp32 GEMM that adds into its output
    (`out_dtype`, torch >= 2.8); checked once on a small case."""
    try:
        a = torch.ones(16, 16, device=device, dtype=dtype)
        out = torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
        return bool((out == 32).all())
    except (RuntimeError, TypeError):
        return False
