"""Pure-torch ground truth for the two TTT hot spots (and the row spread around them).

These are the semantics the Triton kernels must reproduce; tests compare against them and the
training loop falls back to them when `train.kernels = "torch"` (attention, loss) and on the CPU
(the row spread: on a GPU `eagle3.ops.scatter_rows` always takes `kernels/rows.py`, whose result is
the same to the bit).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def spread_rows(src: torch.Tensor, index: torch.Tensor, total: int, fill=0) -> torch.Tensor:
    """src [n, ...] at rows `index` (distinct) of a [total, ...] tensor filled with `fill`: what
    `kernels.rows.spread_rows` computes in one pass."""
    return src.new_full((total, *src.shape[1:]), fill).index_copy(0, index, src)


def _lengths(cu_seqlens: torch.Tensor | None, total: int) -> list[int]:
    if cu_seqlens is None:
        return [total]
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"ttt_attention: cu_seqlens must run from 0 to T={total}, got {bounds[0]}..{bounds[-1]}")
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _one_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D]; k, v [S, n, Hq, D] (heads already expanded), fp32 -> [n, Hq, D]."""
    n = q.shape[0]
    causal = torch.einsum("thd,shd->hts", q, k[0]) * scale                  # [Hq, n, n]
    visible = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    causal = causal.masked_fill(~visible, float("-inf"))
    diag = torch.einsum("thd,jthd->htj", q, k[1:]) * scale                 # [Hq, n, S-1]
    probs = torch.cat([causal, diag], dim=-1).softmax(-1)
    out = torch.einsum("hts,shd->thd", probs[..., :n], v[0])
    return out + torch.einsum("htj,jthd->thd", probs[..., n:], v[1:])


def ttt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cu_seqlens: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of TTT step S-1, with each sequence's scores materialized (the eager baseline).

    q: [T, Hq, D] queries of the current step; k, v: [S, T, Hkv, D] keys/values of steps 0..S-1.
    Query t attends causally to the step-0 keys of its own sequence and, for each later step j,
    to the single key k[j, t] (the diagonal). Returns [T, Hq, D] in q's dtype.
    """
    S, T, Hkv, D = k.shape
    Hq = q.shape[1]
    if q.shape != (T, Hq, D) or v.shape != k.shape or Hq % Hkv:
        raise ValueError(f"ttt_attention: bad shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    scale = D ** -0.5 if scale is None else scale
    group = Hq // Hkv
    lengths = _lengths(cu_seqlens, T)
    # split (not slice) per sequence: its backward is one concatenation, not a zero-fill per piece
    qs = q.float().split(lengths, dim=0)
    ks = k.float().repeat_interleave(group, dim=2).split(lengths, dim=1)
    vs = v.float().repeat_interleave(group, dim=2).split(lengths, dim=1)
    out = torch.cat([_one_sequence(*parts, scale) for parts in zip(qs, ks, vs)])
    return out.to(q.dtype)


def ttt_loss(h: torch.Tensor, w: torch.Tensor, p: torch.Tensor,
             valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of the draft head against target probabilities.

    h: [N, H] draft hidden after the final norm; w: [V, H] draft lm_head; p: [N, V] target
    probabilities over the draft vocab; valid: bool [N]. Returns (loss [N] fp32, argmax [N] int64)
    with loss = -sum_v p log softmax(h w^T) on valid rows and 0 elsewhere; argmax is -1 on rows
    that are not valid (they need no logits).
    """
    N = h.shape[0]
    if valid is None:
        valid = torch.ones(N, dtype=torch.bool, device=h.device)
    logits = (h @ w.t()).float()                                        # [N, V]
    logq = F.log_softmax(logits, dim=-1)
    loss = -(p.float() * logq).sum(-1)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    argmax = torch.where(valid, logits.argmax(-1), torch.full_like(valid, -1, dtype=torch.long))
    return loss, argmax


def ttt_loss_steps(hs, w, ps, valids=None, weights=None, loss_fn=None, p_rows=None):
    """All K TTT steps at once: (total, losses, argmaxes) with total = Σ_k Σ_i weights[k] · loss_k,i.

    Same contract as `kernels.ttt_loss.ttt_loss_steps`; hs[k] [N_k, H], ps[k] [N_k, V], valids[k]
    bool [N_k], the indices of the valid rows (int64 or int32), or None; weights[k] a number or a tensor
    broadcastable to [N_k] (default 1); p_rows[k] int64 [N_k] or None: the rows of ps[k] (then any
    [P, V]) that hs[k]'s rows read, gathered here. `loss_fn` replaces `ttt_loss` for each step (e.g. a
    compiled one).
    """
    loss_fn = loss_fn or ttt_loss
    K = len(hs)
    valids = [None] * K if valids is None else list(valids)
    weights = [1.0] * K if weights is None else list(weights)
    ps = [p if r is None else p[r] for p, r in zip(ps, [None] * K if p_rows is None else p_rows)]
    total, losses, argmaxes = 0.0, [], []
    for h, p, valid, weight in zip(hs, ps, valids, weights):
        if valid is not None and valid.dtype in (torch.int64, torch.int32):   # row indices -> mask
            valid = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device).index_fill_(0, valid.long(), True)
        loss, argmax = loss_fn(h, w, p, valid)
        total = total + (loss * weight).sum()
        losses.append(loss.detach())
        argmaxes.append(argmax)
    return total, losses, argmaxes
