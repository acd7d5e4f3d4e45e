"""Save and resume training state: one directory per saved step under `output_dir/checkpoints/`.

A checkpoint directory appears only when complete: it is written as `step-NNNNNNNN.tmp` and then
renamed. It holds the draft weights (fp32 master copy, `model.safetensors`), the optimizer and
scheduler states, each rank's RNG states and `state.json` (step, data position, resolved config,
draft spec, aux layer ids, target identity).
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eagle3.files import read_json

MODEL = "model.safetensors"
STATE = "state.json"


class CheckpointError(ValueError):
    pass


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / f"step-{step:08d}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp")
                  and (p / STATE).exists())


def latest(output_dir: str | Path) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(output_dir, step: int, model: torch.nn.Module, optimizer, scheduler, state: dict,
         dist, keep: int) -> Path:
    """Collective: every rank calls it (each writes its RNG state); rank 0 writes the rest."""
    final = step_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if dist.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    torch.save(rng_state(), tmp / f"rng-rank{dist.rank}.pt")
    dist.barrier()
    if dist.main:
        weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(weights, tmp / MODEL)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   tmp / "optimizer.pt")
        (tmp / STATE).write_text(json.dumps({**state, "step": step}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def read_state(path: str | Path) -> dict:
    return read_json(Path(path) / STATE, CheckpointError, "not a complete checkpoint")


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path) / MODEL
    if not path.exists():
        raise CheckpointError(f"{path}: missing")
    return load_file(path)


def restore(path: Path, model, optimizer, scheduler, rank: int) -> dict:
    """Load a checkpoint into model/optimizer/scheduler and this rank's RNG; return state.json."""
    state = read_state(path)
    model.load_state_dict(load_weights(path))
    opt = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    rng_file = path / f"rng-rank{rank}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def load_draft(path: str | Path, device: torch.device | str = "cpu"):
    """(Eagle3Draft with the checkpoint's weights, state.json) for evaluation and decoding."""
    from eagle3.draft import DraftSpec, Eagle3Draft
    state = read_state(path)
    draft = Eagle3Draft(DraftSpec(**state["draft_spec"]))
    draft.load_state_dict(load_weights(path))
    return draft.to(device).eval(), state
