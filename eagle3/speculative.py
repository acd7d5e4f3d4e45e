"""Reference greedy speculative decoding with our own target forward and an EAGLE-3 draft.

Chain drafting: each round the draft proposes K tokens from the last accepted position, the
target verifies them in one forward, the longest agreeing prefix plus the target's own next token
is kept. The output is exactly the target's greedy decoding (lossless); the accepted length per
round (tokens gained per target forward) is what the acceptance estimate of SPEC §7 predicts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle3.target.incremental import IncrementalTarget
from kernels.reference import ttt_attention


class Drafter:
    """Proposes K tokens with the draft, as training-time test unrolls it: row t of step 0 reads
    fc(aux[t]) and the embedding of x[t+1]; the chain continues from the last row."""

    def __init__(self, draft, embed: torch.Tensor):
        self.draft, self.embed = draft, embed

    @torch.no_grad()
    def propose(self, aux: torch.Tensor, tokens: torch.Tensor, k: int) -> list[int]:
        """aux [m, 3H] of positions 0..m-1; tokens [m+1] = x_0..x_m -> k target token ids.

        All rows are recomputed every round (a reference, not a fast path): at step j >= 1 a row
        sees only the step-0 keys and its own chain, so the other rows cannot change the last one."""
        m = aux.shape[0]
        device = aux.device
        next_tokens = tokens[1:m + 1].clone()            # row t reads x[t+1] at step 0
        positions = torch.arange(m, device=device)
        cu = torch.tensor([0, m], dtype=torch.int32, device=device)
        h = self.draft.project(aux)
        caches = [[] for _ in self.draft.layers]
        proposed = []
        for step in range(k):
            h = self.draft.step(h, self.embed[next_tokens], positions + step, caches, ttt_attention, cu)
            logits = self.draft.lm_head(self.draft.head_input(h[-1:]))
            best = int(logits.argmax(-1))
            proposed.append(best + int(self.draft.d2t[best]))
            next_tokens = torch.cat([next_tokens[1:], next_tokens.new_tensor([proposed[-1]])])
        return proposed


@dataclass
class Decoded:
    tokens: list[int]                                      # generated tokens (after the prompt)
    accepted: list[int] = field(default_factory=list)      # tokens gained per target forward

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
    cache = target.new_cache()
    _, final = target.forward(torch.tensor(prompt), cache)
    out = [int(target.greedy(final[-1:]))]
    while not _finish(out, max_new, stop)[1]:
        _, final = target.forward(torch.tensor(out[-1:]), cache)
        out.append(int(target.greedy(final)))
    return Decoded(_finish(out, max_new, stop)[0], accepted=[1] * len(out))


def speculative_decode(target: IncrementalTarget, drafter: Drafter, prompt: list[int], max_new: int,
                       k: int, stop: set[int] = frozenset()) -> Decoded:
    cache = target.new_cache()
    aux, final = target.forward(torch.tensor(prompt), cache)
    tokens = list(prompt) + [int(target.greedy(final[-1:]))]
    result = Decoded(tokens[len(prompt):])                # the prefill gives one token, no draft
    while not _finish(result.tokens, max_new, stop)[1]:
        drafts = drafter.propose(aux, torch.tensor(tokens, device=aux.device), k)
        new_aux, final = target.forward(torch.tensor([tokens[-1]] + drafts), cache)
        verified = target.greedy(final).tolist()          # verified[j]: target's token after drafts[:j]
        a = 0
        while a < k and drafts[a] == verified[a]:
            a += 1
        gained = drafts[:a] + [verified[a]]
        IncrementalTarget.crop(cache, len(tokens) + a)   # keep x_0..x_m and the accepted drafts
        aux = torch.cat([aux, new_aux[:a + 1]])
        tokens += gained
        result.tokens += gained
        result.accepted.append(len(gained))
    result.tokens = _finish(result.tokens, max_new, stop)[0]
    result.accepted[-1] -= sum(result.accepted) + 1 - len(result.tokens)  # the last round was cut short
    return result
