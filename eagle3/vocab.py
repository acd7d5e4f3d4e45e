"""The draft vocabulary: the most frequent loss-masked target ids, sorted. `d2t[i]` is the offset from
draft id i to its target id; `t2d[j]` says whether target id j is in the draft vocabulary."""
from __future__ import annotations

from collections import Counter

import torch

from eagle3.errors import Eagle3Error


class VocabError(Eagle3Error):
    pass


def build_vocab(counts: Counter, target_vocab: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top `draft_vocab` ids by count (ties: lower id first), topped up with the lowest unseen ids."""
    if not 0 < draft_vocab <= target_vocab:
        raise VocabError(f"vocab.draft_vocab_size = {draft_vocab}; expected 1..{target_vocab} "
                         "(the target's vocab_size)")
    if bad := [i for i in counts if not 0 <= i < target_vocab]:
        raise VocabError(f"token ids {bad[:5]} are outside the target vocabulary of {target_vocab}")
    ranked = sorted(counts, key=lambda i: (-counts[i], i))[:draft_vocab]
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[ranked] = True
    if missing := draft_vocab - len(ranked):
        t2d[(~t2d).nonzero().flatten()[:missing]] = True
    return t2d.nonzero().flatten() - torch.arange(draft_vocab), t2d


def coverage(counts: Counter, t2d: torch.Tensor) -> float:
    """Share of the counted tokens inside the draft vocabulary: no draft proposes the others."""
    return sum(counts[i] for i in t2d.nonzero().flatten().tolist()) / max(1, sum(counts.values()))


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, where: str = "vocab") -> None:
    """The invariant both engines rely on: arange(draft_vocab) + d2t == nonzero(t2d) (so sorted, unique, in range)."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise VocabError(f"{where}: d2t must be int64 and t2d bool (got {d2t.dtype}, {t2d.dtype})")
    if not torch.equal(torch.arange(d2t.numel()) + d2t.cpu(), t2d.cpu().nonzero().flatten()):
        raise VocabError(f"{where}: arange(draft_vocab) + d2t != nonzero(t2d)")
