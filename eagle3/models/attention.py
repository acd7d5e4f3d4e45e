"""Attention of packed sequences for the target forwards: causal over each sequence for extraction, a long
sequence's chunks against the keys of the chunks before them (`Prefix`), against a KV cache for decoding
(`incremental.LayerPass`)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right


def sdpa(q, k, v, **kw) -> torch.Tensor:
    """q/k/v [n, heads, D] -> [n, heads, Dv], in 4-D: with 3-D inputs SDPA silently takes the math path."""
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)[0].transpose(0, 1)


def causal_attention_packed(q, k, v, cu_seqlens, scale=None, window: int = 0, sinks=None):
    """Causal attention of each packed sequence: q/k [T, heads, D], v [T, Hkv, Dv] -> [T, Hq, Dv]; a narrower v
    (MLA) runs as it is under cuDNN where cuDNN takes it, else zero-padded (flash needs equal head dims); with a
    `window` or `sinks`, `cached_attention`'s."""
    dv = v.shape[-1]
    pad = max(0, q.shape[-1] - dv)
    out = q.new_empty(q.shape[0], q.shape[1], dv)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = q[a:b], k[a:b], v[a:b]
        if window or sinks is not None:
            out[a:b] = cached_attention(qs, ks, vs, scale, window, sinks)
        elif pad and cudnn_takes(qs, ks, vs):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                out[a:b] = sdpa(qs, ks, vs, is_causal=True, scale=scale)
        else:
            out[a:b] = sdpa(qs, ks, F.pad(vs, (0, pad)) if pad else vs, is_causal=True, scale=scale)[..., :dv]
    return out


def cudnn_takes(q, k, v) -> bool:
    """Whether cuDNN's fused attention runs these causal q/k/v [T, heads, D]."""
    if not q.is_cuda:
        return False
    params = torch.backends.cuda.SDPAParams(*[x.transpose(0, 1)[None] for x in (q, k, v)], None, 0.0, True,
                                            q.shape[1] != k.shape[1])
    return torch.backends.cuda.can_use_cudnn_attention(params)


# a window's queries run this many at a time, each block against its own keys: masks of [block, block + window]
WINDOW_BLOCK = 4096
SINK_PAD = 8   # the sink's column in q and k, padded to a width fused kernels take


def cached_attention(q, k, v, scale=None, window: int = 0, sinks=None, mask=None):
    """The last q.shape[0] positions of a sequence attending to all its k/v [n, Hkv, D], causally (with `window`
    > 0: the keys less than `window` positions back; `sinks` [Hq]: a learned logit per head in every softmax's
    denominator, gpt-oss's; a boolean `mask` [T, n]: the keys it allows, as given); without any the causal bias
    aligned to the last key runs in flash / memory-efficient attention on CUDA without a [T, n] mask."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if mask is not None:
        return sdpa(q, k, v, attn_mask=mask, scale=scale)
    if not window and sinks is None:
        return sdpa(q, k, v, attn_mask=causal_lower_right(q.shape[0], k.shape[0]), scale=scale)
    T, n = q.shape[0], k.shape[0]
    if sinks is not None:
        q, k, v = with_sink(q, k, v, sinks, scale, seq_dim=0)
    if not window:   # the sink key comes first: the lower-right causal bias shows it to every query
        return sdpa(q, k, v, attn_mask=causal_lower_right(T, n + 1), scale=scale)
    out = []
    for a in range(n - T, n, WINDOW_BLOCK):   # query positions a..b of the sequence see keys lo..b
        b = min(a + WINDOW_BLOCK, n)
        lo = max(0, a - window + 1)
        # query a + r sees key lo + c when 0 <= a + r - lo - c < window: a band of diagonals, built in bools
        mask = torch.ones(b - a, b - lo, dtype=torch.bool, device=q.device).tril(a - lo).triu(a - lo - window + 1)
        rows = slice(a - (n - T), b - (n - T))
        if sinks is None:
            out.append(sdpa(q[rows], k[lo:b], v[lo:b], attn_mask=mask, scale=scale))
        else:
            keys = torch.cat([k[:1], k[1 + lo:1 + b]])
            values = torch.cat([v[:1], v[1 + lo:1 + b]])
            out.append(sdpa(q[rows], keys, values, attn_mask=F.pad(mask, (1, 0), value=True), scale=scale))
    return torch.cat(out) if len(out) > 1 else out[0]


def with_sink(q, k, v, sinks, scale: float, seq_dim: int):
    """q [..., Hq, D], k/v with keys along `seq_dim` -> the same with one more key in front whose logit is each
    head's sink and whose value is zero: q gains a column sinks / scale, k a one-hot sink key (SINK_PAD wide)."""
    extra = q.new_zeros(*q.shape[:-1], SINK_PAD)
    extra[..., 0] = (sinks.float() / scale).to(q.dtype)
    q = torch.cat([q, extra], -1)
    k = F.pad(k, (0, SINK_PAD))
    key = torch.zeros_like(k.narrow(seq_dim, 0, 1))
    key[..., k.shape[-1] - SINK_PAD] = 1
    return q, torch.cat([key, k], seq_dim), torch.cat([torch.zeros_like(v.narrow(seq_dim, 0, 1)), v], seq_dim)


class Prefix:
    """One layer's keys of one sequence run a chunk of tokens at a time, in order (`streaming.run_layers`): each
    chunk appends what its tokens leave for the later ones (MLA: the normed latent and the roped k_pe; GQA: k, v)
    and its queries attend to everything appended so far, causally: nothing is [T, T], nor keys of every query
    head over all T tokens."""

    def __init__(self, length: int):
        self.length, self.filled, self.parts = length, 0, None

    def extend(self, *parts: torch.Tensor) -> list[torch.Tensor]:
        """This chunk's rows [n, ...] of each part -> each part's rows of every token so far [filled, ...]."""
        if self.parts is None:
            self.parts = [p.new_empty(self.length, *p.shape[1:]) for p in parts]
        n = parts[0].shape[0]
        for buf, p in zip(self.parts, parts):
            buf[self.filled:self.filled + n] = p
        self.filled += n
        return [buf[:self.filled] for buf in self.parts]

    def attend(self, q, k, v, scale=None, window: int = 0, sinks=None) -> torch.Tensor:
        """`LayerPass.attend`'s interface (GQA): this chunk's q [n, Hq, D], k/v [n, Hkv, D|Dv] -> [n, Hq, Dv]."""
        keys, values = self.extend(k, v)
        if window or sinks is not None:   # the window's keys only: nothing grows with the sequence
            lo = max(0, self.filled - q.shape[0] - window + 1) if window else 0
            return cached_attention(q, keys[lo:], values[lo:], scale, window, sinks)
        group = q.shape[1] // k.shape[1]
        return self.attend_heads(q, lambda a, b: tuple(x[:, a // group:b // group].repeat_interleave(group, 1)
                                                       for x in (keys, values)), scale, group)

    def attend_heads(self, q, expand: Callable, scale=None, step: int = 1) -> torch.Tensor:
        """q [n, Hq, D] of the last n tokens -> [n, Hq, Dv]; expand(a, b) gives the keys and values of query heads
        a..b over all `filled` tokens ([filled, b - a, D], [filled, b - a, Dv]). Heads run in slices (multiples of
        `step`) whose keys hold no more elements than q: peak memory follows the chunk, not the sequence, and
        softmax being per head, the slices need no merging (splitting the keys would, by log-sum-exp)."""
        n, heads = q.shape[:2]
        width = max(step, heads * n // self.filled // step * step)
        outs = []
        for a in range(0, heads, width):
            k, v = expand(a, min(a + width, heads))
            dv, pad = v.shape[-1], max(0, q.shape[-1] - v.shape[-1])   # flash wants v as wide as q/k
            outs.append(cached_attention(q[:, a:a + width], k, F.pad(v, (0, pad)) if pad else v, scale)[..., :dv])
        return torch.cat(outs, 1) if len(outs) > 1 else outs[0]


def padded_cached_attention(q, k_cache, v_cache, rows, pad_index, mask, scale=None, sinks=None):
    """New tokens q [t, Hq, D] of R sequences (padded rows pad_index = r * n + i) against their cached keys
    k/v_cache[rows, :L] in one call -> [t, Hq, Dv]. GQA is folded into the query length of mask [R, 1, n * G, L]
    so any fused kernel applies; padded queries (zeros) see key 0 at least: every row stays finite."""
    R, _, rows_per_head, L = mask.shape
    Hq, Hkv = q.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    n = rows_per_head // G
    k, v = k_cache[rows, :L].transpose(1, 2), v_cache[rows, :L].transpose(1, 2)    # [R, Hkv, L, D]
    if sinks is not None:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        q, k, v = with_sink(q, k, v, sinks, scale, seq_dim=2)
        mask = F.pad(mask, (1, 0))
    D = q.shape[2]
    padded = q.new_zeros(R * n, Hq, D).index_copy_(0, pad_index, q)
    folded = padded.view(R, n, Hkv, G, D).transpose(1, 2).reshape(R, Hkv, n * G, D)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)  # [R, Hkv, n * G, Dv]
    return out.view(R, Hkv, n, G, -1).transpose(1, 2).reshape(R * n, Hq, -1).index_select(0, pad_index)
