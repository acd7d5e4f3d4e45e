"""eagle3.linear: the dense linear layers whose uses in one TTT forward share a cast and one
weight-gradient sum."""
import pytest
import torch

from eagle3 import linear


def _uses(w, xs):
    """Three layers' worth of uses of one weight, as TTT steps chain them; the loss is a fixed
    random projection of the last output."""
    h = xs[0]
    for x in xs:
        h = torch.tanh(linear.dense_linear(x + h[:, :x.shape[1]], w))
    return (h.float() * torch.linspace(-1, 1, h.numel()).view_as(h)).sum()


def test_a_weight_used_k_times_gets_the_gradient_autograd_gives():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 32) * 0.2)
    xs = [torch.randn(40, 32, requires_grad=True) for _ in range(3)]
    with linear.casts_reused():
        _uses(w, xs).backward()
    ours, dxs = w.grad.clone(), [x.grad.clone() for x in xs]
    w.grad = None
    for x in xs:
        x.grad = None
    h = xs[0]
    for x in xs:   # the same chain through F.linear: autograd sums the three weight gradients
        h = torch.tanh(torch.nn.functional.linear(x + h[:, :32], w))
    (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
    torch.testing.assert_close(ours, w.grad, rtol=1e-6, atol=1e-7)
    for dx, x in zip(dxs, xs):
        torch.testing.assert_close(dx, x.grad, rtol=1e-6, atol=1e-7)


def test_under_autocast_the_sum_is_kept_in_fp32_not_rounded_per_use():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64) * 0.1)
    xs = [torch.randn(256, 64) for _ in range(4)]
    g = torch.randn(256, 64).bfloat16()

    def products(x):   # this use's dYᵀ·X as a bf16 GEMM would see it: bf16 operands
        return g.double().t() @ x.bfloat16().double()

    with linear.casts_reused(), torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [linear.dense_linear(x, w) for x in xs]
    assert all(o.dtype == torch.bfloat16 for o in outs)
    torch.autograd.backward(outs, [g] * len(xs))
    exact = sum(products(x) for x in xs)
    assert w.grad.dtype == torch.float32
    ours = ((w.grad.double() - exact).norm() / exact.norm()).item()
    rounded = sum((g.t() @ x.bfloat16()).double() for x in xs)   # each use rounded to bf16, then summed
    per_use = ((rounded - exact).norm() / exact.norm()).item()
    assert ours < 1e-6 < per_use


def test_one_cast_per_scope_until_the_weight_changes(monkeypatch):
    calls = []
    cast = linear._cast
    monkeypatch.setattr(linear, "_cast", lambda w, dtype: calls.append(w.shape) or cast(w, dtype))
    w = torch.nn.Parameter(torch.randn(8, 16))
    x = torch.randn(4, 16)
    with linear.casts_reused():
        (linear.dense_linear(x, w) + linear.dense_linear(x, w)).sum().backward()
        assert len(calls) == 1
        torch.testing.assert_close(w.grad, x.sum(0).expand(8, 16) * 2)
        with torch.no_grad():
            w.mul_(2)                               # an in-place change (an optimizer step): a new cast
        linear.dense_linear(x, w).sum().backward()
        assert len(calls) == 2
    torch.testing.assert_close(w.grad, x.sum(0).expand(8, 16) * 3)
    linear.dense_linear(x, w)
    assert len(calls) == 3                          # outside a scope: every call casts


@pytest.mark.parametrize("grad", [False, True])
def test_without_a_gradient_for_the_weight_it_is_f_linear(grad):
    w = torch.randn(8, 16, requires_grad=grad)
    x = torch.randn(4, 16)
    with torch.set_grad_enabled(not grad):
        y = linear.dense_linear(x, w.detach() if grad else w)
    assert torch.equal(y, torch.nn.functional.linear(x, w.detach()))
    assert y.grad_fn is None


def test_layers_sharing_an_input_sum_its_gradient_and_skip_an_unused_output():
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(n, 24) * 0.3) for n in (16, 8, 8)]
    x = torch.randn(10, 24, requires_grad=True)
    with linear.casts_reused():
        q, k, v = linear.dense_linears(x, *ws)
    (q.sum() + (k * k).sum()).backward()             # v: no gradient reaches it
    ours = [x.grad.clone(), ws[0].grad.clone(), ws[1].grad.clone()]
    assert ws[2].grad is None
    xr, wr = x.detach().requires_grad_(), [w.detach().requires_grad_() for w in ws]
    (torch.nn.functional.linear(xr, wr[0]).sum() + (torch.nn.functional.linear(xr, wr[1]) ** 2).sum()).backward()
    for a, b in zip(ours, [xr.grad, wr[0].grad, wr[1].grad]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_backward_that_skips_the_weights_leaves_no_sum_behind():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 16))
    x = torch.randn(4, 16, requires_grad=True)
    with linear.casts_reused():
        y = linear.dense_linear(x, w)
    loss = (y * y).sum()
    (dx,) = torch.autograd.grad(loss, x, retain_graph=True)    # towards x alone: the cast does not run
    loss.backward(inputs=[x], retain_graph=True)               # nor here
    assert w.grad is None
    loss.backward()                                            # now it does: one gradient, not three
    torch.testing.assert_close(w.grad, 2 * (y.detach().t() @ x.detach()), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, 2 * dx, rtol=1e-6, atol=1e-6)
