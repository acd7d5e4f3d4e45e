"""`python -m eagle3 evaluate --config config.toml CHECKPOINT_DIR`: judge a trained draft.

On the held-out sequences (the same split training evaluates on): per-step loss, accuracy,
conditional accuracy and the acceptance-length estimate of SPEC §7 (`accept_len`, every start row
weighted once), broken down by the position of the draft's start row inside its assistant reply;
and `accept_len_decoding`, the tokens per target forward that chain speculative decoding of the
held-out replies gets (rounds replayed from the same per-row chains), which is what a serving
engine measures. The held-out split, K and the loss weights are the ones the checkpoint was
trained with (its state.json), so training sequences never count as held out. Writes `eval.json` next to the checkpoint
and, when matplotlib is installed, `eval.png` (acceptance by step, and loss/acceptance over
training from `metrics.jsonl`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3 import checkpoint as ckpt_io
from eagle3.config import Config
from eagle3.data.batching import pack, split_holdout, to_device
from eagle3.data.shards import ShardReader
from eagle3.extraction import resolve_device
from eagle3.target.checkpoint import Checkpoint
from eagle3.training import check_manifest
from eagle3.ttt import summarize, ttt_forward
from kernels.reference import ttt_attention, ttt_loss_steps

BUCKETS = [(0, 16), (16, 64), (64, 256), (256, 1024), (1024, None)]


def reply_positions(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Index of each token inside its assistant reply (a run of loss_mask = 1 within a sequence)."""
    T = loss_mask.numel()
    idx = torch.arange(T, device=loss_mask.device)
    m = loss_mask.bool()
    seq_start = torch.zeros(T, dtype=torch.bool, device=m.device)
    seq_start[cu_seqlens[:-1].long()] = True
    prev = torch.cat([m.new_zeros(1), m[:-1]])
    starts = m & (seq_start | ~prev)
    last_start = torch.cummax(torch.where(starts, idx, torch.full_like(idx, -1)), 0).values
    return idx - last_start


def decoding_rounds(accepted: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[int, int]:
    """(tokens, rounds) that chain speculative decoding of each reply would take, replayed from the
    per-row accepted counts: the prefill yields the reply's first token x_s; a round whose newest
    token is x_m drafts from row m-1 and gains its accepted drafts + 1, capped at the reply's end.
    Rounds start where the previous one ended, so this weighs positions as decoding does (the
    per-row mean `accept_len` weighs every position once)."""
    acc, mask = accepted.tolist(), loss_mask.tolist()
    tokens = rounds = 0
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        i = a
        while i < b:
            if not mask[i] or i == a:          # a reply needs a prompt before it
                i += 1
                continue
            end = i
            while end < b and mask[end]:
                end += 1
            m = i
            while m < end - 1:
                gained = min(acc[m - 1] + 1, end - 1 - m)
                tokens, rounds, m = tokens + gained, rounds + 1, m + gained
            i = end
    return tokens, rounds


class Evaluation:
    """Accumulates, over batches, metric sums overall and per reply-position bucket."""

    def __init__(self, steps: int):
        self.steps = steps
        self.total = torch.zeros(steps, 7)
        self.buckets = {b: torch.zeros(steps, 7) for b in BUCKETS}
        self.decoded = [0, 0]                  # tokens, rounds of the replayed decoding

    def add(self, metrics: torch.Tensor, detail: dict, batch: dict) -> None:
        self.total += metrics.cpu()
        T = batch["input_ids"].numel()
        label_row = (torch.arange(T, device=batch["loss_mask"].device) + 2).clamp(max=T - 1)
        position = reply_positions(batch["loss_mask"], batch["cu_seqlens"])[label_row].cpu()
        correct, accepted, start = (detail[k].cpu() for k in ("correct", "accepted", "start"))
        tokens, rounds = decoding_rounds(accepted, batch["loss_mask"].cpu(), batch["cu_seqlens"].cpu())
        self.decoded = [self.decoded[0] + tokens, self.decoded[1] + rounds]
        for (lo, hi), sums in self.buckets.items():
            rows = start & (position >= lo) & (position < (hi if hi is not None else T + 1))
            sums[:, 2] += (correct & rows).sum(1)
            sums[:, 3] += rows.sum()
            sums[0, 6] += accepted[rows].sum()

    def report(self) -> dict:
        out = summarize(self.total)
        out["accept_len_decoding"] = self.decoded[0] / self.decoded[1] if self.decoded[1] else float("nan")
        out["by_reply_position"] = [
            {"positions": [lo, hi], "start_rows": int(s[0, 3]),
             "accept_len": summarize(s)["accept_len"], "acc_given_start": summarize(s)["acc"]}
            for (lo, hi), s in self.buckets.items() if s[0, 3] > 0]
        return out


@torch.no_grad()
def evaluate(cfg: Config, checkpoint_dir: str | Path, steps: int | None = None) -> dict:
    """`steps` overrides the K of the estimate (default: the ttt_steps the draft was trained with)."""
    checkpoint_dir = Path(checkpoint_dir)
    device = resolve_device(cfg.train.device)
    draft, state = ckpt_io.load_draft(checkpoint_dir, device)
    target = Checkpoint(cfg.target.path)
    if state["target"] != target.config.identity():
        raise ckpt_io.CheckpointError(f"{checkpoint_dir}/state.json: trained against another target than "
                                      f"{cfg.target.path} (target.path)")
    data_dir = Path(cfg.resolved_train_data_dir())
    reader = ShardReader(data_dir)
    check_manifest(reader.manifest, target.config, state["aux_layer_ids"], data_dir)
    trained = state["config"]["train"]   # the held-out split and K the draft was trained with
    dtype = torch.float32
    embed = target.get("embed_tokens.weight").to(device, dtype)
    head_rows = target.get("lm_head.weight")[draft.t2d.cpu()].to(device, dtype)
    steps = steps or trained["ttt_steps"]
    _, held_out = split_holdout(reader.sequences, trained["eval_fraction"])
    result = Evaluation(steps)
    for refs in pack(held_out, cfg.train.batch_tokens):
        batch = to_device(reader.read(refs), device, dtype)
        _, metrics, detail = ttt_forward(draft, batch, embed, head_rows, steps, ttt_attention,
                                         ttt_loss_steps, trained["loss_decay"])
        result.add(metrics, detail, batch)
    report = {"checkpoint": str(checkpoint_dir), "step": state["step"], "held_out_sequences": len(held_out),
              **result.report()}
    (checkpoint_dir / "eval.json").write_text(json.dumps(report, indent=1))
    plot(report, Path(state["config"]["train"]["output_dir"]) / "metrics.jsonl", checkpoint_dir / "eval.png")
    return report


def plot(report: dict, metrics_path: Path, out: Path) -> bool:
    """Acceptance by step and training curves; skipped (False) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = range(len(report["acc"]))
    left.plot(steps, report["acc"], "o-", label="accuracy")
    left.plot(steps, report["cond_acc"], "s--", label="accuracy given earlier steps right")
    left.set(xlabel="TTT step", ylabel="held-out", title=f"accept_len ≈ {report['accept_len']:.2f}")
    left.legend()
    if metrics_path.exists():
        records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
        train = [r for r in records if r["split"] == "train"]
        evals = [r for r in records if r["split"] == "eval"]
        right.plot([r["step"] for r in train], [r["loss"][0] for r in train], label="train loss (step 0)")
        twin = right.twinx()
        twin.plot([r["step"] for r in evals], [r["accept_len"] for r in evals], "r.-", label="eval accept_len")
        right.set(xlabel="optimizer step")
        right.legend(loc="upper left")
        twin.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True
