"""kernels.ttt_loss against kernels.reference.ttt_loss, on the CPU under TRITON_INTERPRET=1.

TRITON_INTERPRET must be set before triton is imported, and other test files in the same pytest
process may import torch / triton first. So the checks run in one child process: this file run as a
script (`python tests/test_ttt_loss.py`) sets the variable, then imports the kernels and prints one
JSON line per case; the pytest tests below start it once and assert on each case's line.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import run_interpreted

ROOT = Path(__file__).resolve().parents[1]
CASES = ["fp32_rows_not_valid", "bf16_matches_reference", "peaked_flat_and_unnormalized_targets",
         "vocab_block_edges_and_ties", "no_valid_rows_and_no_grad", "all_steps_at_once",
         "valid_rows_as_indices", "float8_gemms_follow_the_exact_ones", "targets_read_by_row_index"]


# ---------------------------------------------------------------------------------------------
# pytest side: one interpreted child process for all cases.

@pytest.fixture(scope="module")
def results():
    out, proc = run_interpreted(__file__)
    out["_proc"] = proc
    return out


@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    proc = results["_proc"]
    rec = results.get(case)
    assert rec is not None, f"case {case} did not report (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    assert rec["ok"], f"{case}: {rec['detail']}"


def test_child_ran_interpreted(results):
    rec = results.get("_interpreter")
    assert rec is not None and rec["ok"], f"the child did not run under the interpreter: {rec}"


# ---------------------------------------------------------------------------------------------
# child side: the checks themselves.

def _rel(x, y) -> float:
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def _reference(h, w, p, valid, upstream):
    """Reference loss / argmax and the gradients of sum(loss * upstream), computed in fp64."""
    import torch
    from kernels.reference import ttt_loss as ref
    hd = h.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    loss, argmax = ref(hd, wd, p.double(), valid)
    (loss * upstream.double()).sum().backward()
    logits = hd.detach() @ wd.detach().t()
    return loss.detach(), argmax, hd.grad, wd.grad, logits


def _check_argmax(argmax, logits, valid, tol):
    """-1 on rows that are not valid; elsewhere an index whose logit is the row max (within tol)."""
    import torch
    valid = torch.ones(len(argmax), dtype=torch.bool) if valid is None else valid
    assert (argmax[~valid] == -1).all(), "argmax is not -1 on rows that are not valid"
    if valid.any():
        picked = logits[valid].gather(1, argmax[valid].clamp_min(0).unsqueeze(1)).squeeze(1)
        gap = (logits[valid].max(1).values - picked).max().item()
        assert gap <= tol, f"argmax picks a logit {gap:.3g} below the row max"


def _run_one(h, w, p, valid, chunk, upstream, tol_loss, tol_grad, tol_argmax=1e-9):
    """ttt_loss vs the fp64 reference; returns the fused outputs for extra checks."""
    import torch
    from kernels.ttt_loss import ttt_loss
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    loss, argmax = ttt_loss(h, w, p, valid, chunk=chunk)
    (loss * upstream).sum().backward()
    r_loss, _, r_dh, r_dw, logits = _reference(h, w, p, valid, upstream)
    assert loss.dtype == torch.float32 and argmax.dtype == torch.int64
    errs = dict(loss=_rel(loss, r_loss), dh=_rel(h.grad, r_dh), dw=_rel(w.grad, r_dw))
    assert errs["loss"] < tol_loss and errs["dh"] < tol_grad and errs["dw"] < tol_grad, f"errors {errs}"
    if valid is not None:
        assert (loss[~valid] == 0).all(), "loss is not 0 on rows that are not valid"
        assert (h.grad[~valid] == 0).all(), "dh is not 0 on rows that are not valid"
    _check_argmax(argmax, logits, valid, tol_argmax)
    return loss, argmax, h.grad, w.grad


def _inputs(N, H, V, dtype=None, temp=3.0, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / H ** 0.5 * 4).to(dtype)
    p = torch.softmax(torch.randn(N, V, generator=g) * temp, -1).to(dtype)
    valid = torch.rand(N, generator=g) > 0.3
    upstream = torch.randn(N, generator=g)   # per-row upstream gradient, not uniform
    return h, w, p, valid, upstream


def case_fp32_rows_not_valid():
    # 45 rows, ~30% not valid, chunks of 8 valid rows (4+ chunks), V = 777 (not a power of 2).
    h, w, p, valid, up = _inputs(45, 32, 777)
    assert (~valid).any() and valid.sum() > 24
    _run_one(h, w, p, valid, 8, up, 1e-5, 1e-5)
    _run_one(h, w, p, None, 16, up, 1e-5, 1e-5)          # valid=None: every row, 3 chunks


def case_bf16_matches_reference():
    import torch
    from kernels.reference import ttt_loss as ref
    from kernels.ttt_loss import ttt_loss
    h, w, p, valid, up = _inputs(40, 64, 1000, torch.bfloat16)
    # Against fp64: bf16 logits and a bf16 dz, like the eager bf16 path. (The interpreter rounds
    # fp32 -> bf16 stores towards zero, the GPU to nearest: the CPU dz error is ~1.3x the GPU's.)
    _run_one(h, w, p, valid, 16, up, 2e-3, 2e-2, tol_argmax=0.1)
    # Against the reference run in bf16 (same rounding of the logits): loss and argmax agree.
    loss, argmax = ttt_loss(h, w, p, valid, chunk=16)
    r_loss, r_arg = ref(h, w, p, valid)
    assert _rel(loss, r_loss) < 1e-4, f"loss vs bf16 reference {_rel(loss, r_loss):.3g}"
    assert (argmax == r_arg).float().mean() > 0.9, "argmax disagrees with the bf16 reference"


def case_peaked_flat_and_unnormalized_targets():
    import torch
    h, w, _, valid, up = _inputs(24, 32, 600, seed=1)
    g = torch.Generator().manual_seed(2)
    peaked = torch.softmax(torch.randn(24, 600, generator=g) * 30, -1)        # nearly one-hot
    onehot = torch.nn.functional.one_hot(torch.randint(0, 600, (24,), generator=g), 600).float()
    flat = torch.full((24, 600), 1 / 600)
    unnorm = torch.softmax(torch.randn(24, 600, generator=g), -1) * 0.97       # Σp = 0.97
    for p in (peaked, onehot, flat, unnorm):
        _run_one(h, w, p, valid, 8, up, 1e-5, 1e-5)
    # bf16 p with fp32 h, w (p of any float dtype)
    _run_one(h, w, peaked.bfloat16(), valid, 8, up, 1e-5, 1e-5)


def case_vocab_block_edges_and_ties():
    import torch
    from kernels.ttt_loss import ttt_loss
    # V = 4097: one full 4096 block and a 1-wide tail; V = 1: a single column.
    for V in (4097, 1):
        h, w, p, valid, up = _inputs(6, 16, V, seed=V)
        _run_one(h, w, p, valid, 4, up, 1e-5, 1e-5)
    # Max in the tail column, and ties across blocks: the first index must win (torch.argmax).
    # Small integers keep every logit exact, so the ties are real ties.
    g = torch.Generator().manual_seed(3)
    h = torch.randint(-3, 4, (3, 16), generator=g).float()
    w = torch.randint(-3, 4, (8193, 16), generator=g).float()    # blocks [0, 4096), [4096, 8192), {8192}
    w[8192] = h[0] * 10                 # row 0: max in the 1-wide tail block
    w[5] = w[4100] = h[1] * 10          # row 1: equal maxima in different blocks
    w[4001] = w[300] = h[2] * 10        # row 2: equal maxima in one block
    p = torch.softmax(torch.randn(3, 8193, generator=g), -1)
    _, argmax = ttt_loss(h, w, p)
    assert argmax.tolist() == [8192, 5, 300], f"argmax {argmax.tolist()}, expected [8192, 5, 300]"


def case_no_valid_rows_and_no_grad():
    import torch
    from kernels.ttt_loss import ttt_loss, ttt_loss_steps
    h, w, p, _, up = _inputs(7, 16, 100)
    none = torch.zeros(7, dtype=torch.bool)
    loss, argmax, dh, dw = _run_one(h, w, p, none, 4, up, 1, 1)
    assert (loss == 0).all() and (argmax == -1).all() and (dh == 0).all() and (dw == 0).all()
    with torch.no_grad():
        loss, argmax = ttt_loss(h, w, p)
        total, losses, _ = ttt_loss_steps([h], w, [p])
    r_loss, _, _, _, _ = _reference(h, w, p, None, up)
    assert _rel(loss, r_loss) < 1e-5 and _rel(losses[0], r_loss) < 1e-5


def case_all_steps_at_once():
    import torch
    from kernels.reference import ttt_loss as ref
    from kernels.ttt_loss import ttt_loss_steps
    K, N, H, V = 4, 30, 32, 900
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(V, H, generator=g) / H ** 0.5 * 4).requires_grad_()
    p_all = torch.softmax(torch.randn(N + K, V, generator=g) * 3, -1)
    ps = [p_all[k:k + N] for k in range(K)]                       # shifted row views, as in training
    hs = [torch.randn(N, H, generator=g).requires_grad_() for _ in range(K)]
    valids = [torch.rand(N, generator=g) > 0.3, None, torch.zeros(N, dtype=torch.bool),
              torch.rand(N, generator=g) > 0.5]
    weights = [1.0, 0.8, 0.64, torch.rand(N, generator=g)]
    total, losses, argmaxes = ttt_loss_steps(hs, w, ps, valids, weights, chunk=8)
    (total * 2.5).backward()                                       # upstream scale != 1
    wd = w.detach().double().requires_grad_()
    hds = [h.detach().double().requires_grad_() for h in hs]
    r_total = 0
    for k in range(K):
        r_loss, r_arg = ref(hds[k], wd, ps[k].double(), valids[k])
        r_total = r_total + (r_loss * torch.as_tensor(weights[k]).double()).sum()
        assert _rel(losses[k], r_loss.detach()) < 1e-5, f"step {k} loss {_rel(losses[k], r_loss.detach()):.3g}"
        _check_argmax(argmaxes[k], hds[k].detach() @ wd.detach().t(), valids[k], 1e-9)
    (r_total * 2.5).backward()
    assert abs(total.item() - r_total.item()) <= 1e-5 * abs(r_total.item()), "total differs"
    errs = [_rel(h.grad, hd.grad) for h, hd in zip(hs, hds)] + [_rel(w.grad, wd.grad)]
    assert max(errs) < 1e-5, f"gradient errors (dh per step, dw) {errs}"
    assert (hs[2].grad == 0).all(), "a step with no valid rows must give dh = 0"


def case_float8_gemms_follow_the_exact_ones():
    """float8 = True (logits and dh as scaled fp8 GEMMs) against the same call in fp32: a few percent
    (e4m3 inputs, e5m2 dz), not more; dw (computed from the same dz, in w's dtype) likewise. Odd row
    counts and chunks exercise the padding to 16 rows, masks the gathered path; V and H must be
    multiples of 16."""
    import torch
    from kernels.ttt_loss import ttt_loss_steps
    K, N, H, V = 3, 37, 64, 320
    g = torch.Generator().manual_seed(6)
    w = torch.randn(V, H, generator=g) / H ** 0.5 * 4
    p_all = torch.softmax(torch.randn(N + K, V, generator=g) * 3, -1)
    ps = [p_all[k:k + N] for k in range(K)]
    hs = [torch.randn(N, H, generator=g) for _ in range(K)]
    valids = [None, torch.rand(N, generator=g) > 0.3, torch.zeros(N, dtype=torch.bool)]

    def run(float8):
        wr, hr = w.clone().requires_grad_(), [h.clone().requires_grad_() for h in hs]
        total, losses, argmaxes = ttt_loss_steps(hr, wr, ps, valids, [1.0, 0.8, 0.64], chunk=24, float8=float8)
        total.backward()
        return total, losses, argmaxes, [h.grad for h in hr], wr.grad

    exact, fp8 = run(False), run(True)
    assert _rel(fp8[0], exact[0]) < 0.03, f"total {_rel(fp8[0], exact[0]):.3g}"
    wr, hr = w.clone().requires_grad_(), [h.clone().requires_grad_() for h in hs]   # chunks of 16: no copy path
    ttt_loss_steps(hr, wr, ps, valids, [1.0, 0.8, 0.64], chunk=16, float8=True)[0].backward()
    assert max(_rel(a, b) for a, b in zip([h.grad for h in hr][:2], exact[3][:2])) < 0.1
    assert 1e-5 < _rel(fp8[1][0], exact[1][0]) < 0.05, "step 0 losses: not fp8, or too far"
    agree = (fp8[2][0] == exact[2][0]).float().mean().item()
    assert agree > 0.8, f"argmax agreement {agree:.2f}"
    errs = [_rel(a, b) for a, b in zip(fp8[3][:2], exact[3][:2])] + [_rel(fp8[4], exact[4])]
    assert max(errs) < 0.1, f"gradient errors (dh steps 0, 1; dw) {errs}"
    assert (fp8[3][2] == 0).all(), "a step with no valid rows must give dh = 0"
    try:
        ttt_loss_steps(hs, w[:100], [p[:, :100] for p in ps], float8=True)
    except ValueError as exc:
        assert "multiples of 16" in str(exc)
    else:
        raise AssertionError("V = 100 must be refused with float8")


def case_valid_rows_as_indices():
    """valids[k] as row indices (int64 or int32; what the trainer passes) == the bool mask, in the
    Triton and the reference `ttt_loss_steps`; other dtypes are refused."""
    import torch
    from kernels import reference
    from kernels.ttt_loss import ttt_loss_steps
    K, N, H, V = 3, 20, 16, 300
    g = torch.Generator().manual_seed(5)
    w = torch.randn(V, H, generator=g) / H ** 0.5
    p_all = torch.softmax(torch.randn(N + K, V, generator=g), -1)
    ps = [p_all[k:k + N] for k in range(K)]
    hs = [torch.randn(N, H, generator=g) for _ in range(K)]
    masks = [torch.rand(N, generator=g) > 0.4, torch.ones(N, dtype=torch.bool), torch.zeros(N, dtype=torch.bool)]

    def run(fn, valids):
        wr, hr = w.clone().requires_grad_(), [h.clone().requires_grad_() for h in hs]
        total, losses, argmaxes = fn(hr, wr, ps, valids, [1.0, 0.8, 0.64])
        total.backward()
        return [total, *losses, *argmaxes, wr.grad, *[h.grad for h in hr]]

    expected = run(ttt_loss_steps, masks)
    for fn in (ttt_loss_steps, reference.ttt_loss_steps):
        for dtype in (torch.int64, torch.int32):
            got = run(fn, [m.nonzero().flatten().to(dtype) for m in masks])
            for a, b in zip(got, expected):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{fn.__module__} {dtype}: differs"
    try:
        ttt_loss_steps(hs, w, ps, [m.to(torch.uint8) for m in masks])
    except TypeError:
        pass
    else:
        raise AssertionError("a uint8 mask must be refused, not read as row indices")


def case_targets_read_by_row_index():
    """p_rows: each step reads its rows of one [P, V] target tensor in place (what training passes:
    kept rows shifted by the step) == the same rows gathered first, in the Triton (dense and gathered
    chunks, with and without float8) and the reference `ttt_loss_steps`; bad p_rows are refused."""
    import torch
    from kernels import reference
    from kernels.ttt_loss import ttt_loss_steps
    K, N, H, V = 3, 21, 16, 304
    g = torch.Generator().manual_seed(7)
    w = torch.randn(V, H, generator=g) / H ** 0.5
    p_all = torch.softmax(torch.randn(N + K + 5, V, generator=g), -1)
    rows = [torch.randperm(N + 5, generator=g)[:N].sort().values + k for k in range(K)]
    hs = [torch.randn(N, H, generator=g) for _ in range(K)]
    valids = [None, torch.rand(N, generator=g) > 0.4, torch.ones(N, dtype=torch.bool)]

    def run(fn, ps, p_rows, **kw):
        wr, hr = w.clone().requires_grad_(), [h.clone().requires_grad_() for h in hs]
        total, losses, argmaxes = fn(hr, wr, ps, valids, [1.0, 0.8, 0.64], p_rows=p_rows, **kw)
        total.backward()
        return [total, *losses, *argmaxes, wr.grad, *[h.grad for h in hr]]

    for kw in ({}, {"chunk": 8}, {"float8": True, "chunk": 16}):
        expected = run(ttt_loss_steps, [p_all[r] for r in rows], None, **kw)
        got = run(ttt_loss_steps, [p_all] * K, rows, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"{kw}: differs from gathered targets"
    expected = run(reference.ttt_loss_steps, [p_all[r] for r in rows], None)
    got = run(reference.ttt_loss_steps, [p_all] * K, rows)
    assert all(torch.equal(a, b) for a, b in zip(got, expected)), "reference: differs from gathered targets"
    for bad in (rows[0][:-1], rows[0].int()):
        try:
            ttt_loss_steps(hs, w, [p_all] * K, p_rows=[bad, None, None])
        except ValueError as exc:
            assert "p_rows" in str(exc)
        else:
            raise AssertionError(f"p_rows {tuple(bad.shape)} {bad.dtype} must be refused")


def _child() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET was set"
    sys.path.insert(0, str(ROOT))
    import torch
    import triton

    torch.manual_seed(0)
    from triton.runtime.interpreter import InterpretedFunction
    from kernels.ttt_loss import _soft_ce_kernel
    interp = isinstance(_soft_ce_kernel, InterpretedFunction)
    print(json.dumps({"case": "_interpreter", "ok": interp, "detail": triton.__version__}), flush=True)
    for name in CASES:
        try:
            globals()["case_" + name]()
            rec = {"case": name, "ok": True, "detail": ""}
        except Exception as exc:  # report every case, then let pytest fail the ones that broke
            import traceback
            rec = {"case": name, "ok": False, "detail": f"{exc!r}\n{traceback.format_exc()[-3000:]}"}
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    _child()
