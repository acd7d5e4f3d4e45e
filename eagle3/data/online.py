"""Online training's data (`train.source = "online"`): each micro-batch's hidden states made by the
target forward when training asks for the batch, never written to disk.

`OnlineReader` has the interface of `ShardReader` (`sequences`, `read`, `manifest`) over the input
records of `data.path`: sequence i is record i, as extraction numbers them, so the same seed gives
the same held-out split, the same packing and the same batches as extract-then-train, and the
states are rounded to the dtypes shards store. Each rank runs the whole target layer by layer
(extraction's executor, streaming or with the layers kept resident) on its own micro-batches.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter

import numpy as np
import torch

from eagle3.config import Config
from eagle3.data.batch import Batch
from eagle3.data.inputs import read_records
from eagle3.data.shards import SeqRef, shard_tensors
from eagle3.models.checkpoint import Checkpoint
from eagle3.models.streaming import TargetRunner
from eagle3.ops import TORCH_DTYPES


class OnlineReader:
    def __init__(self, cfg: Config, ckpt: Checkpoint, aux_layer_ids: list[int], device: torch.device):
        d = cfg.data
        self.records, stats = read_records(d.path, ckpt.config.vocab_size, d.max_seq_len, d.on_error,
                                           target_dir=ckpt.dir)
        self.sequences = [SeqRef(0, 0, len(r.input_ids), i) for i, r in enumerate(self.records)]
        self.aux_dtype = cfg.extract.aux_dtype
        self.runner = TargetRunner(ckpt, aux_layer_ids, device, TORCH_DTYPES[cfg.extract.dtype],
                                   cfg.extract.chunk_tokens, resident=cfg.train.online_target == "resident")
        # what an extraction of the same data would record: the draft vocabulary comes from it
        counts = Counter()
        for r in self.records:
            counts.update(r.input_ids[r.loss_mask.astype(bool)].tolist())
        self.manifest = {"source": {"path": str(d.path), "sequences": stats.sequences},
                         "shards": [{"loss_tokens": sum(counts.values()),
                                     "loss_token_counts": {str(k): v for k, v in sorted(counts.items())}}]}
        # totals since the start, for the log (which side bounds the run); the log takes differences
        self.target_tokens, self.target_seconds = 0, 0.0
        # one forward at a time (the prefetch thread and evaluation both read): memory for one, and
        # the totals stay exact
        self._lock = threading.Lock()
        # the prefetch thread's current CUDA device is 0 whatever the rank: Triton launches there
        self._device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def read(self, refs: list[SeqRef]) -> Batch:
        records = [self.records[r.index] for r in refs]
        ids = torch.from_numpy(np.concatenate([r.input_ids for r in records]))
        cu = np.concatenate([[0], np.cumsum([len(r.input_ids) for r in records])]).tolist()
        with self._lock, self._device:
            start = time.perf_counter()
            out = self.runner.run(ids, cu)        # returns CPU tensors: the forward has finished
            self.target_seconds += time.perf_counter() - start
            self.target_tokens += ids.numel()
        return Batch.from_tensors(shard_tensors(records, out, self.aux_dtype))
