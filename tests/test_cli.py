"""The command line: `python -m eagle3 COMMAND` (the `eagle3` console script), --config and overrides."""
import json

import pytest

from eagle3 import export, extraction, training
from eagle3.__main__ import main
from eagle3.config import cli, tomllib
from conftest import ROOT

CONFIG = str(ROOT / "config.toml")


def help_text(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv + ["--help"])
    assert e.value.code == 0, argv
    return capsys.readouterr().out


def test_every_command_has_help_with_its_arguments_and_overrides(capsys):
    positionals = {"inspect": ["target"], "extract": [], "train": [], "export": ["checkpoint", "out_dir"],
                   "evaluate": ["checkpoint"], "generate": [], "demo": [], "config": []}
    for command, names in positionals.items():
        text = help_text([command], capsys)
        assert f"usage: python -m eagle3 {command}" in text, text
        assert all(f"  {name}  " in text or f"  {name}\n" in text for name in names), text
        reads_config = command != "inspect"
        assert ("--config CONFIG" in text) == reads_config, text
        assert ("Any config key can be overridden: --section.key value or --section.key=value" in text
                and "python -m eagle3 config" in text) == reads_config, text
    for entry in ("Train an EAGLE-3 draft", "Extract target hidden states"):   # train.py, extract.py
        with pytest.raises(SystemExit):
            cli(["--help"], entry)
        text = capsys.readouterr().out
        assert "--config CONFIG" in text and "--section.key value or --section.key=value" in text
    assert "usage: python -m eagle3.bench loss" in help_text(["bench", "loss"], capsys)
    assert "usage: python -m eagle3.bench " in help_text(["bench"], capsys)
    listing = help_text([], capsys)
    assert all(c in listing for c in ("inspect", "extract", "train", "export", "evaluate", "generate", "demo",
                                      "bench", "config"))


def test_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"eagle3": "eagle3.__main__:main"}


def test_train_and_extract_run_their_entry_points_with_overrides(monkeypatch):
    ran = {}
    monkeypatch.setattr(training.loop, "run", lambda cfg: ran.setdefault("train", cfg))   # what training.main calls
    monkeypatch.setattr(extraction, "run", lambda cfg: ran.setdefault("extract", cfg))
    main(["train", "--config", CONFIG, "--train.max_steps", "3"])
    main(["extract", "--config", CONFIG, "--debug.shard_tokens=128"])
    assert ran["train"].train.max_steps == 3 and ran["train"].source == CONFIG
    assert ran["extract"].debug.shard_tokens == 128
    with pytest.raises(SystemExit, match=r"error: command line --debug.kernels: debug.kernels = 'cuda'"):
        main(["train", "--config", CONFIG, "--debug.kernels", "cuda"])


def test_bench_forwards_the_rest_of_the_command_line(monkeypatch):
    from eagle3.bench import loss, step
    seen = []
    monkeypatch.setattr(loss, "main", lambda argv: seen.append(("loss", argv)))
    monkeypatch.setattr(step, "main", lambda argv: seen.append(("step", argv)))
    main(["bench", "loss", "--tiny", "--shapes", "a"])
    main(["bench", "--steps", "1", "--tiny"])
    assert seen == [("loss", ["--tiny", "--shapes", "a"]), ("step", ["--steps", "1", "--tiny"])]


def test_overrides_reach_export(tmp_path, monkeypatch):
    """Without --config the checkpoint's own config (state.json) is the base; overrides apply on top."""
    checkpoint = tmp_path / "step-00000001"
    checkpoint.mkdir()
    state = {"config": {"export": {"formats": ["vllm", "sglang"], "speculative_tokens": 5}}}
    (checkpoint / "state.json").write_text(json.dumps(state))
    seen = []
    monkeypatch.setattr(export, "export_all", lambda ckpt, out, cfg: seen.append(cfg) or {})
    main(["export", str(checkpoint), str(tmp_path / "out"), "--export.formats", '["vllm"]'])
    assert seen[-1].export.formats == ["vllm"] and seen[-1].export.speculative_tokens == 5
    main(["export", str(checkpoint), str(tmp_path / "out"), "--config", CONFIG, "--debug.export_dtype=float32"])
    assert seen[-1].export.formats == ["vllm", "sglang"] and seen[-1].export.speculative_tokens == 3
    assert seen[-1].debug.export_dtype == "float32" and seen[-1].source == CONFIG
    with pytest.raises(SystemExit, match=r"export.formats\[0\] = 'onnx'; expected one of \('vllm', 'sglang'\)"):
        main(["export", str(checkpoint), str(tmp_path / "out"), "--export.formats", '["onnx"]'])


def test_config_command_lists_every_key_with_the_files_values(capsys):
    main(["config", "--config", CONFIG, "--train.seed", "4"])
    text = capsys.readouterr().out
    assert "train.lr: float = 0.0001 (config.toml: 0.003)\n" in text
    assert "train.seed: int = 0 (config.toml: 4)\n" in text
    assert 'data.on_error: "fatal" | "skip" = "fatal"\n' in text
    assert "train.loss_decay: float = 0.8\n" in text
