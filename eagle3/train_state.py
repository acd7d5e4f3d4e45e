"""Training checkpoints `output_dir/checkpoints/step-NNNNNNNN/` (written as `.tmp`, renamed when complete): fp32
draft weights, optimizer and scheduler states, each rank's RNG states, `state.json` (step, config, target)."""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from eagle3.files import free_bytes, make_readable, open_safetensors, read_json, tensor_bytes
from eagle3.resolve import Resolved
from eagle3.errors import Eagle3Error

MODEL, STATE = "model.safetensors", "state.json"


class CheckpointError(Eagle3Error):
    pass


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / f"step-{step:08d}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    root = checkpoints_dir(output_dir)
    return sorted(p for p in (root.iterdir() if root.is_dir() else ()) if p.is_dir() and p.name.startswith("step-")
                  and not p.name.endswith(".tmp") and (p / STATE).exists())


def latest(output_dir: str | Path) -> Path | None:
    return (complete_checkpoints(output_dir) or [None])[-1]


def unreadable(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from (a file truncated or damaged), or None; headers only."""
    try:
        read_state(path)
        with open_safetensors(path / MODEL, CheckpointError, "damaged"), zipfile.ZipFile(path / "optimizer.pt"):
            pass
    except CheckpointError as e:
        return _first_line(e)
    except (zipfile.BadZipFile, OSError) as e:
        return f"{path / 'optimizer.pt'}: {_first_line(e)}"
    return None


def latest_readable(output_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest complete checkpoint that reads, [(newer one skipped, why)])."""
    skipped = []
    for path in reversed(complete_checkpoints(output_dir)):
        if (why := unreadable(path)) is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def rng_state() -> dict:
    """Every RNG's state as tensors, tuples and numbers only (for weights_only loading)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]   # keys as a tensor: weights_only loading
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(output_dir, step: int, model: torch.nn.Module, optimizer, scheduler, state: dict, dist, keep: int) -> Path:
    """Collective: each rank writes its RNG state, rank 0 the rest."""
    _check_space(output_dir, step, model, optimizer, dist)
    final = step_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if dist.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    _write_or_fail(tmp, lambda: torch.save(rng_state(), tmp / f"rng-rank{dist.rank}.pt"))
    dist.barrier()
    if dist.main:
        _write_or_fail(tmp, lambda: _write_main(tmp, step, model, optimizer, scheduler, state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


SIDE_BYTES = 1 << 16   # state.json, and each rank's RNG file (about 16 KB; CUDA's states more), generously


def checkpoint_bytes(model, optimizer, world: int = 1) -> int:
    """About what a checkpoint takes on disk: the weights, the optimizer state, state.json and `world` RNG files."""
    return tensor_bytes(model.state_dict()) + tensor_bytes(optimizer.state_dict()["state"]) + SIDE_BYTES * (1 + world)


def _check_space(output_dir, step: int, model, optimizer, dist) -> None:
    """Fail before anything is written if the checkpoint does not fit; rank 0 measures for every rank."""
    directory = checkpoints_dir(output_dir)
    need = checkpoint_bytes(model, optimizer, getattr(dist, "world", 1))
    free = free_bytes(directory) if dist.main else 0
    if getattr(dist, "world", 1) > 1:
        free = int(dist.all_reduce(torch.tensor([float(free)], dtype=torch.float64, device=dist.device)).item())
    if free < need:
        last = latest(output_dir)
        kept = f"the newest checkpoint, {last}, stays the last good one" if last else "no checkpoint was written yet"
        raise CheckpointError(f"{directory}: not enough free space for the checkpoint of step {step}: it needs "
                              f"about {need} bytes ({need / 2**30:.2f} GiB), {free} bytes ({free / 2**30:.2f} GiB) "
                              f"are free; nothing was written, {kept}: free space (or lower "
                              "train.keep_checkpoints) and rerun to resume from it")


def _write_main(tmp: Path, step: int, model, optimizer, scheduler, state: dict) -> None:
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, tmp / MODEL)
    make_readable(tmp / MODEL)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    (tmp / STATE).write_text(json.dumps({**state, "step": step}, indent=1))


def _write_or_fail(tmp: Path, write) -> None:
    """Run `write` into the temporary directory; on failure (a full disk) remove it and name the free space."""
    try:
        write()
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(tmp.parent).free
        raise CheckpointError(f"{tmp}: writing the checkpoint failed ({_first_line(e)}); {free / 2**30:.2f} GiB "
                              f"({free} bytes) free in {tmp.parent}. The partial directory was removed and the "
                              "last complete checkpoint kept: free space (or lower train.keep_checkpoints) and "
                              "rerun to resume from it") from None


def read_state(path: str | Path) -> dict:
    return read_json(Path(path) / STATE, CheckpointError, "not a complete checkpoint")


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path) / MODEL
    if not path.exists():
        raise CheckpointError(f"{path}: missing")
    with open_safetensors(path, CheckpointError, "the checkpoint is damaged: resume from another one") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


ELSEWHERE = "resume from another checkpoint (train.resume = DIR) or start a new run in another train.output_dir"


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def _safe_load(path: Path, way_out: str):
    """torch.load of tensors and plain values only: a shared checkpoint cannot run code on resume."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)|Unsupported operand \S+", str(e))
        what = f"{found.group(1) or found.group(0)}, " if found else ""
        raise CheckpointError(f"{path}: refused: it holds objects other than tensors and plain values ({what}loaded "
                              f"with weights_only=True), which this trainer never writes; {way_out}") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable ({_first_line(e)}); {way_out}") from None


def restore(path: Path, model, optimizer, scheduler, rank: int) -> dict:
    """Load a checkpoint into model/optimizer/scheduler and this rank's RNG; return state.json."""
    state = read_state(path)
    model.load_state_dict(load_weights(path))
    opt = _safe_load(path / "optimizer.pt", ELSEWHERE)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    rng_file = path / f"rng-rank{rank}.pt"
    if rng_file.exists():
        set_rng_state(_safe_load(rng_file, f"delete it to resume without this rank's RNG "
                                 f"state (a warning says so), or {ELSEWHERE}"))
    else:   # a checkpoint of fewer ranks: the run goes on, not bit for bit as an uninterrupted one
        print(f"warning: {rng_file} is missing (the checkpoint holds the RNG states of "
              f"{len(list(path.glob('rng-rank*.pt')))} ranks): this rank's RNG state is not restored", file=sys.stderr)
    return state


def load_draft(path: str | Path, device: torch.device | str = "cpu"):
    """(Eagle3Draft with the checkpoint's weights, state.json) for evaluation and decoding."""
    from eagle3.draft import Eagle3Draft
    state = read_state(path)
    draft = Eagle3Draft(Resolved.from_dict(state["resolved"]).draft_spec)
    draft.load_state_dict(load_weights(path))
    return draft.to(device).eval(), state
