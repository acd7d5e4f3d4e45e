"""The target resident across one node's ranks as layer stages (`train.online_target = "staged"`): rank r keeps
layers [L·r/W, L·(r+1)/W); `run`, a collective, pipelines every rank's micro-batches through them (docs/data.md)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from eagle3.models.weights import Checkpoint
from eagle3.models.streaming import (MediaInputs, build_model, check_tensors, final_norm, greedy_argmax, run_layers,
                                     split_chunks)


class StagedTarget:
    def __init__(self, ckpt: Checkpoint, aux_layer_ids: list[int], device: torch.device, dtype: torch.dtype,
                 rank: int, world: int, chunk_tokens: int = 65536):
        self.aux_layer_ids, self.device, self.dtype, self.rank, self.world = aux_layer_ids, device, dtype, rank, world
        self.chunk_tokens = chunk_tokens   # whole sequences of at most this many tokens a pass
        self.model = build_model(ckpt, device, dtype)
        check_tensors(ckpt, self.model)
        L = ckpt.config.num_hidden_layers
        self.stages = [range(L * r // world, L * (r + 1) // world) for r in range(world)]
        self.layers = {i: self.model.load_layer(i) for i in self.stages[rank]}
        self.hidden, self.eps = ckpt.config.hidden_size, ckpt.config.rms_norm_eps
        first, last = rank == 0, rank == world - 1
        self.embed = ckpt.get("embed_tokens.weight").to(device, dtype) if first else None
        self.norm = ckpt.get("norm.weight").to(device, dtype) if last else None
        self.head = ckpt.get("lm_head.weight").to(device, dtype) if last else None
        self.media = MediaInputs(ckpt, device, dtype)   # each rank its own batches' vision rows, for stage 0

    @torch.no_grad()
    def run(self, batches: list[tuple], group) -> list[dict[str, torch.Tensor] | None]:
        """This rank's micro-batches ((ids, cu_seqlens[, media[, context]]), as many on every rank) ->
        `TargetRunner.run`'s, or None; the vision rows and where they go (`context`) travel to stage 0 with the ids."""
        mine = [(ids.tolist(), list(cu), self.media.features(rest[0] if rest else ()).cpu(),
                 rest[1].tolist() if len(rest) > 1 else None) for ids, cu, *rest in batches]
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
        return [self._result(a * self.world + self.rank, kept, meta[2]) if meta[0] else None
                for a, meta in enumerate(mine)]

    def _result(self, b: int, kept: dict, media: torch.Tensor) -> dict[str, torch.Tensor]:
        aux = torch.cat([kept[("aux", b, i)] for i in self.aux_layer_ids], dim=-1)
        return {"aux_hidden": aux.cpu(), "final_hidden": kept[("final", b, None)].cpu(),
                "target_argmax": kept[("argmax", b, None)].cpu(), **({"media_embeds": media} if len(media) else {})}

    def _runs(self, b: int, metas: list) -> bool:
        return 0 <= b < len(metas) and len(metas[b][0]) > 0

    def _forward(self, b: int, meta: tuple, h: torch.Tensor | None, kept: dict) -> torch.Tensor:
        """This stage's layers on batch b, `chunk_tokens` at a time -> the activation; outputs to `kept`."""
        ids, cu, media, context = meta
        if self.rank == 0:
            h = self.media.embed(self.embed, torch.tensor(ids).to(self.device, non_blocking=True),
                                 media.to(self.device), None if context is None else torch.tensor(context))
        outs, aux = [], {}
        for first, last in split_chunks(cu, self.chunk_tokens):
            x, captured = run_layers(self.model, self.layers.items(), h[cu[first]:cu[last]],
                                     [c - cu[first] for c in cu[first:last + 1]], self.aux_layer_ids,
                                     self.chunk_tokens)
            outs.append(x)
            for i, y in captured.items():
                aux.setdefault(i, []).append(y)
        h = _join(outs)
        kept.update({("aux", b, i): _join(parts) for i, parts in aux.items()})
        if self.rank == self.world - 1:
            kept[("final", b, None)] = final_norm(h, self.norm, self.eps, self.chunk_tokens)
            kept[("argmax", b, None)] = greedy_argmax(kept[("final", b, None)], self.head)
        return h

    def _messages(self, tick: int, metas: list):
        """Every message of the tick in the order all ranks post them: (kind, src, dst, batch, layer)."""
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
    return parts[0] if len(parts) == 1 else torch.cat(parts)
