"""debug.cuda_graphs: each micro-batch's forward and backward replayed as one CUDA graph. A small draft's
step is a thousand launches of microseconds of work each: the host's launch overhead, not the GPU, bounds it."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch

from eagle3.config import ConfigError
from eagle3.data.batch import Batch

HIDDEN_MAX = 1024   # auto: graphs won at hidden 256, lost at 2048 (benchmarks/RESULTS.md, "Small draft, CUDA graphs")


def wanted(setting: bool | None, device: torch.device, world: int, online: bool, triton: bool,
           hidden: int, source: str, say: bool = False, media: bool = False) -> bool:
    """Whether the run graphs its steps for debug.cuda_graphs = `setting` (None: auto); `say`: print why; `media`:
    the draft reads vision rows, a tensor of another size each batch."""
    if setting is False:
        return False
    blockers = [why for why, blocks in (("not on CUDA", device.type != "cuda"), ("several ranks (DDP)", world > 1),
                                        ("train.source = \"online\"", online),
                                        ("not the Triton kernels", not triton),
                                        ("draft.media_embedding = \"sglang\"", media)) if blocks]
    if blockers and setting:
        raise ConfigError(f"{source}: debug.cuda_graphs = true needs one CUDA GPU, shards, the Triton kernels and "
                          f"vLLM's media rule, here: {', '.join(blockers)}; set it to auto or false")
    off = (", ".join(blockers) if blockers else "ROCm: not measured there" if setting is None and torch.version.hip
           else f"draft hidden size {hidden} > {HIDDEN_MAX}: the GPU bounds the step"
           if setting is None and hidden > HIDDEN_MAX else None)
    why = f"off ({off})" if off else "on" + (" (debug.cuda_graphs = true)" if setting else
                                              f" (draft hidden size {hidden} <= {HIDDEN_MAX})")
    if say:
        print(f"debug.cuda_graphs = {'auto' if setting is None else 'true'}: {why}", file=sys.stderr)
    return off is None


class GraphedStep:
    """`forward(batch, scale)` and its backward (adding to .grad, which must exist) replayed as one CUDA graph per
    count of sequences over static buffers; the first WARMUP micro-batches run eagerly (tuning, compilation)."""

    WARMUP = 2

    def __init__(self, forward: Callable[[Batch, torch.Tensor], tuple], device: torch.device):
        self.forward, self.device = forward, device   # (batch, scale) -> (loss, metric sums, detail)
        self.stream = torch.cuda.Stream(device)
        self.scale = torch.zeros((), device=device)
        self.inputs: dict[int, Batch] = {}      # per sequence count: the static batch the graph reads
        self.graphs: dict[int, tuple] = {}      # per sequence count: (graph, loss, metrics)
        self.eager = 0

    def __call__(self, batch: Batch, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch` padded and on the device; its (loss, metrics) are valid until the next call."""
        key = batch.cu_attention.numel()
        static = self.inputs[key] = load(batch, self.inputs.get(key))
        self.scale.copy_(scale)
        if key in self.graphs:
            graph, loss, metrics = self.graphs[key]
            graph.replay()
            return loss, metrics
        here = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(here)
        if self.eager < self.WARMUP:
            self.eager += 1
            with torch.cuda.stream(self.stream):
                loss, metrics = self._step(static)
            here.wait_stream(self.stream)
            for t in (loss, metrics):   # made on the side stream, read and freed on this one
                t.record_stream(here)
            return loss, metrics
        graph = torch.cuda.CUDAGraph()
        # thread_local: the prefetch thread may pin memory meanwhile, which a global capture would refuse
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
            loss, metrics = self._step(static)
        self.graphs[key] = graph, loss, metrics
        graph.replay()
        return loss, metrics

    def _step(self, static: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        loss, metrics, _ = self.forward(static, self.scale)
        loss.backward()
        return loss.detach(), metrics


def load(batch: Batch, static: Batch | None = None) -> Batch:
    """A padded `batch` copied into `static`, the buffers a graph reads (made when None), its filler rows zeros."""
    if static is None:
        rows, tensors = batch.rows + batch.padding, batch.row_tensors()
        static = dataclasses.replace(batch, plan=None, ready=None, padding=0, cu_seqlens=batch.cu_seqlens.clone(),
                                     cu_attention=batch.cu_attention.clone(),
                                     **{name: t.new_empty(rows, *t.shape[1:]) for name, t in tensors.items()})
    for name, t in batch.row_tensors().items():
        buffer = getattr(static, name)
        buffer[:batch.rows].copy_(t)
        buffer[batch.rows:].zero_()
    for name in ("cu_seqlens", "cu_attention"):
        getattr(static, name).copy_(getattr(batch, name))
    return static
