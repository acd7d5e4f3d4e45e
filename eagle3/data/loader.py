"""Token-budget micro-batches of packed sequences, disjoint per rank, deterministic by seed and
epoch, read ahead in a background thread."""
from __future__ import annotations

import functools
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator

import torch

from eagle3.data.batch import Batch
from eagle3.data.shards import SeqRef, ShardReader


def split_holdout(refs: list[SeqRef], fraction: float) -> tuple[list[SeqRef], list[SeqRef]]:
    """(train, eval): held out by a fixed hash of the index, whatever the ranks or shard sizes."""
    if fraction <= 0:
        return refs, []
    held = [r for r in refs if (r.index * 2654435761 % 2**32) / 2**32 < fraction] or refs[-1:]
    keep = {r.index for r in held}
    return [r for r in refs if r.index not in keep], held


def pack(refs: list[SeqRef], budget: int, seed: int | None = None, epoch: int = 0) -> list[list[SeqRef]]:
    """Micro-batches of whole sequences with at most `budget` tokens; shuffled by (seed, epoch)."""
    order = list(refs)
    if seed is not None:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
    batches, tokens = [], 0
    for ref in order:
        if not batches or tokens + ref.length > budget:
            batches.append([])
            tokens = 0
        batches[-1].append(ref)
        tokens += ref.length
    return batches


class Prefetcher:
    """Reads micro-batches in order in a background thread, `prepare`d and pinned on CUDA; a `lockstep` reader in
    the caller's thread (two NCCL communicators driven from two threads can wait on each other across ranks);
    `rows`: the rows of each packed micro-batch to read (`ShardReader.read`; context parallel, shards only)."""

    def __init__(self, reader: ShardReader, batches: list[list[SeqRef]], depth: int, pin: bool,
                 prepare: Callable[[Batch], Batch] | None = None, together: int = 1, rows=None):
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._read = functools.partial(reader.read_many, rows=rows)
        # inline, a step's `together` micro-batches are read in one collective and used at once: no pinning
        self._inline = self._produce(batches, False, prepare, together) if reader.lockstep else None
        if self._inline is None:
            self._thread = threading.Thread(target=self._work, args=(batches, pin, prepare), daemon=True)
            self._thread.start()

    def _produce(self, batches, pin, prepare, together: int = 1):
        batches = iter(batches)
        while chunk := list(itertools.islice(batches, together)):
            for batch in self._read(chunk, pin):
                if prepare is not None:
                    batch = prepare(batch)
                yield batch.pin_memory() if pin else batch   # what the reader did not pin already

    def _work(self, batches, pin, prepare):
        try:
            for batch in self._produce(batches, pin, prepare):
                self._queue.put(batch)
            self._queue.put(StopIteration())   # the end, for a consumer that asks once more (one_ahead)
        except Exception as e:  # surfaced in the consumer
            self._queue.put(e)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self._inline is not None:
            return next(self._inline)
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item


def one_ahead(items: Iterable, start: Callable) -> Iterator:
    """start(x) for each x, start(x[n+1]) called before start(x[n]) is handed over: its copy overlaps x[n]'s use."""
    pending = None
    for item in items:
        pending, current = start(item), pending
        if current is not None:
            yield current
    if pending is not None:
        yield pending
