"""The benches (`python -m eagle3.bench NAME`) at toy size on the CPU, and their timer."""
import json
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT
from eagle3.bench import moe, timing
from eagle3.bench.__main__ import BENCHES
from eagle3.bench.__main__ import main as bench_main


def check_step_timing(result: dict, steps: int, warmup: int, elapsed: float) -> None:
    """A step row's figures against each other and the caller's clock: the rate is the micro-batch's rows
    (the `torch` path computes every row: step.TINY's 4 x 128 tokens) over the step time, the timed steps
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
        assert f"| {r['layout']} | torch | {r['step_s'] * 1e3:.0f} | {r['tokens_per_s_per_gpu']:,.0f} |" in out.stdout


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


def test_references_evaluation_and_decoding_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None; import kernels, kernels.reference, eagle3.evaluate, "
            "eagle3.speculative; print(kernels.ttt_attention_reference.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "kernels.reference"


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_is_reachable_by_name(name, capsys):
    with pytest.raises(SystemExit) as exit:
        bench_main([name, "--help"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m eagle3.bench")


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


def test_the_timer_gives_the_median_of_calls_on_the_cpu():
    calls = []

    def two_ms():
        calls.append(1)
        time.sleep(0.002)

    assert 2 <= timing.median_ms_of_calls(two_ms, calls=5, warmup_calls=2) < 50
    assert len(calls) >= 1 + 5 + 2
    seconds, out = timing.wall_s(lambda: time.sleep(0.01) or 7)
    assert out == 7 and 0.01 <= seconds < 1


def test_the_peers_steady_state_rate_is_read_from_its_last_epoch():
    from eagle3.bench.step import peer_tokens_per_s

    def epoch(n, *ms):   # the peer's log (speculators 0.9.0), one record per step
        return (f"[04:28:31] INFO     Training epoch {n}/2 started                    trainer.py:737\n"
                + "".join(f"                    profile/fwd_ms=398.646,\n                    profile/step_ms={t},"
                          f"\n                    lr=9.58e-05, global_step={i}\n" for i, t in enumerate(ms)))
    log = epoch(1, "2.41e+05", "1.10e+03") + epoch(2, "4.56e+03", "1.25e+03", "1.25e+03", "960.5") + "Epoch 2 100%"
    assert peer_tokens_per_s(log, 16384) == 16384 / 1.25         # the last epoch's median step
    assert peer_tokens_per_s(epoch(1, "500"), 100) == 200
    assert peer_tokens_per_s("rc 1 CUDA out of memory", 16384) is None


def test_the_peer_run_reads_the_full_log_its_script_writes(tmp_path, monkeypatch):
    from eagle3.bench.step import finish_peer, start_peer
    script = tmp_path / "peer.py"   # writes its log as bench/peer/speculators_kimi_step.py does, prints a summary
    script.write_text("import os, pathlib\n"
                      "pathlib.Path(os.environ['OUT'], 'kimi_peer.log').write_text("
                      "'Training epoch 2/2 started\\n profile/step_ms=2.00e+03,\\n profile/step_ms=1000.0,\\n"
                      " profile/step_ms=1.00e+03,\\n')\n"
                      "print('rc 0 5s', os.environ.get('CUDA_VISIBLE_DEVICES'))\n")
    monkeypatch.setenv("OUT", str(tmp_path))
    assert finish_peer(start_peer(str(script), None), 16384) == 16384.0
    assert finish_peer(start_peer(str(script), 1), 16384) == 16384.0   # --peer-gpu: beside ours, on GPU 1
    assert (tmp_path / "kimi_peer.out").read_text() == "rc 0 5s 1\n"


@pytest.mark.parametrize("argv, message", [
    (["attention"], "eagle3.bench attention needs a CUDA GPU"),
    (["loss"], "eagle3.bench loss needs a CUDA GPU"),
    (["rows"], "eagle3.bench rows needs a CUDA GPU"),
    (["moe", "--parts", "layer"], "eagle3.bench moe needs a CUDA GPU; --tiny runs it at toy size on the CPU"),
])
def test_gpu_benches_say_they_need_a_gpu(monkeypatch, argv, message):
    import importlib

    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bench = importlib.import_module(f"eagle3.bench.{argv[0]}")
    with pytest.raises(SystemExit, match=message):
        bench.main(argv[1:])


@pytest.mark.parametrize("argv", [["--peer-gpu", "1"], ["--peer-gpu", "0", "--peer-script", "peer.py"]])
def test_peer_gpu_needs_the_peer_and_another_gpu(argv, capsys):
    from eagle3.bench import step
    with pytest.raises(SystemExit):
        step.main(["--tiny"] + argv)
    assert "--peer-gpu needs --peer-script and names a GPU other than ours (0)" in capsys.readouterr().err


def test_a_failing_bench_stops_the_peer_running_beside_it(tmp_path, monkeypatch):
    from eagle3.bench import step
    script = tmp_path / "peer.py"
    script.write_text("import time\ntime.sleep(60)\n")
    started = []
    start = step.start_peer
    monkeypatch.setattr(step, "start_peer", lambda *a: started.append(start(*a)) or started[-1])
    monkeypatch.setattr(step, "run_ours", lambda *a: (_ for _ in ()).throw(RuntimeError("ours failed")))
    monkeypatch.setenv("OUT", str(tmp_path))
    with pytest.raises(RuntimeError, match="ours failed"):
        step.main(["--tiny", "--dir", str(tmp_path / "bd"), "--peer-script", str(script), "--peer-gpu", "1"])
    assert started[0].process.wait(timeout=10) == -9   # killed, not left running for its minute


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
