"""Speculative sampling is lossless in distribution: the tokens it emits are distributed as the
target's own sampling, in both draft-sampling modes, and two deliberately wrong rules fail the same
test. Each check is a chi-square goodness-of-fit test of seeded draws against the exact
distribution, rejected at a p-value below ALPHA: a correct rule fails with probability ALPHA for a
random choice of seeds (the seeds are fixed, so the outcome is reproducible); the wrong rules tested
here give p-values many orders of magnitude below it."""
import pytest
import torch

from conftest import make_llama
from eagle3 import sampling, speculative
from eagle3.draft import DraftSpec, Eagle3Draft
from eagle3.models.weights import Checkpoint
from eagle3.models.incremental import IncrementalTarget
from eagle3.sampling import Sampling, draw, target_probs, verify
from eagle3.speculative import Drafter, sampled_decode_many

ALPHA = 1e-3


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper-tail p-value of Pearson's chi-square of `samples` (ids) against `probs`; cells expected
    fewer than 5 times are pooled into one."""
    n = samples.numel()
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * n
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum(0, keepdim=True)])
        expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token with probability 0 was emitted"
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = keep.sum() - 1
    return torch.special.gammaincc(df / 2, stat / 2).item()


def test_target_probs_temperature_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    torch.testing.assert_close(target_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    full = torch.softmax(logits, -1)[0]                        # 0.644 0.237 0.087 0.032
    kept = target_probs(logits, 1.0, top_p=0.85)[0]            # 0.644 < 0.85, 0.881 >= 0.85: two kept
    torch.testing.assert_close(kept, torch.cat([full[:2] / full[:2].sum(), torch.zeros(2)]))
    assert target_probs(logits, 1.0, top_p=0.1)[0].tolist() == [1.0, 0.0, 0.0, 0.0]   # the top token always


def test_draw_is_the_inverse_cdf():
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]]).expand(5, 4)
    u = torch.tensor([0.0, 0.1999, 0.2001, 0.6999, 0.99999])
    assert draw(probs, u).tolist() == [0, 0, 2, 2, 3]
    assert draw(probs * 7, u).tolist() == [0, 0, 2, 2, 3]     # unnormalised weights


# --- the rule alone: synthetic p and q, many rows -----------------------------------------------

def synthetic(mode: str, top_p: float, rows: int = 40000, V: int = 10, k: int = 3):
    """Every row the same p [k+1, V] and q [k, V] with its own uniforms; the drafts as the mode draws them."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, V, generator=g) * 1.5
    p = target_probs(logits, 1.0, top_p).expand(rows, k + 1, V)
    q_logits = logits[:k] + torch.randn(k, V, generator=g)              # a draft near the target,
    q_logits[0, logits[0].argmax()] += 2.0                                # agreeing on the first argmax
    q_row = torch.softmax(q_logits, -1)
    assert q_row[0].argmax() == p[0, 0].argmax()
    u = torch.rand(rows, 2 * k + 1, generator=g)
    if mode == "probabilistic":
        drafts = torch.stack([draw(q_row[j].expand(rows, V), u[:, j]) for j in range(k)], 1)
        q = q_row.expand(rows, k, V)
    else:
        drafts, q = q_row.argmax(-1).expand(rows, k), None
    return p, q, drafts, u


def first_emitted(p, q, drafts, u) -> torch.Tensor:
    k = drafts.shape[1]
    a, token = verify(drafts, p, q, u[:, k:2 * k], u[:, 2 * k])
    return torch.where(a > 0, drafts[:, 0], token)


@pytest.mark.parametrize("mode", ["greedy", "probabilistic"])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_first_emitted_token_is_distributed_as_the_target(mode, top_p):
    p, q, drafts, u = synthetic(mode, top_p)
    assert chi_square_p_value(first_emitted(p, q, drafts, u), p[0, 0]) > ALPHA


def wrong_verify_on_argmax(drafts, p, q, u_accept, u_token):
    """A wrong rule: accept a draft when it is the target's most likely token; else sample p."""
    k = drafts.shape[1]
    ok = drafts == p[:, :k].argmax(-1)
    a = ok.int().cumprod(-1).sum(-1)
    return a, draw(p[torch.arange(len(a)), a], u_token)


@pytest.mark.parametrize("mode", ["greedy", "probabilistic"])
def test_wrong_rules_fail_the_same_test(mode, monkeypatch):
    p, q, drafts, u = synthetic(mode, 1.0)
    with monkeypatch.context() as m:
        m.setattr(sampling, "residual", lambda p, q: p)       # the replacement drawn from p, not the residual
        assert chi_square_p_value(first_emitted(p, q, drafts, u), p[0, 0]) < 1e-12
    k = drafts.shape[1]
    a, token = wrong_verify_on_argmax(drafts, p, q, u[:, k:2 * k], u[:, 2 * k])
    assert chi_square_p_value(torch.where(a > 0, drafts[:, 0], token), p[0, 0]) < 1e-12


# --- the whole loop: a tiny target and a random draft -------------------------------------------

V, PROMPT, COPIES = 16, [3, 1, 4, 1, 5], 3000


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A tiny Llama with a 16-token vocabulary (peaked, context-dependent distributions) and a
    random draft over 12 of its tokens (its head scaled up: a q as peaked as p, and unlike it)."""
    path = make_llama(tmp_path_factory.mktemp("v16"), hidden=32, layers=4, heads=4, kv_heads=2,
                      intermediate=64, vocab=V)
    target = IncrementalTarget(Checkpoint(path), [0, 1, 2], torch.device("cpu"))
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftSpec(32, 4, 2, 8, 64, 1, 1e-6, 10000.0, 64, 12, V, 32))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V)[:12]] = True
    draft.t2d.copy_(t2d)
    draft.d2t.copy_(t2d.nonzero().flatten() - torch.arange(12))
    draft.lm_head.weight.data *= 100
    return target, Drafter(draft, target.embed)


class NearDrafter:
    """A stand-in draft close to the target, so that most drafts are accepted: its q mixes the
    target's own distribution at the temperature (70%) with a fixed random one (30%)."""

    def __init__(self, target):
        self.target = target
        self.noise = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(5)) * 2, -1)

    def new_cache(self, rows=None):
        return None

    def propose_many(self, auxes, tokens, k, sampling_, u, caches):
        contexts, ids, qs = [list(t) for t in tokens], [], []
        for j in range(k):
            caches = [self.target.new_cache() for _ in contexts]
            finals = self.target.forward_many([torch.tensor(c) for c in contexts], caches)
            p = target_probs(self.target.logits(torch.stack([f[-1] for _, f in finals])), sampling_.temperature)
            q = 0.7 * p + 0.3 * self.noise
            x = draw(q, u[:, j]) if sampling_.draft == "probabilistic" else q.argmax(-1)
            ids.append(x)
            qs.append(q)
            contexts = [c + [t] for c, t in zip(contexts, x.tolist())]
        ids = torch.stack(ids, 1).tolist()
        return (ids, torch.stack(qs, 1)) if sampling_.draft == "probabilistic" else ids


def exact_marginals(target, sampling_: Sampling, n: int) -> list[torch.Tensor]:
    """The target's own sampling distribution of generated tokens 1..n after PROMPT (enumerated)."""
    prefixes, weights, out = [[]], torch.ones(1, dtype=torch.float64), []
    for _ in range(n):
        caches = [target.new_cache() for _ in prefixes]
        finals = target.forward_many([torch.tensor(PROMPT + x) for x in prefixes], caches)
        p = target_probs(target.logits(torch.stack([f[-1] for _, f in finals])), sampling_.temperature,
                         sampling_.top_p).double()                                       # [P, V]
        joint = weights[:, None] * p
        out.append(joint.sum(0))
        prefixes = [x + [v] for x in prefixes for v in range(V)]
        weights = joint.flatten()
    return out


def decode_copies(target, drafter, sampling_: Sampling, k: int = 3, n: int = 3) -> torch.Tensor:
    """[COPIES, n] tokens of PROMPT decoded COPIES times (seeds 0..COPIES-1); asserts that some
    drafts were accepted and some rejected, so that both branches of the rule are exercised."""
    decoded = sampled_decode_many(target, drafter, [PROMPT] * COPIES, n, k, set(), sampling_, list(range(COPIES)))
    assert all(len(d.tokens) == n for d in decoded)
    accepted = torch.tensor([a for d in decoded for a in d.drafts_accepted], dtype=torch.float)
    assert 0 < (accepted > 0).float().mean() < 1
    return torch.tensor([d.tokens for d in decoded])


@pytest.mark.parametrize("mode", ["greedy", "probabilistic"])
@pytest.mark.parametrize("near", [False, True], ids=["eagle-draft", "near-draft"])
def test_speculative_sampling_loop_is_lossless(small, mode, near):
    target, drafter = small
    s = Sampling(1.0, 0.9, mode)
    tokens = decode_copies(target, NearDrafter(target) if near else drafter, s)
    exact = exact_marginals(target, s, 3)
    for i in (1, 2):   # token 0 is the prefill's own sample; 1 and 2 come from speculative rounds
        assert chi_square_p_value(tokens[:, i], exact[i]) > ALPHA, f"token {i}"
    assert exact[1].max() < 0.5 and (exact[1] > 0.05).sum() >= 4        # a test with something to find


@pytest.mark.parametrize("mode", ["greedy", "probabilistic"])
def test_speculative_sampling_loop_with_a_wrong_residual_fails(small, mode, monkeypatch):
    """The random draft is rejected most of the time: the replacement decides the distribution."""
    target, drafter = small
    s = Sampling(1.0, 0.9, mode)
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    tokens = decode_copies(target, drafter, s, n=2)
    assert chi_square_p_value(tokens[:, 1], exact_marginals(target, s, 2)[1]) < ALPHA


def test_sampled_decoding_is_seeded_and_independent_of_the_batch(small):
    target, drafter = small
    s = Sampling(0.8, 1.0, "probabilistic")
    prompts, seeds = [PROMPT, [2, 7], PROMPT[:3]], [11, 12, 13]
    together = sampled_decode_many(target, drafter, prompts, 12, 3, set(), s, seeds)
    alone = [sampled_decode_many(target, drafter, [p], 12, 3, set(), s, [x])[0] for p, x in zip(prompts, seeds)]
    assert together == alone
    assert together == sampled_decode_many(target, drafter, prompts, 12, 3, set(), s, seeds)
    other = sampled_decode_many(target, drafter, prompts, 12, 3, set(), s, [21, 22, 23])
    assert [d.tokens for d in other] != [d.tokens for d in together]


def test_probabilistic_proposals_follow_the_draft_distribution(small):
    """The drafter's q [B, k, V] is its softmax at the temperature over the draft vocabulary (zero
    elsewhere) and the draft token of step 1 is a draw of it."""
    target, drafter = small
    caches = [target.new_cache() for _ in range(2)]
    prefill = target.forward_many([torch.tensor(PROMPT), torch.tensor(PROMPT[:2])], caches)
    auxes, tokens = [a for a, _ in prefill], [PROMPT + [0], PROMPT[:2] + [9]]
    u = torch.rand(2, 3, generator=torch.Generator().manual_seed(1))
    ids, q = drafter.propose_many(auxes, tokens, 3, Sampling(0.7, 1.0, "probabilistic"), u)
    assert q.shape == (2, 3, V)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3))
    assert (q[..., ~drafter.draft.t2d] == 0).all()
    assert [row[0] for row in ids] == draw(q[:, 0], u[:, 0]).tolist()
    greedy = drafter.propose_many(auxes, tokens, 3)
    assert greedy == drafter.propose_many(auxes, tokens, 3, Sampling(0.7, 1.0, "greedy"), u)
