"""The EAGLE-3 draft model.

Parameter names equal the exported vLLM names (`fc.weight`, `layers.0.self_attn.q_proj.weight`,
...), so export is a rename-free copy. Token embeddings and the target head rows are frozen
buffers owned by the trainer, not by this module.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from eagle3.float8 import linears as float8_linears
from eagle3.linear import dense_linears
from eagle3.resolve import DraftSpec
from eagle3.ops import (apply_rope, compiled, fused_rms_norm, gather_rows, llama_inv_freq, rms_norm, rope_cos_sin,
                        scatter_rows, silu_mul)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fn = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight.to(x.dtype), self.eps)


@dataclass
class Rows:
    """Which packed rows a TTT step computes (row skipping; None = all `total` rows), and the
    gathers and scatters that go with it, so that the layers see only the rows they work on.

    `computed` [C]: global indices of the rows whose inputs are given; `kept` [N]: indices into the
    computed rows whose outputs are needed. Every computed row still provides its keys and values."""
    total: int
    computed: torch.Tensor | None = None
    kept: torch.Tensor | None = None

    def kept_global(self) -> torch.Tensor | None:
        if self.kept is None:
            return self.computed
        return self.kept if self.computed is None else self.computed[self.kept]

    def all_kept(self) -> "Rows":
        return Rows(self.total, self.computed, None)

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """[C, ...] of the computed rows -> [N, ...] of the kept ones."""
        return gather_rows(x, self.kept)

    def spread_computed(self, x: torch.Tensor) -> torch.Tensor:
        """[C, ...] -> [total, ...], zero where not computed (keys and values: no other row reads those)."""
        return scatter_rows(x, self.computed, self.total)

    def spread_kept(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [total, ...], zero where not kept (queries for the attention kernels)."""
        return scatter_rows(x, self.kept_global(), self.total)

    def take_kept(self, x: torch.Tensor) -> torch.Tensor:
        """[total, ...] -> [N, ...]: the inverse of `spread_kept`."""
        return gather_rows(x, self.kept_global())


class Attention(nn.Module):
    def __init__(self, spec: DraftSpec, in_dim: int):
        super().__init__()
        s = spec
        self.heads, self.kv_heads, self.head_dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.q_proj = nn.Linear(in_dim, s.num_attention_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, s.num_key_value_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, s.num_key_value_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)
        self.rope = apply_rope
        self.linears = dense_linears

    def forward(self, x, cos, sin, cache, attention, cu_seqlens, rows: Rows):
        """x [C, in_dim] for the computed rows; appends this step's keys/values (laid out over all
        rows, zero where not computed: no other row reads them) to `cache`, attends over all
        cached steps; returns [N, H] for the kept rows. Decoding passes instead a KV pool's pass
        as `cache` (incremental.LayerPass: it stores the keys and attends causally; all rows kept)."""
        C = x.shape[0]
        if rows.kept is None:   # every computed row is kept: q, k, v read one input
            q, k, v = self.linears(x, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
            cos_q, sin_q = cos, sin
        else:
            k, v = self.linears(x, self.k_proj.weight, self.v_proj.weight)
            (q,) = self.linears(rows.keep(x), self.q_proj.weight)
            cos_q, sin_q = rows.keep(cos), rows.keep(sin)
        k = self.rope(k.view(C, self.kv_heads, self.head_dim), cos, sin)
        v = v.view(C, self.kv_heads, self.head_dim)
        q = self.rope(q.view(q.shape[0], self.heads, self.head_dim), cos_q, sin_q)
        if isinstance(cache, list):
            cache.append((rows.spread_computed(k), rows.spread_computed(v)))
            keys = torch.stack([kv[0] for kv in cache])      # [S, T, Hkv, D]
            values = torch.stack([kv[1] for kv in cache])
            out = rows.take_kept(attention(rows.spread_kept(q), keys, values, cu_seqlens))
        else:
            out = cache.attend(q, k, v)
        return self.linears(out.flatten(1), self.o_proj.weight)[0]


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = silu_mul
        self.linears = dense_linears

    def forward(self, x):
        gate, up = self.linears(x, self.gate_proj.weight, self.up_proj.weight)
        return self.linears(self.act(gate, up), self.down_proj.weight)[0]


class DecoderLayer(nn.Module):
    """Layer 0 is the EAGLE-3 layer: attention reads [input_layernorm(embed) | hidden_norm(h)]
    (2H wide, embedding first); later layers, if any, are plain Llama layers."""

    def __init__(self, spec: DraftSpec, first: bool):
        super().__init__()
        H = spec.hidden_size
        self.first = first
        self.norm_before_residual = spec.norm_before_residual
        self.input_layernorm = RMSNorm(H, spec.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(H, spec.rms_norm_eps)
        self.self_attn = Attention(spec, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, spec.rms_norm_eps)
        self.mlp = MLP(H, spec.intermediate_size)

    def forward(self, h, emb, cos, sin, cache, attention, cu_seqlens, rows: Rows):
        """h, emb, cos, sin for the computed rows -> the layer's output for the kept rows."""
        if self.first:
            normed = self.hidden_norm(h)
            if self.norm_before_residual:   # the normed state is also the residual
                h = normed
            x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        else:
            x = self.input_layernorm(h)
        h = rows.keep(h) + self.self_attn(x, cos, sin, cache, attention, cu_seqlens, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.spec = spec
        H_t = spec.target_hidden_size
        if spec.norm_before_fc:
            self.input_norm = RMSNorm(3 * H_t, spec.rms_norm_eps)
        if spec.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(H_t, spec.rms_norm_eps) for _ in range(3))
        self.fc = nn.Linear(3 * H_t, spec.hidden_size, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(spec, i == 0) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(spec.target_vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", llama_inv_freq(spec.head_dim, spec.rope_theta, None),
                             persistent=False)
        self.linears = dense_linears
        self.reset_parameters()

    def use_float8(self) -> None:
        """Every linear layer of the draft (fc, attention projections, MLP) as fp8 GEMMs (train.float8)."""
        for m in self.modules():
            if "linears" in vars(m):
                m.linears = float8_linears

    def compile_elementwise(self) -> None:
        """RMSNorm as one Triton kernel each way on a GPU (`ops.fused_rms_norm`), RoPE and SiLU·up
        through torch.compile (GPU training: their eager fp32 chains otherwise cost about a tenth of
        the step in memory traffic)."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fn = fused_rms_norm
            for name in ("rope", "act"):
                if name in vars(m):
                    setattr(m, name, compiled(getattr(m, name)))

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def step(self, h: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor, caches: list,
             attention, cu_seqlens, rows: Rows | None = None) -> torch.Tensor:
        """One TTT step: h, token embeddings [C, H] and positions [C] of the computed rows ->
        output [N, H] of the kept rows (all T rows when `rows` is None; pre-norm unless
        norm_output), the next step's state; `caches` holds one cache per layer (see Attention). Only
        the last layer drops rows: earlier layers' outputs of every computed row feed the next layer's keys."""
        rows = rows or Rows(h.shape[0])
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            h = layer(h, emb, cos, sin, cache, attention, cu_seqlens, rows if i == last else rows.all_kept())
        return self.norm(h) if self.spec.norm_output else h

    def unroll(self, aux: torch.Tensor, attention, cu_seqlens, next_inputs) -> Iterator[torch.Tensor]:
        """The draft's chain, as training-time test and speculative decoding both run it: fc over
        the aux states [T, 3H], then one `step` per round of `next_inputs(k, h)`, which is given
        the previous output (fc's for k = 0) and returns step k's (h, token embeddings, positions,
        rows), or None to stop. Yields each step's output (`step`'s); the steps share one KV cache."""
        caches = [[] for _ in self.layers]
        h, k = self.project(aux), 0
        while (inputs := next_inputs(k, h)) is not None:
            h_in, emb, positions, rows = inputs
            h = self.step(h_in, emb, positions, caches, attention, cu_seqlens, rows)
            yield h
            k += 1

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """A step's output -> the lm_head's input (with norm_output the step has normed it already)."""
        return h if self.spec.norm_output else self.norm(h)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated aux states [T, 3H] (normed first with norm_before_fc / fc_norm)
        -> the step-0 residual stream [T, H]."""
        if self.spec.norm_before_fc:
            aux = self.input_norm(aux)
        elif self.spec.fc_norm:
            aux = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return self.linears(aux, self.fc.weight)[0]
