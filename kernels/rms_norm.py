"""RMSNorm for training in Triton, rounded where `eagle3.ops.rms_norm` rounds: one pass forward, one backward whose
programs sum their rows' dw in fp32, added in a fixed order (deterministic; torch.compile's is a slow reduction)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle3.kernels.interpreter import INTERPRET

MAX_WIDTH = 16384    # one row in registers; wider rows are the caller's to route elsewhere
INTERPRET_PROGRAMS = 4    # backward programs under the interpreter (on a GPU: two per SM)


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
    """dx̂ = round(dy w), dx = rstd (dx̂ - x̂ mean(dx̂ x̂)); this program's part of dw = Σ dy round(x̂)."""
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
        gpu = None if INTERPRET else torch.cuda.get_device_properties(x2.device)
        programs = max(1, min(INTERPRET_PROGRAMS if gpu is None else 2 * gpu.multi_processor_count, rows))
        parts = torch.empty(programs, width, device=x2.device, dtype=torch.float32)
        block, warps = _block(width)
        if rows:
            _rms_norm_bwd_kernel[(programs,)](dy2, x2, weight.contiguous(), rstd, dx if write_dx else x2, parts, rows,
                                              width, triton.cdiv(rows, programs), WRITE_DX=write_dx, BLOCK=block,
                                              num_warps=warps)
        else:
            parts.zero_()
        return dx.view(dy.shape) if write_dx else None, parts.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`eagle3.ops.rms_norm`'s contract (x [..., width <= MAX_WIDTH], weight in x's dtype), differentiable in both."""
    if x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"kernels.rms_norm: rows of {x.shape[-1]} > {MAX_WIDTH} (use eagle3.ops.rms_norm)")
    return _RMSNorm.apply(x, weight, eps)
