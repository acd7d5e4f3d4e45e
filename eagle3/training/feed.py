"""This rank's micro-batches on their way to the step: read ahead in the plan's order, prepared on the
host (the row plan, the sequence boundaries) and copied to the training device while the work before
them computes."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from eagle3.data.batch import Batch
from eagle3.data.loader import Prefetcher, one_ahead
from eagle3.ttt import plan_rows


class Feed:
    """`reader`: the shards or the online target; `plan`: the data plan (its `accum` micro-batches a
    step); `t2d`: the draft vocabulary's map, on the host; `unroll`, `eval_unroll`: what the step's and
    evaluation's TTT unrolls make row plans for (`steps`, `skip_dead_rows`, `objective.rows`);
    `depth`: debug.prefetch; `overlap`: copy each micro-batch on a CUDA stream of its own while the
    work before it computes (on CUDA, offline)."""

    def __init__(self, reader, plan, rank: int, device: torch.device, dtype: torch.dtype, t2d: torch.Tensor,
                 unroll, eval_unroll, depth: int, overlap: bool):
        self.reader, self.plan, self.rank = reader, plan, rank
        self.device, self.dtype, self.cuda = device, dtype, device.type == "cuda"
        self.t2d, self.unroll, self.eval_unroll = t2d, unroll, eval_unroll
        self.depth, self.overlap = depth, overlap

    def prepare(self, batch: Batch, training: bool = True) -> Batch:
        """Host-side work on a batch read from the shards, done by the prefetch thread off the step's
        critical path: what the step would otherwise sync (or spend CPU time) to learn: the row
        plan (moved to the device with the batch) and the sequence boundaries (kept on the host)."""
        u = self.unroll if training else self.eval_unroll
        plan = plan_rows(batch, u.steps, self.t2d, u.skip_dead_rows, u.objective.rows)
        return dataclasses.replace(batch, plan=plan, cu_seqlens_host=batch.cu_seqlens.to(torch.int32))

    def prepared(self, batch: Batch) -> Batch:
        """The batch as `prepare` leaves it (the prefetcher's work, done here if it was not)."""
        return batch if batch.plan is not None else self.prepare(batch)

    def prefetcher(self, start: int) -> Prefetcher:
        """This rank's micro-batches from optimizer step `start` on, read ahead. On CUDA the prefetch
        thread also prepares them; on the CPU the step prepares its own, since a second thread
        doing tensor work there competes with the training for the same cores."""
        return Prefetcher(self.reader, self.plan.rank_batches(start, self.rank), self.depth,
                          pin=self.cuda, prepare=self.prepare if self.cuda else None, together=self.plan.accum)

    def batches(self, start: int) -> Iterator[Batch]:
        """The micro-batches of optimizer steps `start`.. on their way to the device, as the loop takes them."""
        return self.device_batches(self.prefetcher(start))

    def device_batches(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """The micro-batches on the training device, each copied (from pinned host memory, on a CUDA
        stream of its own) while the work before it computes: the next micro-batch's copy is started
        before the current one is handed over, and the compute stream waits for a copy only when the
        step takes that micro-batch (`on_device`). On the compute stream the copies ran in stream
        order with every SM idle: about 17 ms of a 0.9 s Kimi-size step. Device memory: the step's
        micro-batches and one more. Elsewhere, and for online readers, the batches as they come
        (pulling one ahead would move a staged target's collective read out of step with the other
        ranks; for the stream and resident placements the overlap is unmeasured, so left out)."""
        if not self.overlap:
            yield from batches
            return
        stream = torch.cuda.Stream(self.device)

        def start(batch: Batch) -> Batch:
            with torch.cuda.stream(stream):
                moved = self.on_device(self.prepared(batch))
                return dataclasses.replace(moved, ready=stream.record_event())

        yield from one_ahead(batches, start)

    def on_device(self, batch: Batch) -> Batch:
        """The batch on the training device: copied here, or (`device_batches`) its copy on the
        copy stream waited for by this stream, which from now on also owns its memory."""
        if batch.ready is None:
            return batch.to(self.device, self.dtype)
        here = torch.cuda.current_stream(self.device)
        here.wait_event(batch.ready)
        for t in batch.device_tensors():   # allocated on the copy stream, used and freed on this one
            t.record_stream(here)
        return dataclasses.replace(batch, ready=None)
