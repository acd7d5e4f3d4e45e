"""Reference greedy speculative decoding with our own target forward and an EAGLE-3 draft.

Chain drafting: each round the draft proposes K tokens from the last accepted position, the
target verifies them in one forward, the longest agreeing prefix plus the target's own next token
is kept. The output is exactly the target's greedy decoding (lossless); the accepted length per
round (tokens gained per target forward) is what the acceptance estimate of eagle3.ttt predicts.
The `_many` variants decode several prompts at once (one draft pass and one target forward per
round for all of them): the same loops, fewer kernel launches, for measuring on many prompts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from eagle3.draft import Rows
from eagle3.ops import positions_from_cu_seqlens
from eagle3.models.incremental import IncrementalTarget
from kernels.reference import ttt_attention


class Drafter:
    """Proposes K tokens with the draft, as training-time test unrolls it: row t of step 0 reads
    fc(aux[t]) and the embedding of x[t+1]; the chain continues from the last row."""

    def __init__(self, draft, embed: torch.Tensor):
        self.draft, self.embed = draft, embed

    def propose(self, aux: torch.Tensor, tokens: torch.Tensor, k: int) -> list[int]:
        """aux [m, 3H] of positions 0..m-1; tokens [m+1] = x_0..x_m -> k target token ids."""
        return self.propose_many([aux], [tokens.tolist()], k)[0]

    @torch.no_grad()
    def propose_many(self, auxes: list[torch.Tensor], tokens: list[list[int]], k: int) -> list[list[int]]:
        """Several sequences packed into one draft pass (attention never crosses a sequence):
        auxes[i] [m_i, 3H], tokens[i] = x_0..x_{m_i} -> k target token ids per sequence.

        Step 0 runs every row (each row's step-0 keys are what later queries attend to); steps
        >= 1 run only each sequence's last row: at step j a query sees the step-0 keys and its own
        chain, so the other rows cannot change it. Draft tokens stay on the device until the one
        transfer at the end (a reference, not a fast path: step 0 recomputes every row each round)."""
        if k < 1:
            raise ValueError(f"k = {k}: a round drafts at least one token")
        device = auxes[0].device
        bounds = list(accumulate((a.shape[0] for a in auxes), initial=0))
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        positions = positions_from_cu_seqlens(cu, bounds[-1])                # [T]
        last = cu[1:].long() - 1                                             # [B] each sequence's last row
        row_tokens = torch.tensor([x for t, a in zip(tokens, auxes) for x in t[1:a.shape[0] + 1]], device=device)
        proposed = []

        def next_inputs(step: int, h: torch.Tensor):
            if step == 0:                                                    # row t reads x[t+1]
                return h, self.embed[row_tokens], positions, None
            h = h[last] if step == 1 else h                                  # [B, H] each chain's state
            best = self.draft.lm_head(self.draft.head_input(h)).argmax(-1)  # [B] draft ids
            proposed.append(best + self.draft.d2t[best])                    # [B] target ids
            if step == k:
                return None
            return h, self.embed[proposed[-1]], positions[last] + step, Rows(bounds[-1], computed=last)

        for _ in self.draft.unroll(torch.cat(auxes), ttt_attention, cu, next_inputs):
            pass                                                             # next_inputs makes the proposals
        return torch.stack(proposed, 1).tolist()


@dataclass
class Decoded:
    tokens: list[int]                                      # generated tokens (after the prompt)
    accepted: list[int] = field(default_factory=list)      # tokens gained per target forward
    drafts_accepted: list[int] = field(default_factory=list)  # leading draft tokens the target agreed with, per round

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")


def _finish(tokens: list[int], max_new: int, stop: set[int]) -> tuple[list[int], bool]:
    """Cut at max_new tokens or just after the first stop token."""
    for i, t in enumerate(tokens[:max_new]):
        if t in stop:
            return tokens[:i + 1], True
    return tokens[:max_new], len(tokens) >= max_new


def greedy_decode(target: IncrementalTarget, prompt: list[int], max_new: int,
                  stop: set[int] = frozenset()) -> Decoded:
    return greedy_decode_many(target, [prompt], max_new, stop)[0]


def greedy_decode_many(target: IncrementalTarget, prompts: list[list[int]], max_new: int,
                       stop: set[int] = frozenset()) -> list[Decoded]:
    """The target's own greedy decoding of several prompts, each step's forward batched over the
    prompts still decoding (one KV pool: attention for all of them in one call per layer)."""
    caches = [target.new_cache() for _ in prompts]
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
    """One prompt under speculative decoding: its tokens x_0..x_m, the target's cache and aux states
    of x_0..x_{m-1} (the newest token has none yet: the draft reads it as an embedding)."""

    def __init__(self, prompt: list[int], cache: list[dict], aux: torch.Tensor, first: int):
        self.tokens, self.cache, self.aux = list(prompt) + [first], cache, aux
        self.result = Decoded([first])                   # the prefill gives one token, no draft

    def done(self, max_new: int, stop: set[int]) -> bool:
        return _finish(self.result.tokens, max_new, stop)[1]

    def accept(self, drafts: list[int], verified: list[int], new_aux: torch.Tensor) -> None:
        """verified[j]: the target's token after drafts[:j]; keep the agreeing prefix + its token."""
        a = 0
        while a < len(drafts) and drafts[a] == verified[a]:
            a += 1
        gained = drafts[:a] + [verified[a]]
        IncrementalTarget.crop(self.cache, len(self.tokens) + a)   # keep x_0..x_m and the accepted drafts
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


def speculative_decode(target: IncrementalTarget, drafter: Drafter, prompt: list[int], max_new: int,
                       k: int, stop: set[int] = frozenset()) -> Decoded:
    return speculative_decode_many(target, drafter, [prompt], max_new, k, stop)[0]


def speculative_decode_many(target: IncrementalTarget, drafter: Drafter, prompts: list[list[int]],
                            max_new: int, k: int, stop: set[int] = frozenset()) -> list[Decoded]:
    """Greedy chain speculative decoding of several prompts, each round's drafting and verification
    batched over the prompts still decoding; the output is the target's greedy output (lossless)."""
    caches = [target.new_cache() for _ in prompts]
    prefill = target.forward_many([torch.tensor(p) for p in prompts], caches)
    firsts = target.greedy(torch.cat([final[-1:] for _, final in prefill])).tolist()
    chains = [_Chain(p, c, aux, t) for p, c, (aux, _), t in zip(prompts, caches, prefill, firsts)]
    active = [c for c in chains if not c.done(max_new, stop)]
    while active:
        drafts = drafter.propose_many([c.aux for c in active], [c.tokens for c in active], k)
        outs = target.forward_many([torch.tensor([c.tokens[-1]] + d) for c, d in zip(active, drafts)],
                                   [c.cache for c in active])
        verified = target.greedy(torch.cat([final for _, final in outs])).view(len(active), k + 1).tolist()
        for chain, d, v, (new_aux, _) in zip(active, drafts, verified, outs):
            chain.accept(d, v, new_aux)
        active = [c for c in active if not c.done(max_new, stop)]
    return [c.finish(max_new, stop) for c in chains]
