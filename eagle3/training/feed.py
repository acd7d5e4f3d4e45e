"""This rank's micro-batches on their way to the step: read ahead, prepared on the host, copied to the device."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import torch

from eagle3.data.batch import Batch, RowPlan, pad, split, window
from eagle3.data.loader import Prefetcher, one_ahead
from eagle3.ttt import loss_denominator, plan_rows


class Feed:
    """`t2d`: the draft vocabulary's map, on the host; `depth`: debug.prefetch; `overlap`: copy on a side stream;
    `pad_to`: training batches `pad`ded to (rows, longest sequence), for CUDA graphs; `share`: (ranks, this rank's
    index, halo) of a context-parallel `split` of each batch, only whose rows are read; `rank`: the data-parallel."""

    def __init__(self, reader, plan, rank: int, device: torch.device, dtype: torch.dtype, t2d: torch.Tensor,
                 unroll, eval_unroll, depth: int, overlap: bool, pad_to: tuple[int, int] | None = None,
                 share: tuple[int, int, int] | None = None):
        self.reader, self.plan, self.rank, self.share = reader, plan, rank, share
        self.rows = None if share is None else functools.partial(window, **dict(zip(("parts", "index", "halo"), share)))
        self.device, self.dtype, self.cuda = device, dtype, device.type == "cuda"
        self.t2d, self.unroll, self.eval_unroll = t2d, unroll, eval_unroll
        self.depth, self.overlap, self.pad_to = depth, overlap, pad_to

    def prepare(self, batch: Batch, training: bool = True) -> Batch:
        """Host-side work the step would otherwise sync for: the row plan and the host sequence boundaries."""
        u = self.unroll if training else self.eval_unroll
        if self.share is not None:
            batch = split(batch, *self.share)
        if training and self.pad_to:   # a graph's step takes only the loss's denominator from the plan
            plan = RowPlan(u.steps, u.objective.rows, None, [], int(loss_denominator(batch, u.objective.rows)))
            return pad(dataclasses.replace(batch, plan=plan), *self.pad_to)
        plan = plan_rows(batch, u.steps, self.t2d, u.skip_dead_rows, u.objective.rows)
        return dataclasses.replace(batch, plan=plan, cu_seqlens_host=batch.cu_seqlens.to(torch.int32))

    def read(self, refs) -> Batch | None:
        """One micro-batch as this rank reads it (context parallel: its share's rows only)."""
        return self.reader.read(refs, rows=self.rows)

    def prepared(self, batch: Batch) -> Batch:
        return batch if batch.plan is not None else self.prepare(batch)

    def batches(self, start: int) -> Iterator[Batch]:
        """This rank's micro-batches from step `start` on, read ahead and `prepared` (their `rows` this rank's); with
        `overlap` each copied to the device one ahead on a stream of its own (`on_device` waits for it), else as they
        come (online)."""
        batches = Prefetcher(self.reader, self.plan.rank_batches(start, self.rank), self.depth, pin=self.cuda,
                             prepare=self.prepare if self.cuda else None, together=self.plan.accum, rows=self.rows)
        if not self.overlap:
            return map(self.prepared, batches)
        stream = torch.cuda.Stream(self.device)

        def start_copy(batch: Batch) -> Batch:
            with torch.cuda.stream(stream):
                moved = self.on_device(self.prepared(batch))
                return dataclasses.replace(moved, ready=stream.record_event())

        return one_ahead(batches, start_copy)

    def on_device(self, batch: Batch) -> Batch:
        """The batch on the device: copied here, or its copy waited for by this stream, which now owns it."""
        if batch.ready is None:
            return batch.to(self.device, self.dtype)
        here = torch.cuda.current_stream(self.device)
        here.wait_event(batch.ready)
        for t in batch.device_tensors():   # allocated on the copy stream, used and freed on this one
            t.record_stream(here)
        return dataclasses.replace(batch, ready=None)
