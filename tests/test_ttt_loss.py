"""kernels.ttt_loss against kernels.reference.ttt_loss, on the CPU under TRITON_INTERPRET=1.

TRITON_INTERPRET must be set before triton is imported, and other test files in the same pytest
process may import torch / triton first. So the checks run in one child process: this file run as a
script (`python tests/test_ttt_loss.py`) sets the variable, then imports the kernels and prints one
JSON line per case; the pytest tests below start it once and assert on each case's line.

The losses aimed at acceptance (kernels.reference.LOSSES) are pinned twice: the reference against
explicit formulas and closed-form gradients (in this process: no Triton), and the kernel against
the reference's autograd and against finite differences of its own value (in the child).
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from conftest import run_interpreted

ROOT = Path(__file__).resolve().parents[1]
CASES = ["fp32_rows_not_valid", "bf16_matches_reference", "peaked_flat_and_unnormalized_targets",
         "vocab_block_edges_and_ties", "no_valid_rows_and_no_grad", "all_steps_at_once",
         "valid_rows_as_indices", "float8_gemms_follow_the_exact_ones", "targets_read_by_row_index",
         "every_loss_matches_reference", "every_loss_all_steps_at_once", "every_loss_in_bf16",
         "every_loss_gradient_follows_its_value", "unknown_loss_refused"]
LOSSES = ("kl", "tv", "nla", "lk_hybrid", "pq")   # kernels.reference.LOSSES, spelled out


# ---------------------------------------------------------------------------------------------
# pytest side: one interpreted child process for all cases.

INTERPRETED_CHILD = True   # conftest starts the child at collection, in the background


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
# the reference's losses against their formulas (no Triton: in this process).

def _formula_example(temperature: float):
    """fp64 h [6, 5], w [9, 5], p, valid, upstream: p near q (α well inside (0, 1)) except row 1
    (Σp = 0.9), row 2 (zeros in p: 0 log 0) and row 4 (p one-hot where q < 1e-5: nla and pq clamp);
    row 3 not valid."""
    import torch
    g = torch.Generator().manual_seed(11)
    h = torch.randn(6, 5, generator=g, dtype=torch.float64)
    w = torch.randn(9, 5, generator=g, dtype=torch.float64)
    h[4] *= 8                                    # row 4: logits far apart
    logits = h @ w.T
    p = torch.softmax(logits / temperature * 0.6 + torch.randn(6, 9, generator=g, dtype=torch.float64), -1)
    p[1] *= 0.9
    p[2] = 0
    p[2, 0], p[2, 3] = 0.7, 0.3
    p[4] = 0
    p[4, logits[4].argmin()] = 1.0
    valid = torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool)
    return h, w, p, valid, torch.randn(6, generator=g, dtype=torch.float64)


def _closed_form(h, w, p, loss, temperature, eta=3.0):
    """(loss [N], α [N], dloss/dz [N, V]) of every row from the formulas alone, in fp64."""
    import torch
    x = h @ w.T / temperature
    q = torch.softmax(x, -1)
    logq = torch.log_softmax(x, -1)
    alpha = torch.minimum(p, q).sum(-1)
    ind = (q <= p).double()
    S = (ind * q).sum(-1, keepdim=True)
    psum = p.sum(-1, keepdim=True)
    dalpha = q * (ind - S)                                    # dα/dx
    if loss == "kl":
        value, dx = -(p * logq).sum(-1), q * psum - p
    elif loss == "tv":
        value, dx = 1 - alpha, -dalpha
    elif loss == "nla":
        value = -torch.log(alpha.clamp_min(1e-5))
        dx = torch.where((alpha >= 1e-5)[:, None], -dalpha / alpha[:, None], 0.0)
    elif loss == "lk_hybrid":
        lam = torch.exp(-eta * alpha)
        kl = torch.where(p > 0, p * torch.log(p), 0.0).sum(-1) - (p * logq).sum(-1)
        value = lam * kl + (1 - lam) * (1 - alpha)
        dx = lam[:, None] * (q * psum - p) - (1 - lam[:, None]) * dalpha
    else:
        A = (p * q).sum(-1)
        value = -torch.log(A.clamp_min(1e-5))
        dx = torch.where((A >= 1e-5)[:, None], q * (A[:, None] - p) / A[:, None], 0.0)
    return value, alpha, dx / temperature


def _reference_grads(h, w, p, valid, up, **kw):
    from eagle3.kernels.reference import ttt_loss as ref
    hd, wd = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, argmax, alpha = ref(hd, wd, p, valid, **kw)
    (loss * up).sum().backward()
    return loss, argmax, alpha, hd.grad, wd.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("loss", LOSSES)
def test_reference_losses_follow_their_formulas(loss, temperature):
    """Value, α and (autograd) gradient of the reference equal the formulas and closed-form
    gradients of the module docstring, with ∂/∂z = (1/τ) ∂/∂x: this pins the semantics that the
    kernel is then held to."""
    import torch
    from eagle3.kernels.reference import LOSSES as ref_losses
    assert ref_losses == LOSSES
    h, w, p, valid, up = _formula_example(temperature)
    value, alpha, dz = _closed_form(h, w, p, loss, temperature)
    assert alpha[4] < 1e-5 and (p[4] * torch.softmax(h[4] @ w.T / temperature, -1)).sum() < 1e-5   # the clamp row
    r_loss, r_argmax, r_alpha, r_dh, r_dw = _reference_grads(h, w, p, valid, up, loss=loss, temperature=temperature)
    assert r_loss.dtype == torch.float32 and r_alpha.dtype == torch.float32 and not r_alpha.requires_grad
    zero = torch.zeros(6, dtype=torch.float64)
    torch.testing.assert_close(r_loss.double(), torch.where(valid, value, zero), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r_alpha.double(), torch.where(valid, alpha, zero), rtol=1e-5, atol=1e-7)
    assert r_argmax.tolist() == [a if ok else -1 for a, ok in zip((h @ w.T).argmax(-1).tolist(), valid.tolist())]
    dZ = dz * (up * valid)[:, None]
    assert _rel(r_dh, dZ @ w) < 1e-5 and _rel(r_dw, dZ.T @ h) < 1e-5, (_rel(r_dh, dZ @ w), _rel(r_dw, dZ.T @ h))
    if loss in ("nla", "pq"):
        assert (r_dh[4] == 0).all(), "below the 1e-5 clamp the gradient is 0"


def test_lk_hybrid_holds_lambda_constant():
    """lk_hybrid's λ = exp(-eta α) takes no gradient: differentiating through it gives another
    gradient (the reference matches the detached closed form above; this shows the two differ)."""
    import torch
    h, w, p, valid, up = _formula_example(0.7)
    hd = h.clone().requires_grad_()
    q = torch.softmax(hd @ w.T / 0.7, -1)
    alpha = torch.minimum(p, q).sum(-1)
    lam = torch.exp(-3.0 * alpha)                               # not detached
    kl = torch.xlogy(p, p).sum(-1) - (p * torch.log(q)).sum(-1)
    (((lam * kl + (1 - lam) * (1 - alpha)) * up * valid).sum()).backward()
    _, _, _, r_dh, _ = _reference_grads(h, w, p, valid, up, loss="lk_hybrid", temperature=0.7)
    _, _, dz = _closed_form(h, w, p, "lk_hybrid", 0.7)
    assert _rel(r_dh, (dz * (up * valid)[:, None]) @ w) < 1e-5
    assert _rel(r_dh, hd.grad) > 0.01, f"through λ the gradient should differ: {_rel(r_dh, hd.grad):.3g}"
    _, _, _, e_dh, _ = _reference_grads(h, w, p, valid, up, loss="lk_hybrid", temperature=0.7, eta=1.0)
    assert _rel(e_dh, r_dh) > 0.01, "eta is not used"


def test_reference_refuses_unknown_losses_and_temperatures(monkeypatch):
    import torch
    from eagle3.kernels import flex, reference
    h, w, p, valid, _ = _formula_example(1.0)
    for kw, words in [({"loss": "kld"}, ["'kld'", "kl, tv, nla, lk_hybrid, pq"]), ({"loss": "KL"}, ["'KL'"]),
                      ({"temperature": 0.0}, ["0.0", "> 0"]), ({"temperature": -1}, ["-1", "> 0"])]:
        for call in (lambda: reference.ttt_loss(h, w, p, valid, **kw),
                     lambda: reference.ttt_loss_steps([h], w, [p], **kw),
                     lambda: reference.ttt_loss_steps([], w, [], **kw)):
            with pytest.raises(ValueError) as err:
                call()
            assert all(word in str(err.value) for word in words), str(err.value)
    # kernels.flex passes the keywords on to the compiled reference (here: not compiled)
    monkeypatch.setattr(flex, "_compiled_loss", lambda: reference.ttt_loss)
    args = ([h, h], w, [p, p], [valid, None], [1.0, 0.5])
    got = flex.ttt_loss_steps(*args, loss="lk_hybrid", temperature=0.7, eta=2.0)
    want = reference.ttt_loss_steps(*args, loss="lk_hybrid", temperature=0.7, eta=2.0)
    other = reference.ttt_loss_steps(*args, loss="lk_hybrid", temperature=0.7)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[3], want[3]))
    assert not torch.equal(got[0], other[0])
    with pytest.raises(ValueError, match="'nll'"):
        flex.ttt_loss_steps([h], w, [p], loss="nll")


# ---------------------------------------------------------------------------------------------
# child side: the checks themselves.

def _rel(x, y) -> float:
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def _reference(h, w, p, valid, upstream, **kw):
    """Reference loss / argmax and the gradients of sum(loss * upstream), computed in fp64 (the
    softmax in fp32, as the reference does); kw: loss, temperature, eta. Also returns α."""
    from eagle3.kernels.reference import ttt_loss as ref
    hd = h.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    loss, argmax, alpha = ref(hd, wd, p.double(), valid, **kw)
    (loss * upstream.double()).sum().backward()
    logits = hd.detach() @ wd.detach().t()
    return loss.detach(), argmax, hd.grad, wd.grad, logits, alpha


def _check_argmax(argmax, logits, valid, tol):
    """-1 on rows that are not valid; elsewhere an index whose logit is the row max (within tol)."""
    import torch
    valid = torch.ones(len(argmax), dtype=torch.bool) if valid is None else valid
    assert (argmax[~valid] == -1).all(), "argmax is not -1 on rows that are not valid"
    if valid.any():
        picked = logits[valid].gather(1, argmax[valid].clamp_min(0).unsqueeze(1)).squeeze(1)
        gap = (logits[valid].max(1).values - picked).max().item()
        assert gap <= tol, f"argmax picks a logit {gap:.3g} below the row max"


def _run_one(h, w, p, valid, chunk, upstream, tol_loss, tol_grad, tol_argmax=1e-9, tol_alpha=None, **kw):
    """ttt_loss vs the fp64 reference (kw: loss, temperature, eta); returns the fused outputs for
    extra checks. α is held to tol_alpha (default: the loss's tolerance)."""
    import torch
    from eagle3.kernels.ttt_loss import ttt_loss
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    loss, argmax, alpha = ttt_loss(h, w, p, valid, chunk=chunk, **kw)
    (loss * upstream).sum().backward()
    r_loss, _, r_dh, r_dw, logits, r_alpha = _reference(h, w, p, valid, upstream, **kw)
    assert loss.dtype == torch.float32 and argmax.dtype == torch.int64 and alpha.dtype == torch.float32
    assert not alpha.requires_grad, "alpha must not be differentiable"
    errs = dict(loss=_rel(loss, r_loss), alpha=_rel(alpha, r_alpha), dh=_rel(h.grad, r_dh), dw=_rel(w.grad, r_dw))
    assert (errs["loss"] < tol_loss and errs["alpha"] < (tol_alpha or tol_loss) and errs["dh"] < tol_grad
            and errs["dw"] < tol_grad), f"errors {errs} ({kw})"
    if valid is not None:
        assert (loss[~valid] == 0).all(), "loss is not 0 on rows that are not valid"
        assert (alpha[~valid] == 0).all(), "alpha is not 0 on rows that are not valid"
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
    from eagle3.kernels.reference import ttt_loss as ref
    from eagle3.kernels.ttt_loss import ttt_loss
    h, w, p, valid, up = _inputs(40, 64, 1000, torch.bfloat16)
    # Against fp64: bf16 logits and a bf16 dz, like the eager bf16 path. (The interpreter rounds
    # fp32 -> bf16 stores towards zero, the GPU to nearest: the CPU dz error is ~1.3x the GPU's.)
    _run_one(h, w, p, valid, 16, up, 2e-3, 2e-2, tol_argmax=0.1, tol_alpha=2e-2)
    # Against the reference run in bf16 (same rounding of the logits): loss and argmax agree.
    loss, argmax, _ = ttt_loss(h, w, p, valid, chunk=16)
    r_loss, r_arg, _ = ref(h, w, p, valid)
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
    from eagle3.kernels.ttt_loss import ttt_loss
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
    _, argmax, _ = ttt_loss(h, w, p)
    assert argmax.tolist() == [8192, 5, 300], f"argmax {argmax.tolist()}, expected [8192, 5, 300]"


def case_no_valid_rows_and_no_grad():
    import torch
    from eagle3.kernels.ttt_loss import ttt_loss, ttt_loss_steps
    h, w, p, _, up = _inputs(7, 16, 100)
    none = torch.zeros(7, dtype=torch.bool)
    loss, argmax, dh, dw = _run_one(h, w, p, none, 4, up, 1, 1)
    assert (loss == 0).all() and (argmax == -1).all() and (dh == 0).all() and (dw == 0).all()
    with torch.no_grad():
        loss, argmax, _ = ttt_loss(h, w, p)
        total, losses, _, _ = ttt_loss_steps([h], w, [p])
    r_loss = _reference(h, w, p, None, up)[0]
    assert _rel(loss, r_loss) < 1e-5 and _rel(losses[0], r_loss) < 1e-5


def case_all_steps_at_once():
    import torch
    from eagle3.kernels.reference import ttt_loss as ref
    from eagle3.kernels.ttt_loss import ttt_loss_steps
    K, N, H, V = 4, 30, 32, 900
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(V, H, generator=g) / H ** 0.5 * 4).requires_grad_()
    p_all = torch.softmax(torch.randn(N + K, V, generator=g) * 3, -1)
    ps = [p_all[k:k + N] for k in range(K)]                       # shifted row views, as in training
    hs = [torch.randn(N, H, generator=g).requires_grad_() for _ in range(K)]
    valids = [torch.rand(N, generator=g) > 0.3, None, torch.zeros(N, dtype=torch.bool),
              torch.rand(N, generator=g) > 0.5]
    weights = [1.0, 0.8, 0.64, torch.rand(N, generator=g)]
    total, losses, argmaxes, _ = ttt_loss_steps(hs, w, ps, valids, weights, chunk=8)
    (total * 2.5).backward()                                       # upstream scale != 1
    wd = w.detach().double().requires_grad_()
    hds = [h.detach().double().requires_grad_() for h in hs]
    r_total = 0
    for k in range(K):
        r_loss, r_arg, _ = ref(hds[k], wd, ps[k].double(), valids[k])
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
    from eagle3.kernels.ttt_loss import ttt_loss_steps
    K, N, H, V = 3, 37, 64, 320
    g = torch.Generator().manual_seed(6)
    w = torch.randn(V, H, generator=g) / H ** 0.5 * 4
    p_all = torch.softmax(torch.randn(N + K, V, generator=g) * 3, -1)
    ps = [p_all[k:k + N] for k in range(K)]
    hs = [torch.randn(N, H, generator=g) for _ in range(K)]
    valids = [None, torch.rand(N, generator=g) > 0.3, torch.zeros(N, dtype=torch.bool)]

    def run(float8):
        wr, hr = w.clone().requires_grad_(), [h.clone().requires_grad_() for h in hs]
        total, losses, argmaxes, _ = ttt_loss_steps(hr, wr, ps, valids, [1.0, 0.8, 0.64], chunk=24, float8=float8)
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
    from eagle3.kernels import reference
    from eagle3.kernels.ttt_loss import ttt_loss_steps
    K, N, H, V = 3, 20, 16, 300
    g = torch.Generator().manual_seed(5)
    w = torch.randn(V, H, generator=g) / H ** 0.5
    p_all = torch.softmax(torch.randn(N + K, V, generator=g), -1)
    ps = [p_all[k:k + N] for k in range(K)]
    hs = [torch.randn(N, H, generator=g) for _ in range(K)]
    masks = [torch.rand(N, generator=g) > 0.4, torch.ones(N, dtype=torch.bool), torch.zeros(N, dtype=torch.bool)]

    def run(fn, valids):
        wr, hr = w.clone().requires_grad_(), [h.clone().requires_grad_() for h in hs]
        total, losses, argmaxes, alphas = fn(hr, wr, ps, valids, [1.0, 0.8, 0.64])
        total.backward()
        return [total, *losses, *argmaxes, *alphas, wr.grad, *[h.grad for h in hr]]

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
    from eagle3.kernels import reference
    from eagle3.kernels.ttt_loss import ttt_loss_steps
    K, N, H, V = 3, 21, 16, 304
    g = torch.Generator().manual_seed(7)
    w = torch.randn(V, H, generator=g) / H ** 0.5
    p_all = torch.softmax(torch.randn(N + K + 5, V, generator=g), -1)
    rows = [torch.randperm(N + 5, generator=g)[:N].sort().values + k for k in range(K)]
    hs = [torch.randn(N, H, generator=g) for _ in range(K)]
    valids = [None, torch.rand(N, generator=g) > 0.4, torch.ones(N, dtype=torch.bool)]

    def run(fn, ps, p_rows, **kw):
        wr, hr = w.clone().requires_grad_(), [h.clone().requires_grad_() for h in hs]
        total, losses, argmaxes, alphas = fn(hr, wr, ps, valids, [1.0, 0.8, 0.64], p_rows=p_rows, **kw)
        total.backward()
        return [total, *losses, *argmaxes, *alphas, wr.grad, *[h.grad for h in hr]]

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


def _aligned(N, H, V, temperature, seed, dtype=None):
    """h, w, p, valid, upstream with p near q = softmax(h wᵀ / τ) (α well inside (0, 1)), except
    row 1 (Σp = 0.97), row 2 (p one-hot at the top logit: zeros in p) and row 3 (p one-hot at the
    lowest logit: α < 1e-5, where nla and pq clamp); rows 1-3 valid, about a quarter of the others not."""
    import torch
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) / H ** 0.5 * 4
    logits = h @ w.T
    p = torch.softmax(logits / temperature * 0.7 + torch.randn(N, V, generator=g), -1)
    p[1] *= 0.97
    p[2] = torch.nn.functional.one_hot(logits[2].argmax(), V)
    p[3] = torch.nn.functional.one_hot(logits[3].argmin(), V)
    valid = torch.rand(N, generator=g) > 0.25
    valid[1:4] = True
    dtype = dtype or torch.float32
    return h.to(dtype), w.to(dtype), p.to(dtype), valid, torch.randn(N, generator=g)


def case_every_loss_matches_reference():
    """ttt_loss for every loss at τ = 1 and 0.7 (and lk_hybrid at another eta) against the fp64
    reference's autograd: loss, α, argmax, dh and dw, with rows not valid, several chunks and (V =
    4500) two vocab blocks with the max in the second, which pq's online Σ p e^(x - m) rescales."""
    import torch
    from eagle3.kernels.reference import ALPHA_EPS
    from eagle3.kernels.ttt_loss import ttt_loss
    for loss in LOSSES:
        for t, chunk in ((1.0, None), (0.7, 4)):
            h, w, p, valid, up = _aligned(12, 16, 300, t, seed=len(loss))
            _run_one(h, w, p, valid, chunk, up, 1e-5, 1e-5, loss=loss, temperature=t)
            if loss in ("nla", "pq") and t == 0.7:   # row 3 is under the clamp: loss -log 1e-5, no gradient
                out = ttt_loss(h, w, p, valid, loss=loss, temperature=t)
                assert out[2][3] < ALPHA_EPS and abs(out[0][3].item() + math.log(ALPHA_EPS)) < 1e-5
                hr = h.clone().requires_grad_()
                ttt_loss(hr, w, p, valid, loss=loss, temperature=t)[0].sum().backward()
                assert (hr.grad[3] == 0).all() and (hr.grad[1] != 0).any()
        h, w, p, valid, up = _aligned(4, 16, 4500, 0.7, seed=9)
        w[4400] = h[0] * 2                       # row 0's max (and most of p) in the second block
        p[0] = torch.softmax(h[0] @ w.T / 0.7, -1)
        _run_one(h, w, p, None, None, up, 1e-5, 1e-5, loss=loss, temperature=0.7)
    h, w, p, valid, up = _aligned(12, 16, 300, 0.7, seed=3)
    _run_one(h, w, p, valid, None, up, 1e-5, 1e-5, loss="lk_hybrid", temperature=0.7, eta=1.5)


def case_every_loss_all_steps_at_once():
    """ttt_loss_steps for every loss at τ = 1 (targets read by p_rows from one [P, V] tensor) and
    0.7 (targets as per-step tensors) against the fp64 reference ttt_loss_steps: total, losses, α,
    argmaxes, every dh and dw, with masks, row indices and all rows valid, weights that are numbers
    and a tensor, and an upstream scale; without grad the same losses and α (read-only passes)."""
    import torch
    from eagle3.kernels import reference
    from eagle3.kernels.ttt_loss import ttt_loss_steps
    K, N, H, V = 3, 10, 16, 300
    for loss in LOSSES:
        for t, by_row in ((1.0, True), (0.7, False)):
            g = torch.Generator().manual_seed(20 + len(loss))
            w = torch.randn(V, H, generator=g) / H ** 0.5 * 4
            hs = [torch.randn(N, H, generator=g) for _ in range(K)]
            ps = [torch.softmax(h @ w.T / t * 0.7 + torch.randn(N, V, generator=g), -1) for h in hs]
            ps[1][0] = torch.nn.functional.one_hot((hs[1][0] @ w.T).argmin(), V)   # under the clamp
            mask = torch.rand(N, generator=g) > 0.3
            valids = [mask, None, (torch.rand(N, generator=g) > 0.4).nonzero().flatten()]
            weights = [1.0, 0.8, torch.rand(N, generator=g)]
            p_rows, targets = None, ps
            if by_row:   # every step's rows in one shuffled [K·N + 3, V] tensor
                order = torch.randperm(K * N + 3, generator=g)[:K * N]
                p_rows = [order[k * N:(k + 1) * N] for k in range(K)]
                p_all = torch.rand(K * N + 3, V, generator=g)
                for k in range(K):
                    p_all[p_rows[k]] = ps[k]
                targets = [p_all] * K
            kw = dict(loss=loss, temperature=t)
            wr, hr = w.clone().requires_grad_(), [h.clone().requires_grad_() for h in hs]
            total, losses, argmaxes, alphas = ttt_loss_steps(hr, wr, targets, valids, weights, p_rows=p_rows, **kw)
            (total * 1.5).backward()
            wd, hd = w.double().requires_grad_(), [h.double().requires_grad_() for h in hs]
            r_total, r_losses, r_argmaxes, r_alphas = reference.ttt_loss_steps(
                hd, wd, [x.double() for x in targets], valids, weights, p_rows=p_rows, **kw)
            (r_total * 1.5).backward()
            where = f"{loss} τ={t}"
            assert abs(total.item() - r_total.item()) <= 1e-5 * abs(r_total.item()), f"{where}: total"
            errs = ([_rel(a, b) for a, b in zip(losses, r_losses)] + [_rel(a, b) for a, b in zip(alphas, r_alphas)]
                    + [_rel(h.grad, x.grad) for h, x in zip(hr, hd)] + [_rel(wr.grad, wd.grad)])
            assert max(errs) < 1e-5, f"{where}: errors (losses, alphas, dh per step, dw) {errs}"
            for k in range(K):
                _check_argmax(argmaxes[k], hd[k].detach() @ wd.detach().t(), r_argmaxes[k] >= 0, 1e-9)
                assert torch.equal(argmaxes[k] >= 0, r_argmaxes[k] >= 0) and (alphas[k][r_argmaxes[k] < 0] == 0).all()
            with torch.no_grad():
                _, nl, _, na = ttt_loss_steps(hs, w, targets, valids, weights, p_rows=p_rows, **kw)
            assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(nl + na, losses + alphas)), \
                f"{where}: no-grad losses / alphas differ"


def case_every_loss_in_bf16():
    """bf16 h, w, p at τ = 0.7: every loss against the fp64 reference (bf16 logits and dz: α, and with
    it tv's loss, moves ~1% with the logits' rounding) and, for loss and α, against the reference run
    in bf16 (the same rounding of the logits)."""
    import torch
    from eagle3.kernels.reference import ttt_loss as ref
    from eagle3.kernels.ttt_loss import ttt_loss
    for loss in LOSSES:
        h, w, p, valid, up = _aligned(16, 32, 400, 0.7, seed=30, dtype=torch.bfloat16)
        _run_one(h, w, p, valid, 8, up, 3e-2, 4e-2, tol_argmax=0.1, tol_alpha=3e-2, loss=loss, temperature=0.7)
        out = ttt_loss(h, w, p, valid, chunk=8, loss=loss, temperature=0.7)
        r = ref(h, w, p, valid, loss=loss, temperature=0.7)
        errs = _rel(out[0], r[0]), _rel(out[2], r[2])
        assert max(errs) < 1e-5, f"{loss}: loss, alpha vs the bf16 reference {errs}"


def case_every_loss_gradient_follows_its_value():
    """The kernel's gradients against central differences of its own loss (no reference): a wrong
    sign or a missing / doubled 1/τ is off by 30% or more here, the differences by well under 1%.
    ttt_loss (gradient in backward) and ttt_loss_steps (in forward), at τ = 0.7."""
    import torch
    from eagle3.kernels.ttt_loss import ttt_loss, ttt_loss_steps
    t, eps = 0.7, 1e-3
    for loss in LOSSES:
        h, w, p, valid, up = _aligned(6, 16, 200, t, seed=40)
        h, w = h.double(), w.double()            # fp64 GEMMs: the differences see only the kernel's fp32
        g = torch.Generator().manual_seed(41)
        uh, uw = (torch.randn(x.shape, generator=g, dtype=torch.float64) for x in (h, w))
        uh, uw = uh / uh.norm() * h.norm(), uw / uw.norm() * w.norm()   # steps of relative size eps

        def value(hh, ww):
            if loss != "lk_hybrid":
                return (ttt_loss(hh, ww, p, valid, loss=loss, temperature=t)[0].double() * up).sum().item()
            # λ held at its value at (h, w): λ KL + (1 - λ)(1 - α) moves as λ kl + (1 - λ) tv
            kl, tv = (ttt_loss(hh, ww, p, valid, loss=k, temperature=t)[0].double() for k in ("kl", "tv"))
            return ((lam * kl + (1 - lam) * tv) * up).sum().item()

        lam = torch.exp(-3.0 * ttt_loss(h, w, p, valid, loss=loss, temperature=t)[2].double())

        fd_h = (value(h + eps * uh, w) - value(h - eps * uh, w)) / (2 * eps)
        fd_w = (value(h, w + eps * uw) - value(h, w - eps * uw)) / (2 * eps)
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        (ttt_loss(hr, wr, p, valid, loss=loss, temperature=t)[0] * up).sum().backward()
        hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
        ttt_loss_steps([hs], ws, [p], [valid], [up], loss=loss, temperature=t)[0].backward()
        for name, grad, u, fd in (("dh", hr.grad, uh, fd_h), ("dw", wr.grad, uw, fd_w),
                                  ("steps dh", hs.grad, uh, fd_h), ("steps dw", ws.grad, uw, fd_w)):
            d = (grad * u).sum().item()
            assert abs(d - fd) <= 5e-3 * abs(fd), f"{loss} {name}: directional derivative {d:.6g}, differences {fd:.6g}"


def case_unknown_loss_refused():
    """An unknown loss name or a temperature <= 0: ValueError naming it (and the choices), from both
    Triton entry points, before any work."""
    from eagle3.kernels.ttt_loss import ttt_loss, ttt_loss_steps
    h, w, p, valid, _ = _aligned(4, 16, 50, 1.0, seed=50)
    for kw, word in (({"loss": "kld"}, "'kld'"), ({"loss": "lk"}, "lk_hybrid"), ({"temperature": 0.0}, "> 0"),
                     ({"temperature": -0.5}, "-0.5")):
        for call in (lambda: ttt_loss(h, w, p, valid, **kw), lambda: ttt_loss_steps([h], w, [p], **kw)):
            try:
                call()
            except ValueError as exc:
                assert word in str(exc), str(exc)
            else:
                raise AssertionError(f"{kw} must be refused")


def _child() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET was set"
    sys.path.insert(0, str(ROOT))
    import torch
    import triton

    torch.manual_seed(0)
    from triton.runtime.interpreter import InterpretedFunction
    from eagle3.kernels.ttt_loss import _ttt_loss_kernel
    interp = isinstance(_ttt_loss_kernel, InterpretedFunction)
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
