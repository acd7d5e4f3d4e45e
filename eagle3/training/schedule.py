"""The learning-rate `Schedule` and the data `Plan`: pure functions of the step, so a resumed run continues alike."""
from __future__ import annotations

import math

from eagle3.data.loader import pack
from eagle3.errors import TrainError


class Schedule:
    """LambdaLR factor: linear warmup, then down to min_ratio at the last step by a cosine, or (`wsd`)
    constant until the last `decay_fraction` of the steps and linearly down over those."""

    def __init__(self, warmup: int, total: int, min_ratio: float, kind: str = "cosine", decay_fraction: float = 0.2):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        self.kind, self.decay_fraction = kind, decay_fraction

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "wsd":   # the decay starts after warmup, however large decay_fraction is
            start = max(self.warmup, self.total - max(1, round(self.decay_fraction * self.total)))
            progress = min(1.0, max(0, step - start) / max(1, self.total - start))
            return 1 - (1 - self.min_ratio) * progress
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Plan:
    """Which micro-batches rank r reads at step s: `s * world * accum + a * world + r` of the epoch's packing."""

    def __init__(self, refs, budget: int, seed: int, world: int, accum: int, max_steps: int, epochs: int,
                 data: str = "the data"):
        self.refs, self.budget, self.seed, self.per_step = refs, budget, seed, world * accum
        self.world, self.accum = world, accum
        self._epochs, self._steps = {}, {}   # the latest epoch's packing; steps per epoch
        if len(self.epoch(0)) < self.per_step:
            raise TrainError(f"{data}: its training split ({len(refs)} sequences, {sum(r.length for r in refs)} "
                             f"tokens) packs into {len(self.epoch(0))} micro-batches of train.batch_tokens = "
                             f"{budget}, fewer than one optimizer step needs (world size {world} x train.grad_accum "
                             f"{accum}); use more data, or a smaller train.batch_tokens, train.grad_accum or "
                             "train.eval_fraction")
        self.total = max_steps or sum(self.steps_in(e) for e in range(epochs))

    def epoch(self, e: int) -> list:
        if e not in self._epochs:
            self._epochs = {e: pack(self.refs, self.budget, self.seed, e)}
        return self._epochs[e]

    def steps_in(self, e: int) -> int:
        if e not in self._steps:
            self._steps[e] = len(self.epoch(e)) // self.per_step
        return self._steps[e]

    def locate(self, step: int) -> tuple[int, int]:
        e = 0
        while step >= self.steps_in(e):
            step -= self.steps_in(e)
            e += 1
        return e, step

    def rank_batches(self, start: int, rank: int):
        for step in range(start, self.total):
            e, j = self.locate(step)
            batches = self.epoch(e)
            for a in range(self.accum):
                yield batches[j * self.per_step + a * self.world + rank]
