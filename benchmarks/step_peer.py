"""`python -m benchmarks.step_peer`: the step bench (`python -m eagle3.bench`) and the peer's step
(speculators 0.9.0, `benchmarks/peer/speculators_step.py`, its wheels on PYTHONPATH) at the same sizes in
one call, and ours / the peer's tokens/s on layout a.

    python -m benchmarks.step_peer [--peer-gpu 1] --sizes llama8b --layouts a --kernels triton,auto ...

Every option but --peer-script and --peer-gpu is the step bench's. On our GPU the peer runs first, alone
(its compile is the call's long pole); with --peer-gpu (one size) it runs beside ours on another GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from eagle3 import distributed
from eagle3.bench import step

PEER_SCRIPT = Path(__file__).parent / "peer" / "speculators_step.py"


def peer_tokens_per_s(log: str, tokens_per_step: int) -> float | None:
    """Steady-state tokens/s from the peer's log: the median of its own per-step times
    (`profile/step_ms`) over its last epoch (the first compiles for minutes); None without one."""
    starts = list(re.finditer(r"Training epoch \d+/\d+ started", log))
    last = log[starts[-1].end():] if starts else ""
    times = [float(v) for v in re.findall(r"profile/step_ms=([\d.]+(?:e[+-]?\d+)?)", last)]
    return tokens_per_step / (statistics.median(times) / 1e3) if times else None


class PeerRun(NamedTuple):
    process: subprocess.Popen
    log: Path        # the full log the peer's script writes; its stdout and stderr beside it, .out
    started: float   # perf_counter


def start_peer(script: str, gpu: int | None, size: str) -> PeerRun:
    """Start the peer's step at `size` (its script's defaults: 12 steps per epoch, the second epoch steady)
    on GPU `gpu` (None: the one ours uses, so the caller waits for it before timing ours). Its full log
    goes to $OUT (or /tmp)/peer_step.log, its stdout and stderr to peer_step.out beside it."""
    log_file = Path(os.environ.get("OUT", "/tmp")) / "peer_step.log"
    log_file.unlink(missing_ok=True)
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {}))
    print(f"peer ({script}, {size}) started" + (f" on GPU {gpu}" if gpu is not None else ""), flush=True)
    with open(log_file.with_suffix(".out"), "w") as out:   # a file, not a pipe: nobody reads it while it runs
        run = subprocess.Popen([sys.executable, script, "--shape", json.dumps(step.SIZES[size])], stdout=out,
                               stderr=subprocess.STDOUT, env=env)
    return PeerRun(run, log_file, time.perf_counter())


def finish_peer(run: PeerRun, size: str) -> float | None:
    """Wait for the peer started by `start_peer`: its steady tokens/s, or None (its log's tail printed).
    Its log is kept as peer_step-SIZE.log."""
    rc = run.process.wait()
    out = run.log.with_suffix(".out")
    log = (run.log.read_text() if run.log.exists() else "") + (out.read_text() if out.exists() else "")
    if run.log.exists():
        run.log.rename(run.log.with_name(f"peer_step-{size}.log"))
    peer = peer_tokens_per_s(log, step.SIZES[size]["seqs"] * step.SIZES[size]["seq_len"])
    print(f"peer {size}: rc {rc}, {time.perf_counter() - run.started:.0f} s, "
          + (f"{peer:,.0f} tokens/s" if peer else "no completed epoch found in its output:\n" + log[-3000:]), flush=True)
    return peer


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_peer", description=__doc__.split("\n")[0])
    parser.add_argument("--peer-script", default=str(PEER_SCRIPT))
    parser.add_argument("--peer-gpu", type=int, default=None,
                        help="run the peer on this GPU of the host, beside ours on GPU 0 (one size; ours is timed "
                             "while the peer prepares and compiles: check the peer's log times)")
    own, rest = parser.parse_known_args(argv)
    args = step.parse(rest)
    if own.peer_gpu is not None and (own.peer_gpu < 1 or len(args.sizes) > 1):
        parser.error("--peer-gpu takes one size and names a GPU other than ours (0): 1 or more")
    if own.peer_gpu is not None and torch.cuda.is_available() and own.peer_gpu >= torch.cuda.device_count():
        parser.error(f"--peer-gpu {own.peer_gpu}: this process sees {torch.cuda.device_count()} GPU(s)")
    return own, args


def main(argv: list[str] | None = None) -> None:
    own, args = parse(argv)
    dist = distributed.setup()
    if dist.world > 1:   # the other ranks would wait in a collective for the peer's minutes
        raise SystemExit("error: the peer runs on one GPU: run benchmarks.step_peer without torchrun")
    peers, beside = {}, None
    if own.peer_gpu is None:
        peers = {size: finish_peer(start_peer(own.peer_script, None, size), size) for size in args.sizes}
    else:
        beside = start_peer(own.peer_script, own.peer_gpu, args.sizes[0])
    root = Path(args.dir or "/tmp/eagle3-bench")
    try:
        results, tflops = step.run_ours(args, dist, root)
    except BaseException:   # ours failed or was interrupted: the peer beside it must not keep its GPU
        if beside:
            beside.process.kill()
        raise
    if beside:
        peers[args.sizes[0]] = finish_peer(beside, args.sizes[0])
    step.print_table(results, tflops, dist)
    for r in results:
        if r["layout"] == "a" and peers.get(r["size"]) and not r.get("out_of_memory"):
            ours, peer = r["tokens_per_s_per_gpu"], peers[r["size"]]
            print(f"{r['size']} a: ours ({r['kernels']}) / speculators 0.9.0 tokens/s = {ours / peer:.2f}x "
                  f"({ours:,.0f} / {peer:,.0f}, same call)")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"peer": "speculators 0.9.0", "tokens_per_s_per_gpu": peers}) + "\n")
    distributed.teardown()


if __name__ == "__main__":
    main()
