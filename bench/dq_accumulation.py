"""The TTT attention's dQ accumulated inside the dK/dV pass, against the kernel's two passes.

An experiment kept for its figures (bench/RESULTS.md, "TTT attention", ninth session), not part of
the package. `kernels.ttt_attention` recomputes the scores in a separate dQ pass (7 tile products in
the backward where FlashAttention-2 does 5) because adding each key tile's dQ part from the dK/dV pass
needs a sum across programs. Here each dK/dV program owns one key tile, walks its query tiles from
the last to the diagonal and adds dS^T K into an fp32 dQ:
  order 0  unordered fp32 atomics (not deterministic: a lower bound on any ordered scheme's time)
  order 1  fixed order: query tile m takes key tiles 0, 1, ... in turn, a semaphore per (q head,
           query tile) spun on with atomic_cas; the parts added with atomics once it is the tile's turn
  order 2  the same order, the part added by a load and a store through L2 (no float atomics)
Step-0 keys only (S = 1), one sequence, no packing.

    GPU:  PYTHONPATH=. python bench/dq_accumulation.py [a] [c]      (shapes of `eagle3.bench attention`)
    CPU:  TRITON_INTERPRET=1 PYTHONPATH=. python bench/dq_accumulation.py     (a small fp32 check)
"""
import importlib
import os
import sys

import torch
import triton
import triton.language as tl

ta = importlib.import_module("kernels.ttt_attention")  # the module (the package exports the function)
_load_rows, _bwd_dkdv_tile, LOG2E = ta._load_rows, ta._bwd_dkdv_tile, ta.LOG2E


@triton.jit
def _tile(dk, dv, k, v, j, Qh, DOh, LSEh, DELTAh, DQAh, LOCKh, stride_qt, stride_dot, stride_at,
          mi, offs_n, offs_d, T, qk_scale, sm_scale,
          BLOCK_M: tl.constexpr, MASK: tl.constexpr, ORDER: tl.constexpr):
    """The kernel's dK/dV tile, then the fifth product dq = dS K of its query tile, added in `ORDER`."""
    offs_m = mi * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < T
    dk, dv, ds_t = _bwd_dkdv_tile(dk, dv, k, v, Qh, DOh, None, None, 0, 0, LSEh, DELTAh, stride_qt, stride_dot,
                                  mi * BLOCK_M, offs_n, offs_d, T, qk_scale, False, BLOCK_M, MASK, False)
    dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k) * sm_scale  # [BLOCK_M, D]
    ptrs = DQAh + offs_m[:, None] * stride_at + offs_d[None, :]
    if ORDER == 0:
        tl.atomic_add(ptrs, dq, mask=row_mask[:, None], sem="relaxed")
    elif ORDER == 1:
        lock = LOCKh + mi
        old = tl.atomic_cas(lock, j, j, sem="acquire")
        while old != j:
            old = tl.atomic_cas(lock, j, j, sem="acquire")
        tl.debug_barrier()
        tl.atomic_add(ptrs, dq, mask=row_mask[:, None], sem="relaxed")
        tl.debug_barrier()
        tl.atomic_xchg(lock, j + 1, sem="release")
    else:  # ORDER 2: ordered, load-add-store through L2
        lock = LOCKh + mi
        old = tl.atomic_cas(lock, j, j, sem="acquire")
        while old != j:
            old = tl.atomic_cas(lock, j, j, sem="acquire")
        tl.debug_barrier()
        acc = tl.load(ptrs, mask=row_mask[:, None], other=0.0, cache_modifier=".cg")
        tl.store(ptrs, acc + dq, mask=row_mask[:, None], cache_modifier=".cg")
        tl.debug_barrier()
        tl.atomic_xchg(lock, j + 1, sem="release")
    return dk, dv


@triton.jit
def _dkdv_dq(Q, K, V, DO, LSE, DELTA, DK, DV, DQA, LOCK,
             stride_qt, stride_qh, stride_kt, stride_kh, stride_dot, stride_doh, stride_at, stride_ah,
             T, qk_scale, sm_scale, N_M,
             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ORDER: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk, dv of key tile j of one kv head, and its dQ parts. The grid is (kv head, key tile), so key
    tile j - 1 comes before j in launch order and the tile a program spins for is running or done:
    the interpreter runs programs in that order; on a GPU it is an assumption (CUDA does not promise
    in-order block starts, though GPUs start them in order in practice)."""
    kv_head = tl.program_id(0)
    j = tl.program_id(1)
    n0 = j * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_mask = offs_n < T
    kv_base = kv_head * stride_kh
    k = _load_rows(K + kv_base, offs_n, stride_kt, offs_d, key_mask, False)
    v = _load_rows(V + kv_base, offs_n, stride_kt, offs_d, key_mask, False)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    first_unmasked = tl.minimum(tl.cdiv(n0 + BLOCK_N, BLOCK_M), N_M)
    first = n0 // BLOCK_M
    for g in range(GROUP):
        head = kv_head * GROUP + g
        Qh = Q + head * stride_qh
        DOh = DO + head * stride_doh
        LSEh = LSE + head * T
        DELTAh = DELTA + head * T
        DQAh = DQA + head * stride_ah
        LOCKh = LOCK + head * N_M
        # last query tile first, down to the diagonal
        for i in range(0, N_M - first_unmasked):
            dk, dv = _tile(dk, dv, k, v, j, Qh, DOh, LSEh, DELTAh, DQAh, LOCKh, stride_qt, stride_dot,
                           stride_at, N_M - 1 - i, offs_n, offs_d, T, qk_scale, sm_scale,
                           BLOCK_M, False, ORDER)
        for i in range(0, first_unmasked - first):
            dk, dv = _tile(dk, dv, k, v, j, Qh, DOh, LSEh, DELTAh, DQAh, LOCKh, stride_qt, stride_dot,
                           stride_at, first_unmasked - 1 - i, offs_n, offs_d, T, qk_scale, sm_scale,
                           BLOCK_M, True, ORDER)
    out = kv_base + offs_n[:, None] * stride_kt + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_mask[:, None])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_mask[:, None])


def new_backward(do, q, k, v, o, lse, scale, order, cfg):
    """(dq, dk, dv) with dQ from the dK/dV pass; the zeroing and the final cast counted in its time."""
    bm, bn, w, st = cfg
    S, T, Hkv, D = k.shape
    Hq = q.shape[1]
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    delta = torch.empty_like(lse)
    dqa = torch.zeros(T, Hq, D, device=q.device, dtype=torch.float32)
    n_m = triton.cdiv(T, bm)
    lock = torch.zeros(Hq * n_m, device=q.device, dtype=torch.int32)
    rows = ta.ROWS_BLOCK_GPU
    ta._bwd_preprocess[(triton.cdiv(T, rows), Hq)](
        o, do, delta, o.stride(0), o.stride(1), do.stride(0), do.stride(1), T, HEAD_DIM=D, BLOCK=rows)
    _dkdv_dq[(Hkv, triton.cdiv(T, bn))](
        q, k, v, do, lse, delta, dk, dv, dqa, lock,
        q.stride(0), q.stride(1), k.stride(1), k.stride(2), do.stride(0), do.stride(1), dqa.stride(0), dqa.stride(1),
        T, scale * LOG2E, scale, n_m, GROUP=Hq // Hkv, HEAD_DIM=D, ORDER=order,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
    return dqa.to(q.dtype), dk, dv


def gpu(names):
    from triton.testing import do_bench
    torch.manual_seed(0)
    shapes = {"a": (4096, 64, 8), "c": (8192, 64, 64)}
    cfgs = [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]
    for name in names:
        T, Hq, Hkv = shapes[name]
        D = 128
        q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16)
        scale = D ** -0.5
        tma = False   # like for like: the experiment's dK/dV tiles load through pointers
        o, lse = ta._forward(q, k, v, None, 1, T, scale, tma)
        ref = ta._backward(do, q, k, v, o, lse, None, 1, T, scale, tma)
        t_cur = do_bench(lambda: ta._backward(do, q, k, v, o, lse, None, 1, T, scale, tma), warmup=25, rep=200)
        print(f"[{name}] current dkdv+dq backward (S=1): {t_cur:.3f} ms  configs dkdv {ta.best_config('dkdv')} "
              f"dq {ta.best_config('dq')}", flush=True)
        for order in (0, 1, 2):
            for cfg in cfgs:
                try:
                    got = new_backward(do, q, k, v, o, lse, scale, order, cfg)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - a tiling that does not fit is reported, not fatal
                    print(f"[{name}] order {order} {cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                errs = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref)]
                again = new_backward(do, q, k, v, o, lse, scale, order, cfg)
                same = all(torch.equal(a, b) for a, b in zip(got, again))
                t = do_bench(lambda: new_backward(do, q, k, v, o, lse, scale, order, cfg), warmup=25, rep=200)
                print(f"[{name}] order {order} {cfg}: {t:.3f} ms ({t / t_cur:.3f}x current)  err dq/dk/dv "
                      f"{errs[0]:.1e}/{errs[1]:.1e}/{errs[2]:.1e}  bit-equal rerun {same}", flush=True)
        del q, k, v, do, o, lse, ref
        torch.cuda.empty_cache()


def cpu():
    """Under the interpreter: every order gives the kernel's gradients (an odd length, GQA)."""
    torch.manual_seed(0)
    T, Hq, Hkv, D = 80, 4, 2, 64
    q, do = torch.randn(T, Hq, D), torch.randn(T, Hq, D)
    k, v = torch.randn(1, T, Hkv, D), torch.randn(1, T, Hkv, D)
    scale = D ** -0.5
    o, lse = ta._forward(q, k, v, None, 1, T, scale, False)
    ref = ta._backward(do, q, k, v, o, lse, None, 1, T, scale, False)
    ta.ROWS_BLOCK_GPU = ta.INTERPRET_BLOCKS["rows"]
    for order in (0, 1, 2):
        for cfg in [(16, 32, 4, 1), (32, 32, 4, 1)]:
            errs = [((a - b).norm() / b.norm()).item() for a, b in zip(new_backward(do, q, k, v, o, lse, scale, order, cfg), ref)]
            print(f"order {order} {cfg}: rel err dq/dk/dv " + "/".join(f"{e:.1e}" for e in errs))
            assert max(errs) < 1e-5, errs


if __name__ == "__main__":
    cpu() if os.environ.get("TRITON_INTERPRET") == "1" else gpu(sys.argv[1:] or ["a", "c"])
