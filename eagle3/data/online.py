"""Online training's data (`train.source = "online"`): `OnlineReader`, a `ShardReader` over the records of
`data.path` whose hidden states the target makes as training reads them (a seed gives extract-then-train's batches)."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist

from eagle3.config import Config, ConfigError
from eagle3.data.batch import Batch
from eagle3.data.inputs import read_records
from eagle3.data.shards import SeqRef, shard_tensors
from eagle3.models.weights import Checkpoint
from eagle3.resolve import data_windows, data_workers
from eagle3.models.staged import StagedTarget
from eagle3.models.streaming import TargetRunner, past_positions
from eagle3.ops import TORCH_DTYPES


def stream_note(ckpt: Checkpoint, device: torch.device) -> str:
    """What the default `train.online_target = "stream"` costs against the placements that may fit."""
    room = (f"; this GPU has {torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB"
            if device.type == "cuda" else "")
    return (f"note: train.online_target = \"stream\" reads the target's {ckpt.text_bytes() / 1e9:.1f} GB of weights "
            f"({ckpt.dir}) for every micro-batch, 3-4x slower than \"resident\" (the whole target on each GPU{room}) "
            "or \"staged\" (1/N of it on each of a node's N GPUs); docs/training.md")


class OnlineReader:
    def __init__(self, cfg: Config, ckpt: Checkpoint, aux_layer_ids: list[int], device: torch.device):
        d = cfg.data
        main = not dist.is_initialized() or dist.get_rank() == 0
        self.records, stats = read_records(d.path, ckpt.config.vocab_size, d.max_seq_len, d.on_error,
                                           target_dir=ckpt.dir, template_kwargs=d.chat_template_kwargs,
                                           workers=data_workers(cfg), report=main, windows=data_windows(cfg))
        if main and (note := past_positions([len(r.input_ids) for r in self.records], ckpt)):
            print(f"train: {note}", file=sys.stderr)
        self.sequences = [SeqRef(0, 0, len(r.input_ids), i) for i, r in enumerate(self.records)]
        self.aux_dtype = cfg.extract.aux_dtype
        mode, dtype = cfg.train.online_target, TORCH_DTYPES[cfg.extract.dtype]
        # staged: every read is a collective (all ranks, the same order), on a group of its own
        self.lockstep = mode == "staged"
        if self.lockstep:
            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            if world != int(os.environ.get("LOCAL_WORLD_SIZE", world)):
                raise ConfigError(f"{cfg.source}: train.online_target = \"staged\" splits the target across the "
                                  f"GPUs of one node; this run has {world} ranks, "
                                  f"{os.environ['LOCAL_WORLD_SIZE']} per node: use \"stream\" or \"resident\"")
            # the group first: a rank that fails loading its stage then fails alone, not inside new_group
            self.group = dist.new_group() if dist.is_initialized() else None
            self.runner = StagedTarget(ckpt, aux_layer_ids, device, dtype, rank, world, cfg.debug.chunk_tokens)
        else:
            self.runner = TargetRunner(ckpt, aux_layer_ids, device, dtype, cfg.debug.chunk_tokens,
                                       resident=mode == "resident")
        # what an extraction of the same data would record: the draft vocabulary comes from it
        counts = Counter(t for r in self.records for t in r.input_ids[r.loss_mask.astype(bool)].tolist())
        self.manifest = {"source": {"path": str(d.path), "sequences": stats.sequences}, "shards": [
            {"loss_tokens": sum(counts.values()), "loss_token_counts": {str(k): v for k, v in sorted(counts.items())}}]}
        self.totals = [0, 0.0]   # target tokens and seconds since the start, of which the log takes differences
        # one forward at a time (prefetch and evaluation both read): memory for one, exact totals
        self._lock = threading.Lock()
        # the prefetch thread's current CUDA device is 0 whatever the rank: Triton launches there
        self._cuda = device.type == "cuda"
        self._device = torch.cuda.device(device) if self._cuda else contextlib.nullcontext()

    def read(self, refs: list[SeqRef], rows=None) -> Batch | None:
        """The micro-batch of `refs`; staged, every rank calls it in lockstep (`refs` empty: None)."""
        return self.read_many([refs], rows=rows)[0]

    def read_many(self, batches: list[list[SeqRef]], pin: bool = False, rows=None) -> list[Batch | None]:
        """Several micro-batches; staged, in one pass of the pipeline (fewer idle ticks); the caller pins them.
        `rows` (`ShardReader.read`'s share of the rows) must be None: context parallel is refused online."""
        assert rows is None, "online training reads whole micro-batches (train.context_parallel is refused online)"
        records = [[self.records[r.index] for r in refs] for refs in batches]
        inputs = [(torch.from_numpy(np.concatenate([r.input_ids for r in recs]) if recs else np.zeros(0, np.int64)),
                   np.concatenate([[0], np.cumsum([len(r.input_ids) for r in recs])]).astype(int).tolist(),
                   [m for r in recs for m in r.media],
                   torch.from_numpy(np.concatenate([r.loss_mask for r in recs]) == 0 if recs else np.zeros(0, bool)))
                  for recs in records]
        with self._lock, self._device:
            if self.lockstep and self._cuda:   # time the forward, not the queued draft work
                torch.cuda.synchronize()
            start = time.perf_counter()
            # CPU tensors back: the forward has finished
            outs = (self.runner.run(inputs, self.group) if self.lockstep
                    else [self.runner.run(*batch) for batch in inputs])
            self.totals[0] += sum(batch[0].numel() for batch in inputs)
            self.totals[1] += time.perf_counter() - start
        return [Batch(**shard_tensors(recs, out, self.aux_dtype)) if recs else None for recs, out in zip(records, outs)]
