import json
import subprocess
import sys

from conftest import ROOT


def test_train_step_bench_runs_on_a_tiny_shape(tmp_path):
    out = subprocess.run([sys.executable, "-m", "eagle3.bench", "--tiny", "--kernels", "torch", "--steps", "2",
                          "--warmup", "1", "--dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| a |") or line.startswith("| b |")]
    assert len(rows) == 2
    assert all(float(row.split("|")[4].replace(",", "")) > 0 for row in rows)   # tokens/s


def test_train_step_bench_under_torchrun_ends_with_the_same_weights_on_both_ranks(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                          "eagle3.bench", "--tiny", "--kernels", "torch", "--layouts", "b", "--steps", "2",
                          "--warmup", "1", "--dir", str(tmp_path), "--json", str(tmp_path / "r.jsonl")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (result,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert result["world"] == 2 and result["same_weights_on_all_ranks"] is True
    assert result["tokens_per_s_per_gpu"] > 0


def test_references_evaluation_and_decoding_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None; import kernels, kernels.reference, eagle3.evaluate, "
            "eagle3.speculative; print(kernels.ttt_attention_reference.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "kernels.reference"
