"""Sampling and speculative decoding's verification rule as vLLM and SGLang run it (docs/sampling.md); every draw
an inverse-CDF lookup of a uniform from the caller's per-prompt generator, so batching changes nothing."""
from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class Sampling:
    """How a request is served (checked as config keys): the target's temperature and top_p, and how the draft
    proposes: "greedy", its argmax (q one-hot), or "probabilistic", a sample of q."""
    temperature: float = 0.0
    top_p: float = 1.0
    draft: str = "greedy"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> fp32 probabilities at `temperature` (> 0), top-p truncated: a token is kept
    when the mass of the tokens more likely than it is below top_p (so the most likely one always)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1:
        return probs
    ordered, order = probs.sort(dim=-1, descending=True)
    drop = ordered.cumsum(-1) - ordered >= top_p                     # mass above each token reaches top_p
    probs = probs.scatter(-1, order, ordered.masked_fill(drop, 0.0))
    return probs / probs.sum(-1, keepdim=True)


def draft_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The draft's q over its own vocabulary, [..., V_d] fp32 (no top-p: the engines apply none)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of probs [B, V] (any non-negative weights) from uniforms u [B] in [0, 1):
    the first index whose cumulative weight exceeds u times the row's total."""
    cdf = probs.cumsum(-1)
    index = torch.searchsorted(cdf, (u.to(cdf) * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return index.clamp(max=probs.shape[-1] - 1)   # u·total rounding up to the total


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejected position's token comes from: max(p - q, 0) (unnormalised; `draw` scales).
    Where p <= q everywhere (no mass left: p = q up to rounding) it is p itself."""
    r = (p - q).clamp(min=0)
    empty = r.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p, r)


def verify(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, u_accept: torch.Tensor,
           u_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One round for B chains: drafts [B, k], the target's p [B, k+1, V] after each prefix, the draft's q [B, k, V]
    (None: greedy, one-hot), uniforms -> (accepted drafts [B], the recovered or bonus token after them [B])."""
    B, k = drafts.shape
    rows = torch.arange(B, device=p.device)
    p_x = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)                # [B, k]
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    ok = u_accept.to(p_x) < (p_x / q_x).clamp(max=1.0)                        # [B, k] accepted: min(1, p/q)
    a = ok.int().cumprod(-1).sum(-1)                                           # leading accepted drafts
    p_at = p[rows, a]                                                          # [B, V]
    if q is None:
        q_at = torch.zeros_like(p_at).scatter_(-1, drafts[rows, a.clamp(max=k - 1)].unsqueeze(-1), 1.0)
    else:
        q_at = q[rows, a.clamp(max=k - 1)]
    rejected = (a < k).unsqueeze(-1)
    return a, draw(torch.where(rejected, residual(p_at, q_at), p_at), u_token)


def uniforms(generators: list[torch.Generator], n: int) -> torch.Tensor:
    """[B, n] uniforms on the CPU, row b from generators[b] (each prompt's own stream)."""
    return torch.stack([torch.rand(n, generator=g) for g in generators])


def sample(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator]) -> list[int]:
    """One token per row of logits [B, V] (argmax at T = 0), row b's uniform from generators[b]: one batched draw."""
    if temperature == 0:
        return logits.argmax(-1).tolist()
    u = uniforms(generators, 1)[:, 0].to(logits.device)
    return draw(target_probs(logits, temperature, top_p), u).tolist()
