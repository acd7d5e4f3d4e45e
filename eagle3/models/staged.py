"""The target resident across the ranks of one node as contiguous layer stages (online training's
`train.online_target = "staged"`): rank r keeps layers [L·r/W, L·(r+1)/W) and every rank's
micro-batch flows through all the stages.

`StagedTarget.run` is a collective over its process group: every rank calls it with its own A
micro-batches (A the same on every rank; a batch may be empty), in the same order. The W·A batches
are numbered g = a·W + r (batch a of rank r: its owner is g mod W); after their sizes and ids are
gathered, W·A + W - 1 ticks follow; at tick t rank r runs batch t - r through its layers, so the
pipeline is full but for its W - 1 ticks of filling and draining. Each tick ends with one batch of
point-to-point messages posted by every rank in one global order: the activations to the next
stage, and the aux states (from the stage holding the aux layer) and final state and greedy token
(from the last stage) to the batch's owner. Per rank it returns what `TargetRunner.run` returns,
for each of its own micro-batches.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from eagle3.models.weights import Checkpoint
from eagle3.models.streaming import build_model, check_tensors, greedy_argmax, run_layers, split_chunks
from eagle3.ops import rms_norm


def stage_layers(num_layers: int, rank: int, world: int) -> range:
    return range(num_layers * rank // world, num_layers * (rank + 1) // world)


class StagedTarget:
    def __init__(self, ckpt: Checkpoint, aux_layer_ids: list[int], device: torch.device, dtype: torch.dtype,
                 rank: int, world: int, chunk_tokens: int = 65536):
        self.aux_layer_ids, self.device, self.dtype, self.rank, self.world = aux_layer_ids, device, dtype, rank, world
        self.chunk_tokens = chunk_tokens   # whole sequences at most this many tokens a pass: activation memory
        self.model = build_model(ckpt, device, dtype)
        check_tensors(ckpt, self.model)
        self.stages = [stage_layers(ckpt.config.num_hidden_layers, r, world) for r in range(world)]
        self.layers = {i: self.model.load_layer(i) for i in self.stages[rank]}
        self.hidden, self.eps = ckpt.config.hidden_size, ckpt.config.rms_norm_eps
        first, last = rank == 0, rank == world - 1
        self.embed = ckpt.get("embed_tokens.weight").to(device, dtype) if first else None
        self.norm = ckpt.get("norm.weight").to(device, dtype) if last else None
        self.head = ckpt.get("lm_head.weight").to(device, dtype) if last else None

    @torch.no_grad()
    def run(self, batches: list[tuple[torch.Tensor, list[int]]], group) -> list[dict[str, torch.Tensor] | None]:
        """This rank's micro-batches, each (input_ids [T], cu_seqlens as python ints; T may be 0) ->
        for each, CPU tensors aux [T, 3H], final [T, H], argmax [T] int32 (None for an empty batch)."""
        mine = [(ids.tolist(), list(cu)) for ids, cu in batches]
        gathered = [mine] * self.world   # one process: one stage, no messages
        if dist.is_initialized():
            dist.all_gather_object(gathered, mine, group=group)
        if len({len(g) for g in gathered}) != 1:
            raise RuntimeError(f"staged target: the ranks read {[len(g) for g in gathered]} micro-batches at once; "
                               "every rank must read as many")
        metas = [gathered[g % self.world][g // self.world] for g in range(self.world * len(mine))]
        kept: dict = {}      # (kind, batch, layer or None) of the messages, "aux" / "final" / "argmax" -> tensor
        arriving: dict = {}  # batch -> its activation from the previous stage
        for tick in range(len(metas) + self.world - 1):
            b = tick - self.rank
            h = self._forward(b, metas[b], arriving.pop(b, None), kept) if self._runs(b, metas) else None
            self._exchange(tick, metas, h, kept, arriving, group)
        return [self._result(a * self.world + self.rank, kept) if meta[0] else None for a, meta in enumerate(mine)]

    def _result(self, b: int, kept: dict) -> dict[str, torch.Tensor]:
        aux = torch.cat([kept[("aux", b, i)] for i in self.aux_layer_ids], dim=-1)
        return {"aux_hidden": aux.cpu(), "final_hidden": kept[("final", b, None)].cpu(),
                "target_argmax": kept[("argmax", b, None)].cpu()}

    def _runs(self, b: int, metas: list) -> bool:
        return 0 <= b < len(metas) and len(metas[b][0]) > 0

    def _forward(self, b: int, meta: tuple, h: torch.Tensor | None, kept: dict) -> torch.Tensor:
        """This stage's layers on batch b, `chunk_tokens` of whole sequences at a time (sequences do not
        see each other); what it keeps goes to `kept`; returns the activation."""
        ids, cu = meta
        if self.rank == 0:
            h = self.embed[torch.tensor(ids).to(self.device, non_blocking=True)]
        outs, aux = [], {}
        for first, last in split_chunks(cu, self.chunk_tokens):
            x, captured = run_layers(self.model, self.layers.items(), h[cu[first]:cu[last]],
                                     [c - cu[first] for c in cu[first:last + 1]], self.aux_layer_ids)
            outs.append(x)
            for i, y in captured.items():
                aux.setdefault(i, []).append(y)
        h = _join(outs)
        kept.update({("aux", b, i): _join(parts) for i, parts in aux.items()})
        if self.rank == self.world - 1:
            kept[("final", b, None)] = rms_norm(h, self.norm, self.eps)
            kept[("argmax", b, None)] = greedy_argmax(kept[("final", b, None)], self.head)
        return h

    def _messages(self, tick: int, metas: list):
        """Every message of the tick, in the one order all ranks post them: (kind, src, dst, batch, layer)."""
        for src in range(self.world):
            b = tick - src
            if not self._runs(b, metas):
                continue
            owner = b % self.world
            for i in self.aux_layer_ids:
                if i in self.stages[src] and src != owner:
                    yield "aux", src, owner, b, i
            if src < self.world - 1:
                yield "act", src, src + 1, b, None
            elif src != owner:
                yield "final", src, owner, b, None
                yield "argmax", src, owner, b, None

    def _exchange(self, tick: int, metas: list, h, kept: dict, arriving: dict, group) -> None:
        ops, sent, received = [], [], []
        for kind, src, dst, b, layer in self._messages(tick, metas):
            key = (kind, b, layer)
            if src == self.rank:
                ops.append(dist.P2POp(dist.isend, (h if kind == "act" else kept[key]).contiguous(), dst, group))
                sent.append(key)
            elif dst == self.rank:
                rows = len(metas[b][0])
                buf = (torch.empty(rows, dtype=torch.int32, device=self.device) if kind == "argmax"
                       else torch.empty(rows, self.hidden, dtype=self.dtype, device=self.device))
                ops.append(dist.P2POp(dist.irecv, buf, src, group))
                received.append((key, buf))
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
        for key in sent:   # sent away: no longer needed here
            kept.pop(key, None)
        for key, buf in received:
            if key[0] == "act":
                arriving[key[1]] = buf
            else:
                kept[key] = buf


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' rows in order; one chunk (the usual case) without a copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
