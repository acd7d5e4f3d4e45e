"""The lab's MoE-layer bench and autotune-tiling check at toy size on the CPU."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import moe
from eagle3.models import moe as moe_parts
from benchmarks import tiles as check
from eagle3.bench import timing
from eagle3.kernels import tiles

ttt_attention = importlib.import_module("eagle3.kernels.ttt_attention")   # the module (the package exports the function)


def test_moe_bench_runs_on_a_tiny_shape():
    cpu = torch.device("cpu")
    with torch.no_grad():
        layer_s, layer = timing.wall_s(lambda: moe.bench_layer(moe.TINY, cpu, float("nan")))
        streamed_s, streamed = timing.wall_s(lambda: moe.bench_streamed(moe.TINY, cpu))
    assert layer["triton_dequant_ok"] and layer["tokens"] == 128
    assert layer["tokens_per_s"] == pytest.approx(128 / layer["layer_s"])
    assert layer["tflops"] == pytest.approx(sum(layer["flops"].values()) / layer["layer_s"] / 1e12)
    assert layer["tflops"] < 10   # a timer that measured next to nothing would say so; no CPU runs this layer so fast
    # each figure is the median of calls the bench made (dequantisation: of a quarter of the experts, times 4)
    parts = layer["layer_s"] + layer["attention_s"] + layer["moe_s"] + layer["dequant_all_experts_s"] / 4
    assert parts < layer_s
    # the streamed extraction's time is the runner's, most of the call's
    assert streamed["tokens"] == 128 and streamed_s / 4 < streamed["wall_s"] <= streamed_s


def test_the_qwen3_moe_layer_bench_runs_on_a_tiny_shape():
    with torch.no_grad():
        layer = moe.bench_qwen3_layer(moe.QWEN3_TINY, torch.device("cpu"), float("nan"))
    assert layer["tokens"] == 128 and set(layer["flops"]) >= {"experts (8 routed)", "router"}
    assert sum(layer["expert_tokens_min_max"]) > 0 and layer["layer_s"] > 0


@pytest.mark.parametrize("stored", ["fp8", "bf16"])
def test_the_moe_bench_stores_experts_as_checkpoints_do(stored):
    """--formats: fp8 experts (partial 128 x 128 blocks at toy size) and bf16 ones, timed, with the stored forward's
    agreement with the same experts dequantized up front (bit-equal: both dequantize by one rule)."""
    with torch.no_grad():
        layer = moe.bench_layer(moe.TINY, torch.device("cpu"), float("nan"), stored)
    assert layer["experts_stored"] == stored and layer["triton_dequant_ok"] and layer["tokens_per_s"] > 0
    if stored == "fp8":
        assert layer["agreement_rel_err"] == 0 and layer["agreement_bit_equal_share"] == 1
    model = moe.GeneratedKimi(moe.GeneratedCheckpoint(moe.kimi_config(moe.TINY, layers=4), torch.device("cpu"), stored),
                              torch.device("cpu"), torch.bfloat16)
    w = model.load_layer(1)
    assert w["experts.down.weight"].dtype == (torch.float8_e4m3fn if stored == "fp8" else torch.bfloat16)
    dense = moe_parts.expert_weights(w, "gate_up", list(range(8)), torch.bfloat16, model.ckpt.block_cols)
    assert 0.5 < float(dense.float().std() * 64 ** 0.5) < 2   # weights of std fan-in^-0.5, like the int4 ones


def test_the_compile_check_covers_every_list_and_the_fallbacks_build_small():
    """`python -m benchmarks.tiles` builds each list entry for each GPU of its family; the fallbacks,
    built here for the smallest family's newest GPU (sm_120, no GPU needed, pointer loads) and the
    attention's for sm_90 (TMA loads), stay within the 48 KiB a block gets on every GPU Triton
    supports."""
    jobs = check.candidates(list(tiles.FAMILIES))
    expected = sum(len(importlib.import_module(m).CONFIGS[f][k]) * len(check.TARGETS[f]) for m in check.ATTENTION
                   for f in tiles.FAMILIES for k in ("fwd", "dkdv", "dq"))
    assert len(jobs) == expected and len(set(jobs)) == len(jobs)
    assert {cc for f in tiles.FAMILIES for cc in check.TARGETS[f]} == set(check.BLOCK_SMEM)
    assert all(tiles.family((cc // 10, cc % 10)) == f for f in tiles.FAMILIES for cc in check.TARGETS[f])
    for module in check.ATTENTION:   # the GQA kernel and the MLA draft's
        for kernel in ("fwd", "dkdv", "dq"):
            for capability in (120, 90):
                shared = check.compile_one(kernel, ttt_attention.FALLBACK, capability, module)
                assert 0 < shared <= 48 * 1024, (module, kernel, capability, shared)


def test_the_moe_bench_on_a_cpu_machine_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="moe needs a CUDA GPU; --tiny runs it at toy size on the CPU"):
        moe.main(["--parts", "layer"])


@pytest.mark.parametrize("module", ["benchmarks.moe", "benchmarks.tiles", "benchmarks.step_peer", "benchmarks.rows",
                                    "benchmarks.float8", "benchmarks.attention_sweep", "benchmarks.loss_variants",
                                    "benchmarks.graph_check", "benchmarks.vision"])
def test_each_lab_bench_runs_as_a_module(module):
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(f"usage: python -m {module}"), out.stderr[-500:]


def test_the_long_sequence_bench_runs_chunked_and_whole_on_a_tiny_shape():
    with torch.no_grad():
        out = moe.bench_long(moe.TINY, torch.device("cpu"), 64, [16, 0])
    assert out["tokens"] == 64 and list(out["chunk_tokens"]) == ["16", "whole"]
    whole = out["chunk_tokens"]["whole"]
    assert whole["final_rel_err"] < 1e-2 and whole["argmax_agree"] > 0.95   # bf16: the same states, up to rounding
    assert whole["tokens_per_s"] == pytest.approx(64 / whole["wall_s"])


def test_the_long_sequence_bench_in_float32_agrees_across_chunk_sizes():
    """`--long-dtype float32` is the check that chunked and whole agree beyond bf16 rounding: here, to float32
    rounding (on the GPU kernels picked per shape round differently, and routing flips amplify it)."""
    with torch.no_grad():
        out = moe.bench_long(moe.TINY, torch.device("cpu"), 96, [32, 0], torch.float32)
    assert out["dtype"] == "float32"
    whole = out["chunk_tokens"]["whole"]
    assert whole["final_rel_err"] < 1e-5 and whole["argmax_agree"] == 1.0


def test_a_generated_layer_is_the_same_whatever_the_global_rng_did():
    """The runner makes the next layer in a thread while torch.compile saves and restores the global RNG state on
    CUDA: a layer drawn from the global generator differed between runs (chunked vs whole: 0.27 apart in float32)."""
    s = moe.TINY
    model = moe.GeneratedKimi(moe.GeneratedCheckpoint(moe.kimi_config(s, layers=4), torch.device("cpu")),
                              torch.device("cpu"), torch.float32)
    torch.manual_seed(1)
    first = model.load_layer(2)
    torch.manual_seed(2)
    again, other = model.load_layer(2), model.load_layer(3)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["mlp.gate"], other["mlp.gate"])


def test_the_vision_bench_runs_the_test_tower_on_the_cpu(tmp_path):
    from benchmarks import vision
    rows = vision.run(True, str(tmp_path / "v.jsonl"))
    assert rows[0]["tokens"] == 256 and rows[0]["patches"] == 1024 and rows[0]["ms"] > 0
    assert (tmp_path / "v.jsonl").read_text().count("\n") == 1
