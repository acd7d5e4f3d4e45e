"""compressed-tensors `pack-quantized` int4 linears: `X.weight_packed` (int32 [out, in/8], values + 8, lowest nibble
first), `X.weight_scale` [out, in/group], `X.weight_shape`; packed or plain (`X.weight`) by its keys."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


class GroupedShape(NamedTuple):
    """weight_scale of an [out, in] linear: [out, in / g], the file's group size g a multiple of 8."""
    out: int
    inp: int

    def fits(self, shape: list[int]) -> bool:
        return (len(shape) == 2 and shape[0] == self.out and shape[1] > 0 and self.inp % shape[1] == 0
                and (self.inp // shape[1]) % 8 == 0)

    def __str__(self) -> str:
        return f"[{self.out}, {self.inp}/g] for a group size g that is a multiple of 8"


def shape_fits(expected: list[int] | GroupedShape, found: list[int]) -> bool:
    return expected.fits(found) if isinstance(expected, GroupedShape) else list(expected) == list(found)


def packed_shapes(out: int, inp: int) -> dict[str, list[int] | GroupedShape]:
    return {"weight_packed": [out, inp // 8], "weight_scale": GroupedShape(out, inp), "weight_shape": [2]}


def is_packed(has, base: str) -> bool:
    """Any int4 part of linear `base` present (so that a lost part is reported by name)."""
    return any(has(f"{base}.{s}") for s in PACKED_SUFFIXES)


def linear_shapes(has, base: str, shape: tuple[int, int]) -> dict[str, list[int] | GroupedShape]:
    """The tensors of linear `base` of shape [out, in] as stored (three packed parts or `.weight`) -> shape."""
    if is_packed(has, base):
        return {f"{base}.{suffix}": s for suffix, s in packed_shapes(*shape).items()}
    return {f"{base}.weight": list(shape)}


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n/8] (`check_packed`) -> uint8 [..., n] nibbles, element 8c+j from bits 4j..4j+3 of word c."""
    # little-endian words (x86, Arm, CUDA): byte b of word c holds elements 8c+2b (low) and 8c+2b+1 (high)
    b = packed.contiguous().view(torch.uint8)                     # [..., n/2]
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)     # [..., n]


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed int32 [..., out, in/8], scale [..., out, in/group] -> W [..., out, in] in `dtype`,
    (nibble - 8) * scale[o, i // group]; one Triton kernel on CUDA."""
    return (_dequantize_triton if packed.is_cuda else dequantize_int4_torch)(packed, scale, dtype)


def dequantize_int4_torch(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = unpack_int4(packed).to(dtype) - 8                                  # exact: -8..7
    w = q.unflatten(-1, (scale.shape[-1], -1)) * scale.to(dtype)[..., None]  # [..., out, groups, group]
    return w.flatten(-2)


def _dequantize_triton(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # memory-bound (a Kimi layer's experts are 17 G weights): one read and one write, not eager's ~5 passes
    words, groups = packed.shape[-1], scale.shape[-1]
    packed, scale = packed.contiguous(), scale.contiguous()
    rows = packed.numel() // words
    out = torch.empty(*packed.shape[:-1], words * 8, dtype=dtype, device=packed.device)
    block_r, block_w = 16, 64
    grid = ((rows + block_r - 1) // block_r, (words + block_w - 1) // block_w)
    _triton_kernel()[grid](packed, scale, out, rows, words, groups, WORDS_PER_GROUP=words // groups,
                           BLOCK_R=block_r, BLOCK_W=block_w)
    return out


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequant(packed_ptr, scale_ptr, out_ptr, rows, words, groups, WORDS_PER_GROUP: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
        # packed [rows, words] int32, scale [rows, groups], out [rows, 8 * words]
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        mask = (r[:, None] < rows) & (c[None, :] < words)
        p = tl.load(packed_ptr + r[:, None] * words + c[None, :], mask=mask, other=0)
        s = tl.load(scale_ptr + r[:, None] * groups + c[None, :] // WORDS_PER_GROUP, mask=mask, other=0)
        nib = (p[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF          # [R, W, 8]
        w = (nib - 8).to(tl.float32) * s.to(tl.float32)[:, :, None]
        w = tl.reshape(w, (BLOCK_R, BLOCK_W * 8)).to(out_ptr.dtype.element_ty)
        col = tl.program_id(1) * BLOCK_W * 8 + tl.arange(0, BLOCK_W * 8)
        tl.store(out_ptr + r[:, None] * (words * 8) + col[None, :], w,
                 mask=(r[:, None] < rows) & (col[None, :] < words * 8))

    return dequant


def check_packed(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, expected: tuple[int, int]) -> None:
    """Raise ValueError unless the three parts describe an [out, in] = `expected` matrix."""
    if [int(v) for v in shape.tolist()] != list(expected):
        raise ValueError(f"weight_shape = {shape.tolist()}; expected {list(expected)}")
    if packed.dtype != torch.int32:
        raise ValueError(f"weight_packed is {packed.dtype}; expected int32")
    want = packed_shapes(*expected)
    for suffix, t in (("weight_packed", packed), ("weight_scale", scale)):
        if not shape_fits(want[suffix], list(t.shape)):
            raise ValueError(f"{suffix} has shape {list(t.shape)}; expected {want[suffix]}")
