"""Process-group plumbing for torchrun (NCCL on GPUs, gloo on the CPU; a no-op in one process), so that a dead rank
leaves none waiting: collectives time out, `lost_peer` names that failure, SIGTERM ends a rank with one line."""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from tqdm import tqdm

from eagle3.errors import Eagle3Error

# what gloo's transport raises (a plain RuntimeError) when a peer's socket closes or a wait runs out
GLOO_LOST = ("Connection closed by peer", "Connection reset by peer", "Socket closed", "Read error",
             "Timed out waiting")


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def setup(device: str = "auto", timeout_s: float | None = None) -> Dist:
    """`timeout_s`: how long a collective waits for the other ranks (None: torch's default). gloo raises in
    the waiting call; NCCL's watchdog ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, torch's default)."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None,
                                timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
    return Dist(rank, world, dev)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def lost_peer(error: BaseException, timeout: str) -> str | None:
    """The line for a failed collective ("rank 0: rank 1 is gone (...)"), else None; `timeout` names the
    wait that ran out ("debug.collective_timeout_s = 600 s")."""
    text = str(error)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or not (isinstance(error, dist.DistError) or any(mark in text for mark in GLOO_LOST)):
        return None
    other = f"rank {1 - rank}" if world == 2 else "another rank"
    what = (f"did not answer within {timeout}, stuck or gone" if re.search(r"timed out|timeout", text, re.I)
            else "is gone")
    # gloo's text: "[path/pair.cc:553] Connection closed by peer [ip]:port. This is typically ..."
    cause = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().split("\n")[0]).split(". ")[0] or type(error).__name__
    return f"rank {rank}: {other} {what} (a collective failed: {cause})"


def lost_peer_error(cls: type, message: str) -> Exception:
    """`cls(message)` marked as a lost peer's: `main` then ends the rank at once (its interpreter's teardown can
    wait on the lost rank)."""
    error = cls(message)
    error.lost_peer = True
    return error


# with stop_on_sigterm: the error path (`first_word`) or the SIGTERM thread, whichever takes it, says the line
_spoken: threading.Lock | None = None


def first_word(line: str) -> str | int:
    """What SystemExit should carry: `line`, or status 1 alone when the SIGTERM thread has said this rank's."""
    return line if _spoken is None or _spoken.acquire(blocking=False) else 1


def main(run: Callable, kept: Callable, description: str, argv: list[str] | None, prog: str | None,
         command: str) -> None:
    """train.py's and extract.py's entry (`command`): `run(cfg)` of the command line's config; an error, Ctrl-C or
    SIGTERM ends it in one line naming what is `kept(cfg)`."""
    from eagle3.config import cli, interrupted
    cfg = cli(argv, description, prog, command)
    previous = signal.getsignal(signal.SIGTERM)
    stop_on_sigterm(lambda: kept(cfg))
    try:
        run(cfg)
    except Eagle3Error as e:
        line = first_word(f"error: {e}")
        if getattr(e, "lost_peer", False) and isinstance(line, str):
            print(line, file=sys.stderr, flush=True)
            os._exit(1)
        raise SystemExit(line) from None
    except KeyboardInterrupt:
        interrupted(kept(cfg))
    except Terminated:
        print(f"stopped by SIGTERM; {kept(cfg)}; the same command resumes", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:   # a run inside a longer process (a test) leaves its SIGTERM handling as it found it
        if signal.getsignal(signal.SIGTERM) is _terminate:
            signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """SIGTERM in a run of one process: it unwinds as Ctrl-C does (locks released, files closed), then one line."""


def _terminate(*_) -> None:
    raise Terminated


def stop_on_sigterm(kept: Callable[[], str]) -> None:
    """Under a launcher, SIGTERM ends the rank with status 143 and one line naming what is `kept()`, by a thread woken
    by the signal's wakeup byte (a handler would not run in a stuck collective); in one process, `main` says the
    line once the handler's Terminated has unwound the run. Call from the main thread."""
    global _spoken
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        signal.signal(signal.SIGTERM, _terminate)
        return
    _spoken = threading.Lock()
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, lambda *_: None)   # the wakeup byte is written for handled signals only
    # in a forked child the pipe is shared: its own SIGTERM must not wake this rank's thread
    os.register_at_fork(after_in_child=lambda: (signal.set_wakeup_fd(-1),
                                                signal.signal(signal.SIGTERM, signal.SIG_DFL)))
    threading.Thread(target=_on_sigterm, args=(read, kept), daemon=True, name="sigterm").start()


def _on_sigterm(read: int, kept: Callable[[], str]) -> None:
    while os.read(read, 1) != bytes([signal.SIGTERM]):
        pass   # another signal's byte (Ctrl-C): its Python handler runs in the main thread
    if not _spoken.acquire(blocking=False):   # the main thread has said this rank's line and is exiting: it gets
        time.sleep(2)                          # a moment, but SIGTERM ends the rank even if the exit hangs
        os._exit(1)
    try:
        line = (f"rank {os.environ.get('RANK', '0')}: stopped by SIGTERM (torchrun sends it when another rank "
                f"fails, naming that rank in its report, or when it is stopped itself); {kept()}; the same command "
                "resumes")
        with tqdm.external_write_mode(file=sys.stderr):   # in place of a progress bar's line, not after it
            print(line, file=sys.stderr, flush=True)
    finally:   # whatever befell the line, SIGTERM still ends the rank
        os._exit(128 + signal.SIGTERM)
