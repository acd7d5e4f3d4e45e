"""The resume rules: which checkpoint a run continues from (train.resume) and what it must share with
it, checked on the checkpoint's state.json (`was`) and this run's (`now`, `Trainer._state`)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from eagle3 import train_state
from eagle3.errors import TrainError
from eagle3.resolve import DraftSpec

# what a resumed run keeps: data order and LR schedule (grad_accum x world size and max_steps: checked apart)
RESUME_FIXED = ("seed", "batch_tokens", "eval_fraction", "epochs", "ttt_steps", "loss_decay", "lr", "min_lr_ratio",
                "warmup_steps", "schedule", "decay_fraction", "betas", "weight_decay", "prompt_rows")
# how the head starts and whether it trains: a change alters the optimizer's parameters
HEAD_FIXED = ("lm_head_init", "freeze_lm_head")
NEW_RUN = "choose another train.output_dir to start a new run"


def checkpoint(choice: str, output_dir: Path, say: bool = True) -> Path | None:
    """train.resume -> the checkpoint to resume (None: a new run); "auto": the newest that reads (warned when `say`)."""
    if choice in ("never", "overwrite"):
        return None
    if choice != "auto":
        return Path(choice)
    path, skipped = train_state.latest_readable(output_dir)
    if skipped and path is None:
        raise train_state.CheckpointError("no checkpoint of the run reads any more: " + "; ".join(
            f"{bad}: {why}" for bad, why in skipped) + f"; {train_state.ELSEWHERE}")
    for bad, why in skipped if say else ():
        print(f"warning: resume skips {bad}, which no longer reads ({why}); resuming from {path}", file=sys.stderr)
    return path


def _spec_defaults(resolved: dict) -> dict:
    """A recorded resolve with the draft spec's fields added since at their defaults (what that run trained)."""
    defaults = {f.name: f.default for f in dataclasses.fields(DraftSpec) if f.default is not dataclasses.MISSING}
    # data_dir: absolute since checkpoints keep absolute paths; an older one's relative path reads from here
    return {**resolved, "draft_spec": {**defaults, **resolved["draft_spec"]},
            "data_dir": os.path.abspath(resolved["data_dir"])}


def check(path: Path, was: dict, now: dict, total: int) -> None:
    """Refuse to resume from `path` unless this run continues its run (ending at step `total`)."""
    before = {**_spec_defaults(was["resolved"]), "target": was["target"]}
    for key, value in {**_spec_defaults(now["resolved"]), "target": now["target"]}.items():
        if key != "verifier_name" and before[key] != value:   # the verifier is only a name in the export
            raise TrainError(f"{path}/state.json: {key} differs from this run's ({before[key]} vs {value}); {NEW_RUN}")
    check_data(path, was, now)
    check_global_batch(path, was, now["world_size"], now["config"]["train"]["grad_accum"])
    check_context_parallel(path, was, now)
    for section, key in [("experimental", key) for key in HEAD_FIXED] + [("train", key) for key in RESUME_FIXED]:
        before, after = was["config"][section][key], now["config"][section][key]
        if key == "decay_fraction" and now["config"]["train"]["schedule"] == "cosine":
            continue   # the cosine does not read it (and a changed schedule is refused)
        if before != after:
            raise TrainError(f"{path}/state.json: {section}.{key} was {json.dumps(before)}, this run has "
                             f"{json.dumps(after)}; a resumed run must keep it (set --{section}.{key} "
                             f"{json.dumps(before)} to resume it, or {NEW_RUN})")
    check_end(path, was, total, now["config"]["train"]["max_steps"])


def check_data(path: Path, was: dict, now: dict) -> None:
    """The shards at train.data_dir must be the extraction the checkpoint trained on, not a new one at the same path
    (a checkpoint that recorded none is not compared)."""
    if was.get("data_plan_key") is None or was["data_plan_key"] == now.get("data_plan_key"):
        return
    raise TrainError(f"{path}/state.json: the checkpoint trained on other shards than {now['resolved']['data_dir']} "
                     f"holds now (manifest plan_key {str(was['data_plan_key'])[:12]}..., now "
                     f"{str(now.get('data_plan_key'))[:12]}...: extracted again from other data, target or settings); "
                     f"put back the shards it trained on to resume it, or {NEW_RUN}")


def check_global_batch(path: Path, was: dict, world: int, accum: int) -> None:
    """Another world size resumes when world size x train.grad_accum is the checkpoint's."""
    was_world, was_accum = was["world_size"], was["config"]["train"]["grad_accum"]
    if (product := was_world * was_accum) == world * accum:
        return
    keep = (f"train.grad_accum = {product // world} keeps it" if product % world == 0 else
            f"no train.grad_accum keeps it on {world} ranks (use a number of ranks that divides {product})")
    raise TrainError(f"{path}/state.json: the checkpoint's global batch is world size {was_world} x train.grad_accum "
                     f"{was_accum} = {product} micro-batches per step, this run's is world size {world} x "
                     f"train.grad_accum {accum} = {world * accum}; a resumed run must keep it: {keep} (or {NEW_RUN})")


def check_context_parallel(path: Path, was: dict, now: dict) -> None:
    """train.context_parallel sets the micro-batches' size (x train.batch_tokens): the data order (a checkpoint that
    recorded none had 1)."""
    before, after = was["config"]["train"].get("context_parallel", 1), now["config"]["train"]["context_parallel"]
    if before != after:
        raise TrainError(f"{path}/state.json: train.context_parallel was {before}, this run has {after}; a resumed "
                         f"run must keep it (set --train.context_parallel {before} to resume it, or {NEW_RUN})")


def check_end(path: Path, was: dict, total: int, max_steps: int) -> None:
    if total < was["step"]:
        raise TrainError(f"{path}/state.json: the checkpoint is at step {was['step']}, but this run ends at step "
                         f"{total} (train.max_steps = {max_steps}); a resumed run may raise "
                         f"train.max_steps to extend the run, not end before its checkpoint: set train.max_steps >= "
                         f"{was['step']}, resume from an earlier checkpoint (train.resume = DIR), or {NEW_RUN}")


USED = (("float8_used", "fp8 GEMMs (train.float8)"), ("float8_head_used", "fp8 head GEMMs (train.float8_head)"),
        ("cuda_graphs_used", "CUDA graphs (debug.cuda_graphs)"))


def path_changes(was: dict, now: dict) -> str:
    """What a resumed run does differently from the checkpoint's steps so far ("" if nothing; a choice the
    checkpoint did not record is not compared)."""
    return "".join(f"; its steps so far ran {'with' if was[key] else 'without'} {what}, from here "
                   f"{'with' if now[key] else 'without'}" for key, what in USED if key in was and was[key] != now[key])


def note(path: Path, was: dict, now: dict) -> str:
    """The line a resume prints: the checkpoint, its step, and what differs from its steps so far."""
    world, accum = was["world_size"], was["config"]["train"]["grad_accum"]
    other = (f"; written by world size {world} x train.grad_accum {accum}, now {now['world_size']} x "
             f"{now['config']['train']['grad_accum']}: the same global batch" if world != now["world_size"] else "")
    other += path_changes(was, now)
    return f"resumed from {path} (step {was['step']}{other})"
