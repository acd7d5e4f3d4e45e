"""`python -m eagle3.bench attention [--shapes a,b,c] [--json FILE]`: TTT attention fwd + bwd on the GPU, checked
against fp32, each contender timed with its peak memory; useful FLOPs counted FlashAttention's way (`_flops`)."""
from __future__ import annotations

import argparse
import itertools
import random

import torch
import torch.nn.functional as F

from eagle3.bench.timing import (append_json, attempt, describe_device, free_memory, median_ms, peak_bytes,
                                 rel_error, require_cuda, shape_labels)
from eagle3.kernels.flex import ttt_attention as flex_attention   # compiled flex_attention: debug.kernels = "torch"
from eagle3.kernels.reference import ttt_attention as reference_attention
from eagle3.kernels.ttt_attention import ttt_attention

S_STEPS, HEAD_DIM, DTYPE = 7, 128, torch.bfloat16
SHAPES = {"a": (4096, 64, 8, 1), "b": (4096, 64, 8, 8), "c": (8192, 64, 64, 1)}   # label: (T, Hq, Hkv, sequences)
DEVICE = "cuda"
EAGER_LIMIT_GIB = 100.0  # skip the eager reference where its estimated footprint exceeds this
TOLERANCE = 1e-2


def make_case(label: str, seed: int = 0) -> dict:
    T, hq, hkv, n_seq = SHAPES[label]
    cuts = sorted(random.Random(seed).sample(range(1, T), n_seq - 1))
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, T])]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    randn = lambda *size: torch.randn(*size, device=DEVICE, dtype=DTYPE, generator=gen)
    # packed boundaries as the trainer passes them: int32 in pinned host memory
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).pin_memory() if n_seq > 1 else None
    return dict(label=label, T=T, hq=hq, hkv=hkv, lengths=lengths, cu=cu, q=randn(T, hq, HEAD_DIM),
                k=randn(S_STEPS, T, hkv, HEAD_DIM), v=randn(S_STEPS, T, hkv, HEAD_DIM), do=randn(T, hq, HEAD_DIM))


def _flops(case: dict, diagonal: bool = True) -> float:
    """Forward 4·D·Hq·(causal pairs + (S-1)·T diagonal pairs), backward 2.5x; the sdpa floor without the diagonal."""
    pairs = sum(n * (n + 1) // 2 for n in case["lengths"]) + diagonal * (S_STEPS - 1) * case["T"]
    return 3.5 * 4 * HEAD_DIM * case["hq"] * pairs


def _fp32_reference(case: dict) -> tuple[torch.Tensor, ...]:
    """Output, dq, dk, dv of the fp32 reference, a few kv heads at a time to fit memory."""
    q, k, v, do, cu = case["q"], case["k"], case["v"], case["do"], case["cu"]
    T, hkv = case["T"], case["hkv"]
    group = case["hq"] // hkv
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
    got = fwd_bwd(_triton, case)()
    return {name: rel_error(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, _fp32_reference(case))}


def fwd_bwd(build, case):
    """A contender's step: () -> [outputs..., input gradients...]."""
    inputs, run, douts = build(case)

    def step():
        outs = run(*inputs)
        return outs + list(torch.autograd.grad(outs, inputs, douts))
    return step


# The contenders: each builds its own leaf tensors and returns (inputs, step outputs, dOs).

def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def contender(attention):
    """A contender with the trainer's attention signature (kernels/reference.py's)."""
    def build(case):
        inputs = [_leaf(case[n]) for n in ("q", "k", "v")]
        return inputs, lambda q, k, v: [attention(q, k, v, cu_seqlens=case["cu"])], [case["do"]]
    return build


_triton, _flex, _eager = contender(ttt_attention), contender(flex_attention), contender(reference_attention)


def _sdpa_floor(case):
    """Causal SDPA on the step-0 keys only; packed sequences as separate calls on separate tensors."""
    bounds = [0, *itertools.accumulate(case["lengths"])]
    inputs, douts = [], []
    for a, b in zip(bounds, bounds[1:]):
        inputs += [_leaf(x[a:b][None]) for x in (case["q"], case["k"][0], case["v"][0])]   # [1, n, H, D]
        douts.append(case["do"][a:b][None])

    def run(*xs):   # q, k, v of each sequence in turn, attended as [1, H, n, D] views
        return [F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in xs[i:i + 3]), is_causal=True,
                                               enable_gqa=True).transpose(1, 2) for i in range(0, len(xs), 3)]
    return inputs, run, douts


def _eager_gib(case) -> float:
    # About 4.5 fp32 [Hq, T, T] buffers at the peak of fwd+bwd; T^2, not the sum of n^2: an upper bound.
    return 4.5 * 4 * case["hq"] * case["T"] ** 2 / 2**30


def _measure(build, case) -> tuple[float, float]:
    """(median fwd+bwd ms, peak GiB above the inputs) of one contender."""
    step = fwd_bwd(build, case)
    step()  # compile / autotune outside the measurements
    peak = peak_bytes(step)[0] / 2**30
    return median_ms(step, warmup=25, rep=200), peak


def bench_case(label: str) -> dict:
    case = make_case(label)
    errors = check(case)
    free_memory()
    ok = all(e < TOLERANCE for e in errors.values())
    print(f"\nshape ({label}): T={case['T']} Hq={case['hq']} Hkv={case['hkv']} D={HEAD_DIM} S={S_STEPS} "
          f"bf16, sequences {case['lengths']}")
    print("  check vs fp32 reference (relative error): "
          + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()) + ("  PASS" if ok else "  FAIL"))
    contenders = [("triton (this kernel)", _triton, _flops(case)), ("flex_attention (compiled)", _flex, _flops(case)),
                  ("sdpa causal floor", _sdpa_floor, _flops(case, diagonal=False)),
                   ("eager reference", _eager, _flops(case))]
    rows = {}
    for name, build, flops in contenders:
        rows[name] = None
        if build is _eager and _eager_gib(case) > EAGER_LIMIT_GIB:
            print(f"  {name:27s} skipped: would need ~{_eager_gib(case):.0f} GiB")
        elif measured := attempt(f"  {name:27s}", _measure, build, case):
            ms, gib = measured
            rows[name] = (ms, flops / ms / 1e9, gib)
            print(f"  {name:27s} {ms:9.2f} ms {flops / ms / 1e9:7.1f} TFLOP/s {gib:7.2f} GiB", flush=True)
        free_memory()   # what the contender left
    return dict(case=case, errors=errors, ok=ok, rows=rows)


def run(shapes: str = "all", json_path: str | None = None) -> None:
    device = describe_device()
    print(f"TTT attention fwd+bwd, {device}")
    results, rows = [bench_case(label) for label in shape_labels(shapes, SHAPES)], []
    print("\n| shape | implementation | fwd+bwd ms | TFLOP/s | peak GiB | time / this kernel's |")
    print("|---|---|---:|---:|---:|---:|")
    for res in results:
        ours = res["rows"].get("triton (this kernel)")
        for name, row in res["rows"].items():
            ratio = f"{row[0] / ours[0]:.2f}" if row and ours else ""
            cells = f"| {row[0]:.2f} | {row[1]:.0f} | {row[2]:.2f} | {ratio} |" if row else "| not run | | | |"
            print(f"| {res['case']['label']} | {name} {cells}")
            rows.append({"bench": "attention", "device": device, "shape": res["case"]["label"],
                         "lengths": res["case"]["lengths"], "max_rel_err": max(res["errors"].values()),
                         "implementation": name, **dict(zip(("fwd_bwd_ms", "tflops", "peak_gib"), row or (None,) * 3))})
    append_json(json_path, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.bench attention", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="all", help="comma-separated shape labels (a,b,c) or 'all'")
    parser.add_argument("--json", default=None, help="append each row (shape, implementation) here as a JSON line")
    args = parser.parse_args(argv)
    require_cuda("eagle3.bench attention")
    run(args.shapes, args.json)
