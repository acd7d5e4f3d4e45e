"""Rows spread into a filled tensor in one pass, out[index[i]] = src[i], every other row `fill` (torch's
new_full + index_copy writes it twice); `kernels.reference.spread_rows` is the ground truth and the CPU path."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from eagle3.kernels.interpreter import INTERPRET

MAX_BLOCK_W = 64 if INTERPRET else 2048   # columns per program (bf16: 4 KB of one row)


@triton.jit
def _spread_kernel(SRC, INV, OUT, W, fill, BLOCK_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    inside = cols < W
    source = tl.load(INV + row).to(tl.int64)                  # -1: not a spread row
    x = tl.load(SRC + source * W + cols, mask=inside & (source >= 0), other=fill)
    tl.store(OUT + row * W + cols, x.to(OUT.dtype.element_ty), mask=inside)


def spread_rows(src: torch.Tensor, index: torch.Tensor, total: int, fill=0) -> torch.Tensor:
    """`kernels.reference.spread_rows` (`index` distinct), not differentiable: `eagle3.ops.scatter_rows` wraps it."""
    src = src.contiguous()
    n, W = src.shape[0], math.prod(src.shape[1:])
    out = src.new_empty((total, *src.shape[1:]))
    if total == 0 or W == 0:
        return out.fill_(fill)
    inverse = torch.full((total,), -1, dtype=torch.int32, device=src.device)
    inverse.index_copy_(0, index, torch.arange(n, dtype=torch.int32, device=src.device))
    block = min(MAX_BLOCK_W, triton.next_power_of_2(W))
    _spread_kernel[(total, triton.cdiv(W, block))](src, inverse, out, W, float(fill), BLOCK_W=block, num_warps=4)
    return out
