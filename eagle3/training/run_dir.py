"""The rules of train.output_dir: a run owns it while it runs (rank 0's lock), never mixes with an earlier
run in it ("never" refuses one, "overwrite" moves it aside), and a stopped run says what it leaves."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from eagle3 import train_state
from eagle3.config import Config
from eagle3.errors import TrainError
from eagle3.files import relock, run_lock, writable_dir

OLD_RUN = ".old-%Y%m%d-%H%M%S"   # strftime suffix of an output_dir moved aside by train.resume = "overwrite"
KEY, WHAT = "train.output_dir", "train"   # how the lock's messages name the directory and its holder


def existing_run(output_dir: Path) -> list[str]:
    """What in `output_dir` belongs to an earlier run: step directories, metrics.jsonl, export/."""
    steps = sorted(p.name for p in train_state.checkpoints_dir(output_dir).glob("step-*"))
    more = f" and {len(steps) - 1} older" if len(steps) > 1 else ""
    held = [f"checkpoints/{steps[-1]}{more}"] if steps else []
    return held + [name for name in ("metrics.jsonl", "export") if (output_dir / name).exists()]


def refuse_existing_run(output_dir: Path, source: str) -> None:
    """train.resume = "never": a new run in an old run's directory would mix with its checkpoints."""
    if held := existing_run(output_dir):
        raise TrainError(f"{source}: train.resume = \"never\", but train.output_dir {output_dir} already holds a "
                         f"run ({', '.join(held)}); choose another train.output_dir, or set train.resume = "
                         f"\"overwrite\", which moves the old run, whole, to {output_dir}.old-YYYYmmdd-HHMMSS "
                         "and starts the new one in an empty directory (nothing was deleted)")


def move_old_run(output_dir: Path) -> Path | None:
    """train.resume = "overwrite": move a run in output_dir aside, whole, to `<output_dir>.old-<time>`."""
    if not existing_run(output_dir):
        return None
    stamp = time.strftime(OLD_RUN)
    moved, n = output_dir.with_name(output_dir.name + stamp), 1
    while moved.exists():   # two overwrites within one second
        moved, n = output_dir.with_name(f"{output_dir.name}{stamp}-{n}"), n + 1
    try:
        output_dir.rename(moved)
    except OSError as e:
        raise TrainError(f"{output_dir}: train.resume = \"overwrite\", but moving the old run to {moved} failed "
                         f"({e.strerror or e}); nothing was deleted: move or remove it yourself, or choose "
                         "another train.output_dir") from None
    print(f"train.resume = overwrite: moved the old run in {output_dir} to {moved}", file=sys.stderr)
    return moved


def prepare(output_dir: Path, resume: str, source: str, dist) -> None:
    """Make `output_dir` ready for a run under train.resume = `resume` and check that it is writable."""
    if resume in ("never", "overwrite"):
        if resume == "overwrite":
            if dist.main:   # before any other rank looks, then the new directory locked
                move_old_run(output_dir)
                relock(output_dir, KEY, WHAT, TrainError)
            dist.barrier()
        refuse_existing_run(output_dir, source)
    writable_dir(output_dir, TrainError, KEY)


def lock(output_dir: Path, held: bool):
    """Own `output_dir` while the block runs (`held`: rank 0): a second run on it stops at once."""
    return run_lock(output_dir, KEY, WHAT, TrainError, held=held)


def kept(cfg: Config) -> str:
    return newest(cfg.train.output_dir)


def newest(output_dir: Path) -> str:
    """What a stopped run leaves in `output_dir`, as its last line names it."""
    path = train_state.latest(output_dir)
    return f"newest complete checkpoint {path}" if path else "no checkpoint written yet"
