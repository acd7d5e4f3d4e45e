"""Pure-torch ground truth for the two TTT hot spots (SPEC §8).

These are the semantics the Triton kernels must reproduce; tests compare against them and the
training loop falls back to them when `train.kernels = "torch"`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _segments(cu_seqlens: torch.Tensor | None, total: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, total)]
    bounds = cu_seqlens.tolist()
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def ttt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cu_seqlens: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of TTT step S-1.

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
    kf = k.float().repeat_interleave(group, dim=2)  # [S, T, Hq, D]
    vf = v.float().repeat_interleave(group, dim=2)
    qf = q.float()
    out = torch.empty(T, Hq, D, dtype=torch.float32, device=q.device)
    for a, b in _segments(cu_seqlens, T):
        n = b - a
        qs = qf[a:b].transpose(0, 1)                                    # [Hq, n, D]
        causal = qs @ kf[0, a:b].permute(1, 2, 0) * scale               # [Hq, n, n]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        causal = causal.masked_fill(~mask, float("-inf"))
        diag = (qf[a:b].unsqueeze(0) * kf[1:, a:b]).sum(-1) * scale     # [S-1, n, Hq]
        scores = torch.cat([causal, diag.permute(2, 1, 0)], dim=-1)    # [Hq, n, n + S-1]
        probs = scores.softmax(-1)
        o = probs[..., :n] @ vf[0, a:b].transpose(0, 1)                 # [Hq, n, D]
        o = o + (probs[..., n:].permute(2, 1, 0).unsqueeze(-1) * vf[1:, a:b]).sum(0).transpose(0, 1)
        out[a:b] = o.transpose(0, 1)
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
