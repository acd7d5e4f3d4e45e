"""kernels.rms_norm (Triton RMSNorm forward and backward) against eagle3.ops.rms_norm under autograd,
on the CPU under TRITON_INTERPRET=1 (in a child process: the variable must be set before triton is
imported): output, dx and dw, fp32 and bf16, odd widths, no rows, fewer rows than programs and more."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import assert_interpreted_case, run_interpreted

# (row shape, width, dtype): more rows than the interpreter's 4 backward programs (uneven split),
# fewer, one, none, a 3-d input, a width that is not a power of two
CASES = [((37,), 96, "float32"), ((3,), 130, "float32"), ((1,), 7, "float32"), ((0,), 64, "float32"),
         ((2, 5), 64, "bfloat16"), ((41,), 160, "bfloat16")]


@pytest.fixture(scope="module")
def results():
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_triton_rms_norm_matches_the_reference_and_its_gradients(results, case):
    assert_interpreted_case(results, case, CASES[case])


def _child() -> None:
    assert "triton" not in sys.modules
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from eagle3.ops import rms_norm as reference
    from kernels import rms_norm

    print(json.dumps({"case": "interpreted", "ok": isinstance(rms_norm._rms_norm_bwd_kernel, InterpretedFunction)}))
    g = torch.Generator().manual_seed(0)
    for i, (rows, width, dtype) in enumerate(CASES):
        dt = getattr(torch, dtype)
        x = (torch.randn(*rows, width, generator=g) * 3).to(dt)
        w = (torch.rand(width, generator=g) + 0.5).to(dt)
        dy = torch.randn(*rows, width, generator=g).to(dt)
        outs = []
        for fn in (rms_norm.rms_norm, reference):
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fn(xs, ws, 1e-6)
            outs.append((y, *torch.autograd.grad(y, (xs, ws), dy)))
        # fp32: the same arithmetic up to summation order. bf16: the interpreter's roundings to bf16
        # are not the GPU's (round to nearest even), so only close; the GPU bench checks the bits
        detail, ok = [], True
        for name, a, b in zip(("y", "dx", "dw"), *outs):
            a, b = a.float(), b.float()
            if dt == torch.float32:
                close = torch.allclose(a, b, rtol=1e-5, atol=1e-5)
            else:
                close = a.numel() == 0 or ((a - b).norm() / b.norm()).item() < 1e-2
            ok &= close and a.shape == b.shape
            detail.append(f"{name} max err {(a - b).abs().max().item() if a.numel() else 0:.2e}")
        ok &= all(o.dtype == dt for o in outs[0])
        print(json.dumps({"case": str(i), "ok": bool(ok), "detail": ", ".join(detail)}), flush=True)


if __name__ == "__main__":
    _child()
