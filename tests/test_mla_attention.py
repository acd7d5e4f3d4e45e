"""kernels.mla_attention (Triton, unpadded MLA heads: nope + a rotary key shared by every head, values of their own
width) against kernels.reference.ttt_attention(..., k_pe=...) and against the padded path (the GQA Triton kernel over
heads zero-padded to one power of two), on the CPU, alone and under 2-rank context parallelism.

As tests/test_ttt_attention.py: the kernels run under Triton's interpreter in one child process (this file run as a
script), which prints a JSON line per case; the pytest tests below assert on them."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from conftest import print_cases, raises_value_error, run_interpreted

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5   # fp32 under the interpreter
# name -> (T, heads, (nope, rope, v), steps, packed lengths or None, interpreter tiling)
TILES_A = {"fwd": (16, 16), "dkdv": (16, 16), "dq": (16, 16), "rows": 16}
TILES_B = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16), "rows": 8}
MATCH_CASES = {
    "one_sequence": (27, 2, (32, 16, 32), 3, None, TILES_A),
    "packed_with_empty_sequence": (40, 2, (16, 16, 32), 4, [13, 0, 22, 5], TILES_B),
    "step0_only": (21, 2, (32, 16, 16), 1, [12, 9], TILES_A),
    "kimi_widths": (17, 1, (128, 64, 128), 2, [9, 8], TILES_B),
}
OTHER_CASES = ["per_step_views", "bf16_upcast", "unroll_saves_each_step_once", "rejects_bad_arguments"]
PARALLEL_CASE = "context_parallel_2_ranks"   # a child of its own (slow): two forked ranks and the reference
MLA_DIMS = (16, 16, 16, 16, 32)   # the test draft's (q_lora, kv_lora, nope, rope, v): widths the kernel serves


def _interpreted(*cases):
    found, proc = run_interpreted(__file__, *cases)
    if not found:
        pytest.fail(f"interpreted child produced no results (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return found


@pytest.fixture(scope="module")
def results():
    return _interpreted(*MATCH_CASES, *OTHER_CASES)


def _result(results, name):
    assert name in results, f"case {name} did not report"
    res = results[name]
    assert "exception" not in res, res["exception"]
    return res


@pytest.mark.parametrize("name", MATCH_CASES)
def test_forward_dkdv_and_dq_equal_the_reference_and_the_padded_path(results, name):
    res = _result(results, name)
    steps = MATCH_CASES[name][3]
    for against in ("reference", "padded"):
        errors = res[against]
        assert set(errors) == {"out", "dq", "dk", "dv", "dk_pe"} | (
            {"dk_diagonal", "dv_diagonal", "dk_pe_diagonal"} if steps > 1 else set())
        bad = {k: e for k, e in errors.items() if not e < TOLERANCE}
        assert not bad, f"{against}: relative errors over {TOLERANCE}: {bad}"


def test_per_step_views_of_other_strides_are_read_in_place(results):
    """The draft's keys: step 0's k_nope and v views of one kv_b output, k_pe a view of kv_a, later steps tensors of
    their own (rows scattered): the step tables address each as it lies."""
    errors = _result(results, "per_step_views")["errors"]
    assert max(errors.values()) < TOLERANCE, errors


def test_bf16_inputs_are_upcast_under_the_interpreter(results):
    errors = _result(results, "bf16_upcast")["errors"]
    assert max(errors.values()) < 2e-2, errors


def test_an_unroll_saves_each_steps_keys_once_and_no_expanded_rotary_key(results):
    """Over 3 TTT steps the backward keeps each step's k_nope, v and one-head k_pe as given (no stacked copy, no k_pe
    expanded over heads): the saved bytes are q, o, lse per step plus each step's keys once."""
    res = _result(results, "unroll_saves_each_step_once")
    assert res["own_tensors_saved"], res
    assert res["saved_bytes"] == res["expected_bytes"], res


def test_rejects_bad_arguments(results):
    res = _result(results, "rejects_bad_arguments")
    assert all(res["raised"].values()), res


@pytest.mark.slow
def test_two_context_parallel_ranks_give_the_one_process_gradients():
    """An MLA draft's micro-batch split by rows over 2 gloo ranks, the kernel between the all-to-alls (the rotary key
    sent whole to both ranks, its gradient summed back): the ranks' losses and gradients add up to the eager
    reference's on the whole micro-batch in one process."""
    res = _result(_interpreted(PARALLEL_CASE), PARALLEL_CASE)
    assert res["grads"] == 16 and res["worst"] < 1e-4, res
    assert abs(res["loss_ranks"] - res["loss_one"]) < 1e-5 * abs(res["loss_one"]), res


# ---------------------------------------------------------------------------------------------
# child side (TRITON_INTERPRET=1 already set by the parent, or by __main__ below).

def _inputs(T, H, dims, steps, dtype=None, seed=0):
    import torch
    nope, rope, vdim = dims
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(dtype or torch.float32).requires_grad_()
    return (make(T, H, nope + rope), make(steps, T, H, nope), make(steps, T, H, vdim), make(steps, T, 1, rope),
            torch.randn(T, H, vdim, generator=gen))


def _cu(lengths):
    import torch
    return None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _rel(a, b):
    import torch
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item() if torch.isfinite(a).all() \
        else float("inf")


def _run(attention, q, k, v, pe, do, cu, **kw):
    """(out, dq, dk, dv, dk_pe) of one call on leaves of their own."""
    import torch
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, pe)]
    out = attention(leaves[0], leaves[1], leaves[2], cu, k_pe=leaves[3], **kw)
    return [out, *torch.autograd.grad(out, leaves, do.to(out.dtype))]


def _errors(got, want, steps):
    names = ("out", "dq", "dk", "dv", "dk_pe")
    errors = {n: _rel(a, b) for n, a, b in zip(names, got, want)}
    if steps > 1:   # the diagonal keys' gradients come from their own kernel: report them on their own
        errors.update({f"{n}_diagonal": _rel(a[1:], b[1:]) for n, a, b in zip(names[2:], got[2:], want[2:])})
    return errors


def _padded(q, k, v, cu, k_pe):
    from eagle3.kernels.reference import padded_mla
    from eagle3.kernels.ttt_attention import ttt_attention
    return padded_mla(ttt_attention, q, k, v, cu, k_pe=k_pe)


def _match_case(name):
    import eagle3.kernels.mla_attention as mla
    from eagle3.kernels.reference import ttt_attention as reference
    T, H, dims, steps, lengths, tiles = MATCH_CASES[name]
    mla.INTERPRET_BLOCKS = dict(tiles)
    q, k, v, pe, do = _inputs(T, H, dims, steps)
    cu = _cu(lengths)
    got = _run(mla.ttt_attention_mla, q, k, v, pe, do, cu)
    return {"reference": _errors(got, _run(reference, q, k, v, pe, do, cu), steps),
            "padded": _errors(got, _run(_padded, q, k, v, pe, do, cu), steps)}


def _other_case(name):
    import torch

    import eagle3.kernels.mla_attention as mla
    from eagle3.kernels.reference import ttt_attention as reference
    attention = mla.ttt_attention_mla
    if name == "per_step_views":
        T, H, (nope, rope, vdim), cu = 20, 2, (16, 16, 32), _cu([11, 9])
        gen = torch.Generator().manual_seed(3)
        kv = torch.randn(T, H, nope + vdim, generator=gen)         # step 0: views of one kv_b output
        kv_a = torch.randn(T, 8 + rope, generator=gen)             # and of kv_a's [latent | k_pe]
        ks = [kv[..., :nope], *(torch.randn(T, H, nope, generator=gen) for _ in range(2))]
        vs = [kv[..., nope:], *(torch.randn(T, H, vdim, generator=gen) for _ in range(2))]
        pes = [kv_a[:, None, 8:], *(torch.randn(T, 1, rope, generator=gen) for _ in range(2))]
        q, do = torch.randn(T, H, nope + rope, generator=gen), torch.randn(T, H, vdim, generator=gen)

        def run(fn):
            leaves = [x.clone().requires_grad_() for x in (q, *ks, *vs, *pes)]
            for i in (1, 4, 7):   # step 0's views as the draft hands them, not made contiguous by clone
                leaves[i] = leaves[i].detach()
            k0 = (kv.clone().requires_grad_(), kv_a.clone().requires_grad_())
            lists = ([k0[0][..., :nope], *leaves[2:4]], [k0[0][..., nope:], *leaves[5:7]],
                     [k0[1][:, None, 8:], *leaves[8:10]])
            out = fn(leaves[0], lists[0], lists[1], cu, k_pe=lists[2])
            inputs = [leaves[0], *k0, *leaves[2:4], *leaves[5:7], *leaves[8:10]]
            return [out, *torch.autograd.grad(out, inputs, do)]

        got, want = run(attention), run(reference)
        return {"errors": {f"{i}": _rel(a, b) for i, (a, b) in enumerate(zip(got, want))},
                "strided": not ks[0].is_contiguous()}
    if name == "bf16_upcast":
        q, k, v, pe, do = _inputs(24, 2, (32, 16, 32), 3, dtype=torch.bfloat16)
        cu = _cu([15, 9])
        want = _run(reference, *(x.float() for x in (q, k, v, pe)), do, cu)
        return {"errors": _errors(_run(attention, q, k, v, pe, do, cu), want, 3)}
    if name == "unroll_saves_each_step_once":
        T, H, dims, S = 16, 2, (16, 16, 32), 3
        q, k, v, pe, _ = _inputs(T, H, dims, S)
        saved, cache = {}, []

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for step in range(S):
                cache.append(tuple(x[step].detach().clone().requires_grad_() for x in (k, v, pe)))
                out = attention(q, *([c[i] for c in cache] for i in (0, 1)), _cu([7, 9]),
                                k_pe=[c[2] for c in cache])
        out.sum().backward()
        own = {x.untyped_storage().data_ptr() for c in cache for x in c}
        per_call = T * H * dims[2] * 4 + H * T * 4 + 3 * 4   # o, lse, cu_seqlens (fp32, int32); q is one tensor
        per_step = T * H * (dims[0] + dims[2]) * 4 + T * dims[1] * 4   # k_nope, v and the one-head k_pe
        return {"own_tensors_saved": own <= set(saved), "saved_bytes": sum(saved.values()),
                "expected_bytes": q.numel() * 4 + S * (per_call + per_step)}
    if name == "rejects_bad_arguments":
        q, k, v, pe, _ = _inputs(8, 2, (16, 16, 16), 2)
        calls = {
            "no_k_pe": lambda: attention(q, k, v),
            "a_window": lambda: attention(q, k, v, k_pe=pe, window=4),
            "rope_8": lambda: attention(q[..., :24], k, v, k_pe=pe[..., :8]),
            "q_width_not_nope_plus_rope": lambda: attention(q[..., :16], k, v, k_pe=pe),
            "steps_differ": lambda: attention(q, k, v[:1], k_pe=pe),
            "per_head_rotary_key": lambda: attention(q, k, v, k_pe=pe.expand(2, 8, 2, 16)),
        }
        return {"raised": raises_value_error(calls)}
    if name == PARALLEL_CASE:
        return _context_parallel()
    raise KeyError(name)


def _draft_run(attention, split_over=None):
    """Loss and gradients of a tiny MLA draft's TTT micro-batch (test_context's), or of this rank's share of it."""
    import dataclasses

    import torch.distributed as dist

    from eagle3.data.batch import RowRule, split
    from eagle3.training.context import SplitAttention
    from eagle3.ttt import plan_rows, ttt_forward
    from eagle3.kernels.reference import ttt_loss_steps
    from test_context import STEPS, draft_and_inputs
    from test_mla_draft import mla_draft
    _, embed, head, batch = draft_and_inputs()
    draft = mla_draft(3, dims=MLA_DIMS)
    if split_over:
        batch = split(batch, split_over, dist.get_rank(), halo=STEPS + 1)
        attention = SplitAttention(attention, split_over, dist.group.WORLD)
    batch = dataclasses.replace(batch, plan=plan_rows(batch, STEPS, draft.t2d, True, RowRule()))
    loss, _, _ = ttt_forward(draft, batch, embed, head, STEPS, attention, ttt_loss_steps)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def _rank_main(rank: int, world: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from eagle3.kernels.mla_attention import ttt_attention_mla
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(_draft_run(ttt_attention_mla, world), f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def _context_parallel():
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from eagle3.kernels.reference import ttt_attention as reference
    with tempfile.TemporaryDirectory() as out:
        ranks = mp.start_processes(_rank_main, args=(2, f"file://{out}/init", out), nprocs=2, join=False,
                                   start_method="fork")
        deadline = time.monotonic() + 240
        while not ranks.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ranks.processes:
                    p.kill()
                raise AssertionError("2 ranks did not finish in 240 s")
        parts = [torch.load(f"{out}/{r}.pt") for r in range(2)]
    loss_one, one = _draft_run(reference)
    return {"grads": len(one), "loss_one": loss_one, "loss_ranks": parts[0][0] + parts[1][0],
            "worst": max(_rel(parts[0][1][n] + parts[1][1][n], one[n]) for n in one)}


def _main(names):
    print_cases(names or [*MATCH_CASES, *OTHER_CASES, PARALLEL_CASE],
                lambda name: _match_case(name) if name in MATCH_CASES else _other_case(name))


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    _main(sys.argv[1:])
