"""fp8 cast for training GEMMs, one dynamic scale, both layouts (Hopper's fp8 GEMM takes a row-major A, a column-major
B): an amax kernel, then a tiled cast; `to_fp8_reference`, the CPU path, equals it bit for bit on finite inputs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from eagle3.kernels.interpreter import INTERPRET

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
_OUT = {E4M3: tl.float8e4nv, E5M2: tl.float8e5}


def to_fp8_reference(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """t [..., k] (m rows) -> (q [m16, k], qᵀ [k, m16], fp32 scale): scale = max(amax |t| / MAX, 1e-12),
    q = t / scale in `dtype`, rows zero-padded to a multiple of 16."""
    t = t.reshape(-1, t.shape[-1])
    t = F.pad(t, (0, 0, 0, -t.shape[0] % 16))
    amax = t.abs().amax() if t.numel() else t.new_zeros(())
    scale = (amax.float() / MAX[dtype]).clamp(min=1e-12)
    q = (t.float() / scale).to(dtype)
    return q, q.t().contiguous(), scale


@triton.jit
def _amax_kernel(x_ptr, n, amax_ptr, BLOCK: tl.constexpr):
    """Each program: the max |x| of its strided blocks, then one atomic max (|x| >= 0: fp32 order)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid.to(tl.int64) * BLOCK, n, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _cast_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, m, m16, k, OUT: tl.constexpr, TRANSPOSED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_K] tile of x -> the same tile of q and (TRANSPOSED), transposed, of qᵀ."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = cols[None, :] < k
    x = tl.load(x_ptr + rows[:, None] * k + cols[None, :], mask=(rows[:, None] < m) & inside, other=0.0)
    q = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)).to(OUT)   # padding rows: zeros
    tl.store(q_ptr + rows[:, None] * k + cols[None, :], q, mask=(rows[:, None] < m16) & inside)
    if TRANSPOSED:
        tl.store(qt_ptr + cols[:, None] * m16 + rows[None, :], tl.trans(q),
                 mask=(cols[:, None] < k) & (rows[None, :] < m16))


def to_fp8(t: torch.Tensor, dtype: torch.dtype, transposed: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`to_fp8_reference` with no host sync (the scale stays on the device); qᵀ None unless `transposed`."""
    x = t.reshape(-1, t.shape[-1]).contiguous()
    m, k = x.shape
    m16 = m + -m % 16
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    if x.numel():
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        programs = min(triton.cdiv(x.numel(), 4096), 4 * sms)
        _amax_kernel[(programs,)](x, x.numel(), amax, BLOCK=4096, num_warps=8)
    scale = (amax[0] / MAX[dtype]).clamp(min=1e-12)
    # the interpreter rounds some values to the wrong fp8: there the kernel writes fp32 and torch converts
    out = torch.float32 if INTERPRET else dtype
    q = torch.empty(m16, k, dtype=out, device=x.device)
    qt = torch.empty(k, m16, dtype=out, device=x.device) if transposed else q
    if q.numel():
        grid = (triton.cdiv(m16, 64), triton.cdiv(k, 64))
        _cast_kernel[grid](x, q, qt, scale, m, m16, k, OUT=tl.float32 if INTERPRET else _OUT[dtype],
                           TRANSPOSED=transposed, BLOCK_M=64, BLOCK_K=64, num_warps=4)
    if INTERPRET:
        q, qt = q.to(dtype), qt.to(dtype)
    return q, qt if transposed else None, scale
