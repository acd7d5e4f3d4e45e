"""The benches (`python -m eagle3.bench NAME`) at toy size on the CPU, and their timer."""
import json
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT
from eagle3.bench import timing
from eagle3.bench.__main__ import BENCHES
from eagle3.bench.__main__ import main as bench_main


def check_step_timing(result: dict, steps: int, warmup: int, elapsed: float) -> None:
    """A step row's figures against each other and the caller's clock: the rate is the micro-batch's rows
    (the `torch` path computes every row: the tiny size's 4 x 128 tokens) over the step time, the timed steps
    fit in the bench's own seconds (rounded), which fit in the caller's, and are no tiny share of them."""
    assert result["tokens_per_s_per_gpu"] * result["step_s"] == pytest.approx(4 * 128)
    assert steps * result["step_s"] <= result["bench_s"] + 0.5 and result["bench_s"] - 0.5 <= elapsed
    assert result["bench_s"] < 10 * (steps + warmup) * result["step_s"], result


def test_train_step_bench_runs_on_a_tiny_shape(tmp_path):
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "eagle3.bench", "--tiny", "--kernels", "torch", "--steps", "2",
                          "--warmup", "1", "--dir", str(tmp_path), "--json", str(tmp_path / "r.jsonl")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    assert out.returncode == 0, out.stderr[-2000:]
    results = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["layout"] for r in results] == ["a", "b"]
    assert sum(r["bench_s"] for r in results) <= elapsed + 1
    for r in results:
        check_step_timing(r, 2, 1, elapsed)
        # the printed table carries the measured figures
        assert (f"| tiny | 512 | {r['layout']} | torch | {r['step_s'] * 1e3:.0f} | {r['tokens_per_s_per_gpu']:,.0f} |"
                in out.stdout)


def test_the_step_bench_at_a_llama_size_trains_on_a_llama_target(tmp_path, monkeypatch):
    """Sizes other than Kimi's stand on a Llama text config; "auto" is the defaults (no fp8 on a CPU)."""
    from eagle3.bench import step
    s = {**step.SIZES["small"], "seqs": 4}   # the small size's shapes, fewer sequences: the CPU's time
    monkeypatch.setitem(step.SIZES, "small", s)
    step.write_target(tmp_path / "small" / "target", s)
    step.write_shards(tmp_path / "small" / "data-b", tmp_path / "small" / "target", "b", s, 4)
    assert json.loads((tmp_path / "small" / "target" / "config.json").read_text())["model_type"] == "llama"
    r = step.bench_one(tmp_path, "small", "b", "auto", 1, 1, float("nan"))
    assert (r["size"], r["float8"], r["float8_head"]) == ("small", False, False)
    assert r["tokens_per_s_per_gpu"] * r["step_s"] <= s["seqs"] * s["seq_len"]   # rows that reach the loss
    assert r["first_step_loss"][0] > 0


def test_train_step_bench_under_torchrun_ends_with_the_same_weights_on_both_ranks(tmp_path):
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                          "eagle3.bench", "--tiny", "--kernels", "torch", "--layouts", "b", "--steps", "2",
                          "--warmup", "1", "--dir", str(tmp_path), "--json", str(tmp_path / "r.jsonl")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    assert out.returncode == 0, out.stderr[-2000:]
    (result,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert result["world"] == 2 and result["same_weights_on_all_ranks"] is True
    check_step_timing(result, 2, 1, elapsed)   # per GPU: each rank's own micro-batch


@pytest.mark.slow
def test_the_step_bench_splits_a_long_sequence_over_the_ranks(tmp_path):
    """--seq-lens: one sequence per micro-batch, split over length / --tokens-per-rank ranks (context parallel):
    256 tokens on each rank alone, 512 over both."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                          "eagle3.bench", "--tiny", "--seq-lens", "256,512", "--tokens-per-rank", "256", "--kernels",
                          "torch", "--layouts", "a", "--steps", "1", "--warmup", "1", "--dir", str(tmp_path), "--json",
                          str(tmp_path / "r.jsonl")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["seq_len"], r["tokens_per_batch"], r["context_parallel"], r["world"]) for r in rows] == \
        [(256, 256, 1, 2), (512, 512, 2, 2)]
    for r in rows:   # each rank's share of the rows, 256 either way
        assert r["tokens_per_s_per_gpu"] * r["step_s"] == pytest.approx(256)
        assert r["same_weights_on_all_ranks"] is True and r["first_step_loss"][0] > 0
        assert f"| {r['first_step_loss'][0]:.4f} | {r['seq_len']} | {r['context_parallel']} |" in out.stdout


def test_references_evaluation_and_decoding_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None; import eagle3.kernels.reference, eagle3.evaluate, "
            "eagle3.speculative; print(eagle3.kernels.reference.ttt_attention.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "eagle3.kernels.reference"


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_is_reachable_by_name(name, capsys):
    with pytest.raises(SystemExit) as exit:
        bench_main([name, "--help"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m eagle3.bench")


def test_the_timer_gives_the_median_of_calls_on_the_cpu():
    calls = []

    def two_ms():
        calls.append(1)
        time.sleep(0.002)

    assert 2 <= timing.median_ms_of_calls(two_ms, calls=5, warmup_calls=2) < 50
    assert len(calls) >= 1 + 5 + 2
    seconds, out = timing.wall_s(lambda: time.sleep(0.01) or 7)
    assert out == 7 and 0.01 <= seconds < 1


@pytest.mark.parametrize("argv, message", [
    (["attention"], "eagle3.bench attention needs a CUDA GPU"),
    (["loss"], "eagle3.bench loss needs a CUDA GPU"),
])
def test_gpu_benches_say_they_need_a_gpu(monkeypatch, argv, message):
    import importlib

    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bench = importlib.import_module(f"eagle3.bench.{argv[0]}")
    with pytest.raises(SystemExit, match=message):
        bench.main(argv[1:])


def test_the_kernel_benches_append_each_row_as_a_json_line(tmp_path, monkeypatch):
    """--json appends one line per row of the printed table, to what the file holds; the measured rows are
    stood in for (both benches time GPU kernels)."""
    from eagle3.bench import attention, loss
    for bench in (attention, loss):
        monkeypatch.setattr(bench, "require_cuda", lambda *args: None)
    rows = {"triton (this kernel)": (2.0, 300.0, 0.25), "eager reference": None}
    monkeypatch.setattr(attention, "bench_case", lambda label: {"case": {"label": label, "lengths": [4096]},
                                                                "errors": {"out": 1e-3}, "ok": True, "rows": rows})
    monkeypatch.setattr(loss, "matmul_tflops", lambda: 600.0)
    monkeypatch.setattr(loss, "bench_shape", lambda label, rate, results, checks: results.update(
        {(label, "triton-K"): (60.0, 500.0, 0.2, 1.0), (label, "floor"): (50.0, rate, float("nan"), float("nan"))}))
    out = tmp_path / "rows.jsonl"
    out.write_text('{"earlier": 1}\n')
    attention.main(["--shapes", "a,c", "--json", str(out)])
    loss.main(["--shapes", "b", "--json", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0] == {"earlier": 1} and len(lines) == 1 + 4 + 2
    assert [(r["shape"], r["implementation"], r["fwd_bwd_ms"]) for r in lines[1:5]] == [
        ("a", "triton (this kernel)", 2.0), ("a", "eager reference", None),
        ("c", "triton (this kernel)", 2.0), ("c", "eager reference", None)]
    assert lines[1]["bench"] == "attention" and lines[1]["peak_gib"] == 0.25 and lines[1]["max_rel_err"] == 1e-3
    assert [(r["bench"], r["shape"], r["N"], r["method"], r["fwd_bwd_ms"]) for r in lines[5:]] == [
        ("loss", "b", 16384, "triton-K", 60.0), ("loss", "b", 16384, "floor", 50.0)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU sees")
@pytest.mark.parametrize("argv", [[], ["step"]])
def test_a_gpu_bench_on_a_cpu_machine_says_so_at_once(argv):
    """No default that cannot run on a CPU: a one-line refusal naming --tiny, before any work."""
    from eagle3.bench.__main__ import main as bench_main
    with pytest.raises(SystemExit, match="needs a CUDA GPU.*--tiny"):
        bench_main(argv)


def test_bench_help_lists_every_bench(capsys):
    from eagle3.bench.__main__ import BENCHES, main as bench_main
    with pytest.raises(SystemExit):
        bench_main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHES)


@pytest.mark.parametrize("argv, said", [(["--sizes", "llama70b"], "--sizes: unknown llama70b"),
                                        (["--kernels", "triton-fp9"], "--kernels: unknown triton-fp9"),
                                        (["--kernels", "torch-graph"], "--kernels: unknown torch-graph")])
def test_the_step_bench_names_an_unknown_size_or_kernel_choice(argv, said, capsys):
    from eagle3.bench import step
    with pytest.raises(SystemExit):
        step.parse(["--tiny"] + argv if "--kernels" in argv else argv)
    assert said in capsys.readouterr().err


def test_the_step_bench_kernel_choices_set_the_config_they_name():
    from eagle3.bench import step
    args = dict(zip(*[iter(step.kernel_args("triton-fp8-head-graph"))] * 2))
    assert args["--debug.kernels"] == "triton" and args["--train.float8_head"] == "true"
    assert args["--debug.cuda_graphs"] == "true" and args["--debug.skip_dead_rows"] == "true"
    assert dict(zip(*[iter(step.kernel_args("torch"))] * 2))["--debug.cuda_graphs"] == "false"
    assert step.parse(["--tiny", "--kernels", "auto,triton-graph,triton-fp8-graph"]).kernels[1] == "triton-graph"


def test_a_case_out_of_memory_is_a_row_and_the_next_case_runs(tmp_path, monkeypatch, capsys):
    """A case too large for the GPU is a row that says so; the cases after it still run."""
    from eagle3 import distributed
    from eagle3.bench import step
    ran = []

    def bench_one(root, size, layout, kernels, *args):
        ran.append(size)
        if size == "tiny":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.50 GiB.\nmore")
        return {"size": size, "layout": layout, "kernels": kernels, "seq_len": 128, "tokens_per_batch": 512,
                "context_parallel": 1, "step_s": 0.5, "tokens_per_s_per_gpu": 1024.0, "mfu": float("nan"),
                "peak_gib": float("nan"), "gpu_idle": float("nan"), "host_syncs": 0,
                "same_weights_on_all_ranks": True, "first_step_loss": [0.7]}

    monkeypatch.setattr(step, "bench_one", bench_one)
    monkeypatch.setattr(step, "write_target", lambda *a: None)
    monkeypatch.setattr(step, "write_shards", lambda *a: None)
    args = step.parse(["--tiny", "--mla", "--layouts", "a", "--kernels", "auto", "--json",
                       str(tmp_path / "r.jsonl")])
    dist = distributed.setup()
    results, tflops = step.run_ours(args, dist, tmp_path)
    assert ran == ["tiny", "tiny-mla"]
    assert results[0]["out_of_memory"] and results[0]["error"] == "CUDA out of memory. Tried to allocate 3.50 GiB."
    assert results[0]["tokens_per_batch"] == step.SIZES["tiny"]["seqs"] * step.SIZES["tiny"]["seq_len"]
    assert [json.loads(x).get("out_of_memory", False) for x in (tmp_path / "r.jsonl").read_text().splitlines()] \
        == [True, False]
    step.print_table(results, tflops, dist)
    table = capsys.readouterr().out
    assert "| tiny | 512 | a | auto | out of memory (the device's) |" in table
    assert "| tiny-mla | 512 | a | auto | 500 | 1,024 |" in table
