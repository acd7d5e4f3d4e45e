"""What `train.kernels = "torch"` runs on CUDA: compiled flex_attention with the TTT block mask (built
once per packing) and the reference loss under torch.compile; `kernels.reference`'s signatures."""
from __future__ import annotations

import functools

import torch

from eagle3.kernels import reference


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=64)
def _block_mask(T: int, S: int, bounds: tuple[int, ...], device: str, window: int):
    """Keys of all steps side by side ([S*T]): step 0 causal within the sequence (and the window), later steps the
    diagonal only."""
    from torch.nn.attention.flex_attention import create_block_mask
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
    seq_id = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)

    def ttt_mask(b, h, q_idx, kv_idx):
        step, pos = kv_idx // T, kv_idx % T
        causal = (step == 0) & (pos <= q_idx) & (seq_id[pos] == seq_id[q_idx])
        if window:
            causal = causal & (q_idx - pos < window)
        return causal | ((step > 0) & (pos == q_idx))

    return create_block_mask(ttt_mask, B=None, H=None, Q_LEN=T, KV_LEN=S * T, device=device)


def ttt_attention(q: torch.Tensor, k: torch.Tensor | list, v: torch.Tensor | list,
                  cu_seqlens: torch.Tensor | None = None, scale: float | None = None, window: int = 0,
                  k_pe: torch.Tensor | list | None = None) -> torch.Tensor:
    """`kernels.reference.ttt_attention`; MLA's shared rotary key (k_pe) by the padded form (`reference.padded_mla`)."""
    if k_pe is not None:
        return reference.padded_mla(ttt_attention, q, k, v, cu_seqlens, scale, k_pe, window=window)
    k, v = reference.steps_tensor(k), reference.steps_tensor(v)
    S, T, Hkv, D = k.shape
    bounds = tuple(cu_seqlens.tolist()) if cu_seqlens is not None else (0, T)   # host copy: no sync
    mask = _block_mask(T, S, bounds, str(q.device), window)
    k, v = (x.reshape(S * T, Hkv, D).transpose(0, 1)[None] for x in (k, v))   # [1, Hkv, S*T, D]
    out = _compiled_flex()(q.transpose(0, 1)[None], k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != Hkv)
    return out[0].transpose(0, 1)


@functools.cache
def _compiled_loss():
    return torch.compile(reference.ttt_loss, dynamic=True)


def ttt_loss_steps(hs, w, ps, valids=None, weights=None, p_rows=None, *, loss="kl", temperature=1.0, eta=3.0):
    """`kernels.reference.ttt_loss_steps` with each step's loss compiled (one graph per loss kind)."""
    return reference.ttt_loss_steps(hs, w, ps, valids, weights, loss_fn=_compiled_loss(), p_rows=p_rows,
                                    loss=loss, temperature=temperature, eta=eta)
