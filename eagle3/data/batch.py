"""One packed micro-batch as the trainer sees it: T rows, n sequences end to end (`cu_seqlens` [n+1]), and the
row plan `eagle3.ttt.plan_rows` finds on the host once per batch (on the device: a host sync per TTT step)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from eagle3.data.aux_fp8 import decode_aux_fp8


@dataclass(frozen=True)
class RowRule:
    """Which label rows the loss trains besides assistant rows whose target greedy token is in the draft
    vocab (always). Accuracy and acceptance count assistant rows only, whatever the rule."""
    prompt: bool = False    # rows whose label is a prompt token (loss_mask 0): the target's distribution there


@dataclass(frozen=True)
class RowPlan:
    """Which rows each TTT step computes and trains, for one batch and one objective."""
    steps: int                          # K, the unroll it was made for
    rule: RowRule                       # the objective's row rule it was made for
    live: list[torch.Tensor] | None     # per step, rows [N_k] whose work reaches the loss; None: every row runs
    loss: list[torch.Tensor]            # per step, the valid rows as indices into the rows that step keeps
    denominator: int                    # rows the rule trains at step 0 (t2d aside): the loss's normaliser

    def fits(self, steps: int, skip_dead_rows: bool, rule: RowRule) -> bool:
        return self.steps == steps and (self.live is not None) == skip_dead_rows and self.rule == rule

    def map(self, fn) -> "RowPlan":
        """The plan with `fn` applied to each of its tensors (a copy to the device, pinning)."""
        return dataclasses.replace(self, live=None if self.live is None else list(map(fn, self.live)),
                                   loss=list(map(fn, self.loss)))


@dataclass(frozen=True)
class Part:
    """The batch's rows are those of a packed row of `total` rows from `start` on (its cu_seqlens the whole row's):
    a context-parallel rank's share (`split`), or the rows read for it (`window`)."""
    start: int
    total: int


@dataclass
class Batch:
    input_ids: torch.Tensor             # [T] int32: x
    loss_mask: torch.Tensor             # [T] uint8: 1 on assistant tokens
    target_argmax: torch.Tensor         # [T] int32: g[t], the target's greedy token after x[t]
    aux_hidden: torch.Tensor            # [T, 3H]: the aux layers' outputs (fp8 codes when aux_scale is set)
    final_hidden: torch.Tensor          # [T, H]: the target's last hidden state (after its final norm)
    cu_seqlens: torch.Tensor            # [n+1] int64
    aux_scale: torch.Tensor | None = None   # [T, 3] fp32 per-token, per-layer scales of fp8 aux states
    cu_seqlens_host: torch.Tensor | None = None   # int32 copy kept on the host: the kernels read it there
    plan: RowPlan | None = None
    ready: object = None                # a CUDA event: the batch's copy to the device, still in flight
    cu_attention: torch.Tensor | None = None   # [m+1] int32: the kernels' boundaries of a `pad`ded batch
    padding: int = 0                    # `pad`: filler rows after these, which cu_seqlens counts
    part: Part | None = None            # `split`: this rank's rows of a longer batch (cu_seqlens: the whole one)
    media_embeds: torch.Tensor | None = None   # [M, H]: the target's vision rows at the M placeholders, in order

    @property
    def rows(self) -> int:
        """The rows this batch computes (a `split` batch's per-token fields run a few rows further)."""
        return self.aux_hidden.shape[0]

    def to(self, device: torch.device, float_dtype: torch.dtype) -> "Batch":
        """The batch on the device, floats in `float_dtype`, fp8 aux states decoded there; the host
        copy of the boundaries stays on the host."""
        move = lambda t: t.to(device, float_dtype if t.is_floating_point() else None, non_blocking=True)  # noqa: E731
        aux = (move(self.aux_hidden) if self.aux_scale is None else decode_aux_fp8(
            self.aux_hidden.to(device, non_blocking=True), self.aux_scale.to(device, non_blocking=True), float_dtype))
        return Batch(move(self.input_ids), move(self.loss_mask), move(self.target_argmax), aux,
                     move(self.final_hidden), self.cu_seqlens.to(device, non_blocking=True),
                     cu_seqlens_host=self.cu_seqlens_host,
                     plan=self.plan and self.plan.map(lambda r: r.to(device, non_blocking=True)),
                     cu_attention=None if self.cu_attention is None else move(self.cu_attention),
                     padding=self.padding, part=self.part,
                     media_embeds=None if self.media_embeds is None else move(self.media_embeds))

    def row_tensors(self) -> dict[str, torch.Tensor]:
        """The fields with a row per token."""
        names = ("input_ids", "loss_mask", "target_argmax", "aux_hidden", "final_hidden", "aux_scale")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def device_tensors(self) -> list[torch.Tensor]:
        """Its tensors on a GPU, every field as pin_memory covers them."""
        tensors = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, RowPlan):
                tensors += [*(v.live or []), *v.loss]
            elif isinstance(v, torch.Tensor):
                tensors.append(v)
        return [t for t in tensors if t.is_cuda]

    def pin_memory(self) -> "Batch":
        """Every tensor in pinned memory (for asynchronous copies)."""
        pinned = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Batch(**{k: v.pin_memory() if isinstance(v, torch.Tensor) else v.map(torch.Tensor.pin_memory)
                        if isinstance(v, RowPlan) else v for k, v in pinned.items()})


def pad(batch: Batch, rows: int, longest: int) -> Batch:
    """Boundaries for a CUDA graph's static `rows` rows: filler rows as one-token sequences (never trained or
    counted); `cu_attention` in chunks of at most `longest` tokens, padded to a power-of-two count of sequences."""
    n, cu = batch.rows, batch.cu_seqlens
    cu_rows = torch.cat([cu, torch.arange(n + 1, rows + 1, dtype=cu.dtype), cu.new_full((n + 1 - cu.numel(),), rows)])
    bounds = torch.cat([cu, torch.arange(n, rows, longest, dtype=cu.dtype)[1:], cu.new_full((int(rows > n),), rows)])
    count = max(8, 1 << (bounds.numel() - 2).bit_length())   # sequences, a power of two
    cu_attention = torch.cat([bounds, cu.new_full((count + 1 - bounds.numel(),), rows)]).to(torch.int32)
    return dataclasses.replace(batch, cu_seqlens=cu_rows, cu_seqlens_host=None, cu_attention=cu_attention,
                               padding=rows - n)


def window(total: int, parts: int, index: int, halo: int) -> tuple[int, int]:
    """The rows [start, end) of a packed row of `total` rows that `split` part `index` of `parts` reads."""
    rows = -(-total // parts)
    return index * rows, min((index + 1) * rows + halo, total)


def split(batch: Batch, parts: int, index: int, halo: int) -> Batch:
    """Part `index` of the batch's rows cut into `parts` equal slices, the rows padded first to a multiple of `parts`
    with one-token filler sequences (never trained); its aux states, and `halo` rows more of the per-token fields
    (the TTT shift reads past a slice's end), read here rather than exchanged; cu_seqlens stays the whole batch's.
    The batch may hold only the rows the part reads (`window`)."""
    offset, T = (batch.part.start, batch.part.total) if batch.part else (0, batch.rows)
    rows = -(-T // parts)
    total = rows * parts
    start, end = window(total, parts, index, halo)
    cu = torch.cat([batch.cu_seqlens, torch.arange(T + 1, total + 1, dtype=batch.cu_seqlens.dtype)])

    def take(t: torch.Tensor, end: int) -> torch.Tensor:   # rows start..end of the packed row, zeros past its last
        piece = t[start - offset:min(end, T) - offset]
        return torch.cat([piece, piece.new_zeros(end - start - piece.shape[0], *t.shape[1:])])

    fields = {name: take(t, start + rows if name in ("aux_hidden", "aux_scale") else end)
              for name, t in batch.row_tensors().items()}
    return dataclasses.replace(batch, **fields, cu_seqlens=cu, cu_seqlens_host=None, plan=None,
                               part=Part(start, total))
