import dataclasses
import shutil

import pytest
import torch

from eagle3.data.batch import Batch
from eagle3.draft import DraftSpec, Eagle3Draft
from eagle3.ops import compiled, rms_norm
from eagle3.ttt import (METRICS, Objective, loss_denominator, row_layout, step_targets, summarize, target_probs,
                        ttt_forward)
from eagle3.kernels.reference import steps_tensor, ttt_attention, ttt_loss, ttt_loss_steps


def brute_force_attention(q, k, v, cu_seqlens):
    """Every (step, row) key of every step in one list, with an explicit [T, S*T] boolean mask."""
    k, v = steps_tensor(k), steps_tensor(v)   # the unroll hands its steps' keys as lists
    S, T, Hkv, D = k.shape
    Hq = q.shape[1]
    seq = torch.searchsorted(cu_seqlens.long(), torch.arange(T), right=True)
    allowed = torch.zeros(T, S, T, dtype=torch.bool)
    for t in range(T):
        for s in range(T):
            allowed[t, 0, s] = seq[s] == seq[t] and s <= t
        for j in range(1, S):
            allowed[t, j, t] = True
    keys = k.reshape(S * T, Hkv, D).repeat_interleave(Hq // Hkv, 1).double()
    values = v.reshape(S * T, Hkv, D).repeat_interleave(Hq // Hkv, 1).double()
    scores = torch.einsum("thd,khd->htk", q.double(), keys) * D ** -0.5
    scores = scores.masked_fill(~allowed.reshape(T, S * T), float("-inf"))
    return torch.einsum("htk,khd->thd", scores.softmax(-1), values)


@pytest.mark.parametrize("steps,hq,hkv", [(1, 2, 2), (4, 4, 2), (3, 6, 1)])
def test_reference_attention_equals_dense_mask(steps, hq, hkv):
    g = torch.Generator().manual_seed(steps)
    T, D = 23, 8
    q = torch.randn(T, hq, D, generator=g)
    k = torch.randn(steps, T, hkv, D, generator=g)
    v = torch.randn(steps, T, hkv, D, generator=g)
    cu = torch.tensor([0, 5, 6, 17, 23], dtype=torch.int32)
    torch.testing.assert_close(ttt_attention(q, k, v, cu).double(), brute_force_attention(q, k, v, cu),
                               rtol=1e-5, atol=1e-5)


def test_reference_loss_matches_definition():
    h, w = torch.randn(6, 5), torch.randn(7, 5)
    p = torch.softmax(torch.randn(6, 7), -1)
    valid = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    loss, argmax, _ = ttt_loss(h, w, p, valid)
    logits = h @ w.T
    expected = -(p * torch.log(torch.softmax(logits, -1))).sum(-1) * valid
    torch.testing.assert_close(loss, expected)
    assert argmax.tolist() == [a if ok else -1 for a, ok in zip(logits.argmax(-1).tolist(), valid.tolist())]


def test_mask_moves_with_the_targets():
    # one sequence of 10 tokens: user turn at 0..3 and 7, assistant at 4..6 and 8..9
    mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 0, 1, 1])
    greedy = torch.arange(10)
    t2d = torch.ones(16, dtype=torch.bool)
    t2d[6] = False                                  # the target's greedy token 6 is not in the draft vocab
    positions, seq_len = torch.arange(10), torch.full((10,), 10)
    for k in range(4):
        tg = step_targets(k, positions, seq_len, mask, greedy, t2d)
        expected_rows = [t for t in range(10) if t + 2 + k < 10 and mask[t + 2 + k] == 1]
        assert tg.acc_rows.nonzero().flatten().tolist() == expected_rows
        assert tg.valid.nonzero().flatten().tolist() == [t for t in expected_rows if t + 1 + k != 6]
        assert tg.index[expected_rows].tolist() == [t + 1 + k for t in expected_rows]
    # step 2 trains row 2 towards x[6] (assistant) and not row 3 (x[7] is a user token), row 5 -> x[9]
    tg = step_targets(2, positions, seq_len, mask, greedy, t2d)
    assert tg.acc_rows[2] and not tg.acc_rows[3] and tg.acc_rows[5] and not tg.acc_rows[6]


def tiny_draft(seed=0):
    torch.manual_seed(seed)
    spec = DraftSpec(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=32, num_layers=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=256, draft_vocab_size=24, target_vocab_size=40,
                     target_hidden_size=16)
    draft = Eagle3Draft(spec)
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[torch.randperm(40)[:24]] = True
    draft.t2d.copy_(t2d)
    draft.d2t.copy_(t2d.nonzero().flatten() - torch.arange(24))
    return draft


def random_batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    return Batch(aux_hidden=torch.randn(T, 48, generator=g), final_hidden=torch.randn(T, 16, generator=g),
                 input_ids=torch.randint(0, 40, (T,), generator=g, dtype=torch.int32),
                 loss_mask=(torch.rand(T, generator=g) > 0.3).to(torch.uint8),
                 target_argmax=torch.randint(0, 40, (T,), generator=g, dtype=torch.int32),
                 cu_seqlens=torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist()))


def slice_batch(batch, a, b):
    return Batch(batch.input_ids[a:b], batch.loss_mask[a:b], batch.target_argmax[a:b], batch.aux_hidden[a:b],
                 batch.final_hidden[a:b], torch.tensor([0, b - a]))


def test_packed_sequences_do_not_interact():
    draft = tiny_draft()
    embed, head = torch.randn(40, 16), torch.randn(24, 16)
    lengths = [9, 14, 5]
    batch = random_batch(lengths)
    total, metrics, _ = ttt_forward(draft, batch, embed, head, 4, ttt_attention, ttt_loss_steps)
    total.backward()
    packed_grad = draft.fc.weight.grad.clone()
    draft.zero_grad()
    sep_total, sep_metrics = 0, 0
    bounds = batch.cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        t, m, _ = ttt_forward(draft, slice_batch(batch, a, b), embed, head, 4, ttt_attention, ttt_loss_steps)
        t.backward()
        sep_total, sep_metrics = sep_total + t, sep_metrics + m
    torch.testing.assert_close(total, sep_total)
    torch.testing.assert_close(metrics, sep_metrics)
    torch.testing.assert_close(packed_grad, draft.fc.weight.grad)
    assert loss_denominator(batch) == sum(loss_denominator(slice_batch(batch, a, b))
                                          for a, b in zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize("loss,temperature", [("kl", 1.0), ("nla", 0.7), ("pq", 1.0)])
def test_expected_acceptance_metrics(loss, temperature):
    """alpha = Σ min(p, q) and alpha_greedy = p(argmax q) per step, at the loss temperature, averaged
    over the assistant rows (0 where the target's token is out of the draft vocabulary)."""
    draft = tiny_draft(2)
    embed, head = torch.randn(40, 16), torch.randn(24, 16)
    batch = random_batch([11, 7], seed=5)
    recorded = {}

    def recording_loss(hs, w, ps, valids, weights, **kwargs):
        recorded["hs"], recorded["w"] = [h.detach() for h in hs], w.detach()
        return ttt_loss_steps(hs, w, ps, valids, weights, **kwargs)

    objective = Objective(loss=loss, temperature=temperature)
    _, metrics, _ = ttt_forward(draft, batch, embed, head, 3, ttt_attention, recording_loss,
                                skip_dead_rows=False, objective=objective)
    summary = summarize(metrics)
    T = batch.rows
    positions, seq_len = row_layout(batch.cu_seqlens, T)
    probs = target_probs(batch.final_hidden, head, 3, temperature=temperature)
    assert summary["alpha"][0] > 0
    for k in range(3):
        tg = step_targets(k, positions, seq_len, batch.loss_mask, batch.target_argmax.long(), draft.t2d)
        z = recorded["hs"][k] @ recorded["w"].T
        q, p = torch.softmax(z / temperature, -1), probs[k:k + T]
        counted = (tg.valid & tg.acc_rows).float()
        rows = tg.acc_rows.sum()
        assert summary["alpha"][k] == pytest.approx(float((torch.minimum(p, q).sum(-1) * counted).sum() / rows), rel=1e-5)
        p_top = p.gather(1, z.argmax(-1, keepdim=True)).squeeze(1)
        assert summary["alpha_greedy"][k] == pytest.approx(float((p_top * counted).sum() / rows), rel=1e-5)


def test_ttt_step_uses_own_previous_output_and_shifted_tokens():
    """Step k of row t must not depend on tokens after x[t+1+k] nor on other rows' later steps."""
    draft = tiny_draft(1)
    embed, head = torch.randn(40, 16), torch.randn(24, 16)
    batch = random_batch([16], seed=3)
    batch.loss_mask[:] = 1
    batch.target_argmax = draft.t2d.nonzero().flatten()[torch.arange(16) % 24].to(torch.int32)
    outputs = {}

    def recording_loss(hs, w, ps, valids, weights, **kwargs):
        outputs["h"] = [h.detach().clone() for h in hs]
        return ttt_loss_steps(hs, w, ps, valids, weights, **kwargs)

    ttt_forward(draft, batch, embed, head, 3, ttt_attention, recording_loss)
    changed = dataclasses.replace(batch, input_ids=batch.input_ids.clone())
    changed.input_ids[10:] = (changed.input_ids[10:] + 1) % 40   # tokens from position 10 on
    before = outputs.pop("h")
    ttt_forward(draft, changed, embed, head, 3, ttt_attention, recording_loss)
    after = outputs["h"]
    for k in range(3):
        # row t at step k reads x[t+1+k] and earlier tokens only: rows with t+1+k < 10 are unchanged
        same = [t for t in range(16) if t + 1 + k < 10]
        torch.testing.assert_close(before[k][same], after[k][same])
        assert not torch.allclose(before[k][9 - k], after[k][9 - k])


def test_summary_acceptance_length():
    m = torch.zeros(3, len(METRICS))
    m[:, 3] = torch.tensor([10, 10, 10])     # 10 start rows
    m[0, 6] = 15                               # 15 leading correct steps in total
    m[:, 7], m[:, 8] = torch.tensor([6.0, 4.0, 2.0]), torch.tensor([5.0, 3.0, 1.0])
    assert summarize(m)["alpha"] == pytest.approx([0.6, 0.4, 0.2])
    assert summarize(m)["alpha_greedy"] == pytest.approx([0.5, 0.3, 0.1])
    assert summarize(m)["accept_len"] == pytest.approx(2.5)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("chains", ["user_turns", "die_at_step_2"])
def test_skipping_dead_rows_is_exact(layers, chains):
    """Rows with no valid target at any later step are dropped; loss, gradients and metrics equal
    the full computation, also with the live and loss rows found beforehand on the host (as the
    trainer does), with rows found for the other mode (ignored), and when every chain dies early."""
    from eagle3.ttt import plan_rows
    torch.manual_seed(0)
    spec = DraftSpec(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=32, num_layers=layers, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=256, draft_vocab_size=24, target_vocab_size=40,
                     target_hidden_size=16)
    draft = Eagle3Draft(spec)
    reference = tiny_draft(0)
    draft.t2d.copy_(reference.t2d)
    draft.d2t.copy_(reference.d2t)
    embed, head = torch.randn(40, 16), torch.randn(24, 16)
    batch = random_batch([13, 20, 9, 14], seed=5)
    batch.target_argmax = draft.t2d.nonzero().flatten()[torch.arange(56) % 24].to(torch.int32)
    if chains == "user_turns":   # a user turn, a whole user sequence, a short reply
        batch.loss_mask[:8] = 0
        batch.loss_mask[33:42] = 0
        batch.loss_mask[42:56] = torch.tensor([0] * 10 + [1] * 4)
    else:                         # labels only at positions 2 and 3: nothing is valid from step 2 on
        batch.loss_mask[:] = 0
        for a in (0, 13, 33, 42):
            batch.loss_mask[a + 2:a + 4] = 1
    found = {skip: plan_rows(batch, 5, draft.t2d, skip) for skip in (True, False)}
    results = []
    for skip, plan in ((False, None), (False, found[False]), (False, found[True]), (True, None),
                       (True, found[True]), (True, found[False])):
        draft.zero_grad()
        total, metrics, detail = ttt_forward(draft, dataclasses.replace(batch, plan=plan), embed, head, 5,
                                             ttt_attention, ttt_loss_steps, skip_dead_rows=skip)
        total.backward()
        results.append((total.detach(), metrics, detail["accepted"],
                        {n: p.grad.clone() for n, p in draft.named_parameters()}))
    t0, m0, a0, g0 = results[0]
    assert t0 > 0
    for t1, m1, a1, g1 in results[1:]:
        torch.testing.assert_close(t1, t0)
        torch.testing.assert_close(m1, m0)
        assert torch.equal(a1, a0)
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6)
    live = found[True].live
    assert found[False].live is None and all(set(live[k + 1].tolist()) <= set(live[k].tolist()) for k in range(4))
    if chains == "user_turns":
        assert live[1].numel() < 56
    else:
        assert live[1].numel() > 0 and live[2].numel() == 0


def test_batch_with_no_assistant_token_gives_zero_loss_and_grads():
    """Nothing is live: the loss is 0 and every parameter still gets a (zero) gradient, which DDP
    needs to finish its reduction."""
    draft = tiny_draft()
    batch = random_batch([10, 12])
    batch.loss_mask[:] = 0
    total, metrics, _ = ttt_forward(draft, batch, torch.randn(40, 16), torch.randn(24, 16), 3, ttt_attention,
                                    ttt_loss_steps)
    total.backward()
    assert float(total.detach()) == 0 and metrics[:, 3].sum() == 0
    assert all(p.grad is not None and not p.grad.any() for p in draft.parameters())


def test_flex_block_mask_matches_reference(monkeypatch):
    """The torch recipe's TTT block mask (kernels.flex) has the reference semantics; checked with
    uncompiled flex_attention on the CPU (compiled on CUDA)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    import eagle3.kernels.flex as flex
    monkeypatch.setattr(flex, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(40, 4, 16, generator=g), torch.randn(3, 40, 2, 16, generator=g), torch.randn(
        3, 40, 2, 16, generator=g)
    cu = torch.tensor([0, 13, 29, 40], dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(flex.ttt_attention(q, k, v, cu), ttt_attention(q, k, v, cu), rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(flex.ttt_attention(q, k, v, cu, window=5), ttt_attention(q, k, v, cu, window=5),
                                   rtol=1e-5, atol=1e-5)   # a sliding window


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on the CPU needs a C compiler")
def test_compiled_elementwise_ops_give_the_same_loss_and_grads():
    """`debug.compile_ops` (RMSNorm, RoPE, SiLU*up through torch.compile, dynamic row counts) is a
    pure speed change: same loss and gradients as the eager draft, skipping rows or not."""
    batch = random_batch([13, 20, 9, 14], seed=5)
    batch.loss_mask[:8] = 0
    embed, head = torch.randn(40, 16), torch.randn(24, 16)
    results = []
    for compile_ops in (False, True):
        draft = tiny_draft(3)
        if compile_ops:
            draft.compile_elementwise()
        for skip in (False, True):
            draft.zero_grad()
            total, metrics, _ = ttt_forward(draft, batch, embed, head, 4, ttt_attention, ttt_loss_steps,
                                            skip_dead_rows=skip)
            total.backward()
            results.append((total.detach(), metrics, [p.grad.clone() for p in draft.parameters()]))
    t0, m0, g0 = results[0]
    for t1, m1, g1 in results[1:]:
        torch.testing.assert_close(t1, t0)
        torch.testing.assert_close(m1, m0)
        for a, b in zip(g1, g0):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _scale_rows(x, s):
    return x * s[:, None].sigmoid()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on the CPU needs a C compiler")
def test_compiled_ops_take_any_row_count_and_specialise_widths():
    """ops.compiled: new row counts reuse the graph (rows change every TTT step), a new width gets its
    own graph (static widths: the step is faster with them, bench/RESULTS.md)."""
    from torch._dynamo.utils import counters
    counters.clear()
    fn = compiled(_scale_rows)
    for rows, width in [(5, 8), (9, 8), (13, 8), (7, 4), (11, 4)]:
        x, s = torch.randn(rows, width), torch.randn(rows)
        torch.testing.assert_close(fn(x, s), _scale_rows(x, s))
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on the CPU needs a C compiler")
def test_compiled_rms_norm_rounds_where_the_eager_one_rounds():
    """In bf16 the reference RMSNorm rounds the normalised rows before scaling them; the compiled
    op keeps that rounding (without it about a quarter of the outputs differ by an ulp)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g).bfloat16()
    w = (torch.rand(256, generator=g) + 0.5).bfloat16()
    same = compiled(rms_norm)(x, w, 1e-6) == rms_norm(x, w, 1e-6)
    assert same.float().mean() > 0.999   # the rest: the row sum's order, an ulp of the scale at most

