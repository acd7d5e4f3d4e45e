"""Experiment (issue 14): the TTT attention's dK/dV pass written in Gluon for Hopper, timed against the
Triton kernel's dK/dV pass at the attention bench's shapes.

The work split is the Triton kernel's (one program per pair of mirrored key tiles and kv head, the
q heads of the GQA group and the query tiles walked in one flattened loop, every gradient written by
one program: deterministic); what Gluon adds is the order of the asynchronous tensor-core work. Per
query tile i: S^T = K Q_i^T and dP^T = V dO_i^T are issued together, P^T is computed as soon as S^T
lands (while dP^T still runs), dV += P^T dO_i is issued, then dS^T and dK += dS^T Q_i; the wait for
those two products comes only after the next tile's S^T and dP^T are issued, and it frees the q, dO
slot for the TMA copy NUM_STAGES - 1 tiles ahead.

    PYTHONPATH=. python bench/gluon_bwd.py [a] [c]      (on the GPU; with `--build`, compiles for sm_90 here)

Measured (2026-12-02, H200, bench/RESULTS.md): bit-equal to the kernel's dk, dv at every tiling and
never faster. In the eleventh session every tiling spilled at 255 registers: 2-7% slower at best
((32, 64, 3, 4)), 2x slower at BLOCK_M = 64. Since then the epilogue stores through
`gluon_fwd.store_rows` and the BLOCK_M = 32 tilings build without spills (250-251 registers); re-run
in the twelfth session, (32, 64, 3, 4) is 1.059x the kernel at (a) and 0.995x at (c) (parity), the
rest 1.09-2.7x. What is left to FlashAttention-3's structure is warp specialization with register
reallocation (`gl.warp_specialize`), not built.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gluon_fwd import LOG2E, compile_for, script, sequence, store_rows, tile_desc, tk, wgmma_layout  # bench/, this script's folder


@gluon.jit
def _issue_q(q_desc, do_desc, q_smem, do_smem, bars, it, row, col, NUM_STAGES: gl.constexpr):
    slot = it % NUM_STAGES
    mbarrier.expect(bars.index(slot), 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, col], bars.index(slot), q_smem.index(slot))
    tma.async_copy_global_to_shared(do_desc, [row, col], bars.index(slot), do_smem.index(slot))


@gluon.jit
def _q_coords(i, n_m, kv_head, n0, GROUP: gl.constexpr, BLOCK_M: gl.constexpr):
    """(q head, first query position) of flattened iteration i: the group's heads, each over query tiles."""
    head = kv_head * GROUP + i // n_m
    return head, n0 + (i % n_m) * BLOCK_M


@gluon.jit
def _key_tile(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, DK, DV, q_smem, do_smem, k_smem, v_smem, bars, kv_bar,
              base, tile_index, n0, kv_head, start, seqlen, T, stride_kt, qk_scale, sm_scale,
              GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    """dk_0, dv_0 of step-0 keys n0 .. n0 + BLOCK_N; returns the pipeline's iteration count after it."""
    s_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_M)
    g_layout: gl.constexpr = wgmma_layout(num_warps, HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    n_m = gl.cdiv(seqlen - n0, BLOCK_M)
    n_it = GROUP * n_m
    n_masked = BLOCK_N // BLOCK_M      # query tiles that straddle the diagonal, per head
    col = kv_head * HEAD_DIM
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [start + n0, col], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [start + n0, col], kv_bar, v_smem)
    for i in gl.static_range(NUM_STAGES - 1):
        if i < n_it:
            head, m0 = _q_coords(i, n_m, kv_head, n0, GROUP, BLOCK_M)
            _issue_q(q_desc, do_desc, q_smem, do_smem, bars, base + i, start + m0, head * HEAD_DIM, NUM_STAGES)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout))
    mbarrier.wait(kv_bar, tile_index & 1)
    for i in range(n_it):
        it = base + i
        slot = it % NUM_STAGES
        head, m0 = _q_coords(i, n_m, kv_head, n0, GROUP, BLOCK_M)
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=col_s)
        lse = gl.load(LSE + head * T + start + offs_m, mask=offs_m < seqlen, other=float("inf"))
        delta = gl.load(DELTA + head * T + start + offs_m, mask=offs_m < seqlen, other=0.0)
        mbarrier.wait(bars.index(slot), (it // NUM_STAGES) & 1)
        zeros = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        s_t = warpgroup_mma(k_smem, q_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_smem, do_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        # the previous tile's dV, dK products are done: its slot takes the tile NUM_STAGES - 1 ahead
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))   # leaves dP^T in flight (dK, dV done)
        ahead = i + NUM_STAGES - 1
        if ahead < n_it:
            head_a, m0_a = _q_coords(ahead, n_m, kv_head, n0, GROUP, BLOCK_M)
            _issue_q(q_desc, do_desc, q_smem, do_smem, bars, base + ahead, start + m0_a, head_a * HEAD_DIM,
                     NUM_STAGES)
        p_t = gl.exp2(s_t * qk_scale - lse[None, :])
        if i % n_m < n_masked:
            p_t = gl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        p_b = p_t.to(gl.bfloat16)
        dv = warpgroup_mma(gl.convert_layout(p_b, a_layout), do_smem.index(slot), dv, is_async=True)
        dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))  # leaves dV in flight
        ds_t = (p_t * (dp_t - delta[None, :])).to(gl.bfloat16)
        dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_smem.index(slot), dk, is_async=True)
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
    dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))

    store_rows(DK + start * stride_kt, (dk * sm_scale).to(gl.bfloat16), n0, BLOCK_N, seqlen, stride_kt, col, num_warps)
    store_rows(DV + start * stride_kt, dv.to(gl.bfloat16), n0, BLOCK_N, seqlen, stride_kt, col, num_warps)
    return base + n_it


@gluon.jit
def _dkdv_kernel(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, DK, DV, CU_SEQLENS, stride_kt, T, qk_scale, sm_scale,
                 GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, VARLEN: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(BLOCK_N % BLOCK_M == 0)
    pair = gl.program_id(0)
    kv_head = gl.program_id(1)
    start, seqlen = sequence(CU_SEQLENS, T, VARLEN)
    mirror = gl.cdiv(seqlen, BLOCK_N) - 1 - pair
    if pair > mirror:
        return
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(kv_bar, count=1)
    fence_async_shared()
    base = _key_tile(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, DK, DV, q_smem, do_smem, k_smem, v_smem, bars,
                     kv_bar, 0, 0, pair * BLOCK_N, kv_head, start, seqlen, T, stride_kt, qk_scale, sm_scale,
                     GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, num_warps)
    if mirror > pair:
        gl.thread_barrier()   # every warp is done with k, v before the next tile's copies land
        _key_tile(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, DK, DV, q_smem, do_smem, k_smem, v_smem, bars,
                  kv_bar, base, 1, mirror * BLOCK_N, kv_head, start, seqlen, T, stride_kt, qk_scale, sm_scale,
                  GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, num_warps)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(kv_bar)


def _descs(q, do, k0, v0, block_m, block_n):
    T, Hq, D = q.shape
    Hkv = k0.shape[1]
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, D], gl.bfloat16)
    k_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], gl.bfloat16)
    mk = lambda x, rows, layout: TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, D], layout)
    return (mk(q.view(T, Hq * D), block_m, q_layout), mk(do.view(T, Hq * D), block_m, q_layout),
            mk(k0.reshape(T, Hkv * D), block_n, k_layout), mk(v0.reshape(T, Hkv * D), block_n, k_layout))


def dkdv(q, k, v, do, lse, delta, dk, dv, cu_seqlens=None, max_len=None, scale=None,
         block_m=64, block_n=128, stages=2, warps=8):
    """dk[0], dv[0] in place, as `kernels.ttt_attention`'s dK/dV pass (lse in base 2, delta = rowsum(dO O))."""
    S, T, Hkv, D = k.shape
    Hq = q.shape[1]
    scale = D ** -0.5 if scale is None else scale
    descs = _descs(q, do, k[0], v[0], block_m, block_n)
    n_seq = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    max_len = T if max_len is None else max_len
    grid = (triton.cdiv(triton.cdiv(max_len, block_n), 2), Hkv, n_seq)
    _dkdv_kernel[grid](*descs, lse, delta, dk, dv, cu_seqlens, k.stride(1), T, scale * LOG2E, scale,
                       GROUP=Hq // Hkv, HEAD_DIM=D, VARLEN=cu_seqlens is not None,
                       BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=stages, num_warps=warps)


SHAPES = {"a": (4096, 64, 8), "c": (8192, 64, 64)}
CONFIGS = [(64, 128, 2, 8), (64, 128, 3, 8), (32, 128, 3, 8), (64, 64, 3, 4), (32, 64, 3, 4)]


def _triton_dkdv(q, k, v, do, lse, delta, dk, dv, scale, tma=True):
    """The Triton kernel's dK/dV pass alone, launched as `kernels.ttt_attention._backward` does."""
    S, T, Hkv, D = k.shape
    descriptors = tk._descriptors(tma, Qd=q, Kd=k[0], Vd=v[0], DOd=do)
    grid_kv = lambda meta: (triton.cdiv(triton.cdiv(T, meta["BLOCK_N"]), 2), Hkv, 1)
    tk._launch("dkdv", grid_kv, q, k, v, do, lse, delta, dk, dv, None,
               q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), do.stride(0), do.stride(1),
               T, scale * LOG2E, scale, triton.next_power_of_2(T), **descriptors,
               GROUP=q.shape[1] // Hkv, HEAD_DIM=D, VARLEN=False, TMA=tma, UPCAST=False)


def main(labels):
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for label in labels:
        T, hq, hkv = SHAPES[label]
        scale = 128 ** -0.5
        q = torch.randn(T, hq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(7, T, hkv, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(7, T, hkv, 128, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(T, hq, 128, device="cuda", dtype=torch.bfloat16)
        o, lse = tk._forward(q, k, v, None, 1, T, scale, True)
        delta = (o.float() * do.float()).sum(-1).transpose(0, 1).contiguous()   # [Hq, T]
        dk_ref, dv_ref = torch.zeros_like(k), torch.zeros_like(v)
        _triton_dkdv(q, k, v, do, lse, delta, dk_ref, dv_ref, scale)
        t_ref = triton.testing.do_bench(lambda: _triton_dkdv(q, k, v, do, lse, delta, dk_ref, dv_ref, scale),
                                        warmup=25, rep=200)
        print(f"({label}) T={T} {hq}/{hkv} heads: triton dK/dV pass {t_ref:.3f} ms, tiling {tk.best_config('dkdv')}")
        ref_scale = max(dk_ref[0].float().abs().max().item(), dv_ref[0].float().abs().max().item())
        for bm, bn, st, w in CONFIGS:
            try:
                dk, dv = torch.zeros_like(k), torch.zeros_like(v)
                dkdv(q, k, v, do, lse, delta, dk, dv, block_m=bm, block_n=bn, stages=st, warps=w)
                err = max((dk[0].float() - dk_ref[0].float()).abs().max().item(),
                          (dv[0].float() - dv_ref[0].float()).abs().max().item()) / ref_scale
                t = triton.testing.do_bench(lambda: dkdv(q, k, v, do, lse, delta, dk, dv, block_m=bm, block_n=bn,
                                                         stages=st, warps=w), warmup=25, rep=200)
                print(f"  gluon ({bm}, {bn}, stages {st}, warps {w}): {t:.3f} ms = {t / t_ref:.3f}x triton; "
                      f"vs triton max err {err:.1e} (of the largest gradient)")
            except Exception as e:  # noqa: BLE001 - an experiment: report and go on
                print(f"  gluon ({bm}, {bn}, {st}, {w}): {type(e).__name__}: {str(e)[:300]}")


def build(config=(64, 128, 2, 8), capability=90):
    """Compile for sm_`capability` without a GPU; returns (shared bytes, ptxas lines)."""
    bm, bn, st, w = config
    types = {"q_desc": tile_desc(bm), "do_desc": tile_desc(bm), "k_desc": tile_desc(bn), "v_desc": tile_desc(bn),
             "LSE": "*fp32", "DELTA": "*fp32", "DK": "*bf16", "DV": "*bf16", "CU_SEQLENS": "*i32",
             "qk_scale": "fp32", "sm_scale": "fp32"}
    constexprs = {"GROUP": 8, "HEAD_DIM": 128, "VARLEN": True, "BLOCK_M": bm, "BLOCK_N": bn, "NUM_STAGES": st,
                  "num_warps": w}
    return compile_for(_dkdv_kernel, types, constexprs, w, capability)


if __name__ == "__main__":
    script(main, build, CONFIGS)
