"""The TTT attention's three causal kernels with TMA descriptor loads, against the kernel's pointer loads.

An experiment, not part of the package (not yet run on a GPU: prepared 2026-12-02, ninth session;
bench/RESULTS.md, "TTT attention", says what the bounds of issue 14 would take). On Hopper a TMA load
moves a whole tile in one asynchronous copy and frees the registers and instructions of pointer
arithmetic; the forward, the dK/dV pass and the dQ pass load their q, dO tiles and step-0 key tiles
that way here (host `TensorDescriptor`s over the [T, H * D] views; dK/dV also stores through them),
the diagonal keys as before. They reuse the package kernel's tile math (`_fwd_diag`,
`_fwd_softmax_tile`, `_bwd_dkdv_scores_tile`, `_bwd_dq_diag`, `_bwd_dq_scores_tile`) and its work
split (heaviest query tiles first; key tiles paired with their mirrors), so only the loads differ.
One sequence, no packing.

The whole `ttt_attention` forward + backward is timed (K = 7, bf16, D = 128, shapes a and c of
`eagle3.bench attention`) with the kernel's own launches, then with one TMA kernel swapped in per
tiling and with the kernel's own pinned to that tiling (the other kernels autotuned as usual),
beside the causal SDPA floor in the same process; each run's outputs and gradients are compared
with the kernel's (pass below 1e-2 relative).

    GPU:  PYTHONPATH=. python bench/attention_tma.py [a] [c]
    CPU:  TRITON_INTERPRET=1 PYTHONPATH=. python bench/attention_tma.py     (a small fp32 check)
"""
import contextlib
import importlib
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

ta = importlib.import_module("kernels.ttt_attention")  # the module (the package exports the function)
_fwd_diag, _fwd_softmax_tile = ta._fwd_diag, ta._fwd_softmax_tile
_bwd_dq_diag, _bwd_dq_scores_tile = ta._bwd_dq_diag, ta._bwd_dq_scores_tile
_bwd_dkdv_scores_tile = ta._bwd_dkdv_scores_tile


@triton.jit
def _fwd_tma(q_desc, k_desc, v_desc, o_desc, K, V, LSE, stride_ks, stride_kt, stride_kh, T, S, qk_scale,
             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    head = tl.program_id(1)
    kv_head = head // GROUP
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M   # heaviest query tiles first
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < T
    q = q_desc.load([m0, head * HEAD_DIM])   # rows past T come as zeros
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, m_i, l_i = _fwd_diag(acc, m_i, l_i, q, K + kv_head * stride_kh, V + kv_head * stride_kh, S, stride_ks,
                              stride_kt, offs_m, offs_d, row_mask, qk_scale, False)
    col = kv_head * HEAD_DIM
    for n0 in range(0, m0, BLOCK_N):
        acc, m_i, l_i = _fwd_softmax_tile(acc, m_i, l_i, q, k_desc.load([n0, col]), v_desc.load([n0, col]),
                                          offs_m, n0 + tl.arange(0, BLOCK_N), qk_scale, False)
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, T), BLOCK_N):
        acc, m_i, l_i = _fwd_softmax_tile(acc, m_i, l_i, q, k_desc.load([n0, col]), v_desc.load([n0, col]),
                                          offs_m, n0 + tl.arange(0, BLOCK_N), qk_scale, True)
    o_desc.store([m0, head * HEAD_DIM], (acc / l_i[:, None]).to(q.dtype))   # rows past T are not written
    tl.store(LSE + head * T + offs_m, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit
def _dq_tma(q_desc, do_desc, k_desc, v_desc, dq_desc, K, LSE, DELTA, DS, stride_ks, stride_kt, stride_kh,
            T, S, H_Q, qk_scale, sm_scale,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    head = tl.program_id(1)
    kv_head = head // GROUP
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < T
    q = q_desc.load([m0, head * HEAD_DIM])
    do = do_desc.load([m0, head * HEAD_DIM])
    lse = tl.load(LSE + head * T + offs_m, mask=row_mask, other=0.0)
    delta = tl.load(DELTA + head * T + offs_m, mask=row_mask, other=0.0)
    dq = _bwd_dq_diag(K + kv_head * stride_kh, DS, head, 0, T, S, H_Q, stride_ks, stride_kt, offs_m, offs_d,
                      row_mask, BLOCK_M, HEAD_DIM)
    col = kv_head * HEAD_DIM
    for n0 in range(0, m0, BLOCK_N):
        dq = _bwd_dq_scores_tile(dq, q, do, lse, delta, k_desc.load([n0, col]), v_desc.load([n0, col]),
                                 offs_m, n0 + tl.arange(0, BLOCK_N), qk_scale, False)
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, T), BLOCK_N):
        dq = _bwd_dq_scores_tile(dq, q, do, lse, delta, k_desc.load([n0, col]), v_desc.load([n0, col]),
                                 offs_m, n0 + tl.arange(0, BLOCK_N), qk_scale, True)
    dq_desc.store([m0, head * HEAD_DIM], (dq * sm_scale).to(q.dtype))


@triton.jit
def _dkdv_tma(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, LSE, DELTA, T, qk_scale, sm_scale,
              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk_0, dv_0 of key tiles `pair` and its mirror for one kv head, as the kernel's dK/dV pass."""
    pair = tl.program_id(0)
    kv_head = tl.program_id(1)
    mirror = tl.cdiv(T, BLOCK_N) - 1 - pair
    col = kv_head * HEAD_DIM
    for tile in range(pair, mirror + 1, tl.maximum(mirror - pair, 1)):
        n0 = tile * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = k_desc.load([n0, col])
        v = v_desc.load([n0, col])
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        for g in range(GROUP):
            head = kv_head * GROUP + g
            for m0 in range(n0, tl.minimum(n0 + BLOCK_N, T), BLOCK_M):
                dk, dv = _dkdv_query_tile(dk, dv, k, v, q_desc, do_desc, LSE, DELTA, head, m0, offs_n, T,
                                          qk_scale, HEAD_DIM, BLOCK_M, True)
            for m0 in range(n0 + BLOCK_N, T, BLOCK_M):
                dk, dv = _dkdv_query_tile(dk, dv, k, v, q_desc, do_desc, LSE, DELTA, head, m0, offs_n, T,
                                          qk_scale, HEAD_DIM, BLOCK_M, False)
        dk_desc.store([n0, col], (dk * sm_scale).to(k.dtype))   # rows past T are not written
        dv_desc.store([n0, col], dv.to(k.dtype))


@triton.jit
def _dkdv_query_tile(dk, dv, k, v, q_desc, do_desc, LSE, DELTA, head, m0, offs_n, T, qk_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_mask = offs_m < T
    # rows past T: q = dO = 0 (TMA fills zeros), lse = delta = 0, so they add nothing
    lse = tl.load(LSE + head * T + offs_m, mask=row_mask, other=0.0)
    delta = tl.load(DELTA + head * T + offs_m, mask=row_mask, other=0.0)
    dk, dv, _ = _bwd_dkdv_scores_tile(dk, dv, k, v, q_desc.load([m0, head * HEAD_DIM]),
                                      do_desc.load([m0, head * HEAD_DIM]), lse, delta, offs_m, offs_n, qk_scale, MASK)
    return dk, dv


def _rows(x, block_rows):
    """A descriptor over x viewed as [rows, H * D] (step 0 of k, v), one head's [block_rows, D] a tile."""
    rows, width = x.shape[-3], x.shape[-2] * x.shape[-1]
    return TensorDescriptor(x, [rows, width], [width, 1], [block_rows, x.shape[-1]])


def _unpack(cfg, q, k, cu, rest, n_rest: int, what: str):
    """(BLOCK_M, BLOCK_N, T, S, launch keywords) for a TMA kernel standing in for the kernel's `what`."""
    assert cu is None and len(rest) == n_rest, f"the {what} launch's arguments changed, or packed sequences"
    bm, bn, warps, stages = cfg
    S, T, Hkv, D = k.shape
    return bm, bn, T, S, dict(GROUP=q.shape[1] // Hkv, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn,
                              num_warps=warps, num_stages=stages)


def _tma_fwd(cfg, q, k, v, o, lse, cu, *rest):
    """Stands in for the kernel's forward launch (`ta._launch("fwd", ...)`'s arguments)."""
    bm, bn, T, S, meta = _unpack(cfg, q, k, cu, rest, 11, "forward")
    qk_scale = rest[9]
    _fwd_tma[(triton.cdiv(T, bm), q.shape[1])](
        _rows(q, bm), _rows(k[0], bn), _rows(v[0], bn), _rows(o, bm), k, v, lse, k.stride(0), k.stride(1),
        k.stride(2), T, S, qk_scale, **meta)


def _tma_dq(cfg, q, k, v, do, lse, delta, ds, dq, cu, *rest):
    """Stands in for the kernel's dQ launch (`ta._launch("dq", ...)`'s arguments)."""
    bm, bn, T, S, meta = _unpack(cfg, q, k, cu, rest, 15, "dQ")
    qk_scale, sm_scale = rest[12], rest[13]
    _dq_tma[(triton.cdiv(T, bm), q.shape[1])](
        _rows(q, bm), _rows(do, bm), _rows(k[0], bn), _rows(v[0], bn), _rows(dq, bm), k, lse, delta, ds,
        k.stride(0), k.stride(1), k.stride(2), T, S, q.shape[1], qk_scale, sm_scale, **meta)


def _tma_dkdv(cfg, q, k, v, do, lse, delta, dk, dv, cu, *rest):
    """Stands in for the kernel's dK/dV launch (`ta._launch("dkdv", ...)`'s arguments)."""
    bm, bn, T, _, meta = _unpack(cfg, q, k, cu, rest, 11, "dK/dV")
    qk_scale, sm_scale = rest[8], rest[9]
    _dkdv_tma[(triton.cdiv(triton.cdiv(T, bn), 2), k.shape[2])](
        _rows(q, bm), _rows(do, bm), _rows(k[0], bn), _rows(v[0], bn), _rows(dk[0], bn), _rows(dv[0], bn),
        lse, delta, T, qk_scale, sm_scale, **meta)


_TMA = {"fwd": _tma_fwd, "dkdv": _tma_dkdv, "dq": _tma_dq}


@contextlib.contextmanager
def swapped(fwd=None, dkdv=None, dq=None):
    """The kernel's launches, with TMA kernels (a tiling each, or None) in place; yields the list of
    the TMA kernels launched."""
    launch, ran, cfgs = ta._launch, [], {"fwd": fwd, "dkdv": dkdv, "dq": dq}

    def patched(name, grid, *args, **kwargs):
        if cfgs[name]:
            ran.append(name)
            return _TMA[name](cfgs[name], *args)
        return launch(name, grid, *args, **kwargs)

    ta._launch = patched
    try:
        yield ran
    finally:
        ta._launch = launch


def fwd_bwd(q, k, v, do):
    out = ta.ttt_attention(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def rel_errors(got, ref):
    return [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref)]


def inputs(T, Hq, Hkv, D, S, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(T, Hq, D, device=device, dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(S, T, Hkv, D, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(T, Hq, D, device=device, dtype=dtype, generator=g)


SHAPES = {"a": (4096, 64, 8), "c": (8192, 64, 64)}   # T, Hq, Hkv
FWD_CFGS = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 2)]
DQ_CFGS = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3)]
DKDV_CFGS = [(64, 128, 8, 3), (32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3)]


def gpu(names, device="cuda", dtype=torch.bfloat16, head_dim=128):
    from triton.testing import do_bench
    import torch.nn.functional as F
    # TMA descriptors built on the host need no device allocator; in-kernel ones would (triton.set_allocator)
    for name in names:
        T, Hq, Hkv = SHAPES[name]
        q, k, v, do = inputs(T, Hq, Hkv, head_dim, 7, device, dtype)
        ref = fwd_bwd(q, k, v, do)
        t_ref = do_bench(lambda: fwd_bwd(q, k, v, do), warmup=25, rep=200)
        # the floor: causal SDPA over the step-0 keys alone, [1, H, T, D]
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_()
                      for x in (q.detach(), k.detach()[0], v.detach()[0]))
        dos = do.transpose(0, 1).unsqueeze(0).contiguous()

        def floor():
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            return torch.autograd.grad(out, (qs, ks, vs), dos)

        t_floor = do_bench(floor, warmup=25, rep=200)
        print(f"[{name}] kernel {t_ref:.3f} ms, SDPA floor {t_floor:.3f} ms ({t_ref / t_floor:.3f}x); tuned fwd "
              f"{ta.best_config('fwd')} dq {ta.best_config('dq')}", flush=True)
        # each tiling twice: the TMA kernel swapped in, and the kernel's own pinned to the same tiling
        runs = [("fwd", c) for c in FWD_CFGS] + [("dkdv", c) for c in DKDV_CFGS] + [("dq", c) for c in DQ_CFGS]
        for kernel, cfg in runs:
            for how, context in (("tma", lambda: swapped(**{kernel: cfg})), ("pointer", lambda: ta.pinned(kernel, cfg))):
                try:
                    with context():
                        errs = rel_errors(fwd_bwd(q, k, v, do), ref)
                        t = do_bench(lambda: fwd_bwd(q, k, v, do), warmup=25, rep=200)
                except Exception as e:  # noqa: BLE001 - a tiling that does not build or fit is reported
                    print(f"[{name}] {how} {kernel} {cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                verdict = "pass" if max(errs) < 1e-2 else "FAIL"
                print(f"[{name}] {how} {kernel} {cfg}: {t:.3f} ms ({t / t_ref:.3f}x the kernel, {t / t_floor:.3f}x "
                      f"the floor)  err vs kernel out/dq/dk/dv " + "/".join(f"{e:.1e}" for e in errs) + f" {verdict}",
                      flush=True)
        del q, k, v, do, ref
        torch.cuda.empty_cache()


def cpu():
    """Under the interpreter: each TMA kernel gives the kernel's results (odd length, GQA)."""
    q, k, v, do = inputs(80, 4, 2, 64, 3, "cpu", torch.float32)
    ref = fwd_bwd(q, k, v, do)
    for cfgs in [{"fwd": (32, 16, 4, 1)}, {"dkdv": (16, 32, 4, 1)}, {"dq": (32, 16, 4, 1)},
                 {"fwd": (16, 16, 4, 1), "dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 1)}]:
        with swapped(**cfgs) as ran:
            errs = rel_errors(fwd_bwd(q, k, v, do), ref)
        assert ran == [n for n in ("fwd", "dkdv", "dq") if n in cfgs], ran
        print(f"tma {cfgs}: rel err out/dq/dk/dv " + "/".join(f"{e:.1e}" for e in errs))
        assert max(errs) < 1e-5, errs


if __name__ == "__main__":
    cpu() if os.environ.get("TRITON_INTERPRET") == "1" else gpu(sys.argv[1:] or ["a", "c"])
