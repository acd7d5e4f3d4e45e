"""The incremental drafter: with its per-sequence caches of step-0 keys, each round's proposals
equal a full recompute (every row's step 0 again) and the training-time-test unroll they replace,
for every draft variant, in real decoding loops, greedy and sampled."""
from itertools import accumulate

import pytest
import torch
import torch.nn as nn

from conftest import make_llama
from eagle3.draft import DraftSpec, Eagle3Draft, RMSNorm, Rows
from eagle3.models.weights import Checkpoint
from eagle3.models.incremental import SHORT_MAX, IncrementalTarget
from eagle3.ops import positions_from_cu_seqlens
from eagle3.sampling import Sampling
from eagle3.kernels.reference import steps_tensor
from eagle3.speculative import Drafter, greedy_decode_many, sampled_decode_many, speculative_decode_many
from eagle3.kernels.reference import ttt_attention

VARIANTS = {
    "one-layer": {},
    "two-layers-gqa-fc-norm": {"layers": 2, "kv_heads": 2, "fc_norm": True},
    "norms": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
}
# and against the training unroll only (the cached path is the one above): the engine's positional window, W - k
# rows back at chain step k
UNROLLED_VARIANTS = {**VARIANTS, "sliding-window": {"sliding_window": 5}}


def small_target(tmp_path_factory, dtype) -> IncrementalTarget:
    """A tiny Llama with a 16-token vocabulary (its seed: greedy outputs that do not all fall into
    one short cycle); random drafts over 12 of the tokens are accepted now and then."""
    path = make_llama(tmp_path_factory.mktemp("v16"), hidden=32, layers=4, heads=4, kv_heads=2,
                      intermediate=64, vocab=16, seed=3)
    return IncrementalTarget(Checkpoint(path), [0, 1, 2], torch.device("cpu"), dtype)


@pytest.fixture(scope="module")
def target64(tmp_path_factory):
    return small_target(tmp_path_factory, torch.float64)


@pytest.fixture(scope="module")
def target32(tmp_path_factory):
    return small_target(tmp_path_factory, torch.float32)


def make_drafter(target: IncrementalTarget, seed: int, layers: int = 1, kv_heads: int = 4, **options) -> Drafter:
    """A random draft in the target's dtype, weights large enough for peaked attention and logits."""
    torch.manual_seed(seed)
    V, H = target.embed.shape
    draft = Eagle3Draft(DraftSpec(H, 4, kv_heads, 8, 64, layers, 1e-6, 10000.0, 256, 12, V, H, **options))
    for m in draft.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=2 * m.in_features ** -0.5)
        elif isinstance(m, RMSNorm):
            m.weight.data += 0.3 * torch.randn_like(m.weight)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V)[:12]] = True
    draft.t2d.copy_(t2d)
    draft.d2t.copy_(t2d.nonzero().flatten() - torch.arange(12))
    return Drafter(draft.to(target.embed.dtype), target.embed)


def dense_ttt_attention(q, k, v, cu_seqlens, window=0):
    """ttt_attention's semantics in q's own dtype (kernels.reference computes in fp32): query t of
    step S-1 sees the step-0 keys of rows <= t of its sequence (and > t - window) and its own keys of steps 1..S-1."""
    k, v = steps_tensor(k), steps_tensor(v)   # the unroll hands its steps' keys as lists
    S, T, Hkv, D = k.shape
    seq = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff().long())   # [T]
    t = torch.arange(T)
    causal = (seq[:, None] == seq[None]) & (t[None] <= t[:, None])                               # [T, T]
    if window:
        causal &= t[:, None] - t[None] < window
    visible = torch.cat([causal] + [torch.eye(T, dtype=torch.bool)] * (S - 1), 1)                # [T, S*T]
    group = q.shape[1] // Hkv
    keys, values = (x.repeat_interleave(group, 2).flatten(0, 1) for x in (k, v))                 # [S*T, Hq, D]
    scores = torch.einsum("thd,shd->hts", q, keys) * D ** -0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, values)


def test_dense_reference_is_ttt_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 4, 8, generator=g), torch.randn(3, 9, 2, 8, generator=g), torch.randn(3, 9, 2, 8, generator=g)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    torch.testing.assert_close(dense_ttt_attention(q, k, v, cu), ttt_attention(q, k, v, cu))
    torch.testing.assert_close(dense_ttt_attention(q, k, v, cu, 2), ttt_attention(q, k, v, cu, window=2))
    assert not torch.allclose(ttt_attention(q, k, v, cu, window=2), ttt_attention(q, k, v, cu))


def unrolled(drafter: Drafter, auxes, tokens, k):
    """The full recompute as training-time test unrolls it (the drafter before its caches): step 0
    over every row, then each last row's chain -> (ids [B][k], head inputs [k, B, H])."""
    draft, embed = drafter.draft, drafter.embed
    cu = torch.tensor(list(accumulate((a.shape[0] for a in auxes), initial=0)))
    positions = positions_from_cu_seqlens(cu, int(cu[-1]))
    last = cu[1:] - 1
    row_tokens = torch.tensor([x for t, a in zip(tokens, auxes) for x in t[1:a.shape[0] + 1]])
    ids, heads = [], []

    def next_inputs(step, h):
        if step == 0:
            return h, embed[row_tokens], positions, None
        h = h[last] if step == 1 else h
        heads.append(draft.head_input(h))
        best = draft.lm_head(heads[-1]).argmax(-1)
        ids.append(best + draft.d2t[best])
        if step == k:
            return None
        return h, embed[ids[-1]], positions[last] + step, Rows(int(cu[-1]), computed=last)

    for _ in draft.unroll(torch.cat(auxes), dense_ttt_attention, cu, next_inputs):
        pass
    return torch.stack(ids, 1).tolist(), torch.stack(heads)


def recorded(drafter: Drafter, propose):
    """propose() -> (its result, the lm_head inputs of its steps [k, B, H])."""
    heads = []
    hook = drafter.draft.lm_head.register_forward_hook(lambda m, args, out: heads.append(args[0]))
    try:
        return propose(), torch.stack(heads)
    finally:
        hook.remove()


class Checked:
    """Proposes through the drafter's caches and checks every round against a full recompute
    (propose_many without caches) and, for greedy proposals, against the unroll; records the rounds."""

    def __init__(self, drafter: Drafter):
        self.drafter, self.batches, self.new_rows = drafter, [], []

    def new_cache(self, rows=None):
        return self.drafter.new_cache(rows)

    def propose_many(self, auxes, tokens, k, *sampling, caches):
        self.batches.append(len(auxes))
        self.new_rows.append(max(a.shape[0] - c.length for a, c in zip(auxes, caches)))
        full, full_heads = recorded(self.drafter, lambda: self.drafter.propose_many(auxes, tokens, k, *sampling))
        out, heads = recorded(self.drafter, lambda: self.drafter.propose_many(auxes, tokens, k, *sampling, caches=caches))
        assert [c.length for c in caches] == [a.shape[0] for a in auxes]      # every step-0 row, no chain key
        torch.testing.assert_close(heads, full_heads, rtol=0, atol=1e-10)
        if sampling and sampling[0].draft == "probabilistic":
            assert out[0] == full[0]
            torch.testing.assert_close(out[1], full[1], rtol=0, atol=1e-10)
        else:
            assert out == full
            ids, unrolled_heads = unrolled(self.drafter, auxes, tokens, k)
            assert out == ids
            torch.testing.assert_close(heads, unrolled_heads, rtol=0, atol=1e-10)
        return out


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 16, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("variant", UNROLLED_VARIANTS)
def test_incremental_drafter_equals_full_recompute(target64, variant):
    """float64, sequences of different lengths (one past SHORT_MAX: attended on its own) batched
    together, one finishing early at a stop token; greedy, then probabilistic proposals."""
    drafter = Checked(make_drafter(target64, 0, **UNROLLED_VARIANTS[variant]))
    prompts = prompts_of([SHORT_MAX + 6, 5, 1, 12])
    stop = {greedy_decode_many(target64, [prompts[1]], 16)[0].tokens[6]}
    decoded = speculative_decode_many(target64, drafter, prompts, 16, 3, stop)
    assert len(decoded[1].tokens) == 7 and max(len(d.tokens) for d in decoded) == 16
    sampled = sampled_decode_many(target64, drafter, prompts, 16, 3, stop, Sampling(1.0, 0.9, "probabilistic"),
                                  [1, 2, 3, 4])
    assert min(len(d.tokens) for d in sampled) < 16
    assert drafter.batches[0] == 4 and min(drafter.batches) < 4          # the batch shrank
    assert drafter.new_rows[0] == SHORT_MAX + 6 and max(drafter.new_rows[1:]) > 1   # accepted drafts: several new rows


class Recompute:
    """The drafter without caches: each round recomputes step 0 over every row (the former path)."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter

    def new_cache(self, rows=None):
        return None

    def propose_many(self, *args, caches):
        return self.drafter.propose_many(*args)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_decoding_with_caches_equals_recompute(target32, variant):
    drafter = make_drafter(target32, 1, **VARIANTS[variant])
    prompts = prompts_of([9, SHORT_MAX + 3, 2, 30], seed=1)
    cached = speculative_decode_many(target32, drafter, prompts, 32, 4)
    assert cached == speculative_decode_many(target32, Recompute(drafter), prompts, 32, 4)
    assert sum(sum(d.drafts_accepted) for d in cached) > 0


@pytest.mark.parametrize("mode", ["greedy", "probabilistic"])
def test_sampled_decoding_with_caches_equals_recompute(target32, mode):
    drafter = make_drafter(target32, 2, layers=2, kv_heads=2)
    prompts, s = prompts_of([9, SHORT_MAX + 3, 2, 30], seed=2), Sampling(1.0, 0.9, mode)
    cached = sampled_decode_many(target32, drafter, prompts, 24, 4, {3}, s, [5, 6, 7, 8])
    assert cached == sampled_decode_many(target32, Recompute(drafter), prompts, 24, 4, {3}, s, [5, 6, 7, 8])
    assert sum(sum(d.drafts_accepted) for d in cached) > 0


def test_a_repeated_round_recomputes_only_the_last_row(target64):
    """Calling again with the same caches and inputs (no new row) gives the same proposals."""
    drafter = make_drafter(target64, 3, layers=2, kv_heads=2)
    prompts = prompts_of([6, 11], seed=3)
    prefill = target64.forward_many([torch.tensor(p) for p in prompts], [target64.new_cache() for _ in prompts])
    auxes, tokens = [a for a, _ in prefill], [p + [0] for p in prompts]
    caches = [drafter.new_cache() for _ in prompts]
    first = drafter.propose_many(auxes, tokens, 4, caches=caches)
    assert drafter.propose_many(auxes, tokens, 4, caches=caches) == first == drafter.propose_many(auxes, tokens, 4)
    assert [c.length for c in caches] == [6, 11]
