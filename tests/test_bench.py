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
