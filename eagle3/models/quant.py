"""The stored formats of a target's linears, one reader each (docs/checkpoints.md): compressed-tensors
`pack-quantized` int4 (`X.weight_packed` int32 [out, in/8], values + 8, lowest nibble first, `X.weight_scale`
[out, in/group], `X.weight_shape`), fp8 e4m3 blocks (`X.weight` float8 [out, in], `X.weight_scale_inv` one per
b0 x b1 block, partial at the edges) and plain `X.weight`; which one a linear is, by its keys; gpt-oss's MXFP4
experts (`X_blocks` / `X_scales`, `dequantize_mxfp4`)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
FP8_SCALE = "weight_scale_inv"
# compressed-tensors weights as Kimi-K2-Thinking / K2.5 / K2.6 store them: the one scheme read
INT4_SCHEME = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "dynamic": False,
               "actorder": None, "block_structure": None}
FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt", "modules_to_not_convert"}


@dataclass(frozen=True)
class Format:
    """What a checkpoint's quantization_config allows its linears to be stored as: "int4", "fp8" (blocks
    `block`) or neither ("none": every linear plain)."""
    kind: str
    block: tuple[int, int] | None = None
    described: tuple = ()                                  # (key, value) pairs for `inspect`

    def describe(self) -> dict | None:
        return dict(self.described) if self.kind != "none" else None


def read_format(q, where: str) -> Format:
    """A quantization_config (None: unquantized) -> its Format; ValueError naming what is not implemented."""
    if not q:
        return Format("none")
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_format(q, where)
    if method == "compressed-tensors":
        return _int4_format(q, where)
    if method == "mxfp4":   # gpt-oss: its experts' `_blocks` / `_scales`, every other linear plain
        return Format("mxfp4", None, (("method", "mxfp4"),))
    raise ValueError(f"{where}: quantization_config quant_method {method!r} is not read (read: 'fp8' with "
                     "weight_block_size, 'compressed-tensors' pack-quantized int4, 'mxfp4' gpt-oss experts)")


def _fp8_format(q: dict, where: str) -> Format:
    block, fmt = q.get("weight_block_size"), q.get("fmt", "e4m3")
    problems = [f"unknown keys {sorted(set(q) - FP8_KEYS)}"] if set(q) - FP8_KEYS else []
    if fmt not in ("e4m3", "float8_e4m3fn"):
        problems.append(f"fmt {fmt!r} (read: e4m3)")
    if q.get("activation_scheme", "dynamic") != "dynamic":   # static: input scales this forward never applies
        problems.append(f"activation_scheme {q['activation_scheme']!r} (read: dynamic)")
    if q.get("scale_fmt", "ue8m0") != "ue8m0":
        problems.append(f"scale_fmt {q['scale_fmt']!r} (read: ue8m0, or none)")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        problems.append(f"weight_block_size {block!r} (read: two positive integers; per-tensor fp8 is not read)")
    if problems:
        raise ValueError(f"{where}: quantization_config fp8 with {'; '.join(problems)}")
    return Format("fp8", tuple(block), (("method", "fp8"), ("fmt", "e4m3"), ("weight_block_size", block),
                                        ("scale_fmt", q.get("scale_fmt"))))


def _int4_format(q: dict, where: str) -> Format:
    groups = list((q.get("config_groups") or {}).values())
    problems = [] if q.get("format") == "pack-quantized" else [f"format {q.get('format')!r} (read: pack-quantized)"]
    for g in groups or [{}]:
        w = g.get("weights") or {}
        # an absent key means compressed-tensors' default, which is ours but for num_bits and strategy
        found = {k: w.get(k, None if k in ("num_bits", "strategy") else v) for k, v in INT4_SCHEME.items()}
        problems += [f"weights {k} {found[k]!r} (read: {v!r})" for k, v in INT4_SCHEME.items() if found[k] != v]
        if not (isinstance(w.get("group_size"), int) and w["group_size"] > 0 and w["group_size"] % 8 == 0):
            problems.append(f"weights group_size {w.get('group_size')!r} (read: a multiple of 8)")
        if g.get("input_activations") is not None:
            problems.append("input_activations quantized (read: weights only)")
    if q.get("kv_cache_scheme") is not None:
        problems.append("kv_cache_scheme set (read: none)")
    if problems:
        raise ValueError(f"{where}: quantization_config compressed-tensors with {'; '.join(dict.fromkeys(problems))}")
    w = groups[0]["weights"]
    return Format("int4", None, (("method", "compressed-tensors"), ("format", "pack-quantized"), ("num_bits", 4),
                                 ("group_size", w["group_size"]), ("symmetric", True)))


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


def block_scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> list[int]:
    """weight_scale_inv of an [out, in] linear in b0 x b1 blocks: [ceil(out / b0), ceil(in / b1)]."""
    return [-(-shape[0] // block[0]), -(-shape[1] // block[1])]


def row_scales(scale_inv: torch.Tensor, out: int, block_rows: int) -> torch.Tensor:
    """Block scales [ceil(out/b0), c] -> one row per weight row [out, c]: row-aligned like int4's scales, so that the
    linears of an expert stack along rows whatever out is (576 = 4.5 blocks); float32 scales cost 4 / b1 bytes a
    weight (1/32 at 128)."""
    return scale_inv.repeat_interleave(block_rows, dim=0)[:out]


def dequantize(parts: dict[str, torch.Tensor], dtype: torch.dtype, block_cols: int | None = None) -> torch.Tensor:
    """A linear's stored parts (or experts' stacked along dim 0) -> W [..., out, in] in `dtype`: int4 packs, an fp8
    weight with row scales (`row_scales`, columns in blocks of `block_cols`), or a plain weight."""
    if "weight_packed" in parts:
        return dequantize_int4(parts["weight_packed"], parts["weight_scale"], dtype)
    if "row_scale" in parts:
        return dequantize_fp8(parts["weight"], parts["row_scale"], block_cols, dtype)
    if "blocks" in parts:
        return dequantize_mxfp4(parts["blocks"], parts["scales"], dtype)
    return parts["weight"].to(dtype)


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor, block_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """fp8 w [..., out, in], row scales [..., out, ceil(in/b1)] -> float(w[i, j]) * scale[i, j // b1] in fp32, then
    `dtype` (DeepSeek-V3's weight_dequant, vLLM's scaled_dequantize); one Triton kernel on CUDA."""
    if w.is_cuda and torch.cuda.get_device_capability(w.device) >= (8, 9):   # Triton converts fp8 from sm_89 on
        return _launch(w, scale, dtype, block_cols, 1)
    return dequantize_fp8_torch(w, scale, block_cols, dtype)


def dequantize_fp8_torch(w: torch.Tensor, scale: torch.Tensor, block_cols: int, dtype: torch.dtype) -> torch.Tensor:
    full = scale.float().repeat_interleave(block_cols, dim=-1)[..., :w.shape[-1]]
    return (w.float() * full).to(dtype)


def linear_kind(has, base: str) -> str:
    """How linear `base` is stored, by its keys: "int4", "fp8" or "plain"."""
    return "int4" if is_packed(has, base) else "fp8" if has(f"{base}.{FP8_SCALE}") else "plain"


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
    return _launch(packed, scale, dtype, packed.shape[-1] // scale.shape[-1], 8)


def _launch(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, per_scale: int, expand: int) -> torch.Tensor:
    """stored [..., words] (each word `expand` weights), row scales [..., groups] of `per_scale` words each ->
    [..., words * expand]. Memory-bound (a Kimi layer's experts are 17 G weights): one read and one write."""
    words, groups = stored.shape[-1], scale.shape[-1]
    stored, scale = stored.contiguous(), scale.contiguous()
    rows = stored.numel() // words if words else 0
    out = torch.empty(*stored.shape[:-1], words * expand, dtype=dtype, device=stored.device)
    block_r, block_w = 16, 512 // expand
    grid = ((rows + block_r - 1) // block_r, (words + block_w - 1) // block_w)
    if rows:
        _triton_kernel()[grid](stored, scale, out, rows, words, groups, WORDS_PER_GROUP=per_scale, BLOCK_R=block_r,
                               BLOCK_W=block_w, EXPAND=expand)
    return out


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequant(stored_ptr, scale_ptr, out_ptr, rows, words, groups, WORDS_PER_GROUP: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, EXPAND: tl.constexpr):
        # stored [rows, words]: int32 words of 8 int4 weights (EXPAND 8) or fp8 weights (1); scale [rows, groups] of
        # WORDS_PER_GROUP words each (the last one partial); out [rows, EXPAND * words]
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        mask = (r[:, None] < rows) & (c[None, :] < words)
        s = tl.load(scale_ptr + r[:, None] * groups + c[None, :] // WORDS_PER_GROUP, mask=mask, other=0).to(tl.float32)
        if EXPAND == 8:
            p = tl.load(stored_ptr + r[:, None] * words + c[None, :], mask=mask, other=0)
            nib = (p[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF          # [R, W, 8]
            w = tl.reshape((nib - 8).to(tl.float32) * s[:, :, None], (BLOCK_R, BLOCK_W * 8))
        else:
            w = tl.load(stored_ptr + r[:, None] * words + c[None, :], mask=mask).to(tl.float32) * s
        col = tl.program_id(1) * BLOCK_W * EXPAND + tl.arange(0, BLOCK_W * EXPAND)
        tl.store(out_ptr + r[:, None] * (words * EXPAND) + col[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=(r[:, None] < rows) & (col[None, :] < words * EXPAND))

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


# the e2m1 values of an MXFP4 nibble (OCP Microscaling: sign bit high), blocks of 32 sharing a power-of-two scale
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_shapes(stacked: int, out: int, inp: int) -> dict[str, list[int]]:
    """`_blocks` uint8 [E, out, in/32, 16] and `_scales` uint8 [E, out, in/32] of `stacked` [out, in] matrices."""
    return {"blocks": [stacked, out, inp // 32, 16], "scales": [stacked, out, inp // 32]}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., out, G, 16] (two values a byte, the low nibble first), scales uint8 [..., out, G]
    (2^(s - 127)) -> W [..., out, 32 G] in `dtype`, computed there: exact (a value has two significant bits, the
    scale is a power of two that bf16's exponent holds)."""
    lut = torch.tensor(MXFP4_VALUES, dtype=dtype, device=blocks.device)
    scale = torch.exp2(scales.float() - 127).to(dtype)[..., None, None]                     # [..., out, G, 1, 1]
    # int32 indices: a uint8 index would be read as a mask
    w = torch.stack([lut[(blocks & 0xF).int()], lut[(blocks >> 4).int()]], dim=-1) * scale   # [..., out, G, 16, 2]
    return w.flatten(-3)
