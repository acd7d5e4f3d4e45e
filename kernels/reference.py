"""Pure-torch ground truth of the TTT kernels and the row spread: what the Triton kernels are tested against and what
runs on the CPU; the losses (`LOSSES`) are defined in docs/losses.md, autograd gives their gradients."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def spread_rows(src: torch.Tensor, index: torch.Tensor, total: int, fill=0) -> torch.Tensor:
    """src [n, ...] at rows `index` (distinct) of a [total, ...] tensor filled with `fill`."""
    return src.new_full((total, *src.shape[1:]), fill).index_copy(0, index, src)


def _one_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """q [n, Hq, D]; k [S, n, Hq, D], v [S, n, Hq, Dv] (heads already expanded), fp32 -> [n, Hq, Dv]."""
    n = q.shape[0]
    causal = torch.einsum("thd,shd->hts", q, k[0]) * scale                  # [Hq, n, n]
    visible = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if window:   # key j visible to query i when i - j < window
        visible = visible.triu(1 - window)
    causal = causal.masked_fill(~visible, float("-inf"))
    diag = torch.einsum("thd,jthd->htj", q, k[1:]) * scale                 # [Hq, n, S-1]
    probs = torch.cat([causal, diag], dim=-1).softmax(-1)
    out = torch.einsum("hts,shd->thd", probs[..., :n], v[0])
    return out + torch.einsum("htj,jthd->thd", probs[..., n:], v[1:])


def steps_shape(x: torch.Tensor | list) -> tuple[int, ...]:
    """(S, T, Hkv, D) of keys or values given as one [S, T, Hkv, D] tensor or as S per-step [T, Hkv, D] tensors."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    shapes = {tuple(t.shape) for t in x}
    if len(shapes) != 1 or len(next(iter(shapes))) != 3:
        raise ValueError(f"ttt_attention: per-step keys and values must share one [T, Hkv, D] shape, got {shapes}")
    return (len(x), *shapes.pop())


def steps_tensor(x: torch.Tensor | list) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.stack(list(x))


def with_shared_key(k: torch.Tensor | list, k_pe: torch.Tensor | list) -> torch.Tensor:
    """MLA's keys per head: k [S, T, H, Dn] beside the rotary key k_pe [S, T, 1, Dr] that every head shares (or lists
    of S per-step tensors) -> [S, T, H, Dn + Dr]."""
    k, k_pe = steps_tensor(k), steps_tensor(k_pe)
    return torch.cat([k, k_pe.expand(*k.shape[:3], k_pe.shape[-1])], -1)


def ttt_attention(q: torch.Tensor, k: torch.Tensor | list, v: torch.Tensor | list,
                  cu_seqlens: torch.Tensor | None = None, scale: float | None = None, window: int = 0,
                  k_pe: torch.Tensor | list | None = None) -> torch.Tensor:
    """Attention of TTT step S-1: q [T, Hq, D] sees the step-0 keys of k [S, T, Hkv, D], v [S, T, Hkv, Dv] (or lists
    of S per-step [T, Hkv, ·]) causally within its sequence (cu_seqlens [n+1] or None; with `window` > 0 only keys j
    with i - j < window) and, at each later step j, only k[j, t] -> [T, Hq, Dv]. MLA: k_pe [S, T, 1, Dr] (or a list)
    is a rotary key every head shares, met by q's last Dr dims (k then holds the other D - Dr)."""
    k, v = steps_tensor(k) if k_pe is None else with_shared_key(k, k_pe), steps_tensor(v)
    S, T, Hkv, D = k.shape
    Hq = q.shape[1]
    if q.shape != (T, Hq, D) or v.shape[:3] != k.shape[:3] or Hq % Hkv:
        raise ValueError(f"ttt_attention: bad shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != T:
        raise ValueError(f"ttt_attention: cu_seqlens must run from 0 to T={T}, got {bounds[0]}..{bounds[-1]}")
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    scale, group = D ** -0.5 if scale is None else scale, Hq // Hkv
    # split (not slice) per sequence: its backward is one concatenation, not a zero-fill per piece
    qs = q.float().split(lengths, dim=0)
    ks = k.float().repeat_interleave(group, dim=2).split(lengths, dim=1)
    vs = v.float().repeat_interleave(group, dim=2).split(lengths, dim=1)
    out = torch.cat([_one_sequence(*parts, scale, window) for parts in zip(qs, ks, vs)])
    return out.to(q.dtype)


def padded_mla(attention, q: torch.Tensor, k: torch.Tensor | list, v: torch.Tensor | list, cu_seqlens=None,
               scale: float | None = None, k_pe: torch.Tensor | list = None, **options) -> torch.Tensor:
    """MLA's attention (`ttt_attention`'s k_pe form) by an `attention` of one head dim D for q, k and v: the keys
    joined with the shared rotary key, q, k, v zero-padded to the least power of two >= 64 holding q/k and v (Kimi:
    192 and 128 -> 256), the output cut back to v's width. Zeros add nothing to q.k: exact, at the padding's cost."""
    k, v = with_shared_key(k, k_pe), steps_tensor(v)
    dv, scale = v.shape[-1], q.shape[-1] ** -0.5 if scale is None else scale
    width = max(64, 1 << (max(q.shape[-1], dv) - 1).bit_length())
    q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    return attention(q, k, v, cu_seqlens, scale=scale, **options)[..., :dv]


LOSSES = ("kl", "tv", "nla", "lk_hybrid", "pq")   # the Triton kernel takes the index (`LOSS`)
ALPHA_EPS = 1e-5   # nla and pq clamp their probability here before the log (speculators' value)


def loss_index(loss: str, temperature: float) -> int:
    """The index of `loss` in LOSSES; ValueError for an unknown name or a temperature that is not > 0."""
    if loss not in LOSSES:
        raise ValueError(f"ttt_loss: unknown loss {loss!r}, expected one of {', '.join(LOSSES)}")
    if not temperature > 0:
        raise ValueError(f"ttt_loss: temperature must be > 0, got {temperature!r}")
    return LOSSES.index(loss)


def ttt_loss(h: torch.Tensor, w: torch.Tensor, p: torch.Tensor, valid: torch.Tensor | None = None,
             loss: str = "kl", temperature: float = 1.0, eta: float = 3.0,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss of q = softmax(h wᵀ / temperature) (h [N, H], w [V, H]) against p [N, V] -> (loss, first argmax
    of the logits, detached α = Σ min(p, q)), [N] each, 0, -1 and 0 on rows not `valid`; differentiable in h, w."""
    kind = LOSSES[loss_index(loss, temperature)]
    N = h.shape[0]
    if valid is None:
        valid = torch.ones(N, dtype=torch.bool, device=h.device)
    logits = (h @ w.t()).float()                                        # [N, V]
    logq = F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    p = p.float()
    if kind == "kl":   # α only reported: no graph through it, one [N, V] temporary
        q = logq.detach().exp()
        alpha = torch.minimum(q, p, out=q).sum(-1)
        row = -(p * logq).sum(-1)
    else:
        q = logq.exp()
        alpha = torch.where(q <= p, q, p).sum(-1)   # min(p, q); its gradient takes q where q <= p
        if kind == "tv":
            row = 1 - alpha
        elif kind == "nla":
            row = -alpha.clamp_min(ALPHA_EPS).log()
        elif kind == "lk_hybrid":
            lam = torch.exp(-eta * alpha).detach()
            kl = torch.xlogy(p, p).sum(-1) - (p * logq).sum(-1)
            row = lam * kl + (1 - lam) * (1 - alpha)
        else:   # pq
            row = -(p * q).sum(-1).clamp_min(ALPHA_EPS).log()
    zero = torch.zeros_like(row)
    row = torch.where(valid, row, zero)
    alpha = torch.where(valid, alpha.detach(), zero)
    argmax = torch.where(valid, logits.argmax(-1), torch.full_like(valid, -1, dtype=torch.long))
    return row, argmax, alpha


def ttt_loss_steps(hs, w, ps, valids=None, weights=None, loss_fn=None, p_rows=None, *,
                   loss: str = "kl", temperature: float = 1.0, eta: float = 3.0):
    """All K steps: (Σ_k Σ_i weights[k] · loss_k,i, losses, argmaxes, alphas); valids[k] a bool mask or row indices,
    p_rows[k] the rows of ps[k] that hs[k] reads (or None); `loss_fn` replaces `ttt_loss` per step."""
    loss_index(loss, temperature)
    loss_fn = loss_fn or ttt_loss
    K = len(hs)
    valids = [None] * K if valids is None else list(valids)
    weights = [1.0] * K if weights is None else list(weights)
    ps = [p if r is None else p[r] for p, r in zip(ps, [None] * K if p_rows is None else p_rows)]
    total, losses, argmaxes, alphas = 0.0, [], [], []
    for h, p, valid, weight in zip(hs, ps, valids, weights):
        if valid is not None and valid.dtype in (torch.int64, torch.int32):   # row indices -> mask
            valid = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device).index_fill_(0, valid.long(), True)
        row, argmax, alpha = loss_fn(h, w, p, valid, loss=loss, temperature=temperature, eta=eta)
        total = total + (row * weight).sum()
        losses.append(row.detach())
        argmaxes.append(argmax)
        alphas.append(alpha.detach())
    return total, losses, argmaxes, alphas
