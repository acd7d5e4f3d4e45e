"""`python -m benchmarks.attention_sweep`: the TTT attention kernels' candidate configs timed one at a time.

Each config of SWEEP (every GPU family's tilings and a few more) is pinned for its kernel, the others autotuned, and timed
fwd+bwd at the attention bench's shapes (`python -m eagle3.bench attention`), with its error against the
autotuned result: how a new GPU's tile lists are chosen (docs/kernels.md). Where tiles load through TMA, the autotuned
kernels are also timed with pointer loads.

    python -m benchmarks.attention_sweep [--shapes a,c] [--seconds 300]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import time

import torch
import triton

from eagle3.bench.attention import SHAPES, TOLERANCE, contender, fwd_bwd, make_case
from eagle3.bench.timing import describe_device, free_memory, median_ms, rel_error, require_cuda, shape_labels
from eagle3.kernels import tiles
from eagle3.kernels.ttt_attention import CONFIGS, FALLBACK, ttt_attention

_EXTRA = {"fwd": [(128, 64, 8, 4), (128, 128, 8, 2)], "dkdv": [(64, 128, 8, 4), (64, 64, 4, 3)],
          "dq": [(64, 64, 4, 3), (128, 32, 8, 4)]}
SWEEP = {name: [c for c in tiles.union({f: CONFIGS[f][name] for f in CONFIGS}) if c != FALLBACK] + extra
         for name, extra in _EXTRA.items()}
kernel_module = importlib.import_module("eagle3.kernels.ttt_attention")   # the attribute of that name is the function


@contextlib.contextmanager
def pinned(name: str, config: tuple):
    """Launch kernel `name` ("fwd", "dkdv" or "dq") with `config` (BLOCK_M, BLOCK_N, warps, stages) instead of
    the autotuner's pick: a one-config autotuner in its place (it launches that config untimed)."""
    m, n, warps, stages = config
    saved = kernel_module.TUNED[name]
    kernel_module.TUNED[name] = triton.autotune([triton.Config(
        {"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages, pre_hook=kernel_module.block_rows)],
        key=[])(kernel_module.KERNELS[name])
    try:
        yield
    finally:
        kernel_module.TUNED[name] = saved


def time_config(case, name, config, expected) -> tuple[float, float, list[torch.Tensor]]:
    """(median fwd+bwd ms, max rel error against `expected`, outputs and gradients) with kernel `name`
    pinned to `config` (None: all autotuned, nothing to compare with)."""
    step = fwd_bwd(contender(ttt_attention), case)
    with pinned(name, config) if config else contextlib.nullcontext():
        got = [t.detach() for t in step()]   # compiles (autotunes)
        error = max(rel_error(a, b) for a, b in zip(got, expected)) if expected else 0.0
        return median_ms(step, warmup=10, rep=100), error, got


def cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")[:160]


def sweep_config(label, case, name, config, base, expected) -> str:
    try:
        ms, error, _ = time_config(case, name, config, expected)
        flag = "" if error < TOLERANCE else " WRONG"
        return f"| {label} | {name} | {config} | {ms:.3f} | {ms / base:.3f} | {error:.1e}{flag} |"
    except Exception as exc:  # a config that does not compile or run is a row, not the end
        return f"| {label} | {name} | {config} | failed: {cell(f'{type(exc).__name__}: {exc}')} | | |"


def sweep(shapes: str, budget_s: float) -> None:
    """Time every SWEEP config of every kernel at each shape, the others autotuned; start nothing after budget_s."""
    deadline = time.monotonic() + budget_s
    spent = "not run: sweep budget spent | | |"
    print(f"TTT attention config sweep, {describe_device()}")
    print("| shape | kernel | config (BLOCK_M, BLOCK_N, warps, stages) | fwd+bwd ms | vs autotuned "
          "| max rel err vs autotuned |\n|---|---|---|---:|---:|---:|")
    for label in shape_labels(shapes, SHAPES):
        if time.monotonic() > deadline:
            print(f"| {label} | | | {spent}")
            continue
        case = make_case(label)
        base, _, expected = time_config(case, None, None, None)
        picks = ", ".join(f"{name} {kernel_module.best_config(name)}" for name in SWEEP)
        print(f"| {label} | (autotuned: {picks}) | | {base:.3f} | 1.000 | |", flush=True)
        if kernel_module.uses_tma(torch.device("cuda")):   # the backward loads as its forward did
            with kernel_module.tma_loads(False):
                ms, error, _ = time_config(case, None, None, expected)
            print(f"| {label} | (autotuned, pointer loads instead of TMA) | | {ms:.3f} | {ms / base:.3f} | {error:.1e} |")
        for name, config in ((name, c) for name, configs in SWEEP.items() for c in configs):
            if time.monotonic() > deadline:
                print(f"| {label} | {name} | {config} | {spent}")
                continue
            print(sweep_config(label, case, name, config, base, expected), flush=True)
            try:
                free_memory()
            except RuntimeError as exc:   # a sticky CUDA error: nothing after it can be trusted
                print(f"sweep stopped: {cell(str(exc))}")
                return
        del case, expected
        free_memory()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="a,c", help="comma-separated shape labels (a,b,c) or 'all'")
    parser.add_argument("--seconds", type=float, default=300.0, help="start no new config after this many seconds")
    args = parser.parse_args(argv)
    require_cuda("benchmarks.attention_sweep")
    sweep(args.shapes, args.seconds)


if __name__ == "__main__":
    main()
