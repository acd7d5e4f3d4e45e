"""`python -m benchmarks.moe`: Kimi-K2.5 extraction on one GPU: one real-size MoE layer's
throughput, the peak memory of a 4-layer real-width streamed extraction, and (`--parts long`) one long
sequence through those 4 layers at several `debug.chunk_tokens` (`--tiny`: the same code at toy size on
the CPU). `--model qwen3`: the layer of Qwen3-235B-A22B instead (GQA with per-head q/k norms, 128 bf16
experts, top-8 softmax routing), for `--parts layer`.

Weights are random, generated on the device in the layout `DeepseekTarget.load_layer` produces from
the real checkpoint format (routed experts stacked per layer as stored: int4 pack-quantized as Kimi-K2.5 /
K2-Thinking, fp8 128 x 128 blocks as Kimi-K2-Instruct / DeepSeek-V3, or bf16 (`--formats`); bf16 rest, fp32
router and bias), so no 600 GB checkpoint is needed. Each format's layer is also run on its experts
dequantized to bf16 up front: the agreement of the forward that dequantizes as it goes. FLOPs count
the active parameters of each token (MLA projections, the causal attention itself, router, 8 routed + 1
shared expert). Times:
`timing.median_ms_of_calls` (median of triton.testing.do_bench over 5 calls after 2 warm-ups).
"""
from __future__ import annotations

import argparse
import functools
import json
import tempfile
from pathlib import Path

import torch

from eagle3.bench.timing import describe_device, matmul_tflops, median_ms_of_calls, peak_bytes, require_cuda, wall_s
from eagle3.models import attention, deepseek, families, gqa, moe, quant, streaming, tiny
from eagle3.models.weights import read_config
from eagle3.ops import rms_norm

# the real Kimi-K2.5 text config (its published sizes); 16 sequences of 4096 tokens: a 64k-token chunk
KIMI_MODEL = dict(hidden=7168, heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
                  intermediate=18432, moe_intermediate=2048, experts=384, top_k=8, n_group=1, topk_group=1,
                  first_dense=1, vocab=163840, yarn_original=4096, yarn_factor=64.0)
# `long`: one sequence of that many tokens, run at each of `long_chunks` (debug.chunk_tokens; 0: whole)
KIMI = dict(model=KIMI_MODEL, seqs=16, seq_len=4096, long=131072, long_chunks=[16384, 65536, 0])
TINY = dict(model=dict(KIMI_MODEL, hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope=16, qk_rope=8,
                       v_head=16, intermediate=128, moe_intermediate=32, experts=8, top_k=2, vocab=512,
                       yarn_original=128),
            seqs=2, seq_len=64, long=256, long_chunks=[64, 0])
# Qwen3-235B-A22B's published sizes (bf16 experts); the same 64k-token chunk
QWEN3_MODEL = dict(hidden=4096, heads=64, kv_heads=4, head_dim=128, inter=1536, experts=128, top_k=8, vocab=151936)
QWEN3 = dict(model=QWEN3_MODEL, seqs=16, seq_len=4096)
QWEN3_TINY = dict(model=dict(QWEN3_MODEL, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=32, experts=8, top_k=2,
                             vocab=256), seqs=2, seq_len=64)


def kimi_config(s: dict, layers: int):
    """The text config of shape `s` with `layers` decoder layers."""
    cfg = tiny.kimi_k25_config(layers=layers, **s["model"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(cfg))
        return read_config(path)


def qwen3_config(s: dict, layers: int):
    """Qwen3-MoE's text config of shape `s` with `layers` decoder layers, every one MoE (as the real model's)."""
    m = s["model"]
    cfg = tiny.moe_config("qwen3_moe", m["hidden"], layers, m["heads"], m["kv_heads"], m["head_dim"], m["inter"],
                          m["experts"], m["top_k"], m["vocab"]) | {"mlp_only_layers": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(cfg))
        return read_config(path)


class GeneratedCheckpoint:
    """What the runner reads from a checkpoint besides the layers: the config, embedding, final norm
    and head (random, on the device). Every tensor counts as present: the layers come from
    `GeneratedKimi`."""

    def __init__(self, config, device: torch.device, stored: str = "int4"):
        self.config, self.device, self.stored = config, device, stored   # stored: the experts' format
        self.block_cols = 128 if stored == "fp8" else None

    def has(self, name: str) -> bool:
        return True

    def linear_shapes(self, base: str, shape: tuple[int, int]) -> dict:
        return {}   # made in the shapes the config implies

    def account(self, names: list[str]) -> dict:
        return {}   # every tensor is made for the forward

    def outer_tensors(self) -> dict:
        return {}   # made from the config below: nothing to check against it

    def check_shapes(self, expected: dict) -> None:
        """Nothing to check: `GeneratedKimi` makes the layers in the shapes the config implies."""

    def get(self, name: str) -> torch.Tensor:
        V, H, dev = self.config.vocab_size, self.config.hidden_size, self.device
        if name == "norm.weight":
            return torch.ones(H, device=dev, dtype=torch.bfloat16)
        return torch.randn(V, H, device=dev, dtype=torch.bfloat16) * (1.0 if name.startswith("embed") else H ** -0.5)


class GeneratedKimi(deepseek.DeepseekTarget):
    """DeepseekTarget whose layers are random, made on the device instead of read from disk."""

    def load_layer(self, i: int) -> dict[str, torch.Tensor]:
        s, H, dev, dt = self.spec, self.cfg.hidden_size, self.device, self.dtype
        # a generator of the layer's own: the runner loads the next layer in a thread while torch.compile (on CUDA)
        # saves and restores the global RNG state, so global draws would give each run other weights
        g = torch.Generator(dev).manual_seed(1000 + i)
        w = {name: torch.randn(*shape, device=dev, dtype=dt, generator=g) * shape[1] ** -0.5
             for name, shape in self._shapes(i).items()}
        w.update({n: torch.ones(d, device=dev, dtype=dt) for n, d in (
            ("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.kv_a_layernorm", s.kv_lora_rank),
            ("self_attn.q_a_layernorm", s.q_lora_rank))})
        if s.is_moe(i):
            E, I = s.n_routed_experts, s.moe_intermediate_size
            w["mlp.gate"] = torch.randn(E, H, device=dev, generator=g) * H ** -0.5
            w["mlp.gate.bias"] = torch.randn(E, device=dev, generator=g) * 0.01
            for key, (rows, inp) in (("gate_up", (2 * I, H)), ("down", (H, I))):
                w.update({f"experts.{key}.{n}": t for n, t in self._experts(E, rows, inp, g).items()})
        return w

    def _experts(self, E: int, rows: int, inp: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        """E experts' stacked [rows, inp] linears as `Checkpoint.linear_parts` gives them, weights of std inp^-0.5."""
        dev, stored = self.device, self.ckpt.stored
        if stored == "int4":   # int4 values have std ~4.6
            return {"weight_packed": torch.randint(-2 ** 31, 2 ** 31 - 1, (E, rows, inp // 8), dtype=torch.int32,
                                                   device=dev, generator=g),
                    "weight_scale": torch.full((E, rows, inp // 32), inp ** -0.5 / 4.6, dtype=torch.bfloat16,
                                               device=dev)}
        w = torch.empty(E, rows, inp, device=dev, dtype=torch.bfloat16 if stored == "bf16" else torch.float8_e4m3fn)
        for e in range(E):   # an expert at a time: no [E, rows, inp] temporary in bf16 beside the fp8 weights
            # fp8 values of std 32: far inside e4m3's range (448, where a cast saturates)
            w[e] = torch.randn(rows, inp, device=dev, generator=g) * (inp ** -0.5 if stored == "bf16" else 32)
        if stored == "bf16":
            return {"weight": w}
        blocks = torch.rand(E, -(-rows // 128), -(-inp // 128), device=dev, generator=g) + 0.5   # one per 128 x 128
        scale = quant.row_scales(blocks.transpose(0, 1), rows, 128).transpose(0, 1) * (inp ** -0.5 / 32)
        return {"weight": w, "row_scale": scale.contiguous()}


def eager_dequant(parts: dict):
    """A call dequantizing experts' `parts` to bf16 by eager torch (what the Triton kernels replace), None for bf16."""
    if "weight_packed" in parts:
        return lambda: quant.dequantize_int4_torch(parts["weight_packed"], parts["weight_scale"], torch.bfloat16)
    if "row_scale" in parts:
        return lambda: quant.dequantize_fp8_torch(parts["weight"], parts["row_scale"], 128, torch.bfloat16)
    return None


class GeneratedQwen3Moe(gqa.GqaTarget):
    """GqaTarget of Qwen3-MoE's layout whose layers are random, made on the device in `load_layer`'s format."""

    def __init__(self, ckpt, device: torch.device, dtype: torch.dtype):
        super().__init__(ckpt, device, dtype, families.qwen3_moe(ckpt, ckpt.config, ckpt.config.raw))

    def load_layer(self, i: int) -> dict:
        dev, dt, e, H = self.device, self.dtype, self.layout.experts[i], self.cfg.hidden_size
        g = torch.Generator(dev).manual_seed(1000 + i)   # as GeneratedKimi's: the same weights every run

        def rand(*shape, dtype=dt):
            return torch.randn(*shape, device=dev, dtype=dtype, generator=g) * shape[-1] ** -0.5
        w = {name: rand(*shape) for name, shape in self._linears(i).items()}
        w.update({n: torch.ones(d, device=dev, dtype=dt) for n, d in self._vectors(i).items()})
        w.update({"window": 0, "moe": e, "router": rand(e.router.experts, H, dtype=torch.float32),
                  "experts.gate_up.weight": rand(e.router.experts, 2 * e.inter, H),
                  "experts.down.weight": rand(e.router.experts, H, e.inter)})
        return w


def routing(model, w: dict, x: torch.Tensor) -> torch.Tensor:
    """The experts [T, k] a MoE layer's router picks for x, Kimi's or Qwen3's."""
    if isinstance(model, gqa.GqaTarget):
        return moe.route(torch.nn.functional.linear(x.float(), w["router"]), None, w["moe"].router)[0]
    return moe.route(torch.nn.functional.linear(x.float(), w["mlp.gate"]), w["mlp.gate.bias"], model.spec.router)[0]


def qwen3_flops(model, s: dict) -> dict[str, float]:
    """Useful FLOPs of one Qwen3-MoE layer over s["seqs"] sequences of s["seq_len"] tokens."""
    a, e, H = model.layout.attention, model.layout.experts[1], model.cfg.hidden_size
    tokens, pairs = s["seqs"] * s["seq_len"], s["seqs"] * s["seq_len"] * (s["seq_len"] + 1) // 2
    proj = H * (a.heads + 2 * a.kv_heads) * a.head_dim + a.heads * a.head_dim * H
    return {"attention projections": 2 * proj * tokens, "attention (causal)": 4 * a.heads * a.head_dim * pairs,
            "router": 2 * H * e.router.experts * tokens,
            "experts (8 routed)": 2 * e.router.top_k * 3 * H * e.inter * tokens}


def bench_qwen3_layer(s: dict, device: torch.device, peak: float) -> dict:
    """One Qwen3-235B-A22B MoE layer (bf16 experts: nothing to dequantize) on s's chunk."""
    model = GeneratedQwen3Moe(GeneratedCheckpoint(qwen3_config(s, layers=4), device), device, torch.bfloat16)
    return {"model": "Qwen3-235B-A22B layer", **time_layer(model, model.load_layer(1), s, device, peak)}


def layer_flops(model, s: dict) -> dict[str, float]:
    """Useful FLOPs of one MoE layer over s["seqs"] sequences of s["seq_len"] tokens (active parameters only)."""
    spec, H, nh = model.spec, model.cfg.hidden_size, model.heads
    tokens = s["seqs"] * s["seq_len"]
    proj = H * spec.q_lora_rank + spec.q_lora_rank * nh * spec.qk_head_dim
    proj += H * (spec.kv_lora_rank + spec.qk_rope_head_dim)
    proj += spec.kv_lora_rank * nh * (spec.qk_nope_head_dim + spec.v_head_dim) + nh * spec.v_head_dim * H
    pairs = s["seqs"] * s["seq_len"] * (s["seq_len"] + 1) // 2
    experts = (spec.num_experts_per_tok + spec.n_shared_experts) * 3 * H * spec.moe_intermediate_size
    return {"attention projections": 2 * proj * tokens,
            "attention (causal)": 2 * nh * (spec.qk_head_dim + spec.v_head_dim) * pairs,
            "router": 2 * H * spec.n_routed_experts * tokens,
            "experts (8 routed + 1 shared)": 2 * experts * tokens}


def check_dequant(w) -> bool:
    """The Triton kernel against the eager torch dequantization, on real-size experts (bf16: nothing to check)."""
    if "experts.down.weight_packed" in w:
        p, sc = w["experts.down.weight_packed"][:3], w["experts.down.weight_scale"][:3]
        return torch.equal(quant.dequantize_int4(p, sc, torch.bfloat16),
                           quant.dequantize_int4_torch(p, sc, torch.bfloat16))
    if "experts.down.row_scale" in w:
        p, sc = w["experts.down.weight"][:3], w["experts.down.row_scale"][:3]
        return torch.equal(quant.dequantize_fp8(p, sc, 128, torch.bfloat16),
                           quant.dequantize_fp8_torch(p, sc, 128, torch.bfloat16))
    return True


def agreement(model, w: dict, s: dict, device: torch.device) -> dict:
    """The layer's output with its experts as stored (dequantized a block at a time) against the same layer with all
    of them dequantized to bf16 up front: relative error and bit-equal share, over one 64k-token chunk."""
    T = s["seqs"] * s["seq_len"]
    x = torch.randn(T, model.cfg.hidden_size, device=device, dtype=torch.bfloat16,
                    generator=torch.Generator(device).manual_seed(7))
    cu = torch.arange(0, T + 1, s["seq_len"], device=device)
    pos = torch.arange(T, device=device) % s["seq_len"]
    got = model.layer_forward(w, x, pos, cu)
    dense = {k: v for k, v in w.items() if not k.startswith("experts.")}
    for key in ("gate_up", "down"):
        dense[f"experts.{key}.weight"] = moe.expert_weights(w, key, list(range(model.spec.n_routed_experts)), model.dtype,
                                                            model.ckpt.block_cols)
    want = model.layer_forward(dense, x, pos, cu)
    return {"agreement_rel_err": float((got.float() - want.float()).norm() / want.float().norm()),
            "agreement_bit_equal_share": float((got == want).float().mean())}


def check_narrow_v(model, device: torch.device) -> dict:
    """The layer's causal attention core with MLA's narrower v (run unpadded where cuDNN takes it)
    against v zero-padded to the q/k head dim (flash attention's way), on one 4096-token sequence."""
    s, nh, T = model.spec, model.heads, 4096
    q, k = (torch.randn(T, nh, s.qk_head_dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    # v as the layer has it: a view of kv_b_proj's output beside k_nope (rows not contiguous)
    kv = torch.randn(T, nh, s.qk_nope_head_dim + s.v_head_dim, device=device, dtype=torch.bfloat16)
    v = kv[..., s.qk_nope_head_dim:]
    cu = torch.tensor([0, T], device=device)
    got = attention.causal_attention_packed(q, k, v, cu, model.softmax_scale).float()
    padded = torch.nn.functional.pad(v, (0, s.qk_head_dim - s.v_head_dim))
    expect = attention.causal_attention_packed(q, k, padded, cu, model.softmax_scale)[..., :s.v_head_dim].float()
    return {"attention_narrow_v_cudnn": attention.cudnn_takes(q, k, v),
            "attention_narrow_v_rel_err": float((got - expect).norm() / expect.norm())}


def check_norm(model, device: torch.device) -> dict:
    """The layer's RMSNorm as it runs (one compiled kernel on CUDA) against the eager fp32 chain."""
    x = torch.randn(65536, model.cfg.hidden_size, device=device, dtype=torch.bfloat16)
    w = torch.rand(model.cfg.hidden_size, device=device, dtype=torch.bfloat16) + 0.5
    got, expect = model.norm(x, w, model.cfg.rms_norm_eps), rms_norm(x, w, model.cfg.rms_norm_eps)
    return {"norm_rel_err": float((got.float() - expect.float()).norm() / expect.float().norm()),
            "norm_bit_equal_share": float((got == expect).float().mean())}


def bench_layer(s: dict, device: torch.device, peak: float, stored: str = "int4") -> dict:
    """One MoE layer with its routed experts stored `stored` (int4, fp8 or bf16): times, and its agreement with
    the same weights dequantized up front."""
    model = GeneratedKimi(GeneratedCheckpoint(kimi_config(s, layers=4), device, stored), device, torch.bfloat16)
    w = model.load_layer(1)
    ok = check_dequant(w)
    print(f"{stored} experts: triton dequant == torch dequant on real-size experts: {ok}")
    if not ok:   # keep measuring, with the torch dequantization, and say so
        quant.dequantize_int4, quant.dequantize_fp8 = quant.dequantize_int4_torch, quant.dequantize_fp8_torch
    agree = agreement(model, w, s, device) if stored != "bf16" else {}
    print(f"{stored} experts: {agree or 'bf16: the reference itself'}")
    narrow = {**check_narrow_v(model, device), **check_norm(model, device)}
    print(f"attention with MLA's narrow v: cuDNN unpadded {narrow['attention_narrow_v_cudnn']}, "
          f"rel err against v padded {narrow['attention_narrow_v_rel_err']:.1e}; RMSNorm as run against eager: rel err "
          f"{narrow['norm_rel_err']:.1e}, {narrow['norm_bit_equal_share']:.1%} of outputs bit-equal")
    return {"experts_stored": stored, **time_layer(model, w, s, device, peak), "triton_dequant_ok": ok, **agree,
            **narrow}


def time_layer(model, w: dict, s: dict, device: torch.device, peak: float) -> dict:
    T, cuda = s["seqs"] * s["seq_len"], device.type == "cuda"
    x = torch.randn(T, model.cfg.hidden_size, device=device, dtype=torch.bfloat16)
    cu = torch.arange(0, T + 1, s["seq_len"], device=device)
    pos = torch.arange(T, device=device) % s["seq_len"]
    transient = peak_bytes(lambda: model.layer_forward(w, x, pos, cu))[0] / 2 ** 30 if cuda else float("nan")
    t_layer = median_ms_of_calls(lambda: model.layer_forward(w, x, pos, cu), calls=5, warmup_calls=2) / 1e3
    xn = torch.randn_like(x)
    t_attn = median_ms_of_calls(lambda: model._attention(w, xn, pos, cu, None), calls=5, warmup_calls=2) / 1e3
    t_moe = median_ms_of_calls(lambda: model._moe(w, xn), calls=5, warmup_calls=2) / 1e3
    t_moe_mem = peak_bytes(lambda: model._moe(w, xn))[0] / 2 ** 30 if cuda else float("nan")
    E = w["moe"].router.experts if "moe" in w else model.spec.n_routed_experts
    quarter = list(range(E // 4))
    t_deq = median_ms_of_calls(lambda: (moe.expert_weights(w, "gate_up", quarter, model.dtype, model.ckpt.block_cols),
                                        moe.expert_weights(w, "down", quarter, model.dtype, model.ckpt.block_cols)),
                               calls=5, warmup_calls=2) * 4 / 1e3
    eager = eager_dequant({n.removeprefix("experts.gate_up."): t[:8] for n, t in w.items()
                           if n.startswith("experts.gate_up.")})
    t_deq_eager = median_ms_of_calls(eager, calls=5, warmup_calls=2) * E / 8 / 1e3 if eager else float("nan")
    idx = routing(model, w, xn)
    counts = torch.bincount(idx.flatten(), minlength=E)
    flops = (qwen3_flops if isinstance(model, gqa.GqaTarget) else layer_flops)(model, s)
    total = sum(flops.values())
    return {"tokens": T, "layer_s": t_layer, "tokens_per_s": T / t_layer, "tflops": total / t_layer / 1e12,
            "peak_share": total / t_layer / 1e12 / peak, "flops": flops, "attention_s": t_attn, "moe_s": t_moe,
            "moe_transient_gib": t_moe_mem,
            "dequant_all_experts_s": t_deq, "dequant_all_experts_eager_s": t_deq_eager,
            "layer_transient_gib": transient, "expert_tokens_min_max": [int(counts.min()), int(counts.max())]}


def bench_streamed(s: dict, device: torch.device) -> dict:
    tokens = s["seqs"] * s["seq_len"]
    ids = torch.randint(0, kimi_config(s, layers=4).vocab_size, (tokens,))
    elapsed, out, allocated, reserved = streamed_run(s, device, ids, list(range(0, tokens + 1, s["seq_len"])), tokens)
    assert all(torch.isfinite(out[k].float()).all() for k in ("aux_hidden", "final_hidden"))
    return {"layers": "1 dense + 3 MoE", "tokens": tokens, "wall_s": elapsed,
            "peak_allocated_gib": allocated, "peak_reserved_gib": reserved}


def streamed_run(s: dict, device: torch.device, ids: torch.Tensor, cu: list[int], chunk_tokens: int,
                 dtype: torch.dtype = torch.bfloat16):
    """The 4-layer generated Kimi over ids (sequences `cu`) in chunks of chunk_tokens, computing in `dtype` -> (wall s,
    the runner's outputs, peak allocated / reserved GiB). Every call runs the same weights (fixed seeds)."""
    cuda = device.type == "cuda"
    ckpt = GeneratedCheckpoint(kimi_config(s, layers=4), device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)   # the embedding and head (each layer draws from a generator of its own): the same every call
    runner = streaming.TargetRunner(ckpt, [1, 2, 3], device, dtype, chunk_tokens=chunk_tokens)
    # the runner's model reads layers from its checkpoint; this one makes each layer when the runner loads it
    runner.model = GeneratedKimi(ckpt, device, dtype)
    elapsed, out = wall_s(lambda: runner.run(ids, cu))
    allocated, reserved = (torch.cuda.max_memory_allocated() / 2 ** 30, torch.cuda.max_memory_reserved() / 2 ** 30) \
        if cuda else (float("nan"), float("nan"))
    return elapsed, out, allocated, reserved


def bench_long(s: dict, device: torch.device, tokens: int, chunks: list[int],
               dtype: torch.dtype = torch.bfloat16) -> dict:
    """One sequence of `tokens` through the 4 layers at each chunk size (0: whole): time, peak memory, and the
    states against the first size's. They differ by rounding (kernels picked per shape), which routing flips amplify
    (a flipped expert choice changes a token's state): far less in float32 than in bf16."""
    ids = torch.randint(0, kimi_config(s, layers=4).vocab_size, (tokens,))
    rows, ref = {}, None
    for chunk in chunks:
        elapsed, out, allocated, reserved = streamed_run(s, device, ids, [0, tokens], chunk or tokens, dtype)
        final = out["final_hidden"].float()
        if ref is None:   # the first size's states: what the others are compared with
            ref, ref_norm, ref_argmax = final, final.norm(), out["target_argmax"]
        rows[str(chunk or "whole")] = {
            "wall_s": elapsed, "tokens_per_s": tokens / elapsed, "peak_allocated_gib": allocated,
            "peak_reserved_gib": reserved, "final_rel_err": float((final - ref).norm() / ref_norm),
            "argmax_agree": float((out["target_argmax"] == ref_argmax).float().mean())}
    return {"layers": "1 dense + 3 MoE", "tokens": tokens, "dtype": str(dtype).removeprefix("torch."), "chunk_tokens": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (smoke test)")
    parser.add_argument("--model", choices=("kimi", "qwen3"), default="kimi",
                        help="kimi: Kimi-K2.5's layer (every part); qwen3: Qwen3-235B-A22B's (--parts layer)")
    parser.add_argument("--parts", default="layer,streamed",
                        help="comma list: layer (one MoE layer's time), streamed (4-layer memory), long (one long "
                             "sequence at several chunk sizes)")
    parser.add_argument("--long-tokens", type=int, default=None, help="the long sequence (default 131072; --tiny 256)")
    parser.add_argument("--long-chunks", default=None,
                        help="comma list of debug.chunk_tokens for `long`, 0: the whole sequence at once "
                             "(default 16384,65536,0; --tiny 64,0)")
    parser.add_argument("--long-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="`long` computes in this dtype; float32 checks that the chunk sizes agree beyond bf16 "
                             "rounding (e.g. --long-tokens 32768 --long-chunks 8192,0)")
    parser.add_argument("--formats", default="int4",
                        help="comma list of how the routed experts of `layer` are stored: int4 (Kimi-K2.5), fp8 "
                             "(128 x 128 blocks, Kimi-K2-Instruct / DeepSeek-V3), bf16")
    parser.add_argument("--expert-block", type=int, default=moe.EXPERT_BLOCK,
                        help="experts dequantized together (eagle3.models.moe.EXPERT_BLOCK)")
    args = parser.parse_args(argv)
    if args.expert_block < 1:
        parser.error(f"--expert-block {args.expert_block}: expected at least 1")
    moe.EXPERT_BLOCK = args.expert_block
    if not args.tiny:
        require_cuda("benchmarks.moe", "; --tiny runs it at toy size on the CPU")
    parts, formats = args.parts.split(","), args.formats.split(",")
    if not set(formats) <= {"int4", "fp8", "bf16"}:
        parser.error(f"--formats {args.formats}: expected a comma list of int4, fp8, bf16")
    if not set(parts) <= {"layer", "streamed", "long"}:
        parser.error(f"--parts {args.parts}: expected a comma list of layer, streamed, long")
    if args.model == "qwen3" and (parts != ["layer"] or formats != ["int4"]):
        parser.error("--model qwen3 runs --parts layer only, its experts in bf16 (no --formats)")
    shapes = {"kimi": (KIMI, TINY), "qwen3": (QWEN3, QWEN3_TINY)}[args.model]
    s, device = (shapes[1], torch.device("cpu")) if args.tiny else (shapes[0], torch.device("cuda"))
    print(describe_device(), f"expert block {moe.EXPERT_BLOCK}")
    with torch.no_grad():
        peak = matmul_tflops() if device.type == "cuda" else float("nan")
        print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s")
        for stored in formats if "layer" in parts else ():
            bench = bench_qwen3_layer if args.model == "qwen3" else functools.partial(bench_layer, stored=stored)
            print(json.dumps(bench(s, device, peak), indent=1))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if "streamed" in parts:
            print(json.dumps(bench_streamed(s, device), indent=1))
        if "long" in parts:
            chunks = [int(c) for c in args.long_chunks.split(",")] if args.long_chunks else s["long_chunks"]
            print(json.dumps(bench_long(s, device, args.long_tokens or s["long"], chunks,
                                        getattr(torch, args.long_dtype)), indent=1))


if __name__ == "__main__":
    main()
