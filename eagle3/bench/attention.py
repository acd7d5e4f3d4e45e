"""`python -m eagle3.bench attention [--shapes a,b,c]`: TTT attention, forward + backward, on the GPU.

For each shape (all K = 7 steps, i.e. S = 7 key/value steps, bf16, D = 128):
  a  T = 4096, one sequence, 64 q heads, 8 kv heads
  b  the same with 8 packed sequences of random lengths summing to 4096
  c  T = 8192, one sequence, 64 q heads, 64 kv heads
it first checks the Triton kernel against an fp32 reference (output and dq, dk, dv), then times
fwd+bwd (`timing.median_ms`: median of triton.testing.do_bench) and measures peak memory for:
  triton       kernels.ttt_attention.ttt_attention (tiles loaded through TMA on sm_90 and later)
  pointer      the same kernels with pointer loads (a row only where the kernel uses TMA)
  flex         kernels.flex.ttt_attention, what `debug.kernels = "torch"` runs: compiled
               flex_attention with the TTT block mask (mask built on the untimed first call)
  sdpa floor   causal SDPA over the step-0 keys only (no diagonal terms): the floor; per-sequence
               calls for packed sequences, each on its own input tensors
  eager        kernels.reference.ttt_attention (materializes the fp32 score matrices)

FLOPs are the useful ones, counted the FlashAttention way: forward = 4 * D * Hq * (sum over
sequences of n(n+1)/2 causal pairs + (S-1) * T diagonal pairs), backward = 2.5 x forward. The floor
is counted without the diagonal pairs. Masked-out work that an implementation still does is not
counted. Peak memory is the peak allocated during one fwd+bwd minus what was allocated before it
(inputs and dO excluded; outputs, saved tensors, gradients and workspaces included). Packed
boundaries go to every contender as the trainer passes them: int32 in pinned host memory.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import random
import time
import traceback

import torch
import torch.nn.functional as F

from eagle3.bench.timing import describe_device, free_memory, median_ms, peak_bytes, require_cuda
from kernels.flex import ttt_attention as flex_attention
from kernels.reference import ttt_attention as reference_attention
from kernels.ttt_attention import ttt_attention

# the module itself (kernels.ttt_attention as an attribute is the function of that name)
kernel_module = importlib.import_module("kernels.ttt_attention")

S_STEPS, HEAD_DIM, DTYPE = 7, 128, torch.bfloat16
SHAPES = {
    "a": dict(T=4096, hq=64, hkv=8, n_seq=1),
    "b": dict(T=4096, hq=64, hkv=8, n_seq=8),
    "c": dict(T=8192, hq=64, hkv=64, n_seq=1),
}
DEVICE = "cuda"
EAGER_LIMIT_GIB = 100.0  # skip the eager reference where its estimated footprint exceeds this
TOLERANCE = 1e-2


# ----------------------------------------------------------------------------------------------
# Inputs and FLOPs
# ----------------------------------------------------------------------------------------------

def _lengths(T: int, n_seq: int, seed: int) -> list[int]:
    cuts = sorted(random.Random(seed).sample(range(1, T), n_seq - 1))
    bounds = [0, *cuts, T]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _make_case(label: str, seed: int = 0) -> dict:
    shape = SHAPES[label]
    T, hq, hkv = shape["T"], shape["hq"], shape["hkv"]
    lengths = _lengths(T, shape["n_seq"], seed)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    randn = lambda *size: torch.randn(*size, device=DEVICE, dtype=DTYPE, generator=gen)
    cu = None
    if len(lengths) > 1:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).pin_memory()
    return dict(label=label, T=T, hq=hq, hkv=hkv, lengths=lengths, cu=cu,
                q=randn(T, hq, HEAD_DIM), k=randn(S_STEPS, T, hkv, HEAD_DIM),
                v=randn(S_STEPS, T, hkv, HEAD_DIM), do=randn(T, hq, HEAD_DIM))


def _flops(case: dict, diagonal: bool = True) -> float:
    pairs = sum(n * (n + 1) // 2 for n in case["lengths"])
    if diagonal:
        pairs += (S_STEPS - 1) * case["T"]
    return 3.5 * 4 * HEAD_DIM * case["hq"] * pairs


# ----------------------------------------------------------------------------------------------
# Correctness at the benchmark shape
# ----------------------------------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).norm() / b.norm()).item()


def _fp32_reference(case: dict) -> tuple[torch.Tensor, ...]:
    """Output and gradients of the fp32 reference, computed a few kv heads at a time to fit memory."""
    q, k, v, do, cu = case["q"], case["k"], case["v"], case["do"], case["cu"]
    T, hq, hkv = case["T"], case["hq"], case["hkv"]
    group = hq // hkv
    # The reference holds about a dozen fp32 [heads, T, T] buffers: keep each chunk near 16 GiB.
    chunk_kv = max(1, min(hkv, int(16 * 2**30 // (12 * 4 * T * T * group))))
    outs = [torch.empty(x.shape, device=DEVICE, dtype=torch.float32) for x in (q, q, k, v)]
    for h0 in range(0, hkv, chunk_kv):
        h1 = min(hkv, h0 + chunk_kv)
        qs = slice(h0 * group, h1 * group)
        args = [q[:, qs].float().requires_grad_(), k[:, :, h0:h1].float().requires_grad_(),
                v[:, :, h0:h1].float().requires_grad_()]
        o = reference_attention(*args, cu_seqlens=cu)
        dq, dk, dv = torch.autograd.grad(o, args, do[:, qs].float())
        outs[0][:, qs], outs[1][:, qs] = o.detach(), dq
        outs[2][:, :, h0:h1], outs[3][:, :, h0:h1] = dk, dv
        del o, dq, dk, dv, args
    return tuple(outs)


def check(case: dict) -> dict[str, float]:
    q, k, v = (case[n].detach().clone().requires_grad_() for n in ("q", "k", "v"))
    out = ttt_attention(q, k, v, cu_seqlens=case["cu"])
    grads = torch.autograd.grad(out, (q, k, v), case["do"])
    ref = _fp32_reference(case)
    errors = {name: _rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), ref)}
    del out, grads, ref
    return errors


# ----------------------------------------------------------------------------------------------
# The contenders: each builds its own leaf tensors and returns (inputs, step outputs, dOs)
# ----------------------------------------------------------------------------------------------

def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def _kernel(attention):
    """A contender with the trainer's attention signature (kernels/reference.py's)."""
    def build(case):
        inputs = [_leaf(case[n]) for n in ("q", "k", "v")]
        return inputs, lambda q, k, v: [attention(q, k, v, cu_seqlens=case["cu"])], [case["do"]]
    return build


def _pointer_loads(q, k, v, cu_seqlens=None):
    """The kernel with pointer loads where it would use TMA (the backward loads as its forward did)."""
    with kernel_module.tma_loads(False):
        return ttt_attention(q, k, v, cu_seqlens=cu_seqlens)


_triton, _flex, _eager = _kernel(ttt_attention), _kernel(flex_attention), _kernel(reference_attention)
_pointer = _kernel(_pointer_loads)


def _sdpa_floor(case):
    """Causal SDPA on the step-0 keys only; packed sequences as separate calls on separate tensors."""
    bounds = [0, *torch.tensor(case["lengths"]).cumsum(0).tolist()]
    inputs, douts = [], []
    for a, b in zip(bounds, bounds[1:]):
        inputs += [_leaf(case["q"][a:b][None]), _leaf(case["k"][0, a:b][None]), _leaf(case["v"][0, a:b][None])]
        douts.append(case["do"][a:b][None])

    def run(*xs):
        outs = []
        for i in range(0, len(xs), 3):
            q, k, v = (x.transpose(1, 2) for x in xs[i:i + 3])       # [1, H, n, D] views
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        return [o.transpose(1, 2) for o in outs]

    return inputs, run, douts


def _eager_gib(case) -> float:
    # Measured on shape (a): 18.9 GiB, about 4.5 fp32 [Hq, T, T] buffers at the peak of fwd+bwd.
    # T^2 rather than the sum of n^2: an upper bound whether the reference works per sequence or not.
    return 4.5 * 4 * case["hq"] * case["T"] ** 2 / 2**30


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def _measure(build, case) -> tuple[float, float]:
    """(median fwd+bwd ms, peak GiB above the inputs) of one contender."""
    inputs, run, douts = build(case)

    def step():
        outs = run(*inputs)
        torch.autograd.grad(outs, inputs, douts)

    step()  # compile / autotune outside the measurements
    peak = peak_bytes(step)[0] / 2**30
    return median_ms(step, warmup=25, rep=200), peak


def _bench_case(label: str) -> dict:
    case = _make_case(label)
    errors = check(case)
    free_memory()
    ok = all(e < TOLERANCE for e in errors.values())
    print(f"\nshape ({label}): T={case['T']} Hq={case['hq']} Hkv={case['hkv']} D={HEAD_DIM} S={S_STEPS} "
          f"bf16, sequences {case['lengths']}")
    print("  check vs fp32 reference (relative error): "
          + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()) + ("  PASS" if ok else "  FAIL"))
    rows = {}
    contenders = [("triton (this kernel)", _triton, _flops(case))]
    if kernel_module.uses_tma(torch.device(DEVICE)):
        contenders.append(("triton, pointer loads", _pointer, _flops(case)))
    contenders += [("flex_attention (compiled)", _flex, _flops(case)),
                   ("sdpa causal floor", _sdpa_floor, _flops(case, diagonal=False)),
                   ("eager reference", _eager, _flops(case))]
    for name, build, flops in contenders:
        if build is _eager and _eager_gib(case) > EAGER_LIMIT_GIB:
            rows[name] = None
            print(f"  {name:27s} skipped: would need ~{_eager_gib(case):.0f} GiB")
            continue
        try:
            ms, gib = _measure(build, case)
        except Exception as exc:  # one failing contender (OOM, compile error) must not end the run
            rows[name] = None
            print(f"  {name:27s} failed: {type(exc).__name__}: {str(exc)[:300]}")
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
            continue
        finally:
            free_memory()   # what the contender left (after a failure: once its traceback is gone)
        rows[name] = (ms, flops / ms / 1e9, gib)
        print(f"  {name:27s} {ms:9.2f} ms {flops / ms / 1e9:7.1f} TFLOP/s {gib:7.2f} GiB", flush=True)
    return dict(case=case, errors=errors, ok=ok, rows=rows)


def run(shapes: str = "all") -> None:
    labels = list(SHAPES) if shapes == "all" else [s.strip() for s in shapes.split(",") if s.strip()]
    print(f"TTT attention fwd+bwd, {describe_device()}")
    results = [_bench_case(label) for label in labels]

    print("\n| shape | implementation | fwd+bwd ms | TFLOP/s | peak GiB |")
    print("|---|---|---:|---:|---:|")
    for res in results:
        for name, row in res["rows"].items():
            cells = "| not run (see above) | | |" if row is None else f"| {row[0]:.2f} | {row[1]:.0f} | {row[2]:.2f} |"
            print(f"| {res['case']['label']} | {name} {cells}")
    print("\n| shape | check (max rel err) | kernel/flex time | flex/kernel speed-up | kernel/floor time "
          "| kernel/flex memory |")
    print("|---|---|---:|---:|---:|---:|")
    for res in results:
        rows = res["rows"]
        kern, flex, floor = (rows.get(n) for n in ("triton (this kernel)", "flex_attention (compiled)",
                                                   "sdpa causal floor"))
        verdict = f"{max(res['errors'].values()):.1e} {'pass' if res['ok'] else 'FAIL'}"
        if kern and flex and floor:
            print(f"| {res['case']['label']} | {verdict} | {kern[0] / flex[0]:.2f} | {flex[0] / kern[0]:.2f}x "
                  f"| {kern[0] / floor[0]:.2f} | {kern[2] / flex[2]:.2f} |")
        else:
            print(f"| {res['case']['label']} | {verdict} | n/a | n/a | n/a | n/a |")


# ----------------------------------------------------------------------------------------------
# Sweep: each kernel's candidate configs one at a time (the others autotuned)
# ----------------------------------------------------------------------------------------------

def _time_config(case, name, config, expected) -> tuple[float, float, list[torch.Tensor]]:
    """(median fwd+bwd ms, max rel error against `expected`, the output and gradients) with kernel
    `name` pinned to `config` (config None: the autotuned kernels, nothing to compare with)."""
    inputs, run, douts = _triton(case)

    def step():
        outs = run(*inputs)
        return outs + list(torch.autograd.grad(outs, inputs, douts))

    with kernel_module.pinned(name, config) if config else contextlib.nullcontext():
        got = [t.detach() for t in step()]   # compiles (autotunes)
        error = max(_rel(a, b) for a, b in zip(got, expected)) if expected else 0.0
        return median_ms(step, warmup=10, rep=100), error, got


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")[:160]


def sweep(shapes: str, budget_s: float) -> None:
    """Time every SWEEP config of every kernel at each shape, the other kernels autotuned; starts no new
    shape or config after budget_s. A config that fails to compile or run is a row, not the end."""
    deadline = time.monotonic() + budget_s
    print(f"TTT attention config sweep, {describe_device()}")
    print("| shape | kernel | config (BLOCK_M, BLOCK_N, warps, stages) | fwd+bwd ms | vs autotuned "
          "| max rel err vs autotuned |")
    print("|---|---|---|---:|---:|---:|")
    for label in [s.strip() for s in shapes.split(",") if s.strip()]:
        if time.monotonic() > deadline:
            print(f"| {label} | | | not run: sweep budget spent | | |")
            continue
        case = _make_case(label)
        base, _, expected = _time_config(case, None, None, None)
        picks = ", ".join(f"{name} {kernel_module.best_config(name)}" for name in kernel_module.SWEEP)
        print(f"| {label} | (autotuned: {picks}) | | {base:.3f} | 1.000 | |", flush=True)
        for name, configs in kernel_module.SWEEP.items():
            for config in configs:
                if time.monotonic() > deadline:
                    print(f"| {label} | {name} | {config} | not run: sweep budget spent | | |")
                    continue
                try:
                    ms, error, _ = _time_config(case, name, config, expected)
                    flag = "" if error < TOLERANCE else " WRONG"
                    print(f"| {label} | {name} | {config} | {ms:.3f} | {ms / base:.3f} | {error:.1e}{flag} |",
                          flush=True)
                except Exception as exc:  # a config that does not compile or run is reported, not fatal
                    print(f"| {label} | {name} | {config} | failed: {_cell(f'{type(exc).__name__}: {exc}')} | | |",
                          flush=True)
                try:
                    free_memory()
                except RuntimeError as exc:   # a sticky CUDA error: nothing after it can be trusted
                    print(f"sweep stopped: {_cell(str(exc))}")
                    return
        del case, expected
        free_memory()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.bench attention", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="all", help="comma-separated shape labels (a,b,c) or 'all'")
    parser.add_argument("--sweep", action="store_true",
                        help="time each kernel's candidate configs (kernels.ttt_attention.SWEEP) one by one "
                             "(shapes a and c unless --shapes names others)")
    parser.add_argument("--sweep-seconds", type=float, default=300.0,
                        help="start no new sweep config after this many seconds")
    args = parser.parse_args(argv)
    require_cuda("attention")
    if args.sweep:
        sweep("a,c" if args.shapes == "all" else args.shapes, args.sweep_seconds)
    else:
        run(args.shapes)
