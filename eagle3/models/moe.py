"""The mixture-of-experts parts the target families share: routers (DeepSeek's sigmoid with a bias and groups,
Qwen's softmax top-k, gpt-oss's softmax over the top-k logits), the experts' weights as stored (per-expert
linears, dense or int4; gpt-oss's fused MXFP4 or bf16 tensors) and the dispatch of tokens to the active ones."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3.errors import TargetError
from eagle3.ops import silu_mul
from eagle3.models import quant

# experts dequantized into one buffer at a time: 32 Kimi experts, 2.8 GB of bf16, small next to a chunk's activations
EXPERT_BLOCK = 32


@dataclass(frozen=True)
class Router:
    """How a MoE layer picks `top_k` of `experts` and weighs them. `scoring`: "sigmoid" (chosen by score + bias
    within the topk_group best of n_group groups, weighted by the score), "softmax" (softmax over all experts),
    "topk_softmax" (softmax over the chosen logits); `renormalize`: weights summing to 1; times `scaling`."""
    scoring: str
    experts: int
    top_k: int
    renormalize: bool
    scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1


def check_groups(r: Router, where: str) -> None:
    """Raise unless the experts split into n_group groups of which topk_group are kept."""
    if r.experts % r.n_group or r.topk_group > r.n_group:
        raise TargetError(f"{where}: n_routed_experts {r.experts} must split into n_group {r.n_group} groups and "
                          f"topk_group {r.topk_group} <= n_group")


def route(logits: torch.Tensor, bias: torch.Tensor | None, r: Router) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (experts [T, k] int64, weights [T, k] fp32)."""
    logits = logits.float()
    if r.scoring == "topk_softmax":
        top = logits.topk(r.top_k, dim=-1)
        return top.indices, top.values.softmax(-1)
    scores = logits.softmax(-1) if r.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if r.n_group > 1:
        T, E = choice.shape
        groups = choice.view(T, r.n_group, E // r.n_group)
        best = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)             # [T, G] a group's two best
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(r.topk_group, dim=-1).indices, True)
        choice = groups.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    idx = choice.topk(r.top_k, dim=-1).indices
    weights = scores.gather(1, idx)
    if r.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return idx, weights * r.scaling


def weighted_swiglu(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[n, 2I] gate | up -> silu(gate) · up · routing weight [n] (cheaper on [n, I] than on [n, H])."""
    I = gate_up.shape[1] // 2
    return silu_mul(gate_up[:, :I], gate_up[:, I:]).float().mul_(weight[:, None]).to(gate_up.dtype)


def weighted_clamped_swiglu(gate_up: torch.Tensor, weight: torch.Tensor, limit: float = 7.0,
                            alpha: float = 1.702) -> torch.Tensor:
    """gpt-oss's: [n, 2I] gate and up interleaved -> (up + 1) · gate · sigmoid(alpha · gate) · weight, gate
    clamped above at `limit`, up to ±limit."""
    gate, up = gate_up[:, ::2].clamp(max=limit), gate_up[:, 1::2].clamp(-limit, limit)
    return ((up + 1) * gate * torch.sigmoid(gate * alpha)).float().mul_(weight[:, None]).to(gate_up.dtype)


def select(stacked: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """stacked[experts]: a view for consecutive experts (all of Kimi's at a 64k-token chunk), else a copy."""
    if experts == list(range(experts[0], experts[0] + len(experts))):
        return stacked[experts[0]:experts[0] + len(experts)]
    return stacked.index_select(0, torch.tensor(experts).to(stacked.device, non_blocking=True))


def expert_matmul(x: torch.Tensor, w: torch.Tensor, sizes: list[int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, K] in groups of sizes[j] rows, w [B, N, K] (bias [B, N]) -> [n, N], group j times w[j].T."""
    return torch.cat([F.linear(part, w[j], None if bias is None else bias[j]) for j, part in enumerate(x.split(sizes))])


def expert_weights(w: dict, key: str, experts: list[int], dtype: torch.dtype, block_cols: int | None) -> torch.Tensor:
    """Dense [len(experts), out, in] weights of the chosen experts of `experts.{key}.*` as stored (`quant.dequantize`;
    fp8 blocks `block_cols` wide)."""
    prefix = f"experts.{key}."
    parts = {n[len(prefix):]: select(t, experts) for n, t in w.items() if n.startswith(prefix) and n[-5:] != ".bias"}
    return quant.dequantize(parts, dtype, block_cols)


def routed(w: dict, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts: int, act,
           dtype: torch.dtype, block_cols: int | None = None) -> torch.Tensor:
    """Σ_k weights[t, k] · expert_idx[t, k](x_t) [T, H], EXPERT_BLOCK active experts' weights dequantized at a
    time; pair (t, slot) lands in row t·k + slot, the k slots summed at the end (fewer bytes than index_add).
    `act(gate_up, pair weights)` -> the weighted inner activation; a down bias is weighted alike."""
    T, k = idx.shape
    order = idx.flatten().argsort(stable=True)
    token, pair_w = order // k, weights.flatten()[order]
    counts = torch.bincount(idx.flatten(), minlength=experts).tolist()  # one sync
    starts = list(itertools.accumulate(counts, initial=0))
    pairs = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=x.device)
    active = [e for e, n in enumerate(counts) if n]
    for b in range(0, len(active), EXPERT_BLOCK):
        block = active[b:b + EXPERT_BLOCK]
        sizes, rows = [counts[e] for e in block], slice(starts[block[0]], starts[block[-1] + 1])
        gate_up_bias = select(w["experts.gate_up.bias"], block) if "experts.gate_up.bias" in w else None
        h = act(expert_matmul(x[token[rows]], expert_weights(w, "gate_up", block, dtype, block_cols), sizes, gate_up_bias),
                pair_w[rows])                                                                     # [n, I]
        out = expert_matmul(h, expert_weights(w, "down", block, dtype, block_cols), sizes)
        if "experts.down.bias" in w:   # weight · (h W + b), h already weighted
            out += pair_w[rows, None].to(out.dtype) * select(w["experts.down.bias"], block).repeat_interleave(
                torch.tensor(sizes, device=out.device), 0, output_size=out.shape[0])
        pairs.index_copy_(0, order[rows], out)
    return pairs.view(T, k, x.shape[1]).sum(1)   # summed in fp32 (the reduction's accumulator)


def load_experts(ckpt, prefix: str, projs: tuple[str, ...], experts: int, inner: int, hidden: int, device,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per-expert linears `{prefix}N.{gate, up, down}` (`projs` names them) of `ckpt` (a `weights.Checkpoint`) ->
    `experts.gate_up.*` [E, 2I, ...] (gate rows first) and `experts.down.*` [E, H, ...]: as stored (int4 or fp8,
    `Checkpoint.linear_parts`) if all are stored alike, else dense."""
    kinds = {quant.linear_kind(ckpt.has, f"{prefix}{e}.{name}") for e in range(experts) for name in projs}
    out = {}
    for key, names, shape in (("gate_up", projs[:2], (inner, hidden)), ("down", projs[2:], (hidden, inner))):
        bases = [[f"{prefix}{e}.{name}" for name in names] for e in range(experts)]
        out.update({f"experts.{key}.{n}": t for n, t in _stack(ckpt, bases, shape, len(kinds) > 1, device,
                                                                dtype).items()})
    return out


def _stack(ckpt, bases: list[list[str]], shape: tuple[int, int], dense: bool, device, dtype) -> dict[str, torch.Tensor]:
    """bases[e] = the linears of expert e, stacked along rows -> their parts [E, rows, ...] on the device, as
    stored or (`dense`: experts stored in several ways) dequantized."""
    rows, out = shape[0] * len(bases[0]), {}
    for e, names in enumerate(bases):
        for j, base in enumerate(names):
            parts = ckpt.linear_parts(base, shape)
            if dense:
                parts = {"weight": quant.dequantize(parts, dtype, ckpt.block_cols)}
            for n, t in parts.items():
                if n not in out:  # allocated on first sight: the dtype is the file's
                    out[n] = torch.empty(len(bases), rows, *t.shape[1:], dtype=t.dtype, device=device)
                out[n][e, j * shape[0]:(j + 1) * shape[0]].copy_(t)
    return out
