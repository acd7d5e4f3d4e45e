"""Processes of a launch: torchrun and its workers, found through /proc and killed together, as a
crashed node would lose them all (the node and online benchmarks and the kill/resume tests)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):   # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launch and every process below it, as a crashed node would lose them all (torchrun
    starts its workers in sessions of their own: killing its process group leaves them running),
    then wait until none is left."""
    victims = [proc.pid, *descendants(proc.pid)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.time() + 60
    while any(alive(pid) for pid in victims[1:]):
        if time.time() > deadline:
            raise RuntimeError(f"processes {[p for p in victims[1:] if alive(p)]} outlived SIGKILL")
        time.sleep(0.05)
