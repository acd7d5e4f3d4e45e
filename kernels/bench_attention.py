"""`python -m kernels.bench attention`: TTT attention, forward + backward, on the GPU.

For each shape (all K = 7 steps, i.e. S = 7 key/value steps, bf16, D = 128):
  a  T = 4096, one sequence, 64 q heads, 8 kv heads
  b  the same with 8 packed sequences of random lengths summing to 4096
  c  T = 8192, one sequence, 64 q heads, 64 kv heads
it first checks the Triton kernel against an fp32 reference (output and dq, dk, dv), then times
fwd+bwd (median of triton.testing.do_bench) and measures peak memory for:
  triton       kernels.ttt_attention.ttt_attention
  flex         torch.compile(flex_attention) with the TTT block mask (mask built once, untimed)
  sdpa floor   causal SDPA over the step-0 keys only (no diagonal terms): the floor; per-sequence
               calls for packed sequences, each on its own input tensors
  eager        kernels.reference.ttt_attention (materializes the fp32 score matrices)

FLOPs are the useful ones, counted the FlashAttention way: forward = 4 * D * Hq * (sum over
sequences of n(n+1)/2 causal pairs + (S-1) * T diagonal pairs), backward = 2.5 x forward. The floor
is counted without the diagonal pairs. Masked-out work that an implementation still does is not
counted. Peak memory is the peak allocated during one fwd+bwd minus what was allocated before it
(inputs and dO excluded; outputs, saved tensors, gradients and workspaces included).
"""
from __future__ import annotations

import datetime
import gc
import os
import random
import traceback

import torch
import torch.nn.functional as F
import triton

from kernels.reference import ttt_attention as reference_attention
from kernels.ttt_attention import ttt_attention

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
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
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


def _triton(case):
    inputs = [_leaf(case[n]) for n in ("q", "k", "v")]
    return inputs, lambda q, k, v: [ttt_attention(q, k, v, cu_seqlens=case["cu"])], [case["do"]]


def _eager(case):
    inputs = [_leaf(case[n]) for n in ("q", "k", "v")]
    return inputs, lambda q, k, v: [reference_attention(q, k, v, cu_seqlens=case["cu"])], [case["do"]]


_compiled_flex = None


def _flex(case):
    """flex_attention over the keys of all steps laid side by side: [1, Hkv, S*T, D] (a free view)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    T = case["T"]
    seq_id = torch.repeat_interleave(torch.arange(len(case["lengths"]), device=DEVICE),
                                     torch.tensor(case["lengths"], device=DEVICE))

    def ttt_mask(b, h, q_idx, kv_idx):
        step, pos = kv_idx // T, kv_idx % T
        causal = (step == 0) & (pos <= q_idx) & (seq_id[pos] == seq_id[q_idx])
        return causal | ((step > 0) & (pos == q_idx))

    block_mask = create_block_mask(ttt_mask, B=None, H=None, Q_LEN=T, KV_LEN=S_STEPS * T, device=DEVICE)
    q = _leaf(case["q"][None])                                        # [1, T, Hq, D]
    k = _leaf(case["k"].reshape(1, S_STEPS * T, case["hkv"], HEAD_DIM))  # [1, S*T, Hkv, D]
    v = _leaf(case["v"].reshape(1, S_STEPS * T, case["hkv"], HEAD_DIM))

    def run(q, k, v):
        o = _compiled_flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           block_mask=block_mask, enable_gqa=True)
        return [o.transpose(1, 2)]

    return [q, k, v], run, [case["do"][None]]


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
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
    del inputs, run, douts
    gc.collect()
    torch.cuda.empty_cache()
    return ms, peak


def _bench_case(label: str) -> dict:
    case = _make_case(label)
    errors = check(case)
    gc.collect()
    torch.cuda.empty_cache()
    ok = all(e < TOLERANCE for e in errors.values())
    print(f"\nshape ({label}): T={case['T']} Hq={case['hq']} Hkv={case['hkv']} D={HEAD_DIM} S={S_STEPS} "
          f"bf16, sequences {case['lengths']}")
    print("  check vs fp32 reference (relative error): "
          + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()) + ("  PASS" if ok else "  FAIL"))
    rows = {}
    for name, build, flops in (("triton (this kernel)", _triton, _flops(case)),
                               ("flex_attention (compiled)", _flex, _flops(case)),
                               ("sdpa causal floor", _sdpa_floor, _flops(case, diagonal=False)),
                               ("eager reference", _eager, _flops(case))):
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
            gc.collect()
            torch.cuda.empty_cache()
            continue
        rows[name] = (ms, flops / ms / 1e9, gib)
        print(f"  {name:27s} {ms:9.2f} ms {flops / ms / 1e9:7.1f} TFLOP/s {gib:7.2f} GiB", flush=True)
    return dict(case=case, errors=errors, ok=ok, rows=rows)


def run(shapes: str = "all") -> None:
    labels = list(SHAPES) if shapes == "all" else [s.strip() for s in shapes.split(",") if s.strip()]
    props = torch.cuda.get_device_properties(0)
    print(f"TTT attention fwd+bwd, {datetime.date.today()}, {props.name} ({props.multi_processor_count} SMs), "
          f"torch {torch.__version__}, triton {triton.__version__}")
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
