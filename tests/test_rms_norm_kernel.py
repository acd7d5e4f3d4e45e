"""kernels.rms_norm (Triton RMSNorm forward and backward) against eagle3.ops.rms_norm under autograd,
on the CPU under TRITON_INTERPRET=1 (in a child process: the variable must be set before triton is
imported): output, dx and dw, fp32 and bf16, odd widths, no rows, fewer rows than programs and more."""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import assert_interpreted_case, run_interpreted

# (row shape, width, dtype): more rows than the interpreter's 4 backward programs (uneven split),
# fewer, one, none, 5 rows (2 a program: the last program gets none), a 3-d input, a width that is
# not a power of two
CASES = [((37,), 96, "float32"), ((3,), 130, "float32"), ((1,), 7, "float32"), ((0,), 64, "float32"),
         ((5,), 64, "float32"), ((2, 5), 64, "bfloat16"), ((41,), 160, "bfloat16")]


INTERPRETED_CHILD = True   # conftest starts the child at collection, in the background


@pytest.fixture(scope="module")
def results():
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_triton_rms_norm_matches_the_reference_and_its_gradients(results, case):
    assert_interpreted_case(results, case, CASES[case])


def _truncating_reference(x, w, dy, eps):
    """ops.rms_norm's forward and backward as the interpreter computes them: in fp32, each cast to
    bf16 truncating (the interpreter's; a GPU rounds to nearest even) where the kernel rounds."""
    import torch

    def bf16(t):   # fp32 -> bf16 -> fp32 by dropping the low 16 bits
        return (t.contiguous().view(torch.int32) & -65536).view(torch.float32)

    xf, wf, dyf = x.float(), w.float(), dy.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    y = bf16(wf * bf16(xhat))
    dxhat = bf16(dyf * wf)
    dx = bf16(rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True)))
    dw = (dyf * bf16(xhat)).reshape(-1, x.shape[-1]).sum(0)
    return y, dx, dw


def _child() -> None:
    assert "triton" not in sys.modules
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from eagle3.ops import rms_norm as reference
    from eagle3.kernels import rms_norm

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
        ok = all(a.dtype == b.dtype == dt and a.shape == b.shape for a, b in zip(*outs))
        detail = []
        for name, a, b in zip(("y", "dx", "dw"), *outs):   # against ops.rms_norm under autograd
            a, b = a.float(), b.float()
            tol = 1e-5 if dt == torch.float32 else 1e-2        # fp32: summation order; bf16: the casts
            ok &= a.numel() == 0 or ((a - b).norm() / b.norm().clamp(min=1e-30)).item() < tol
            detail.append(f"{name} max err {(a - b).abs().max().item() if a.numel() else 0:.2e}")
        if dt == torch.bfloat16:   # bit for bit where the kernel rounds (up to an fp32 ulp of rstd)
            want = _truncating_reference(x, w, dy, 1e-6)
            for name, a, b in zip(("y", "dx", "dw"), outs[0], (*want[:2], want[2].to(dt).float())):
                same = (a.float() == b).float().mean().item()
                ok &= same >= 0.999
                detail.append(f"{name} bit-equal {same:.4f}")
        ws = w.clone().requires_grad_()    # x frozen: the kernel skips dx, dw stays the same
        (dw_frozen,) = torch.autograd.grad(rms_norm.rms_norm(x, ws, 1e-6), ws, dy)
        ok &= torch.equal(dw_frozen, outs[0][2])
        print(json.dumps({"case": str(i), "ok": bool(ok), "detail": ", ".join(detail)}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")   # run as a script by hand too
    _child()
