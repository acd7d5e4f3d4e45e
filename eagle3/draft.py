"""The EAGLE-3 draft model. Parameter names equal the exported vLLM names (`fc.weight`,
`layers.0.self_attn.q_proj.weight`, ...); the token embeddings and target head rows are the trainer's."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from eagle3.float8 import linears as float8_linears
from eagle3.linear import dense_linears
from eagle3.models.deepseek import apply_rope_interleaved, interleaved_cos_sin, yarn_rope
from eagle3.resolve import DraftSpec
from eagle3.ops import (apply_rope, compiled, draft_rope, fused_rms_norm, gather_rows, rms_norm, rope_cos_sin,
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
    """Which of `total` packed rows a TTT step computes (None: all): all give keys and values, the kept outputs."""
    total: int
    computed: torch.Tensor | None = None   # [C] global indices of the rows whose inputs are given
    kept: torch.Tensor | None = None       # [N] indices into the computed rows

    def kept_global(self) -> torch.Tensor | None:
        if self.kept is None:
            return self.computed
        return self.kept if self.computed is None else self.computed[self.kept]

    def keep(self, x: torch.Tensor) -> torch.Tensor:   # [C, ...] -> [N, ...]
        return gather_rows(x, self.kept)


def attend(q, k, v, cache, attention, cu_seqlens, rows: Rows, scale: float | None = None,
           window: int = 0, k_pe: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D] of the kept rows, k [C, Hkv, D], v [C, Hkv, Dv] of the computed ones -> [N, Hq, Dv], over the steps
    in `cache` (a list this step's keys and values join, or in decoding a KV pool's `incremental.LayerPass`); `window`
    > 0: the step-0 keys less than `window` positions back (a sliding-window draft); k_pe [C, 1, Dr]: MLA's rotary key
    every head shares, met by q's last Dr dims (k holds the rest)."""
    shared = () if k_pe is None else (k_pe,)
    if not isinstance(cache, list):
        keys = torch.cat([k, k_pe.expand(-1, k.shape[1], -1)], -1) if shared else k
        return cache.attend(q, keys, v, scale, window=window)
    # keys, values and queries laid out over all rows, zero elsewhere
    kept = rows.kept_global()
    q, k, v, *shared = scatter_rows(q, kept, rows.total), *(scatter_rows(x, rows.computed, rows.total)
                                                            for x in (k, v, *shared))
    if split := getattr(attention, "to_heads", None):   # context parallel: all rows of some heads here
        q, k, v, *shared = split(q, k, v, shared=shared)
    cache.append((k, v, *shared))
    keys, values, *pes = (list(kvs) for kvs in zip(*cache))   # S x [T, Hkv, D] each: the kernel saves no stacked copy
    options = {} if scale is None else {"scale": scale}         # None: the kernels' D^-0.5
    if window:   # step k's queries sit k positions past their row: an engine's window of W positions leaves W - k rows
        options["window"] = window - len(cache) + 1
    if pes:
        options["k_pe"] = pes[0]
    out = attention(q, keys, values, cu_seqlens, **options)
    return gather_rows(attention.to_rows(out) if split else out, kept)


class Attention(nn.Module):
    def __init__(self, spec: DraftSpec, in_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.window = spec.sliding_window
        self.q_proj = nn.Linear(in_dim, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, spec.hidden_size, bias=False)
        self.rope = apply_rope
        self.linears = dense_linears

    def forward(self, x, cos, sin, cache, attention, cu_seqlens, rows: Rows):
        """x [C, in_dim] of the computed rows -> [N, H] of the kept ones (`attend` says over what)."""
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
        out = attend(q, k, v, cache, attention, cu_seqlens, rows, window=self.window)
        return self.linears(out.flatten(1), self.o_proj.weight)[0]


class MLAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention in its expanded form, as vLLM's Eagle3DeepseekV2ForCausalLM and our
    target forward compute it: q = q_b(norm(q_a(x))) [heads, nope | rope]; kv_a(x) = [latent | k_pe], the latent
    normed and expanded by kv_b to [k_nope | v] per head; k_pe one rotary key for all heads (interleaved YaRN)."""

    def __init__(self, spec: DraftSpec, in_dim: int):
        super().__init__()
        self.heads, self.nope, self.rope_dim = spec.num_attention_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim
        self.kv_lora, self.v_dim = spec.kv_lora_rank, spec.v_head_dim
        qk = self.nope + self.rope_dim
        self.q_a_proj = nn.Linear(in_dim, spec.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(spec.q_lora_rank, spec.rms_norm_eps)
        self.q_b_proj = nn.Linear(spec.q_lora_rank, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_dim, self.kv_lora + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, spec.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, spec.hidden_size, bias=False)
        self.scale = yarn_rope(self.rope_dim, qk, spec.rope_theta, spec.rope_scaling)[2]   # YaRN's mscale² in it
        self.rope = apply_rope_interleaved
        self.linears = dense_linears

    def forward(self, x, cos, sin, cache, attention, cu_seqlens, rows: Rows):
        """x [C, in_dim] of the computed rows, cos/sin [C, rope/2] -> [N, H] of the kept ones."""
        C = x.shape[0]
        if rows.kept is None:   # both down-projections read one input
            q_a, kv_a = self.linears(x, self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight)
            cos_q, sin_q = cos, sin
        else:
            (kv_a,) = self.linears(x, self.kv_a_proj_with_mqa.weight)
            (q_a,) = self.linears(rows.keep(x), self.q_a_proj.weight)
            cos_q, sin_q = rows.keep(cos), rows.keep(sin)
        N = q_a.shape[0]
        q = self.linears(self.q_a_layernorm(q_a), self.q_b_proj.weight)[0].view(N, self.heads, -1)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], -1)
        latent, k_pe = kv_a.split([self.kv_lora, self.rope_dim], -1)
        kv = self.linears(self.kv_a_layernorm(latent), self.kv_b_proj.weight)[0].view(C, self.heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        q = torch.cat([q_nope, self.rope(q_pe, cos_q, sin_q)], -1)                        # [N, heads, qk]
        # k_nope and v stay views of kv; the rotary key one [C, 1, rope] for every head (the kernels expand nothing)
        out = attend(q, k_nope, v, cache, attention, cu_seqlens, rows, self.scale,
                     k_pe=self.rope(k_pe[:, None], cos, sin))
        return self.linears(out.reshape(N, -1), self.o_proj.weight)[0]


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
    """Layer 0 reads [input_layernorm(embed) | hidden_norm(h)] (2H wide); later layers are plain Llama ones."""

    def __init__(self, spec: DraftSpec, first: bool):
        super().__init__()
        H = spec.hidden_size
        self.first = first
        self.norm_before_residual = spec.norm_before_residual
        self.input_layernorm = RMSNorm(H, spec.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(H, spec.rms_norm_eps)
        self.self_attn = (MLAttention if spec.attention == "mla" else Attention)(spec, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, spec.rms_norm_eps)
        self.mlp = MLP(H, spec.intermediate_size)

    def forward(self, h, emb, cos, sin, cache, attention, cu_seqlens, rows: Rows):
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
        if spec.attention == "mla":   # DeepSeek's interleaved rotary on the rope dims, YaRN from the target
            inv_freq, self.rope_mscale, _ = yarn_rope(spec.qk_rope_head_dim, spec.head_dim, spec.rope_theta,
                                                      spec.rope_scaling)
        else:
            inv_freq, self.rope_mscale = draft_rope(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.linears = dense_linears
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def use_float8(self) -> None:
        for m in self.modules():
            if "linears" in vars(m):
                m.linears = float8_linears

    def compile_elementwise(self) -> None:
        """RMSNorm as a Triton kernel each way, RoPE and SiLU·up compiled: less GPU memory traffic."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fn = fused_rms_norm
            for name in ("rope", "act"):
                if name in vars(m):
                    setattr(m, name, compiled(getattr(m, name)))

    def step(self, h: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor, caches: list,
             attention, cu_seqlens, rows: Rows | None = None) -> torch.Tensor:
        """One TTT step: h, token embeddings [C, H], positions [C] of the computed rows -> [N, H] of the kept."""
        rows = rows or Rows(h.shape[0])
        cos, sin = (interleaved_cos_sin if self.spec.attention == "mla" else rope_cos_sin)(
            positions, self.inv_freq, self.rope_mscale)
        every = Rows(rows.total, rows.computed)   # only the last layer drops rows: the others feed its keys
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            h = layer(h, emb, cos, sin, cache, attention, cu_seqlens, rows if i == len(self.layers) - 1 else every)
        return self.norm(h) if self.spec.norm_output else h

    def unroll(self, aux: torch.Tensor, attention, cu_seqlens, next_inputs) -> Iterator[torch.Tensor]:
        """fc over the aux states [T, 3H], then a `step` per `next_inputs(k, h)` (given the previous output;
        step k's (h, embeddings, positions, rows), or None to stop), yielding each output; one KV cache."""
        caches = [[] for _ in self.layers]
        h, k = self.project(aux), 0
        while (inputs := next_inputs(k, h)) is not None:
            h_in, emb, positions, rows = inputs
            h = self.step(h_in, emb, positions, caches, attention, cu_seqlens, rows)
            yield h
            k += 1

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """A step's output -> the lm_head's input (with norm_output the step normed it already)."""
        return h if self.spec.norm_output else self.norm(h)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the aux states [T, 3H] (normed first with norm_before_fc / fc_norm) -> [T, H]."""
        if self.spec.norm_before_fc:
            aux = self.input_norm(aux)
        elif self.spec.fc_norm:
            aux = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return self.linears(aux, self.fc.weight)[0]
