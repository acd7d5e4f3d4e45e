"""`python -m benchmarks.float8`: the pieces of `train.float8` at the Kimi-size draft's shapes.

Per operand: the cast (`kernels.fp8_cast`) against the same arithmetic compiled and eager, bit for bit;
the fp8 GEMM it feeds (`torch._scaled_mm`) against bf16; and fp8 GEMM + cast against the bf16 GEMM.
"""
from __future__ import annotations

import argparse

import torch

from eagle3.bench.timing import describe_device, median_ms
from eagle3.float8 import E4M3, E5M2, scaled_mm
from eagle3.kernels import fp8_cast

H, I, V, ROWS = 7168, 18432, 32000, 14336      # hidden, intermediate, draft vocab, rows of a layout-(a) TTT step
# (name, a [m, k] cast, b [n, k], a's format); the loss's GEMMs (train.float8_head) over one chunk of rows
SHAPES = [("attention in: x [rows, 2H] @ Wq", (ROWS, 2 * H), (8192, 2 * H), E4M3),
          ("mlp in: x [rows, H] @ Wgate", (ROWS, H), (I, H), E4M3),
          ("mlp grad: dY [rows, I] @ Wgate", (ROWS, I), (H, I), E5M2),
          ("loss logits: h [chunk, H] @ head", (8192, H), (V, H), E4M3),
          ("loss dh: dz [chunk, V] @ head", (8192, V), (H, V), E5M2)]


def same_bits(got, want) -> bool:
    """Two casts' (q, qᵀ, scale) are equal bit for bit; a qᵀ not made (None) matches only None."""
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.element_size() == 1 else t
    return all((g is None) == (w is None) and (g is None or (g.dtype == w.dtype and torch.equal(bits(g), bits(w))))
               for g, w in zip(got, want))


def bench_shape(name: str, a_shape, b_shape, fmt) -> dict:
    a = torch.randn(a_shape, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(b_shape, device="cuda", dtype=torch.bfloat16) * 0.02
    compiled = torch.compile(fp8_cast.to_fp8_reference, dynamic=True)
    aq, _, sa = got = fp8_cast.to_fp8(a, fmt)
    bq, _, sb = fp8_cast.to_fp8(b, E4M3, transposed=False)   # B as the GEMM takes it: bq.t()
    r = {"name": name, "a": list(a_shape), "b": list(b_shape), "format": str(fmt).removeprefix("torch."),
         "bit_equal": same_bits(got, fp8_cast.to_fp8_reference(a, fmt)),
         "cast_triton_ms": median_ms(lambda: fp8_cast.to_fp8(a, fmt)),
         "cast_compiled_ms": median_ms(lambda: compiled(a, fmt)),
         "cast_eager_ms": median_ms(lambda: fp8_cast.to_fp8_reference(a, fmt)),
         "gemm_bf16_ms": median_ms(lambda: a @ b.t()),
         "gemm_fp8_ms": median_ms(lambda: scaled_mm(aq, sa, bq.t(), sb, torch.bfloat16))}
    # effective bytes: one bf16 read and two fp8 writes (the amax pass reads again)
    r["cast_gb_per_s"] = (a.numel() * 2 + aq.numel() * 2) / 1e9 / r["cast_triton_ms"] * 1e3
    r["fp8_with_casts_vs_bf16"] = (r["gemm_fp8_ms"] + r["cast_triton_ms"]) / r["gemm_bf16_ms"]
    return r


def odd_shapes_bit_equal() -> bool:
    """Padding rows, k edges and a 3-d input with the GPU's own fp8 stores (the interpreter tests
    convert in torch): the Triton cast equals the reference bit for bit."""
    ok = True
    for shape, fmt in (((37, 130), E4M3), ((1, 16), E5M2), ((0, 32), E4M3), ((2, 5, 96), E5M2), ((4099, 7168), E4M3)):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 30
        for transposed in (True, False):
            want = fp8_cast.to_fp8_reference(x, fmt)
            ok &= same_bits(fp8_cast.to_fp8(x, fmt, transposed), want if transposed else (want[0], None, want[2]))
    return ok


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="python -m benchmarks.float8", description=__doc__.split("\n")[0]).parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("error: python -m benchmarks.float8 needs a GPU with fp8 tensor cores (compute capability >= 8.9)")
    print(describe_device())
    print(f"odd shapes (padding, k edges, 3-d, no transposed copy) bit-equal to the reference: {odd_shapes_bit_equal()}")
    print("| operand | a | format | bit-equal | cast triton / compiled / eager ms | cast GB/s (effective) | GEMM bf16 / fp8 ms "
          "| fp8 + cast / bf16 |")
    print("| --- | --- | --- | --- | --- | ---: | --- | ---: |")
    for shape in SHAPES:
        r = bench_shape(*shape)
        print(f"| {r['name']} | {r['a']} | {r['format']} | {r['bit_equal']} | {r['cast_triton_ms']:.3f} / "
              f"{r['cast_compiled_ms']:.3f} / {r['cast_eager_ms']:.3f} | {r['cast_gb_per_s']:,.0f} | "
              f"{r['gemm_bf16_ms']:.3f} / {r['gemm_fp8_ms']:.3f} | {r['fp8_with_casts_vs_bf16']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
