"""Reference speculative decoding with our own target forward and an EAGLE-3 draft: per round k drafts verified in
one target forward, greedily (exactly the target's greedy output) or by the engines' rule above T = 0."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from eagle3.models.incremental import IncrementalTarget, KVPool, LayerPass, PassLayout, SequenceCache
from eagle3.sampling import Sampling, draft_probs, draw, sample, target_probs, uniforms, verify


class Drafter:
    """Proposes k tokens with the draft as training-time test unrolls it, the chain from the last row; verified rows'
    step-0 keys stay in a draft cache per sequence (chain keys at m-1+j, cut back after), so step 0 runs on new rows."""

    def __init__(self, draft, embed: torch.Tensor, media_pad: int | None = None):
        self.draft, self.embed = draft, embed
        self.media_pad = media_pad   # SGLang's rule: the prompt's media pads read the target's vision rows
        self.pool = KVPool(len(draft.layers))

    def new_cache(self, rows: torch.Tensor | None = None) -> SequenceCache:
        """An empty draft cache for one sequence (a slot of the pool, freed when dropped); `rows`: the target's vision
        rows [M, H] of its prompt's media pads, read under SGLang's rule."""
        return SequenceCache(self.pool, rows if self.media_pad is not None else None)

    @torch.no_grad()
    def propose_many(self, auxes: list[torch.Tensor], tokens: list[list[int]], k: int,
                     sampling: Sampling | None = None, u: torch.Tensor | None = None,
                     caches: list[SequenceCache] | None = None):
        """auxes[i] [m_i, 3H], tokens[i] = x_0..x_{m_i} -> k target ids per sequence (argmaxes, or with a probabilistic
        `sampling` draws with uniforms u [B, k], then also q [B, k, V_target]); caches[i] kept across rounds."""
        probabilistic = sampling is not None and not sampling.greedy and sampling.draft == "probabilistic"
        caches = [self.new_cache() for _ in auxes] if caches is None else caches
        h = self._step0(auxes, tokens, caches)                               # [B, H] the last rows
        rows = [c.length for c in caches]                                    # m_i step-0 rows
        proposed, qs = [], []
        for step in range(1, k + 1):
            logits = self.draft.lm_head(self.draft.head_input(h))            # [B, V_d]
            if probabilistic:
                qs.append(draft_probs(logits, sampling.temperature))
                best = draw(qs[-1], u[:, step - 1].to(h.device))
            else:
                best = logits.argmax(-1)                                     # [B] draft ids
            proposed.append(best + self.draft.d2t[best])                    # [B] target ids
            if step < k:                                                     # chain step `step`
                h = self._pass(h, self.embed[proposed[-1]], caches, [1] * len(caches))
        for cache, m in zip(caches, rows):
            cache.length = m                                                 # drop the chain's keys
        ids = torch.stack(proposed, 1)                                       # [B, k]
        if not probabilistic:
            return ids.tolist()
        q = torch.stack(qs, 1)                                               # [B, k, V_d]
        full = q.new_zeros(*q.shape[:2], self.embed.shape[0])
        targets = torch.arange(q.shape[-1], device=q.device) + self.draft.d2t
        return ids.tolist(), full.index_copy_(-1, targets, q)

    def _step0(self, auxes: list[torch.Tensor], tokens: list[list[int]], caches: list[SequenceCache]) -> torch.Tensor:
        """Step 0 of the rows each cache lacks, at least the last -> [B, H] each sequence's last-row output."""
        for cache, aux in zip(caches, auxes):
            cache.length = min(cache.length, aux.shape[0] - 1)
        starts = [c.length for c in caches]
        lengths = [a.shape[0] - s for a, s in zip(auxes, starts)]
        aux = torch.cat([a[s:] for a, s in zip(auxes, starts)])              # [N, 3H] the new rows
        ids = [x for t, s, n in zip(tokens, starts, lengths) for x in t[s + 1:s + n + 1]]   # row t reads x[t+1]
        emb = self._media(self.embed[torch.tensor(ids, device=self.embed.device)], tokens, starts, lengths, caches)
        h = self._pass(self.draft.project(aux), emb, caches, lengths)      # [N, H]
        return h[torch.tensor(list(accumulate(lengths)), device=h.device) - 1]

    def _media(self, emb: torch.Tensor, tokens: list[list[int]], starts: list[int], lengths: list[int],
               caches: list[SequenceCache]) -> torch.Tensor:
        """emb [N, H] of the rows' tokens x[s+1 .. s+n] with each of the first M media pads of a sequence (its prompt's)
        replaced by its cache's vision row, as SGLang's draft reads them; unchanged without rows."""
        offset = 0
        for t, s, n, cache in zip(tokens, starts, lengths, caches):
            if cache.rows is not None and len(cache.rows):
                ids = torch.tensor(t[:s + n + 1])
                slot = (ids == self.media_pad).cumsum(0) - 1                 # each pad's row
                at = torch.arange(s + 1, s + n + 1)
                at = at[(ids[at] == self.media_pad) & (slot[at] < len(cache.rows))]
                emb[offset + at - s - 1] = cache.rows[slot[at]].to(emb.device, emb.dtype)
            offset += n
        return emb

    def _pass(self, h: torch.Tensor, emb: torch.Tensor, caches: list[SequenceCache],
              lengths: list[int]) -> torch.Tensor:
        """One draft step on the next lengths[i] rows of each sequence, packed: h, emb [N, H] -> [N, H];
        row r is at RoPE position r and sees its cache's keys 0..r."""
        layout = PassLayout(self.pool, caches, lengths, self.embed.device)
        passes = [LayerPass(self.pool, i, layout) for i in range(len(self.draft.layers))]
        out = self.draft.step(h, emb, layout.positions, passes, None, layout.cu)
        for cache, n in zip(caches, lengths):
            cache.length += n
        return out


@dataclass
class Decoded:
    tokens: list[int]                                      # generated tokens (after the prompt)
    accepted: list[int] = field(default_factory=list)      # tokens gained per target forward
    drafts_accepted: list[int] = field(default_factory=list)  # leading draft tokens the target agreed with, per round
    depths: list[int] = field(default_factory=list)        # tokens in the context as each round's draft proposes

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")


def _finish(tokens: list[int], max_new: int, stop: set[int]) -> tuple[list[int], bool]:
    """Cut at max_new tokens or just after the first stop token."""
    for i, t in enumerate(tokens[:max_new]):
        if t in stop:
            return tokens[:i + 1], True
    return tokens[:max_new], len(tokens) >= max_new


def greedy_decode_many(target: IncrementalTarget, prompts: list[list[int]], max_new: int,
                       stop: set[int] = frozenset(), media: list[list] | None = None) -> list[Decoded]:
    """The target's own greedy decoding of several prompts, each step's forward batched over those still decoding;
    `media`: each prompt's MediaItems, for its media pads."""
    caches = [target.new_cache(m) for m in media or [()] * len(prompts)]
    feed = [torch.tensor(p) for p in prompts]             # each sequence's tokens the cache lacks
    outs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    while active:
        finals = target.forward_many([feed[i] for i in active], [caches[i] for i in active])
        chosen = target.greedy(torch.cat([final[-1:] for _, final in finals])).tolist()   # [B]
        for i, token in zip(active, chosen):
            outs[i].append(token)
            feed[i] = torch.tensor([token])
        active = [i for i in active if not _finish(outs[i], max_new, stop)[1]]
    return [Decoded(_finish(out, max_new, stop)[0], accepted=[1] * len(out)) for out in outs]


class _Chain:
    """One prompt under speculative decoding: its tokens x_0..x_m, the target's cache and aux states of
    x_0..x_{m-1} (the draft reads the newest as an embedding), the draft's cache."""

    def __init__(self, prompt: list[int], cache, aux: torch.Tensor, first: int, draft_cache):
        self.tokens, self.cache, self.aux, self.draft_cache = list(prompt) + [first], cache, aux, draft_cache
        self.result = Decoded([first])                   # the prefill gives one token, no draft

    def done(self, max_new: int, stop: set[int]) -> bool:
        return _finish(self.result.tokens, max_new, stop)[1]

    def take(self, drafts: list[int], a: int, token: int, new_aux: torch.Tensor) -> None:
        """Keep the first `a` drafts and the target's `token` after them."""
        gained = drafts[:a] + [token]
        self.result.depths.append(len(self.tokens))      # prompt + generated: where the round started
        self.cache.length = min(self.cache.length, len(self.tokens) + a)   # x_0..x_m and the accepted drafts
        self.aux = torch.cat([self.aux, new_aux[:a + 1]])
        self.tokens += gained
        self.result.tokens += gained
        self.result.accepted.append(len(gained))
        self.result.drafts_accepted.append(a)            # before any cut: what verification said

    def finish(self, max_new: int, stop: set[int]) -> Decoded:
        result = self.result
        result.tokens = _finish(result.tokens, max_new, stop)[0]
        if result.accepted:                              # the last round may have been cut short
            result.accepted[-1] -= sum(result.accepted) + 1 - len(result.tokens)
        return result


def _propose(drafter, chains: list[_Chain], k: int, *sampling):
    """The drafter's proposals for the chains (propose_many), through their draft caches."""
    return drafter.propose_many([c.aux for c in chains], [c.tokens for c in chains], k, *sampling,
                                caches=[c.draft_cache for c in chains])


def speculative_decode_many(target: IncrementalTarget, drafter: Drafter, prompts: list[list[int]],
                            max_new: int, k: int, stop: set[int] = frozenset(),
                            media: list[list] | None = None) -> list[Decoded]:
    """Greedy chain speculative decoding of several prompts; the output is the target's greedy output."""
    def round_(live: list[int], active: list[_Chain]) -> None:
        drafts = _propose(drafter, active, k)
        outs = _verify_pass(target, active, drafts)
        verified = target.greedy(torch.cat([final for _, final in outs])).view(len(active), k + 1).tolist()
        for chain, d, v, (new_aux, _) in zip(active, drafts, verified, outs):   # v[j]: the target's token after d[:j]
            a = next((j for j, (x, y) in enumerate(zip(d, v)) if x != y), len(d))   # the agreeing prefix
            chain.take(d, a, v[a], new_aux)
    return _decode(target, drafter, prompts, max_new, stop, lambda final: target.greedy(final).tolist(), round_, media)


def sampled_decode_many(target: IncrementalTarget, drafter: Drafter, prompts: list[list[int]], max_new: int,
                        k: int, stop: set[int], sampling: Sampling, seeds: list[int],
                        media: list[list] | None = None) -> list[Decoded]:
    """Speculative sampling at sampling.temperature > 0, distributed as the target's own; prompt i draws its uniforms
    from its own generator (seeds[i]), so its tokens do not depend on the batch."""
    generators = [torch.Generator().manual_seed(s) for s in seeds]

    def round_(live: list[int], active: list[_Chain]) -> None:
        u = uniforms([generators[i] for i in live], 2 * k + 1).to(target.device)   # [B, 2k+1]
        proposal = _propose(drafter, active, k, sampling, u[:, :k])
        drafts, q = proposal if sampling.draft == "probabilistic" else (proposal, None)
        outs = _verify_pass(target, active, drafts)
        logits = target.logits(torch.cat([final for _, final in outs])).view(len(active), k + 1, -1)
        p = target_probs(logits, sampling.temperature, sampling.top_p)        # [B, k+1, V]
        a, token = verify(torch.tensor(drafts, device=p.device), p, q, u[:, k:2 * k], u[:, 2 * k])
        for chain, d, n, t, (new_aux, _) in zip(active, drafts, a.tolist(), token.tolist(), outs):
            chain.take(d, n, t, new_aux)
    first = lambda final: sample(target.logits(final), sampling.temperature, sampling.top_p, generators)  # noqa: E731
    return _decode(target, drafter, prompts, max_new, stop, first, round_, media)


def _decode(target: IncrementalTarget, drafter: Drafter, prompts: list[list[int]], max_new: int, stop: set[int],
            first: Callable, round_: Callable, media: list[list] | None = None) -> list[Decoded]:
    """Prefill (`media`: each prompt's MediaItems), first(final states [B, H]) the first token, then round_(live
    indices, chains) until all are done."""
    caches = [target.new_cache(m) for m in media or [()] * len(prompts)]
    rows = [c.rows for c in caches]   # the target's forward consumes them: the drafter keeps its own reference
    prefill = target.forward_many([torch.tensor(p) for p in prompts], caches)
    firsts = first(torch.cat([final[-1:] for _, final in prefill]))
    chains = [_Chain(p, c, aux, t, drafter.new_cache(r))
              for p, c, (aux, _), t, r in zip(prompts, caches, prefill, firsts, rows)]
    live = [i for i, c in enumerate(chains) if not c.done(max_new, stop)]
    while live:
        round_(live, [chains[i] for i in live])
        live = [i for i in live if not chains[i].done(max_new, stop)]
    return [c.finish(max_new, stop) for c in chains]


def _verify_pass(target: IncrementalTarget, chains: list[_Chain], drafts: list[list[int]]) -> list:
    """The target's forward over each chain's newest token and its drafts."""
    return target.forward_many([torch.tensor([c.tokens[-1]] + d) for c, d in zip(chains, drafts)],
                               [c.cache for c in chains])
