"""Context parallelism (docs/training.md, "Long sequences: context parallelism"): each micro-batch, one packed row of
c x train.batch_tokens tokens, split by rows over a group of c ranks. Everything per row (fc, norms, MLP, head, loss)
runs on the rank's own slice; the TTT attention switches by an all-to-all from (own rows, all heads) to (all rows,
heads / c) and back, so the attention kernel runs unchanged over the whole packed row."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from eagle3.distributed import Dist
from eagle3.errors import TrainError


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Chunk s of x's first dim to rank s of the group; chunk s of the result from rank s (gloo and NCCL alike)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` is its own inverse (chunk s of rank r trades places with chunk r of rank s): so is its backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


@dataclasses.dataclass(frozen=True, eq=False)
class SplitAttention:
    """The run's TTT attention (the signature of kernels.reference.ttt_attention) for a draft whose rows are split over
    a group of `size` ranks: the draft hands it its rows' q, k, v (and MLA's shared rotary key) through `to_heads` and
    takes the output back through `to_rows` (`eagle3.draft.attend`). Heads go to ranks in contiguous blocks: GQA's q-to-kv map holds per rank."""
    attention: Callable
    size: int
    group: object

    def __call__(self, *args, **kwargs):   # over all rows of this rank's heads, as in one process
        return self.attention(*args, **kwargs)

    def to_heads(self, *xs: torch.Tensor, shared=()) -> tuple[torch.Tensor, ...]:
        """[L, H_i, D_i] each (this rank's rows, all heads) -> [c·L, H_i / c, D_i] (all rows, this rank's heads), then
        each of `shared` [L, 1, D] (one head that every head reads: MLA's rotary key) -> [c·L, 1, D] on every rank; its
        gradient comes back summed over the ranks' heads."""
        c, L = self.size, xs[0].shape[0]
        xs = (*xs, *(x.expand(L, c, x.shape[2]) for x in shared))
        # one exchange for all: per rank, its head block of each tensor side by side
        sent = torch.cat([x.reshape(L, c, -1) for x in xs], dim=2).transpose(0, 1)   # [c, L, Σ H_i·D_i / c]
        got = _AllToAll.apply(sent, self.group)                                       # chunk r: rank r's rows
        widths = [x.shape[1] * x.shape[2] // c for x in xs]
        # each its own tensor: the attention keeps the steps' keys for its backward, and a view would keep the
        # whole exchange buffer (this step's queries too) alive with them
        return tuple(part.reshape(c * L, x.shape[1] // c, x.shape[2]).contiguous()
                     for part, x in zip(got.split(widths, 2), xs))

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[c·L, h, D] (all rows, this rank's heads) -> [L, c·h, D] (this rank's rows, all heads)."""
        c, (T, h, D) = self.size, x.shape
        got = _AllToAll.apply(x.reshape(c, T // c, h * D), self.group)   # chunk r: rank r's heads
        return got.transpose(0, 1).reshape(T // c, c * h, D)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the ranks share the work: groups of `size` consecutive ranks (one node's GPUs) each train one micro-batch
    split by rows; the data-parallel rank and world count groups."""
    size: int          # c, train.context_parallel
    index: int         # this rank's place in its group: its slice of the micro-batch's rows
    data_rank: int     # which group
    data_world: int    # how many groups
    group: object = None

    def attention(self, attention: Callable) -> Callable:
        return attention if self.size == 1 else SplitAttention(attention, self.size, self.group)

    def share(self, steps: int) -> tuple[int, int, int] | None:
        """(ranks, index, halo) of this rank's `eagle3.data.batch.split` of a micro-batch, the halo the K + 1 rows past
        its slice that the TTT shift reads (None: the whole micro-batch)."""
        return None if self.size == 1 else (self.size, self.index, steps + 1)


def layout(size: int, d: Dist, kv_heads: int, heads: int, source: str, online: bool) -> Layout:
    """The run's `Layout` for train.context_parallel = `size` (set in `source`), refusing what it cannot split; every
    rank makes every group (torch.distributed's rule), in the same order."""
    needs = [why for why, bad in ((f"a divisor of the world size ({d.world})", d.world % size),
                                  (f"a divisor of draft.num_key_value_heads ({kv_heads}) and "
                                   f"draft.num_attention_heads ({heads}): each rank attends with whole heads",
                                   kv_heads % size or heads % size),
                                  ('train.source = "shards" (online, each rank would run the target over its group\'s '
                                   'whole micro-batch)', online)) if bad]
    if size > 1 and needs:
        raise TrainError(f"{source}: train.context_parallel = {size} needs {'; '.join(needs)}")
    if size == 1:
        return Layout(1, 0, d.rank, d.world)
    groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(d.world // size)]
    return Layout(size, d.rank % size, d.rank // size, d.world // size, groups[d.rank // size])
