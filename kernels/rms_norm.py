"""RMSNorm for training in Triton: one pass forward, one pass backward with the weight gradient
summed per program.

Forward, per row (fp32 inside): rstd = 1 / sqrt(mean(x²) + eps), y = w · round(x · rstd), rounded
where `eagle3.ops.rms_norm` (the reference models' arithmetic) rounds. Backward, per row:
dx̂ = round(dy · w), dx = rstd · (dx̂ - x̂ · mean(dx̂ · x̂)), and dw = Σ_rows dy · round(x̂), each
program summing its rows in fp32 registers and the programs' partial sums added at the end (the
order is fixed: deterministic). torch.compile makes the same backward two kernels, the weight
gradient a slow column reduction.

`eagle3.ops.rms_norm` is the reference (`eagle3.ops.fused_rms_norm` routes training here on a
GPU). Under TRITON_INTERPRET=1 the tests run these kernels on the CPU; the interpreter rounds to
bf16 otherwise than a GPU does (truncating), so there bf16 is checked bit for bit against a reference
that truncates where the kernel rounds.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.interpreter import fix_loop_bounds

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_WIDTH = 16384    # one row in registers; wider rows are the caller's to route elsewhere
INTERPRET_PROGRAMS = 4    # backward programs under the interpreter (on a GPU: two per SM)
if INTERPRET:
    fix_loop_bounds()


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x rounded to the tensors' dtype and back to fp32 (where the reference rounds)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(X + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / width + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = w * _round(x * rstd, Y.dtype.element_ty)
    tl.store(Y + row * width + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTS, rows, width, rows_per_program, WRITE_DX: tl.constexpr,
                         BLOCK: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    first = program * rows_per_program
    offset = first.to(tl.int64) * width          # pointers advance a row at a time: no 32-bit overflow
    X += offset
    DY += offset
    DX += offset
    for row in range(first, tl.minimum(first + rows_per_program, rows)):
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        dw += dy * _round(xhat, X.dtype.element_ty)
        if WRITE_DX:   # not for a frozen input (the draft's embedding norm)
            dxhat = _round(dy * w, X.dtype.element_ty)
            dx = rstd * (dxhat - xhat * (tl.sum(dxhat * xhat, 0) / width))
            tl.store(DX + cols, dx.to(DX.dtype.element_ty), mask=mask)
        X += width
        DY += width
        DX += width
    tl.store(DW_PARTS + program.to(tl.int64) * width + cols, dw, mask=mask)


def _block(width: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of `width`."""
    block = triton.next_power_of_2(width)
    return block, max(1, min(16, block // 512))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rows, width = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        block, warps = _block(width)
        if rows:
            _rms_norm_fwd_kernel[(rows,)](x2, weight.contiguous(), y, rstd, width, eps, BLOCK=block, num_warps=warps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        rows, width = x2.shape
        dy2 = dy.reshape(rows, width).contiguous()
        write_dx = ctx.needs_input_grad[0]
        dx = torch.empty_like(x2) if write_dx else None
        programs = max(1, min(_backward_programs(x2.device), rows))
        parts = torch.empty(programs, width, device=x2.device, dtype=torch.float32)
        block, warps = _block(width)
        if rows:
            _rms_norm_bwd_kernel[(programs,)](dy2, x2, weight.contiguous(), rstd, dx if write_dx else x2, parts, rows,
                                              width, triton.cdiv(rows, programs), WRITE_DX=write_dx, BLOCK=block,
                                              num_warps=warps)
        else:
            parts.zero_()
        return dx.view(dy.shape) if write_dx else None, parts.sum(0).to(weight.dtype), None


def _backward_programs(device: torch.device) -> int:
    """Programs of the backward: two per SM (each sums its rows' dw; the partial sums are added after)."""
    if INTERPRET:
        return INTERPRET_PROGRAMS
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`eagle3.ops.rms_norm`'s contract (x [..., width], weight [width] in x's dtype), differentiable
    in both; rows of at most MAX_WIDTH."""
    if x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"kernels.rms_norm: rows of {x.shape[-1]} > {MAX_WIDTH} (use eagle3.ops.rms_norm)")
    return _RMSNorm.apply(x, weight, eps)
