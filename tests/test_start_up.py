"""What a run checks and says before its first step and leaves after its last: exports it can write, start-up checks
that agree between commands, the step's memory, paths that read from anywhere, what the log names."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import ROOT, make_config
from eagle3 import config as config_mod, training, train_state
from eagle3.errors import TrainError
from eagle3.export import ExportError
from eagle3.training import memory
from eagle3.training.loop import start_notes

ROOT = Path(__file__).resolve().parents[1]


# --- exports (row 4) --------------------------------------------------------------------------------

def test_a_two_layer_draft_trains_and_writes_both_default_exports(tmp_path, llama_target, token_data, hidden, capsys):
    cfg = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "draft.num_layers": 2,
                                                             "train.max_steps": 3})
    assert cfg.export.formats == ["vllm", "sglang"]
    training.run(cfg)
    sglang = tmp_path / "train" / "export" / "sglang"
    assert json.loads((sglang / "config.json").read_text())["num_hidden_layers"] == 2
    with safe_open(sglang / "model.safetensors", "pt") as f:
        assert {"midlayer.hidden_norm.weight", "layers.1.hidden_norm.weight"} <= set(f.keys())
    assert (tmp_path / "train" / "export" / "vllm" / "model.safetensors").exists()
    out = capsys.readouterr().out
    assert "serve with vLLM 0.34.0: vllm serve" in out and "sglang.launch_server" in out


def test_what_no_chosen_format_exports_is_refused_at_start_up():
    with pytest.raises(config_mod.ConfigError, match="draft.num_layers = 2 cannot be exported for SGLang 0.5.23"):
        config_mod.check_servable_settings(config_mod.load(None, ["--draft.attention", "mla", "--draft.num_layers", "2"]))
    config_mod.check_servable_settings(config_mod.load(None, ["--draft.attention", "mla", "--draft.num_layers", "2",
                                                              "--export.formats", '["vllm"]']))


def test_one_export_failing_at_the_end_keeps_the_others(tmp_path, llama_target, token_data, hidden, monkeypatch):
    real = training.loop.export_all

    def failing_sglang(checkpoint, out, cfg, formats):
        if formats == ["sglang"]:
            raise ExportError("no space for sglang")
        return real(checkpoint, out, cfg, formats)
    monkeypatch.setattr(training.loop, "export_all", failing_sglang)
    cfg = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "train.max_steps": 3})
    with pytest.raises(TrainError, match="the sglang export failed: no space for sglang"):
        training.run(cfg)
    assert (tmp_path / "train" / "export" / "vllm" / "config.json").exists()


# --- start-up checks that agree (row 5) ---------------------------------------------------------------

def test_online_train_refuses_sequences_longer_than_a_micro_batch_as_extract_does(tmp_path):
    args = ["--config", str(ROOT / "config.toml"), "--train.batch_tokens", "160", "--data.max_seq_len", "400"]
    for command, extra in (("extract", []), ("train", ["--train.source", "online"])):
        with pytest.raises(SystemExit, match="data.max_seq_len = 400 is longer than one micro-batch trains"):
            config_mod.cli(args + extra, command=command)


def test_a_short_micro_batch_names_what_to_change(tmp_path, llama_target, token_data, hidden):
    """The shards keep their sequences (up to 40 tokens) as extracted: data.max_seq_len alone changes nothing."""
    cfg = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "train.batch_tokens": 30})
    with pytest.raises(TrainError, match=r"raise train.batch_tokens, split each micro-batch over more ranks "
                                         r"\(train.context_parallel\), or re-extract with a lower data.max_seq_len"):
        training.Trainer(cfg)


def test_evaluate_with_a_window_or_an_unexported_setting_is_not_refused():
    """evaluate exports nothing: the engines' export checks belong to the commands that export."""
    cfg = config_mod.load(None, ["--draft.sliding_window", "16", "--experimental.norm_before_residual", "true"])
    assert cfg.draft.sliding_window == 16
    with pytest.raises(SystemExit, match="norm_before_residual cannot be exported for SGLang 0.5.23"):
        config_mod.cli(["--config", str(ROOT / "config.toml"), "--experimental.norm_before_residual", "true"],
                       command="train")


def test_the_log_notes_a_window_past_the_longest_sequence_and_context_parallelism():
    cfg = config_mod.load(None, ["--draft.sliding_window", "4096", "--train.batch_tokens", "1024"])
    alone, shared = types.SimpleNamespace(size=1), types.SimpleNamespace(size=2)
    assert start_notes(cfg, 1800, alone) == [
        "note: draft.sliding_window = 4096 is not shorter than the longest sequence trained (1800 tokens): no training "
        "row sees the window cut, the draft trains as without it"]
    assert start_notes(cfg, 5000, shared) == [
        "context parallel: 2 ranks share each micro-batch of 2 x 1024 tokens (train.context_parallel); the longest "
        "sequence trained has 5000 tokens"]


# --- memory (row 6) -----------------------------------------------------------------------------------

@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset: Linux only")
def test_the_estimate_is_within_a_factor_1_5_of_a_measured_cpu_step(tmp_path):
    """One step of a draft whose vocabulary-wide logits dominate (~230 MiB): the peak resident memory the step adds
    (gradients, AdamW's moments, activations) against the estimate of those parts (benchmarks/memory.py; on a GPU
    the same with torch.cuda.max_memory_allocated). In a process of its own: a long-lived one (the test session)
    reuses heap it freed earlier, so its resident peak need not grow."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--device", "cpu", "--sizes", "tiny"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert 1 / 1.5 < result["ratio"] < 1.5, result


def test_a_step_that_would_not_fit_is_refused_naming_what_lowers_it(tmp_path, llama_target, token_data, hidden,
                                                                     monkeypatch):
    cfg = config_mod.load(None, ["--train.batch_tokens", "16384", "--vocab.draft_vocab_size", "32000"])
    estimate = memory.Estimate(weights=2 << 30, optimizer=1 << 30, activations=30 << 30)
    with pytest.raises(TrainError, match=r"needs about 33.0 GiB .* against the 24.0 GiB of RAM available now; "
                                         r"lower train.batch_tokens = 16384 .*train.ttt_steps = 7"):
        memory.check(estimate, (24 << 30, "the 24.0 GiB of RAM available now"), cfg)
    assert "warning" in memory.check(estimate, (40 << 30, "the GPU's 40.0 GiB"), cfg, "cuda")
    assert memory.check(estimate, (80 << 30, "the GPU's 80.0 GiB"), cfg, "cuda") is None
    monkeypatch.setattr(memory, "available_bytes", lambda device: (1 << 20, "the 0.0 GiB of RAM available now"))
    with pytest.raises(TrainError, match="one training step needs about"):
        training.Trainer(make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden}))
    assert not (tmp_path / "train" / "checkpoints").exists()


# --- paths (row 7) -------------------------------------------------------------------------------------

def test_a_checkpoint_trained_with_relative_paths_evaluates_from_another_directory(tmp_path, llama_target, token_data,
                                                                                    hidden, monkeypatch, capsys):
    from eagle3.__main__ import main
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(work)
    rel = {key: os.path.relpath(path, work) for key, path in (("target", llama_target), ("data", token_data),
                                                               ("hidden", hidden))}
    cfg = make_config(Path("."), rel["target"], rel["data"], **{"extract.output_dir": rel["hidden"],
                                                                "train.output_dir": "train", "train.max_steps": 3})
    training.run(cfg)
    checkpoint = train_state.latest(work / "train")
    state = train_state.read_state(checkpoint)
    assert state["config"]["target"]["path"] == str(llama_target) and Path(state["resolved"]["data_dir"]).is_absolute()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    main(["evaluate", str(checkpoint), "--out", "eval.json"])
    assert json.loads((elsewhere / "eval.json").read_text())["step"] == 3
