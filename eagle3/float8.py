"""fp8 training GEMMs (`train.float8`): the draft's linear layers as scaled fp8 matmuls.

Forward: the input and the weight cast to float8_e4m3fn with one dynamic scale per tensor (amax /
448); their product in the input's dtype. Backward: the output gradient in float8_e5m2 (more range,
amax / 57344); dX = dY·W and dW = dYᵀ·X as scaled fp8 matmuls of the copies saved by the forward
(they also halve the activation memory kept for backward). The fp32 master weights stay with the
optimizer; each step casts them afresh. `torch._scaled_mm` runs on GPUs with fp8 tensor cores
(compute capability 8.9 and later: Ada, Hopper, Blackwell) and on the CPU (the tests); it wants every
dimension a multiple of 16, so rows are zero-padded (zero rows add nothing to dW).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3.config import ConfigError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The default: x @ w.T (w is an fp32 master). Under autocast the weight goes in as it is:
    autocast casts it once per step and reuses the copy; without, it takes x's dtype."""
    return F.linear(x, w if torch.is_autocast_enabled(x.device.type) else w.to(x.dtype))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ w.T with w [n, k], as fp8 GEMMs forward and backward; the output in autocast's
    dtype where autocast is on (as the dense path's), else in x's."""
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return _Float8Linear.apply(x.reshape(-1, x.shape[-1]), w, out_dtype).reshape(*x.shape[:-1], w.shape[0])


def to_fp8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t / scale in `dtype`, scale): one fp32 scale for the tensor, its amax at the format's largest value."""
    scale = (t.detach().abs().amax().float() / MAX[dtype]).clamp(min=1e-12)
    return (t.float() / scale).to(dtype), scale


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, -t.shape[0] % 16))


def _mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
        out_dtype: torch.dtype) -> torch.Tensor:
    """a [m, k] @ b[n, k].T * scale_a * scale_b, both row-major fp8 (b.T is the column-major operand)."""
    return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:   # x [m, k], w [n, k]
        m = x.shape[0]
        xq, sx = to_fp8(_pad_rows(x), E4M3)                               # [m16, k]
        wq, sw = to_fp8(w, E4M3)
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.rows, ctx.x_dtype, ctx.w_dtype = m, x.dtype, w.dtype
        return _mm(xq, sx, wq, sw, out_dtype)[:m]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xq, sx, wq, sw = ctx.saved_tensors
        gq, sg = to_fp8(_pad_rows(grad.reshape(ctx.rows, -1)), E5M2)      # [m16, n]
        dx = None
        if ctx.needs_input_grad[0]:   # not for fc: the aux states need none
            dx = _mm(gq, sg, wq.t().contiguous(), sw, ctx.x_dtype)[:ctx.rows]      # [m, k] = dY @ W
        dw = _mm(gq.t().contiguous(), sg, xq.t().contiguous(), sx, torch.float32)   # [n, k] = dYᵀ @ X
        return dx, dw.to(ctx.w_dtype), None


def check_device(device: torch.device, where: str) -> None:
    """fp8 GEMMs need fp8 tensor cores on a GPU; say so at start-up, not at the first step."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"{where}: train.float8 = true needs a GPU with fp8 tensor cores (compute capability "
                         f">= 8.9: Ada, Hopper, Blackwell); {name} has "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")


def check_dims(dims: dict[str, int], where: str) -> None:
    """torch._scaled_mm on a GPU wants every matrix dimension a multiple of 16 (rows are padded here)."""
    odd = {name: size for name, size in dims.items() if size % 16}
    if odd:
        raise ConfigError(f"{where}: train.float8 = true needs the draft's widths to be multiples of 16; "
                         + ", ".join(f"{name} = {size}" for name, size in odd.items()))
