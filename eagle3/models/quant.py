"""compressed-tensors `pack-quantized` int4 weights: unpacking and dequantization.

A quantized linear `X` is stored as `X.weight_packed` (int32 [out, in/8], eight 4-bit values per
int32 along the input dimension, lowest nibble first, each stored as value + 8), `X.weight_scale`
([out, in/group]) and `X.weight_shape` (int32 [2] = [out, in]); a plain linear as `X.weight`.
Which one a linear is gets decided by its keys, never by the config's ignore list.
"""
from __future__ import annotations

import functools
import itertools
import os
from typing import NamedTuple

import torch

PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


class GroupedShape(NamedTuple):
    """The shape of the weight_scale of an [out, in] linear: [out, in / g] for the file's group size g,
    which must divide in and be a multiple of 8 (the config's group_size is only reported)."""
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
    """The shapes of the three parts of an [out, in] int4 linear, by suffix."""
    return {"weight_packed": [out, inp // 8], "weight_scale": GroupedShape(out, inp), "weight_shape": [2]}


def is_packed(has, base: str) -> bool:
    """Linear `base` is stored as int4 parts: any of them present (so a lost part is reported by name)."""
    return any(has(f"{base}.{s}") for s in PACKED_SUFFIXES)


def linear_shapes(has, base: str, shape: tuple[int, int]) -> dict[str, list[int] | GroupedShape]:
    """The tensors of linear `base` (e.g. `layers.3.mlp.experts.0.up_proj`) of logical shape [out, in] =
    `shape`, as stored (its three packed parts, or `base.weight`), and their shapes."""
    if is_packed(has, base):
        return {f"{base}.{suffix}": s for suffix, s in packed_shapes(*shape).items()}
    return {f"{base}.weight": list(shape)}


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n/8] -> uint8 [..., n] nibbles (0..15), element 8c+j from bits 4j..4j+3 of column c."""
    if packed.dtype != torch.int32:
        raise TypeError(f"weight_packed must be int32, got {packed.dtype}")
    # int32 words are little-endian in memory (x86, Arm, CUDA): byte b of word c holds element
    # 8c+2b in its low nibble and 8c+2b+1 in its high one, so a byte view unpacks with 8-bit ops
    b = packed.contiguous().view(torch.uint8)                     # [..., n/2]
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)     # [..., n]


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    triton: bool = True) -> torch.Tensor:
    """packed int32 [..., out, in/8], scale [..., out, in/group] -> W [..., out, in] in `dtype`,
    W[o, i] = (nibble - 8) * scale[o, i // group]. One fused Triton kernel on CUDA (unless not `triton`)."""
    if packed.is_cuda and triton:
        return _dequantize_triton(packed, scale, dtype)
    return dequantize_int4_torch(packed, scale, dtype)


def dequantize_int4_torch(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = unpack_int4(packed).to(dtype) - 8                                  # exact: -8..7
    w = q.unflatten(-1, (scale.shape[-1], -1)) * scale.to(dtype)[..., None]  # [..., out, groups, group]
    return w.flatten(-2)


def _dequantize_triton(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # eager torch makes ~5 passes over byte- and bf16-sized intermediates; dequantizing every active
    # expert of a Kimi layer (17 G weights) is memory-bound, so one read of int4 + one write matters
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


# ---------------------------------------------------------------------------------------------
# W4A16: the experts' int4 weights dequantised inside the GEMM's load path (no bf16 copy of them)

# BLOCK_M is fixed (the host builds the tile schedule from it); on a GPU BLOCK_N, BLOCK_K, warps and
# stages are autotuned per (N, K) among the candidates of the GPU's family (`kernels.tiles`): "large"
# (Hopper, datacenter Blackwell: 227 KB of shared memory) as measured on an H200; "a100" (163 KB) and
# "small" (about 99 KB: sm_86/89/120) the tilings whose stages fit by count (tests/test_tiles.py), not
# measured; FALLBACK runs everywhere.
W4A16_BLOCK_M = {"gpu": 64, "interpret": 16}
W4A16_INTERPRET_NK = (16, 32)   # BLOCK_N, BLOCK_K under the interpreter (one config, no tuning)
W4A16_FALLBACK = (32, 32, 4, 2)   # BLOCK_N, BLOCK_K, num_warps, num_stages
_W4A16_LARGE = [(128, 64, 4, 4), (128, 128, 8, 3), (256, 64, 8, 3), (64, 64, 4, 3), W4A16_FALLBACK]
W4A16_CONFIGS = {
    "large": _W4A16_LARGE,
    "a100": _W4A16_LARGE,   # every one fits 163 KB
    "small": [(128, 64, 4, 3), (256, 64, 8, 3), (64, 64, 4, 3), W4A16_FALLBACK],
}


def grouped_matmul_int4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, sizes: list[int],
                        blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [n, K] with rows grouped by expert (sizes[j] rows for expert j, host ints), packed int32
    [E, N, K/8], scale [E, N, K/group] -> [n, N] in x's dtype: each group times its expert's
    dequantised W[j].T, all experts in one launch (what `dequantize_int4` then a grouped GEMM give).
    `blocks` (BLOCK_M, BLOCK_N, BLOCK_K) fixes the tiling (tests); else it is tuned on a GPU."""
    import triton
    E, N, words = packed.shape
    K = words * 8
    if x.shape[1] != K or len(sizes) != E or sum(sizes) != x.shape[0]:
        raise ValueError(f"x {list(x.shape)}, packed {list(packed.shape)}, sizes {sizes}: shapes do not match")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret:   # the K loop's run-time bound
        from kernels.interpreter import fix_loop_bounds
        fix_loop_bounds()
    group = K // scale.shape[-1]
    block_m = blocks[0] if blocks else W4A16_BLOCK_M["interpret" if interpret else "gpu"]
    # the tile schedule from the host-side sizes (no device sync): expert and first row of each row tile
    ends = list(itertools.accumulate(sizes))
    tiles = [(e, ends[e] - size + m) for e, size in enumerate(sizes) for m in range(0, size, block_m)]
    out = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    if not tiles:
        return out
    schedule = torch.tensor(tiles, dtype=torch.int32).to(x.device, non_blocking=True)
    # the autotuner's key: N, K and the rows per expert (to a power of two), which decide the best tile
    rows_bucket = triton.next_power_of_2(max(sizes))
    args = (x.contiguous(), packed.contiguous(), scale.contiguous(), out, schedule,
            torch.tensor(ends, dtype=torch.int32).to(x.device, non_blocking=True), N, K, scale.shape[-1], rows_bucket)
    if blocks or interpret:
        block_n, block_k = blocks[1:] if blocks else W4A16_INTERPRET_NK
        if not _fits_group(block_k, group):
            raise ValueError(f"BLOCK_K {block_k} and the scale group {group}: one must divide the other")
        grid = (len(tiles), triton.cdiv(N, block_n))
        _w4a16_kernel()[grid](*args, GROUP=group, UPCAST=interpret, IEEE=x.dtype == torch.float32,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    else:
        grid = lambda meta: (len(tiles), triton.cdiv(N, meta["BLOCK_N"]))   # noqa: E731
        _w4a16_tuned(group)[grid](*args, GROUP=group, UPCAST=False, IEEE=x.dtype == torch.float32, BLOCK_M=block_m)
    return out


def _fits_group(block_k: int, group: int) -> bool:
    """A K block holds whole scale groups, or lies inside one (the kernel's scale broadcast)."""
    return block_k % group == 0 or group % block_k == 0


@functools.cache
def _w4a16_tuned(group: int):
    import triton

    from kernels import tiles
    lists = {name: [c for c in configs if _fits_group(c[1], group)] for name, configs in W4A16_CONFIGS.items()}
    if not all(lists.values()):
        raise ValueError(f"int4 scale group {group}: no W4A16 tile fits it (BLOCK_K and group must divide)")
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
               for n, k, w, st in tiles.union(lists)]
    prune = tiles.pruner(lists, ("BLOCK_N", "BLOCK_K"))
    return triton.autotune(configs=configs, key=["N", "K", "ROWS_BUCKET"],
                           prune_configs_by={"early_config_prune": prune})(_w4a16_kernel())


@functools.cache
def _w4a16_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def w4a16(X, P, S, O, SCHEDULE, ENDS, N, K, GROUPS, ROWS_BUCKET, GROUP: tl.constexpr, UPCAST: tl.constexpr,
              IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # one [BLOCK_M, BLOCK_N] output tile of one expert; the weights come in as packed int32 words
        # [BLOCK_N, BLOCK_K / 8], unpacked and scaled in registers (an eighth of bf16's bytes read).
        # It computes the transposed tile, W·xᵀ [BLOCK_N, BLOCK_M]: the dequantised weights are then
        # the MMA's first operand, which Hopper's wgmma reads from registers (no shared-memory round
        # trip, so the MMA can overlap the next block's unpacking). ROWS_BUCKET: the autotuner's key.
        SCALES: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP        # scale groups per K block (>= 1)
        e = tl.load(SCHEDULE + 2 * tl.program_id(0))
        rows = tl.load(SCHEDULE + 2 * tl.program_id(0) + 1) + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(ENDS + e)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        words = K // 8
        p_rows = P + e.to(tl.int64) * N * words + cols[:, None].to(tl.int64) * words    # [BN, 1]
        s_rows = S + e.to(tl.int64) * N * GROUPS + cols[:, None].to(tl.int64) * GROUPS
        x_rows = X + rows[:, None].to(tl.int64) * K
        shifts = (tl.arange(0, 8) * 4)[None, None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):   # K at run time: a loop, not unrolled code
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
            wi = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            word = tl.load(p_rows + wi[None, :], mask=col_ok[:, None] & (wi < words)[None, :], other=0)
            nib = ((word[:, :, None] >> shifts) & 0xF) - 8                                  # [BN, BK/8, 8]
            gi = k0 // GROUP + tl.arange(0, SCALES)
            s = tl.load(s_rows + gi[None, :], mask=col_ok[:, None] & (gi < GROUPS)[None, :], other=0.0)
            w = tl.reshape(nib.to(tl.float32), (BLOCK_N, SCALES, BLOCK_K // SCALES)) * s.to(tl.float32)[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K))
            if UPCAST:   # the interpreter's bf16 dot is wrong: fp32 there
                acc += tl.dot(w, tl.trans(x.to(tl.float32)))
            elif IEEE:   # fp32 inputs: exact fp32 products, not TF32
                acc += tl.dot(w, tl.trans(x), input_precision="ieee")
            else:
                acc += tl.dot(w.to(x.dtype), tl.trans(x))
        tl.store(O + rows[None, :].to(tl.int64) * N + cols[:, None], acc.to(O.dtype.element_ty),
                 mask=row_ok[None, :] & col_ok[:, None])

    return w4a16


def check_packed(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, expected: tuple[int, int]) -> None:
    """Raise ValueError unless the three parts describe an [out, in] = expected matrix."""
    if [int(v) for v in shape.tolist()] != list(expected):
        raise ValueError(f"weight_shape = {shape.tolist()}; expected {list(expected)}")
    if packed.dtype != torch.int32:
        raise ValueError(f"weight_packed is {packed.dtype}; expected int32")
    want = packed_shapes(*expected)
    for suffix, t in (("weight_packed", packed), ("weight_scale", scale)):
        if not shape_fits(want[suffix], list(t.shape)):
            raise ValueError(f"{suffix} has shape {list(t.shape)}; expected {want[suffix]}")
