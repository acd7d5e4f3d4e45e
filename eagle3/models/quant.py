"""The published formats of a linear's weight and `linear_weight`, the one call that reads any of them dense:
compressed-tensors `pack-quantized` int4 (`X.weight_packed` int32 [out, in/8], values + 8, lowest nibble first,
`X.weight_scale` [out, in/group], `X.weight_shape`), or plain `X.weight`, by its keys; gpt-oss's MXFP4 experts
(`dequantize_mxfp4`)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from eagle3.errors import TargetError

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


def packed_parts(ckpt, base: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 weight_packed and weight_scale of linear `base` of `ckpt` (a `weights.Checkpoint`), checked."""
    packed, scale = ckpt.get(base + ".weight_packed"), ckpt.get(base + ".weight_scale")
    try:
        check_packed(packed, scale, ckpt.get(base + ".weight_shape"), shape)
    except ValueError as e:
        full = ckpt.full_name(base + ".weight_packed")
        raise TargetError(f"{ckpt.dir / ckpt.weight_map[full]}: {ckpt.full_name(base)}.{e}") from None
    return packed, scale


def linear_weight(ckpt, base: str, shape: tuple[int, int], device, dtype: torch.dtype) -> torch.Tensor:
    """Linear `base`'s weight [out, in] = `shape` on `device` in `dtype`, dequantized from whichever format it is
    stored in."""
    if is_packed(ckpt.has, base):
        packed, scale = packed_parts(ckpt, base, shape)
        return dequantize_int4(packed.to(device), scale.to(device), dtype)
    w, full = ckpt.get(base + ".weight"), ckpt.full_name(base + ".weight")
    if list(w.shape) != list(shape):
        raise TargetError(f"{ckpt.dir / ckpt.weight_map[full]}: {full}: shape {list(w.shape)}; expected {list(shape)}")
    return w.to(device, dtype, non_blocking=True)


# the e2m1 values of an MXFP4 nibble (OCP Microscaling: sign bit high), blocks of 32 sharing a power-of-two scale
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_shapes(stacked: int, out: int, inp: int) -> dict[str, list[int]]:
    """`_blocks` uint8 [E, out, in/32, 16] and `_scales` uint8 [E, out, in/32] of `stacked` [out, in] matrices."""
    return {"blocks": [stacked, out, inp // 32, 16], "scales": [stacked, out, inp // 32]}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., out, G, 16] (two values a byte, the low nibble first), scales uint8 [..., out, G]
    (2^(s - 127)) -> W [..., out, 32 G] in `dtype`; exact (a value has two significant bits)."""
    lut = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=blocks.device)
    nibbles = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2)           # [..., out, G, 32]
    w = torch.ldexp(lut[nibbles.long()], scales.to(torch.int32)[..., None] - 127)
    return w.flatten(-2).to(dtype)
