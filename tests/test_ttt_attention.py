"""kernels.ttt_attention (Triton) against kernels.reference.ttt_attention, on the CPU.

The kernels run under Triton's interpreter, which only works when TRITON_INTERPRET=1 is set before
triton itself is imported (triton.language's own jit helpers are decorated at that import). Other
test files in the same pytest process import triton first, so the checks run in one child process:
this file run as a script (`python tests/test_ttt_attention.py [case ...]`) sets the variable, imports
the kernels and prints one JSON line per case; the pytest tests below start it once and assert on
each case's line.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from conftest import print_cases, raises_value_error, run_interpreted

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5  # fp32 under the interpreter; observed errors are about 3e-7

# name -> (T, Hq, Hkv, D, steps, packed lengths or None, interpreter tiling)
TILES_A = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16), "rows": 16}
TILES_B = {"fwd": (16, 16), "dkdv": (16, 16), "dq": (16, 16), "rows": 8}
TILES_FALLBACK = {"fwd": (32, 32), "dkdv": (32, 32), "dq": (32, 32), "rows": 16}   # kernels.ttt_attention.FALLBACK
MATCH_CASES = {
    "gqa_odd_length": (37, 4, 2, 64, 3, None, TILES_A),          # no multiple of any block size
    "gqa_odd_length_small_tiles": (37, 4, 2, 64, 3, None, TILES_B),
    "mha_d128": (50, 2, 2, 128, 4, None, TILES_A),
    "step0_only": (29, 4, 1, 64, 1, None, TILES_B),              # plain causal attention
    "packed_with_empty_sequence": (45, 4, 1, 64, 2, [13, 0, 27, 5], TILES_A),
    "packed_many_tiles_d128": (120, 2, 1, 128, 3, [70, 33, 1, 16], TILES_B),
    "packed_many_tiles_gqa": (120, 4, 2, 64, 4, [70, 33, 1, 16], TILES_A),
    "fallback_tiles": (120, 4, 2, 128, 3, [70, 33, 1, 16], TILES_FALLBACK),  # the config every GPU can run
}
# a sliding window over the step-0 keys (key j seen by query i when i - j < window): name -> (match case, window);
# inside one key tile, straddling several, with only step 0 (rows whose first tiles are all masked), TMA
WINDOW_CASES = {"window_5": ("gqa_odd_length", 5), "window_20_packed": ("packed_many_tiles_gqa", 20),
                "window_3_step0_only": ("step0_only", 3),
                "tma_window_20_packed_small_tiles": ("packed_many_tiles_d128", 20)}
# the same cases with tiles loaded through TMA descriptors (what Hopper and datacenter Blackwell
# run): past a packed sequence's end those load the next sequence's rows, which the kernels' masks
# must drop
TMA_CASES = [f"tma_{name}" for name in MATCH_CASES]
OTHER_CASES = [*WINDOW_CASES, "custom_scale", "bf16_upcast", "sequences_isolated", "tma_sequences_isolated",
               "tma_misaligned_views", "rejects_bad_arguments", "per_step_lists"]


# ---------------------------------------------------------------------------------------------
# pytest side: one interpreted child process for all cases.

INTERPRETED_CHILD = True   # conftest starts the child at collection, in the background


@pytest.fixture(scope="module")
def results():
    found, proc = run_interpreted(__file__)
    if not found:
        pytest.fail(f"interpreted child produced no results (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return found


def _result(results, name):
    assert name in results, f"case {name} did not report"
    res = results[name]
    assert "exception" not in res, res["exception"]
    return res


@pytest.mark.parametrize("name", [*MATCH_CASES, *TMA_CASES])
def test_forward_and_gradients_match_reference(results, name):
    res = _result(results, name)
    errors = res["errors"]
    # the loads the case asked for are the ones launched: descriptors to the forward, dK/dV and dQ, or none
    assert res["descriptors"] == [name.startswith("tma_")] * 3, res
    steps = MATCH_CASES[name.removeprefix("tma_")][4]
    assert set(errors) == {"out", "dq", "dk", "dv"} | ({"dk_diagonal", "dv_diagonal"} if steps > 1 else set())
    bad = {k: e for k, e in errors.items() if not e < TOLERANCE}
    assert not bad, f"relative errors over {TOLERANCE}: {bad}"


@pytest.mark.parametrize("name", WINDOW_CASES)
def test_a_sliding_window_matches_the_reference(results, name):
    errors = _result(results, name)["errors"]
    assert max(errors.values()) < TOLERANCE, errors


def test_custom_scale(results):
    errors = _result(results, "custom_scale")["errors"]
    assert max(errors.values()) < TOLERANCE, errors


def test_the_fallback_case_runs_the_kernels_fallback_tiling():
    from eagle3.kernels.ttt_attention import FALLBACK
    tiles = {FALLBACK[:2]}
    assert {TILES_FALLBACK[k] for k in ("fwd", "dkdv", "dq")} == tiles


def test_config_lists_keep_the_tiling_rules_and_end_with_the_fallback():
    from benchmarks.attention_sweep import SWEEP
    from eagle3.kernels.ttt_attention import CONFIGS, FALLBACK
    assert all(configs[-1] == FALLBACK for family in CONFIGS.values() for configs in family.values())
    for lists in (*CONFIGS.values(), SWEEP):
        for name, configs in lists.items():
            assert all(len(config) == 4 for config in configs), configs   # (BLOCK_M, BLOCK_N, warps, stages)
            for block_m, block_n, *_ in configs:
                # fwd/dq step over key tiles inside a query tile, dkdv over query tiles inside a key tile
                assert (block_m % block_n if name in ("fwd", "dq") else block_n % block_m) == 0, (name, block_m, block_n)


def test_best_config_reads_the_autotuners_pick(monkeypatch):
    from types import SimpleNamespace

    import triton

    import eagle3.kernels.ttt_attention as tta
    assert tta.best_config("dq") is None       # nothing tuned in this (CPU) process
    monkeypatch.setitem(tta.TUNED, "dkdv", SimpleNamespace(
        best_config=triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3)))
    assert tta.best_config("dkdv") == (64, 128, 8, 3)
    monkeypatch.setitem(tta.TUNED, "dkdv", SimpleNamespace())     # a tuner that has not run
    assert tta.best_config("dkdv") is None


def test_bf16_inputs_are_upcast_under_the_interpreter(results):
    # bf16 tiles are upcast to fp32 in the kernels; only the bf16 rounding of results remains.
    errors = _result(results, "bf16_upcast")["errors"]
    assert max(errors.values()) < 2e-2, errors


@pytest.mark.parametrize("name", ["sequences_isolated", "tma_sequences_isolated"])
def test_sequences_do_not_see_each_other(results, name):
    res = _result(results, name)
    assert res["other_sequence_unchanged"] and res["own_sequence_changed"], res


def test_views_tma_cannot_take_load_through_pointers(results):
    # q, k, v off 16-byte alignment: the whole call loads through pointers; a misaligned dO alone is
    # copied, so the backward keeps TMA
    res = _result(results, "tma_misaligned_views")
    assert res["misaligned_inputs"] == [False] * 3 and res["misaligned_do"] == [True] * 3, res
    assert max(res["errors"].values()) < TOLERANCE, res["errors"]


def test_per_step_lists_equal_the_stacked_call_and_an_unroll_saves_each_steps_keys_once(results):
    """A TTT unroll hands the kernel its steps' keys and values as lists: the same output and gradients as one
    stacked tensor, and over 4 steps the backward keeps each step's keys and values once (stacked calls keep
    1 + 2 + 3 + 4 copies: at the Kimi-size MLA draft, 28 GiB of 16,384 tokens x 64 heads x 256)."""
    res = _result(results, "per_step_lists")
    assert res["equal"], res
    assert res["own_tensors_saved"], res
    assert res["stacked_bytes"] - res["list_bytes"] == 2 * (1 + 2 + 3 + 4 - 4) * res["step_bytes"], res


def test_rejects_bad_arguments(results):
    res = _result(results, "rejects_bad_arguments")
    assert all(res["raised"].values()), res


# ---------------------------------------------------------------------------------------------
# child side (TRITON_INTERPRET=1 already set by the parent, or by __main__ below).

def _inputs(T, hq, hkv, d, steps, dtype=None, seed=0):
    import torch
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(dtype or torch.float32).requires_grad_()
    return make(T, hq, d), make(steps, T, hkv, d), make(steps, T, hkv, d), torch.randn(T, hq, d, generator=gen)


def _cu(lengths):
    import torch
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _errors(T, hq, hkv, d, steps, lengths=None, scale=None, dtype=None, window=0):
    """Relative errors of the output and every gradient against the fp32 reference."""
    import torch
    from eagle3.kernels.reference import ttt_attention as reference
    from eagle3.kernels.ttt_attention import ttt_attention

    cu = None if lengths is None else _cu(lengths)
    q, k, v, do = _inputs(T, hq, hkv, d, steps, dtype)
    out = ttt_attention(q, k, v, cu_seqlens=cu, scale=scale, window=window)
    assert out.dtype == q.dtype and out.shape == q.shape
    grads = torch.autograd.grad(out, (q, k, v), do.to(q.dtype))
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference(qf, kf, vf, cu_seqlens=cu, scale=scale, window=window)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), do)
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("inf")
    errors = {name: rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))}
    if steps > 1:  # the diagonal keys' gradients come from their own kernel: report them on their own
        errors["dk_diagonal"] = rel(grads[1][1:], ref_grads[1][1:])
        errors["dv_diagonal"] = rel(grads[2][1:], ref_grads[2][1:])
    return errors


def _descriptors_launched(call):
    """call()'s result, and per kernel launch whether it was given TMA descriptors."""
    import eagle3.kernels.ttt_attention as tta
    launch, seen = tta._launch, []

    def spy(name, grid, *args, **kwargs):
        seen.append(kwargs.get("Qd") is not None)
        return launch(name, grid, *args, **kwargs)

    tta._launch = spy
    try:
        return call(), seen
    finally:
        tta._launch = launch


def _match_case(name):
    import eagle3.kernels.ttt_attention as tta
    T, hq, hkv, d, steps, lengths, tiles = MATCH_CASES[name.removeprefix("tma_")]
    tta.INTERPRET_BLOCKS = dict(tiles)
    with tta.tma_loads(name.startswith("tma_")):
        errors, seen = _descriptors_launched(lambda: _errors(T, hq, hkv, d, steps, lengths))
    return {"errors": errors, "descriptors": seen}


def _other_case(name):
    import torch

    import eagle3.kernels.ttt_attention as tta
    from eagle3.kernels.ttt_attention import ttt_attention

    if name in WINDOW_CASES:
        T, hq, hkv, d, steps, lengths, tiles = MATCH_CASES[WINDOW_CASES[name][0]]
        tta.INTERPRET_BLOCKS = dict(tiles)
        with tta.tma_loads(name.startswith("tma_")):
            return {"errors": _errors(T, hq, hkv, d, steps, lengths, window=WINDOW_CASES[name][1])}
    if name.startswith("tma_") and name != "tma_misaligned_views":
        with tta.tma_loads(True):
            return _other_case(name.removeprefix("tma_"))
    if name == "tma_misaligned_views":
        def off_by_one(x):   # the same values in a view 4 bytes past a 16-byte boundary
            flat = torch.empty(x.numel() + 1, dtype=x.dtype)
            flat[1:] = x.detach().reshape(-1)
            return flat[1:].view(x.shape).requires_grad_()

        q, k, v, do = _inputs(45, 4, 2, 64, 3)
        cu = _cu([20, 25])
        ref = ttt_attention(q, k, v, cu_seqlens=cu)
        ref_grads = torch.autograd.grad(ref, (q, k, v), do)
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()
        errors, seen = {}, {}
        with tta.tma_loads(True):
            for case, (qi, ki, vi, doi) in {"misaligned_inputs": (off_by_one(q), off_by_one(k), off_by_one(v), do),
                                            "misaligned_do": (q, k, v, off_by_one(do))}.items():
                def run():
                    out = ttt_attention(qi, ki, vi, cu_seqlens=cu)
                    return [out, *torch.autograd.grad(out, (qi, ki, vi), doi)]
                got, seen[case] = _descriptors_launched(run)
                errors.update({f"{case} {n}": rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got,
                                                                         (ref, *ref_grads))})
        return {"errors": errors, **seen}
    if name == "custom_scale":
        return {"errors": _errors(33, 2, 1, 64, 3, [20, 13], scale=0.3)}
    if name == "bf16_upcast":
        return {"errors": _errors(40, 4, 2, 64, 3, dtype=torch.bfloat16)}
    if name == "sequences_isolated":
        # Each sequence's inputs changed in turn: the other's output and gradients stay bit-equal
        # (TMA tiles run forward from a sequence's start, over the next one's rows).
        q, k, v, do = _inputs(30, 2, 1, 64, 2)
        cu = _cu([14, 16])

        def run(q, k, v, do):
            q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
            out = ttt_attention(q, k, v, cu_seqlens=cu)
            return [out, *torch.autograd.grad(out, (q, k, v), do)]

        base = run(q, k, v, do)
        unchanged, changed = [], []
        for own, other in ((slice(0, 14), slice(14, 30)), (slice(14, 30), slice(0, 14))):
            q2, k2, v2, do2 = (x.detach().clone() for x in (q, k, v, do))
            q2[own] += 1.0
            k2[:, own] += 1.0
            v2[:, own] -= 1.0
            do2[own] *= 2.0
            got = run(q2, k2, v2, do2)
            unchanged.append(torch.equal(got[0][other], base[0][other]) and torch.equal(got[1][other], base[1][other])
                             and all(torch.equal(g[:, other], b[:, other]) for g, b in zip(got[2:], base[2:])))
            changed.append(not torch.allclose(got[0][own], base[0][own]))
        return {"other_sequence_unchanged": all(unchanged), "own_sequence_changed": all(changed)}
    if name == "per_step_lists":
        q, k, v, do = _inputs(30, 4, 2, 64, 4)
        cu = _cu([14, 16])
        out = ttt_attention(q, k, v, cu_seqlens=cu)
        grads = torch.autograd.grad(out, (q, k, v), do)
        ks, vs = ([x.detach().clone().requires_grad_() for x in t] for t in (k, v))
        out2 = ttt_attention(q, ks, vs, cu_seqlens=cu)
        got = torch.autograd.grad(out2, (q, *ks, *vs), do)
        equal = (torch.equal(out, out2) and torch.equal(grads[0], got[0]) and torch.equal(grads[1], torch.stack(got[1:5]))
                 and torch.equal(grads[2], torch.stack(got[5:])))

        def unroll(as_list):   # 4 TTT steps, the cache growing: the bytes autograd keeps, and whose storages
            saved = {}

            def pack(t):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t
            cache = []
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                for step in range(4):
                    cache.append((k[step].detach().clone().requires_grad_(), v[step].detach().clone().requires_grad_()))
                    keys, values = ([c[i] for c in cache] for i in (0, 1))
                    out = ttt_attention(q, *((keys, values) if as_list else (torch.stack(keys), torch.stack(values))),
                                        cu_seqlens=cu)
            out.sum().backward()   # a one-step list's gradient has its key's shape
            own = {x.untyped_storage().data_ptr() for c in cache for x in c}
            return sum(saved.values()), own <= set(saved)

        (list_bytes, own_saved), (stacked_bytes, _) = unroll(True), unroll(False)
        return {"equal": equal, "own_tensors_saved": own_saved, "list_bytes": list_bytes,
                "stacked_bytes": stacked_bytes, "step_bytes": k[0].numel() * k.element_size()}
    if name == "rejects_bad_arguments":
        q, k, v, _ = _inputs(8, 4, 2, 64, 2)
        calls = {
            "cu_seqlens_not_ending_at_T": lambda: ttt_attention(q, k, v, torch.tensor([0, 5], dtype=torch.int32)),
            "heads_not_a_multiple": lambda: ttt_attention(q[:, :3], k, v),
            "head_dim_48": lambda: ttt_attention(q[..., :48], k[..., :48], v[..., :48]),
        }
        return {"raised": raises_value_error(calls)}
    raise KeyError(name)


def _main(names):
    print_cases(names or [*MATCH_CASES, *TMA_CASES, *OTHER_CASES],
                lambda name: _match_case(name) if name.removeprefix("tma_") in MATCH_CASES else _other_case(name))


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    sys.path.insert(0, str(ROOT))
    _main(sys.argv[1:])
