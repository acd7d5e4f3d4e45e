"""kernels.fp8_cast (amax + cast in both layouts) against its torch reference, bit for bit, on the
CPU under TRITON_INTERPRET=1 (in a child process: the variable must be set before triton is imported)."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import assert_interpreted_case, run_interpreted

# (rows, k, fp8 format, input dtype): odd rows (padded to 16), one row, none, a k that is not a
# multiple of the tile, a 3-d input, and enough elements that amax programs loop (16 x 4096 < 89,600)
CASES = [(37, 96, "e4m3", "float32"), (64, 130, "e5m2", "bfloat16"), (1, 16, "e4m3", "bfloat16"),
         (0, 32, "e5m2", "float32"), ((2, 5), 96, "e4m3", "bfloat16"), (700, 128, "e5m2", "bfloat16")]


INTERPRETED_CHILD = True   # conftest starts the child at collection, in the background


@pytest.fixture(scope="module")
def results():
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_triton_cast_is_the_reference_bit_for_bit(results, case):
    assert_interpreted_case(results, case, CASES[case])


def _child() -> None:
    assert "triton" not in sys.modules
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from benchmarks.float8 import same_bits
    from eagle3.kernels import fp8_cast

    print(json.dumps({"case": "interpreted", "ok": isinstance(fp8_cast._cast_kernel, InterpretedFunction)}))
    torch.manual_seed(0)
    formats = {"e4m3": fp8_cast.E4M3, "e5m2": fp8_cast.E5M2}
    for i, (rows, k, fmt, dtype) in enumerate(CASES):
        shape = (*rows, k) if isinstance(rows, tuple) else (rows, k)
        x = (torch.randn(shape) * 30).to(getattr(torch, dtype))
        got, want = fp8_cast.to_fp8(x, formats[fmt]), fp8_cast.to_fp8_reference(x, formats[fmt])
        m = x.reshape(-1, k).shape[0]
        detail = [(tuple(g.shape), tuple(w.shape)) for g, w in zip(got, want)]
        same = same_bits(got, want) and same_bits(   # A operands: no qᵀ
            fp8_cast.to_fp8(x, formats[fmt], transposed=False), (want[0], None, want[2]))
        shapes = got[0].shape == (m + -m % 16, k) and got[1].shape == (k, m + -m % 16)
        nonzero = m == 0 or got[0].float().abs().max() > 0     # it did cast something
        print(json.dumps({"case": str(i), "ok": bool(same and shapes and nonzero), "detail": str(detail)}), flush=True)


if __name__ == "__main__":
    _child()
