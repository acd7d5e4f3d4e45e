"""eval.png as a person reads it: real decoding's figure as the headline, whole TTT steps, the depth panel on the
whole range a round can gain, every depth bucket shown (an empty one marked), the round counts off the bars."""
from __future__ import annotations

import json

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from eagle3.evaluate import headline, plot, plot_depth, plot_estimate  # noqa: E402

REPORT = {"acc": [0.62, 0.41, 0.33], "cond_acc": [0.62, 0.55, 0.5], "accept_len": 1.71, "real_accept_len": 1.74,
          "prompts": 8, "k": 3, "temperature": 0.0,
          "by_depth": [{"label": "<2k", "real_accept_len": 1.74, "rounds": 212},
                       {"label": "2k-8k", "real_accept_len": 1.76, "rounds": 31},
                       {"label": "8k-32k", "real_accept_len": None, "rounds": 0}]}


def test_the_headline_is_real_decoding_and_the_estimate_only_without_it():
    assert headline(REPORT) == "real decoding: 1.74 tokens per target forward (8 prompts, k = 3, T = 0.0)"
    estimate = {k: v for k, v in REPORT.items() if k != "real_accept_len"}
    assert headline(estimate).startswith("held-out estimate: accept_len ≈ 1.71")


def test_ttt_steps_get_whole_ticks_and_the_depth_panel_its_whole_range():
    fig, (a, b) = plt.subplots(1, 2)
    plot_estimate(a, REPORT, None)
    plot_depth(b, REPORT, None)
    fig.canvas.draw()
    assert list(a.get_xticks()) == [0, 1, 2]
    low, high = b.get_ylim()
    assert low == 0 and high >= REPORT["k"] + 1   # 1.74 against 1.76 stays a 1% difference to the eye
    labels = [t.get_text() for t in b.get_xticklabels()]
    assert labels == ["<2k\n212 rounds", "2k-8k\n31 rounds", "8k-32k\n0 rounds"]
    assert "no rounds" in [t.get_text() for t in b.texts]
    inside = b.get_window_extent()
    for text in b.texts:   # the value labels stay inside the panel
        box = text.get_window_extent()
        assert inside.y0 <= box.y0 and box.y1 <= inside.y1, text.get_text()
    plt.close(fig)


def test_eval_png_is_written_with_the_headline(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in (
        {"split": "train", "step": 2, "loss": [3.0]}, {"split": "eval", "step": 2, "accept_len": 1.5})))
    assert plot(REPORT, metrics, tmp_path / "eval.png") and (tmp_path / "eval.png").stat().st_size > 10_000
