"""`python -m benchmarks.rows`: the row kernels of a TTT step (`kernels/rows.py`, `kernels/rms_norm.py`)
against what torch would run, on the GPU: the spread of a Kimi-size step's live rows into zeros (bytes: the
output written, the source read) and RMSNorm fwd and fwd+bwd (autograd.grad, host time included).
"""
from __future__ import annotations

import argparse

import torch

from eagle3.bench.timing import describe_device, median_ms, rel_error, require_cuda
from eagle3.ops import compiled, rms_norm

SPREAD_TOTAL, SPREAD_ROWS = 16384, 14000
SPREAD_SHAPES = [(7168,), (64, 128), (8, 128)]
NORM_ROWS, NORM_WIDTH = [3000, 14000, 16384], 7168


def bench_spread() -> None:
    from eagle3.kernels import reference
    from eagle3.kernels.rows import spread_rows
    for shape in SPREAD_SHAPES:
        src = torch.randn(SPREAD_ROWS, *shape, device="cuda", dtype=torch.bfloat16)
        index = torch.randperm(SPREAD_TOTAL, device="cuda")[:SPREAD_ROWS].sort().values
        same = torch.equal(spread_rows(src, index, SPREAD_TOTAL), reference.spread_rows(src, index, SPREAD_TOTAL))
        ours = median_ms(lambda: spread_rows(src, index, SPREAD_TOTAL))
        torch_ms = median_ms(lambda: reference.spread_rows(src, index, SPREAD_TOTAL))
        gb = (SPREAD_TOTAL + SPREAD_ROWS) * src[0].numel() * src.element_size() / 1e9
        print(f"spread {SPREAD_ROWS} of {SPREAD_TOTAL} rows of {list(shape)}: triton {ours * 1e3:.0f} us "
              f"({gb / ours:.2f} TB/s), torch index_copy {torch_ms * 1e3:.0f} us ({gb / torch_ms:.2f} TB/s), "
              f"{torch_ms / ours:.2f}x, equal {same}", flush=True)


def bench_norm() -> None:
    from eagle3.kernels.rms_norm import rms_norm as triton_norm
    contenders = {"triton": triton_norm, "compiled": compiled(rms_norm), "eager": rms_norm}
    for rows in NORM_ROWS:
        x = torch.randn(rows, NORM_WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.rand(NORM_WIDTH, device="cuda") + 0.5).bfloat16().requires_grad_()
        dy = torch.randn(rows, NORM_WIDTH, device="cuda", dtype=torch.bfloat16)
        xs, ws = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        exact = torch.autograd.grad(ws * xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6), (xs, ws),
                                    dy.double())
        eager_y = rms_norm(x, w, 1e-6).detach()
        err = lambda got, want: f"{rel_error(got, want, torch.float64):.1e}"
        for name, fn in contenders.items():
            y = fn(x, w, 1e-6)
            dx, dw = torch.autograd.grad(y, (x, w), dy)
            fwd = median_ms(lambda: fn(x, w, 1e-6))
            both = median_ms(lambda: torch.autograd.grad(fn(x, w, 1e-6), (x, w), dy))
            print(f"norm [{rows}, {NORM_WIDTH}] {name:8s}: fwd {fwd * 1e3:5.0f} us, fwd+bwd {both * 1e3:5.0f} us, "
                  f"outputs bit-equal to eager {float((y == eager_y).float().mean()):.4%}, rel err vs fp64 "
                  f"dx {err(dx, exact[0])} dw {err(dw, exact[1])}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rows", description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="spread,norm", help="comma list of spread, norm")
    args = parser.parse_args(argv)
    require_cuda("benchmarks.rows")
    print(f"row kernels, {describe_device()}")
    for part in args.parts.split(","):
        {"spread": bench_spread, "norm": bench_norm}[part.strip()]()


if __name__ == "__main__":
    main()
