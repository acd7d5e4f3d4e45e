"""The lab's kernel benches (`benchmarks.rows`, `float8`, `attention_sweep`, `loss_variants`) on a CPU machine:
a one-line refusal, and the loss variants' arguments and table."""
import pytest
import torch

from benchmarks import attention_sweep, float8, loss_variants, rows


@pytest.mark.parametrize("bench, message", [(rows, "benchmarks.rows needs a CUDA GPU"),
                                            (attention_sweep, "benchmarks.attention_sweep needs a CUDA GPU"),
                                            (loss_variants, "benchmarks.loss_variants needs a CUDA GPU"),
                                            (float8, "benchmarks.float8 needs a GPU with fp8 tensor cores")])
def test_each_gpu_bench_on_a_cpu_machine_says_so(bench, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=message):
        bench.main([])


def test_the_loss_kinds_are_parsed_with_kl_first_and_an_unknown_one_named(capsys):
    assert loss_variants.parse_losses("tv, nla,tv,kl") == ["kl", "tv", "nla"]
    with pytest.raises(SystemExit):
        loss_variants.main(["--losses", "tv,kll"])
    assert "unknown loss kll; the losses are kl,tv,nla,lk_hybrid,pq" in capsys.readouterr().err


def test_the_loss_table_sets_each_kind_against_kl():
    results = {("a", "kl"): (10.0, 0.5), ("a", "tv"): (10.5, 0.5), ("c", "kl"): (20.0, 1.0), ("c", "pq"): (23.0, 1.25)}
    table = loss_variants.loss_table(results, ["a", "c"], ["kl", "tv", "pq"])
    assert "| a | tv | 10.50 | 1.050 | 0.50 | +0.000 |" in table
    assert "| c | pq | 23.00 | 1.150 | 1.25 | +0.250 |" in table
    assert table[-1] == "slowest loss against kl: pq at (c) 1.150x (OVER the 1.10x bar)"


def test_the_sweep_pins_one_kernel_to_one_config_and_restores_the_tuner(monkeypatch):
    kernels = attention_sweep.kernel_module
    monkeypatch.setitem(kernels.TUNED, "dq", tuner := object())
    with attention_sweep.pinned("dq", (32, 16, 4, 3)):
        (config,) = kernels.TUNED["dq"].configs
        assert (config.kwargs, config.num_warps, config.num_stages) == ({"BLOCK_M": 32, "BLOCK_N": 16}, 4, 3)
        assert config.pre_hook is kernels.block_rows
    assert kernels.TUNED["dq"] is tuner
