"""The training log: metrics.jsonl on rank 0 (strict JSON, NaN and inf as null), TensorBoard beside it
when installed, and the end-of-run summary, read back from the file."""
from __future__ import annotations

import json
from pathlib import Path

from eagle3.errors import TrainError
from eagle3.files import atomic_write_text, free_bytes, strict_json
from eagle3.training import run_dir


def _logged_step(line: str) -> float:
    """Step of a metrics.jsonl line; a torn line counts as after any checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def _num(value) -> str:
    return "nan" if value is None else f"{value:.4f}"


class MetricsLog:
    def __init__(self, output_dir: Path, start_step: int, enabled: bool):
        self.enabled, self.output_dir, self.path, self.tb = enabled, output_dir, output_dir / "metrics.jsonl", None
        if not enabled:
            return
        if self.path.exists():  # a resumed run drops what the killed run logged after its checkpoint
            kept = [ln for ln in self.path.read_text().splitlines() if _logged_step(ln) <= start_step]
            try:   # through a temporary name: a full disk keeps the old log whole
                atomic_write_text(self.path, "".join(ln + "\n" for ln in kept))
            except OSError as e:
                raise self.failed(e) from None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(output_dir / "tensorboard"))
        except ImportError:
            pass

    def failed(self, e: OSError) -> TrainError:
        """The one line for a log that cannot be written (a full disk): the free space, what the run leaves."""
        free = free_bytes(self.output_dir)
        return TrainError(f"{self.path}: writing the training log failed ({e.strerror or e}); {free} bytes "
                          f"({free / 2**30:.2f} GiB) free there; training stopped, {run_dir.newest(self.output_dir)}: "
                          "free space, then the same command resumes")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            with self.path.open("a") as f:
                f.write(strict_json(record) + "\n")
        except OSError as e:
            raise self.failed(e) from None
        if self.tb is not None:
            prefix = record.get("split", "train")
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(f"{prefix}/{key}", value, record["step"])
                elif isinstance(value, list):
                    for k, v in enumerate(value):
                        self.tb.add_scalar(f"{prefix}/{key}_{k}", v, record["step"])

    def summary(self, total: int, saved: Path | None, formats, prompts: str | None = None) -> str:
        """Where the run ended and where its files are, read back from metrics.jsonl (a rerun says the same);
        `prompts`: the file the evaluate command names (evaluate.prompts)."""
        out = self.output_dir
        records = [json.loads(ln) for ln in self.path.read_text().splitlines()] if self.path.exists() else []
        last = {r["split"]: r for r in records}
        lines = [f"train: done, step {total} in {out}"]
        for split, name in (("train", "train"), ("eval", "held-out")):
            if r := last.get(split):
                estimate = f", accept_len {_num(r['accept_len'])}" if split == "eval" else ""
                lines.append(f"  {name} (step {r['step']}{estimate}), per TTT step: loss "
                             f"{' '.join(_num(x) for x in r['loss'])}; accuracy {' '.join(_num(x) for x in r['acc'])}")
        if skipped := sum(r.get("skipped_steps", 0) for r in records if r["split"] == "train"):
            lines.append(f"  skipped steps (non-finite loss or gradient norm, debug.skip_nonfinite): {skipped}")
        lines += [f"  metrics: {self.path}", f"  last checkpoint: {saved}"]
        lines += [f"  {fmt} export: {out / 'export' / fmt}" for fmt in formats if (out / "export" / fmt).is_dir()]
        if self.tb is not None:
            lines.append(f"  tensorboard: {out / 'tensorboard'}")
        if saved is not None:   # training draws no plot: evaluate does, with real decoding when given prompts
            lines.append(f"  plot and real decoding: python -m eagle3 evaluate {saved} "
                         f"--prompts {prompts or 'PROMPTS.jsonl'} "
                         "(the checkpoint's own settings; writes eval.json and eval.png into the checkpoint, deleted "
                         "with it by checkpoint rotation: --out FILE keeps them elsewhere)")
        return "\n".join(lines)
