"""Kimi-K2.5 extraction on one GPU: one real-size MoE layer's throughput, and the peak memory of a
4-layer real-width streamed extraction (`PYTHONUNBUFFERED=1 python bench/bench_moe.py`).

Weights are random, generated on the GPU in the layout `DeepseekTarget.load_layer` produces from
the real checkpoint format (int4 pack-quantized routed experts stacked per layer, bf16 rest, fp32
router and bias), so no 600 GB checkpoint is needed. FLOPs count the active parameters of each
token (MLA projections, the causal attention itself, router, 8 routed + 1 shared expert).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.models import deepseek, quant, streaming, tiny  # noqa: E402
from eagle3.models.checkpoint import read_config  # noqa: E402

DEV = torch.device("cuda")
SEQS, SEQ_LEN = 16, 4096           # a 64k-token chunk


def kimi_config(layers: int):
    """The real Kimi-K2.5 text config (its published sizes) with `layers` decoder layers."""
    cfg = tiny._kimi_config(hidden=7168, layers=layers, heads=64, q_lora_rank=1536, kv_lora_rank=512,
                            qk_nope=128, qk_rope=64, v_head=128, intermediate=18432, moe_intermediate=2048,
                            experts=384, top_k=8, n_group=1, topk_group=1, first_dense=1, vocab=163840,
                            yarn_original=4096, yarn_factor=64.0)
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(cfg))
    return read_config(path)


class GeneratedKimi(deepseek.DeepseekTarget):
    """DeepseekTarget whose layers are random, made on the GPU instead of read from disk."""

    def __init__(self, config, device, dtype):
        super().__init__(type("Ckpt", (), {"config": config})(), device, dtype)

    def load_layer(self, i: int) -> dict[str, torch.Tensor]:
        s, H, nh, dev, dt = self.spec, self.cfg.hidden_size, self.heads, self.device, self.dtype
        w = {name: torch.randn(*shape, device=dev, dtype=dt) * shape[1] ** -0.5
             for name, shape in self._shapes(i).items()}
        w.update({n: torch.ones(d, device=dev, dtype=dt) for n, d in (
            ("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.kv_a_layernorm", s.kv_lora_rank),
            ("self_attn.q_a_layernorm", s.q_lora_rank))})
        if s.is_moe(i):
            E, I = s.n_routed_experts, s.moe_intermediate_size
            w["mlp.gate"] = torch.randn(E, H, device=dev) * H ** -0.5
            w["mlp.gate.bias"] = torch.randn(E, device=dev) * 0.01
            for key, (rows, inp) in (("gate_up", (2 * I, H)), ("down", (H, I))):
                w[f"experts.{key}.weight_packed"] = torch.randint(-2 ** 31, 2 ** 31 - 1, (E, rows, inp // 8),
                                                                  dtype=torch.int32, device=dev)
                # int4 values have std ~4.6: weights of std inp^-0.5 like the bf16 layers
                w[f"experts.{key}.weight_scale"] = torch.full((E, rows, inp // 32), inp ** -0.5 / 4.6,
                                                              dtype=torch.bfloat16, device=dev)
        return w


def cuda_time(fn, reps: int = 5, warmup: int = 2) -> float:
    """Median seconds of fn() over reps, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def matmul_peak() -> float:
    a, b = (torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    t = cuda_time(lambda: a @ b, reps=10, warmup=3)
    return 2 * 8192 ** 3 / t


def layer_flops(model, tokens: int) -> dict[str, float]:
    """Useful FLOPs of one MoE layer over SEQS sequences of SEQ_LEN tokens (active parameters only)."""
    s, H, nh = model.spec, model.cfg.hidden_size, model.heads
    proj = H * s.q_lora_rank + s.q_lora_rank * nh * s.qk_head_dim + H * (s.kv_lora_rank + s.qk_rope_head_dim)
    proj += s.kv_lora_rank * nh * (s.qk_nope_head_dim + s.v_head_dim) + nh * s.v_head_dim * H
    pairs = SEQS * SEQ_LEN * (SEQ_LEN + 1) // 2
    experts = (s.num_experts_per_tok + s.n_shared_experts) * 3 * H * s.moe_intermediate_size
    return {"attention projections": 2 * proj * tokens,
            "attention (causal)": 2 * nh * (s.qk_head_dim + s.v_head_dim) * pairs,
            "router": 2 * H * s.n_routed_experts * tokens,
            "experts (8 routed + 1 shared)": 2 * experts * tokens}


def check_grouped_mm() -> bool:
    """torch._grouped_mm on this GPU against the per-expert loop, at a small bf16 shape."""
    x = torch.randn(300, 256, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(3, 128, 256, device=DEV, dtype=torch.bfloat16)
    sizes = [100, 0, 200]
    ends = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
    try:
        got = deepseek.expert_matmul(x, w, sizes, ends)
    except RuntimeError as e:
        print(f"grouped mm failed: {e}")
        return False
    expect = torch.cat([x[:100] @ w[0].T, x[100:] @ w[2].T])
    return bool(((got.float() - expect.float()).norm() / expect.float().norm()) < 1e-2)


def check_dequant(w) -> bool:
    """The Triton kernel against the eager torch dequantization, on real-size experts."""
    p, sc = w["experts.down.weight_packed"][:3], w["experts.down.weight_scale"][:3]
    return torch.equal(quant.dequantize_int4(p, sc, torch.bfloat16), quant.dequantize_int4_torch(p, sc, torch.bfloat16))


def bench_layer(peak: float) -> dict:
    cfg = kimi_config(layers=4)
    model = GeneratedKimi(cfg, DEV, torch.bfloat16)
    w = model.load_layer(1)
    ok, grouped_ok = check_dequant(w), check_grouped_mm()
    print(f"triton dequant == torch dequant on real-size experts: {ok}; grouped mm works: {grouped_ok}")
    if not ok:  # keep measuring, on the eager path, and say so
        quant._dequantize_triton = quant.dequantize_int4_torch
    supported = deepseek.grouped_mm_supported
    if not grouped_ok:
        deepseek.grouped_mm_supported = lambda x: False
    T = SEQS * SEQ_LEN
    x = torch.randn(T, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    cu = torch.arange(0, T + 1, SEQ_LEN, device=DEV)
    pos = torch.arange(T, device=DEV) % SEQ_LEN
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t_layer = cuda_time(lambda: model.layer_forward(w, x, pos, cu))
    transient = torch.cuda.max_memory_allocated() - base
    xn = torch.randn_like(x)
    t_attn = cuda_time(lambda: model._attention(w, xn, pos, cu, None))
    t_moe = cuda_time(lambda: model._moe(w, xn))
    deepseek.grouped_mm_supported = lambda x: False
    t_moe_loop = cuda_time(lambda: model._moe(w, xn), reps=3, warmup=1)
    deepseek.grouped_mm_supported = supported if grouped_ok else deepseek.grouped_mm_supported
    all_e = list(range(model.spec.n_routed_experts))
    t_deq = cuda_time(lambda: (model._expert_weights(w, "gate_up", all_e[:96]),
                               model._expert_weights(w, "down", all_e[:96]))) * 4
    p, sc = w["experts.gate_up.weight_packed"][:8], w["experts.gate_up.weight_scale"][:8]
    t_deq_eager = cuda_time(lambda: quant.dequantize_int4_torch(p, sc, torch.bfloat16)) * 384 / 8
    idx, _ = deepseek.route(torch.nn.functional.linear(xn.float(), w["mlp.gate"]), w["mlp.gate.bias"], model.spec)
    counts = torch.bincount(idx.flatten(), minlength=384)
    flops = layer_flops(model, T)
    total = sum(flops.values())
    return {"tokens": T, "layer_s": t_layer, "tokens_per_s": T / t_layer, "tflops": total / t_layer / 1e12,
            "peak_share": total / t_layer / peak, "flops": flops, "attention_s": t_attn, "moe_s": t_moe,
            "moe_per_expert_loop_s": t_moe_loop,
            "dequant_all_experts_s": t_deq, "dequant_all_experts_eager_s": t_deq_eager,
            "layer_transient_gib": transient / 2 ** 30, "expert_tokens_min_max": [int(counts.min()), int(counts.max())],
            "triton_dequant_ok": ok, "grouped_mm_ok": grouped_ok}


class GeneratedCheckpoint:
    """What TargetRunner reads besides the layers: embedding, final norm, head (random, on the GPU)."""

    def __init__(self, config):
        self.config = config

    def get(self, name: str) -> torch.Tensor:
        V, H = self.config.vocab_size, self.config.hidden_size
        if name == "norm.weight":
            return torch.ones(H, device=DEV, dtype=torch.bfloat16)
        return torch.randn(V, H, device=DEV, dtype=torch.bfloat16) * (1.0 if name.startswith("embed") else H ** -0.5)


def bench_streamed() -> dict:
    cfg = kimi_config(layers=4)
    streaming.build_model = lambda ckpt, device, dtype: GeneratedKimi(ckpt.config, device, dtype)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    runner = streaming.TargetRunner(GeneratedCheckpoint(cfg), [1, 2, 3], DEV, torch.bfloat16,
                                    chunk_tokens=SEQS * SEQ_LEN)
    ids = torch.randint(0, cfg.vocab_size, (SEQS * SEQ_LEN,))
    cu = list(range(0, SEQS * SEQ_LEN + 1, SEQ_LEN))
    t0 = time.perf_counter()
    out = runner.run(ids, cu)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    assert all(torch.isfinite(out[k].float()).all() for k in ("aux_hidden", "final_hidden"))
    return {"layers": "1 dense + 3 MoE", "tokens": SEQS * SEQ_LEN, "wall_s": elapsed,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30}


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    import triton
    print(f"{time.strftime('%Y-%m-%d')} {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}")
    with torch.no_grad():
        peak = matmul_peak()
        print(f"bf16 matmul 8192^3: {peak / 1e12:.0f} TFLOP/s")
        layer = bench_layer(peak)
        print(json.dumps(layer, indent=1))
        streamed = bench_streamed()
        print(json.dumps(streamed, indent=1))


if __name__ == "__main__":
    main()
