"""Pure-torch ground truth for the two TTT hot spots (SPEC §8).

These are the semantics the Triton kernels must reproduce; tests compare against them and the
training loop falls back to them when `train.kernels = "torch"`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _same_sequence_causal(cu_seqlens: torch.Tensor | None, total: int, device) -> torch.Tensor:
    """[T, T] bool: key j is visible to query i (same packed sequence, j <= i)."""
    idx = torch.arange(total, device=device)
    mask = idx[None, :] <= idx[:, None]
    if cu_seqlens is not None:
        seq = torch.searchsorted(cu_seqlens.to(device=device, dtype=torch.int64), idx, right=True)
        mask &= seq[None, :] == seq[:, None]
    return mask


def ttt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cu_seqlens: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of TTT step S-1, with the scores materialized (the eager baseline).

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
    kf = k.float().repeat_interleave(group, dim=2)                      # [S, T, Hq, D]
    vf = v.float().repeat_interleave(group, dim=2)
    qf = q.float()
    causal = torch.einsum("thd,shd->hts", qf, kf[0]) * scale            # [Hq, T, T]
    causal = causal.masked_fill(~_same_sequence_causal(cu_seqlens, T, q.device), float("-inf"))
    diag = torch.einsum("thd,jthd->htj", qf, kf[1:]) * scale            # [Hq, T, S-1]
    probs = torch.cat([causal, diag], dim=-1).softmax(-1)
    out = torch.einsum("hts,shd->thd", probs[..., :T], vf[0])
    out = out + torch.einsum("htj,jthd->thd", probs[..., T:], vf[1:])
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
