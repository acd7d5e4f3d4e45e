"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2 and GLM-5): a small indexer scores every earlier key of a query and
the query attends to its `index_topk` best only (transformers 5.24 `DeepseekV32Indexer` / `GlmMoeDsaIndexer`). Up to
`index_topk` keys every key is chosen, so attention there is dense MLA; past it, queries run a row block at a time:
index scores [rows, heads, L] then the top-k mask [rows, L], never [T, T]."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from eagle3.models.attention import cached_attention
from eagle3.models.weights import TargetError, TextConfig

# elements of one row block's fp32 index scores [rows, heads, L] (1 GiB) or boolean mask [rows, L]
BLOCK_ELEMENTS = 1 << 28


@dataclass(frozen=True)
class IndexerSpec:
    heads: int
    head_dim: int
    topk: int
    rope_dim: int
    interleaved: bool            # GLM-5 rotates adjacent pairs; DeepSeek-V3.2 the two halves
    source: tuple[int, ...]      # per layer: the layer whose indexer chooses its keys (itself, or a full one before)

    @classmethod
    def from_config(cls, c: TextConfig, rope_dim: int) -> IndexerSpec:
        raw, where = c.raw, c.source
        types = layer_types(raw, c.num_hidden_layers, where)
        if types[0] != "full":
            raise TargetError(f"{where}: indexer_types[0] = '{types[0]}'; the first layer must be 'full' (a 'shared' "
                              "layer reuses the keys the full layer before it chose)")
        if raw["index_topk"] < 1 or not rope_dim <= raw["index_head_dim"]:
            raise TargetError(f"{where}: index_topk {raw['index_topk']} and index_head_dim {raw['index_head_dim']}; "
                              f"expected a top-k of at least 1 and a head of at least qk_rope_head_dim {rope_dim}")
        source = []
        for i, kind in enumerate(types):
            source.append(i if kind == "full" else source[-1])
        return cls(heads=raw["index_n_heads"], head_dim=raw["index_head_dim"], topk=raw["index_topk"],
                   rope_dim=rope_dim, interleaved=c.text_model_type == "glm_moe_dsa", source=tuple(source))


def layer_types(raw: dict, layers: int, where: str) -> list[str]:
    """'full' or 'shared' per layer as transformers 5.24's `GlmMoeDsaConfig` derives them: `indexer_types`, else the
    pattern `index_topk_pattern` ("FSS..."), else every `index_topk_freq`-th layer from `index_skip_topk_offset`."""
    types = raw.get("indexer_types")
    if types is None and (pattern := raw.get("index_topk_pattern")) is not None:
        types = [{"F": "full", "S": "shared"}.get(ch, ch) for ch in pattern]
    if types is None:
        freq, offset = max(int(raw.get("index_topk_freq") or 1), 1), int(raw.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if len(types) != layers or set(types) - {"full", "shared"}:
        raise TargetError(f"{where}: indexer_types {types}; expected 'full' or 'shared' for each of the {layers} layers")
    return list(types)


def shapes(spec: IndexerSpec, hidden: int, q_lora_rank: int) -> dict[str, tuple[int, int]]:
    """[out, in] of a full layer's indexer linears (`self_attn.indexer.*`)."""
    p = "self_attn.indexer."
    return {p + "wq_b": (spec.heads * spec.head_dim, q_lora_rank), p + "wk": (spec.head_dim, hidden),
            p + "weights_proj": (spec.heads, hidden)}


def queries_and_keys(w: dict, x: torch.Tensor, q_resid: torch.Tensor, rope: Callable, spec: IndexerSpec):
    """x [T, H] (the normed layer input), q_resid [T, q_lora] (q_a_layernorm's output) -> queries [T, heads, D],
    keys [T, D] (LayerNorm `k_norm`, eps 1e-6), head weights [T, heads] fp32 (`weights_proj` in fp32, times
    heads^-0.5); rotary on the first rope_dim of each, by `rope(x [T, n, r])`."""
    p, T, D = "self_attn.indexer.", x.shape[0], spec.head_dim
    q = F.linear(q_resid, w[p + "wq_b"]).view(T, spec.heads, D)
    k = F.layer_norm(F.linear(x, w[p + "wk"]), (D,), w[p + "k_norm.weight"], w[p + "k_norm.bias"], 1e-6)[:, None]
    q, k = (torch.cat([rope(t[..., :spec.rope_dim]), t[..., spec.rope_dim:]], -1) for t in (q, k))
    weights = F.linear(x.float(), w[p + "weights_proj"]) * spec.heads ** -0.5
    return q, k[:, 0], weights


def select(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
           topk: int) -> torch.Tensor:
    """Queries q [n, heads, D] at positions [n] (key j sits at position j) of keys [L, D] -> the `topk` keys each
    keeps [n, topk] int32, by Σ_h weights[h] · relu(q_h · k / sqrt(D)) over its causal keys, in fp32; of keys tied
    at the cut, the earlier."""
    n, heads, D = q.shape
    L = keys.shape[0]
    keys_t = keys.float().T
    out = torch.empty(n, topk, dtype=torch.int32, device=q.device)
    rows = max(1, BLOCK_ELEMENTS // (heads * L))
    for a in range(0, n, rows):
        b = min(a + rows, n)
        scores = F.relu(torch.matmul(q[a:b].float(), keys_t) * D ** -0.5)                 # [r, heads, L]
        index = torch.matmul(weights[a:b, None], scores)[:, 0]                            # [r, L]
        index.masked_fill_(torch.arange(L, device=q.device) > positions[a:b, None], float("-inf"))
        # a stable sort, not topk: keys tied at the cut (ReLU zeros) go to the earlier one whatever the row block
        out[a:b] = index.sort(dim=-1, descending=True, stable=True).indices[:, :topk]
    return out


def sparse_attention(q: torch.Tensor, positions: torch.Tensor, chosen: torch.Tensor, length: int, expand: Callable,
                     scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions [n] attending to the keys `chosen` [n, k] among the sequence's first `length`, whose
    keys and values expand(a, b) gives for heads a..b ([length, b - a, D], [length, b - a, Dv]) -> [n, Hq, Dv].
    Head slices hold no more key elements than q; row blocks no more (head, query, key) triples than BLOCK_ELEMENTS,
    so even SDPA's unfused path (scores in fp32) stays bounded."""
    n, heads = q.shape[:2]
    width = max(1, heads * n // length)
    rows = max(1, BLOCK_ELEMENTS // (length * min(width, heads)))
    later = torch.arange(length, device=q.device)
    outs = []
    for h in range(0, heads, width):
        k, v = expand(h, min(h + width, heads))
        dv, pad = v.shape[-1], max(0, q.shape[-1] - v.shape[-1])
        v = F.pad(v, (0, pad)) if pad else v
        out = q.new_empty(n, k.shape[1], dv)
        for a in range(0, n, rows):
            b = min(a + rows, n)
            mask = torch.zeros(b - a, length, dtype=torch.bool, device=q.device).scatter_(1, chosen[a:b].long(), True)
            mask &= later <= positions[a:b, None]
            out[a:b] = cached_attention(q[a:b, h:h + width], k, v, scale, mask=mask)[..., :dv]
        outs.append(out)
    return torch.cat(outs, 1) if len(outs) > 1 else outs[0]
