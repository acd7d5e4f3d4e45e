"""`python -m eagle3 demo`: the plain demo trains on replies the target regenerated, so that its held-out estimate
and real decoding of the held-out prompts measure the same thing and agree within the margin it states. (The
thinking demo: tests/test_chat_fields.py; the real model: tests/test_real_model.py.)"""
import json
import re

import pytest

from eagle3 import demo
from eagle3.models import tiny


@pytest.mark.slow
def test_the_plain_demo_regenerates_and_its_estimate_agrees_with_real_decoding(tmp_path, capsys):
    from eagle3.__main__ import main
    data = tiny.make_token_data(tmp_path / "data.jsonl", vocab=512, sequences=64)   # the demo's data, fewer lines
    settings = {"target.path": tmp_path / "target", "data.path": data, "extract.output_dir": tmp_path / "hidden",
                "train.output_dir": tmp_path / "train", "generate.output_path": tmp_path / "regenerated.jsonl",
                "train.max_steps": 150, "train.ttt_steps": 3, "train.batch_tokens": 512, "train.lr": 1e-2,
                "train.eval_fraction": 0.25, "train.eval_every": 150, "train.checkpoint_every": 150, "debug.train_device": "cpu", "debug.extract_device": "cpu",
                "debug.evaluate_device": "cpu", "debug.generate_device": "cpu"}
    main(["demo", *[a for k, v in settings.items() for a in (f"--{k}", str(v))]])
    out = capsys.readouterr().out
    regenerated = [json.loads(line) for line in (tmp_path / "regenerated.jsonl").read_text().splitlines()]
    assert len(regenerated) == 64 and all(sum(line["loss_mask"]) <= 48 for line in regenerated)
    report = json.loads(next((tmp_path / "train" / "checkpoints").glob("*/eval.json")).read_text())
    held_out = (tmp_path / "prompts.jsonl").read_text().splitlines()
    assert report["prompts"] == len(held_out) >= 8 and report["mismatches"] == 0
    real, estimate = report["real_accept_len"], report["accept_len_decoding"]
    # the draft learned something of the target's replies (one learning nothing decodes 1.02 here; the full demo's
    # 200 steps at 4x the tokens reach 1.31), so that a gap between the two can show
    assert real > 1.1, report
    assert abs(estimate - real) <= demo.REGENERATED_MARGIN * real, (estimate, real)
    line = re.search(r"demo: real decoding ([\d.]+) .* the held-out estimate replays ([\d.]+)", out)
    assert line and (float(line[1]), float(line[2])) == (round(real, 2), round(estimate, 2)), out
    assert f"agree within {demo.REGENERATED_MARGIN:.0%}" in out and "a bug to report" not in out



def test_a_rerun_with_other_generate_settings_starts_the_demos_replies_over(tmp_path, monkeypatch):
    """The demo's own replies file recorded under other settings is removed before generating; under the same
    settings it is kept (generate then reuses or resumes it)."""
    from eagle3 import config as config_mod
    from eagle3 import generate
    from eagle3.files import strict_json
    from eagle3.models.weights import Checkpoint
    tiny.make_kimi(tmp_path / "target")
    data = tiny.make_token_data(tmp_path / "data.jsonl", vocab=512, sequences=8)
    out = tmp_path / "regenerated.jsonl"
    cfg = config_mod.load(None, ["--target.path", str(tmp_path / "target"), "--data.path", str(data),
                                 "--generate.output_path", str(out)])
    monkeypatch.setattr(generate, "run", lambda cfg: out)   # what is left for generate to find is the point
    current = generate.settings(cfg, Checkpoint(cfg.target.path))
    out.write_text("{}\n")
    generate.sidecar(out).write_text(strict_json(current))
    demo.regenerate(cfg)
    assert out.exists() and generate.sidecar(out).exists()
    generate.sidecar(out).write_text(strict_json({**current, "generate.max_new_tokens": 1}))
    demo.regenerate(cfg)
    assert not out.exists() and not generate.sidecar(out).exists()
