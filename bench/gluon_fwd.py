"""Experiment (issue 14): the TTT attention forward written in Gluon for Hopper, timed against the
Triton kernel's forward and cuDNN's causal forward (SDPA) at the attention bench's shapes.

What Gluon allows that the Triton kernel's compiler did not give it: FlashAttention-3's overlap
inside one warpgroup. Per key tile j the program issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} on
the tensor cores together (asynchronous wgmma) and runs the softmax of S_j while the second is in
flight, rescaling O once it is done (issuing S_{j+1} before the softmax of S_j instead made ptxas
serialize every wgmma: warning C7514). The k, v tiles come by TMA into a ring of NUM_STAGES slots
with one mbarrier each. The diagonal keys (steps 1..S-1) are folded in after the causal tiles, row
by row in O's layout, their [BLOCK_M, D] tiles by TMA too.

    PYTHONPATH=. python bench/gluon_fwd.py [a] [c]      (on the GPU; with `--build`, compiles for sm_90 here)

Measured (2026-12-02, twelfth session, H200, bench/RESULTS.md): correct (rel err 2.93e-3 against fp32
at (a), as the kernel's; packed sequences within one bf16 ulp of the kernel's o, lse within 2e-6) and
slower at every tiling of CONFIGS: 1.16x the Triton kernel's forward at best ((128, 128, 2, 8)) at (a)
and 1.18x at (c). It builds with no spills (246-248 registers); the overlap of one warpgroup's wgmma
with its own softmax is not what the kernel lacks. FlashAttention-3's producer warp and register
reallocation (`gl.warp_specialize`) are not built.
"""
from __future__ import annotations

import importlib
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

tk = importlib.import_module("kernels.ttt_attention")   # the module (`kernels` exports its function by this name)
LOG2E = tk.LOG2E


@gluon.constexpr_function
def wgmma_layout(num_warps, n):
    """The accumulator layout of a wgmma of N = n over num_warps warps stacked along M."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def sequence(CU_SEQLENS, T, VARLEN: gl.constexpr):
    """(first token, length) of this program's packed sequence (grid axis 2); the batch without cu_seqlens."""
    if VARLEN:
        start = gl.load(CU_SEQLENS + gl.program_id(2))
        seqlen = gl.load(CU_SEQLENS + gl.program_id(2) + 1) - start
    else:
        start = 0
        seqlen = T
    return start, seqlen


@gluon.jit
def store_rows(base, x, row0, n_rows: gl.constexpr, seqlen, row_stride, col, num_warps: gl.constexpr):
    """x [n_rows, 128] at rows row0.. of a sequence starting at `base`, columns col..; rows past
    seqlen are not written; 16-byte vectors along the row."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = row0 + gl.arange(0, n_rows, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(base + rows[:, None] * row_stride + col + offs_d[None, :], gl.convert_layout(x, layout),
             mask=(rows < seqlen)[:, None])


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, tile, row0, col,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    slot = tile % NUM_STAGES
    mbarrier.expect(k_bar.index(slot), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + tile * BLOCK_N, col], k_bar.index(slot), k_smem.index(slot))
    mbarrier.expect(v_bar.index(slot), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row0 + tile * BLOCK_N, col], v_bar.index(slot), v_smem.index(slot))


@gluon.jit
def _issue_diag(kd_desc, vd_desc, kd_smem, vd_smem, d_bar, row, col):
    """k_j, v_j rows row.. of the [S * T, Hkv * D] matrices (step j's diagonal tiles)."""
    mbarrier.expect(d_bar, 2 * kd_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kd_desc, [row, col], d_bar, kd_smem)
    tma.async_copy_global_to_shared(vd_desc, [row, col], d_bar, vd_smem)


@gluon.jit
def _qk(q_smem, k_smem, k_bar, j, s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr):
    """S_j = Q K_j^T issued asynchronously once k tile j has landed."""
    slot = j % NUM_STAGES
    mbarrier.wait(k_bar.index(slot), (j // NUM_STAGES) & 1)
    return warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)),
                         gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_i, offs_m, j, n_full, qk_scale, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """P_j (bf16, unnormalised), O's rescale factor and the new running max and sum of score tile j."""
    if j >= n_full:   # tiles that straddle the diagonal
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p.to(gl.bfloat16), alpha, m_new, l_i


@gluon.jit
def _pv(acc, p, v_smem, v_bar, j, p_layout: gl.constexpr, NUM_STAGES: gl.constexpr):
    """O += P_j V_j issued asynchronously once v tile j has landed."""
    slot = j % NUM_STAGES
    mbarrier.wait(v_bar.index(slot), (j // NUM_STAGES) & 1)
    return warpgroup_mma(gl.convert_layout(p, p_layout), v_smem.index(slot), acc, is_async=True)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, kd_desc, vd_desc, O, LSE, CU_SEQLENS,
                stride_ot, T, S, qk_scale,
                GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, VARLEN: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                num_warps: gl.constexpr):
    head = gl.program_id(1)
    kv_head = head // GROUP
    start, seqlen = sequence(CU_SEQLENS, T, VARLEN)
    m0 = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    if m0 >= seqlen:
        return

    s_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(num_warps, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    kd_smem = gl.allocate_shared_memory(kd_desc.dtype, kd_desc.block_type.shape, kd_desc.layout)
    vd_smem = gl.allocate_shared_memory(vd_desc.dtype, vd_desc.block_type.shape, vd_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    d_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(d_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()

    col = kv_head * HEAD_DIM
    n_tiles = gl.cdiv(gl.minimum(m0 + BLOCK_M, seqlen), BLOCK_N)
    n_full = m0 // BLOCK_N       # tiles wholly below the diagonal: no mask
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [start + m0, head * HEAD_DIM], q_bar, q_smem)
    if S > 1:
        _issue_diag(kd_desc, vd_desc, kd_smem, vd_smem, d_bar, T + start + m0, col)
    for i in gl.static_range(NUM_STAGES):   # every slot: the loop refills slot j-1 with tile j-1+NUM_STAGES
        if i < n_tiles:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, i, start, col, BLOCK_N, NUM_STAGES)

    offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)

    # FlashAttention-3's order: S_j and P_{j-1} V_{j-1} are issued together, the softmax of S_j runs
    # while the tensor cores do P_{j-1} V_{j-1}, and O is rescaled once that is done.
    mbarrier.wait(q_bar, 0)
    s = _qk(q_smem, k_smem, k_bar, 0, s_layout, BLOCK_M, BLOCK_N, NUM_STAGES)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, offs_m, 0, n_full, qk_scale, s_layout, BLOCK_N)
    for j in range(1, n_tiles):
        s = _qk(q_smem, k_smem, k_bar, j, s_layout, BLOCK_M, BLOCK_N, NUM_STAGES)
        acc = _pv(acc, p, v_smem, v_bar, j - 1, p_layout, NUM_STAGES)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, offs_m, j, n_full, qk_scale, s_layout, BLOCK_N)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        refill = j - 1 + NUM_STAGES    # P_{j-1} V_{j-1} done: slot j-1 is free
        if refill < n_tiles:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, refill, start, col, BLOCK_N, NUM_STAGES)
    acc = _pv(acc, p, v_smem, v_bar, n_tiles - 1, p_layout, NUM_STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    # The diagonal keys of steps 1..S-1, row by row in O's layout: their [BLOCK_M, D] tiles come by TMA
    # (step 1's was issued with Q), each read once from shared memory.
    m_o = gl.convert_layout(m_i, row_o)
    l_o = gl.convert_layout(l_i, row_o)
    qo = q_smem.load(o_layout)
    for j in range(1, S):
        mbarrier.wait(d_bar, (j - 1) & 1)
        kj = kd_smem.load(o_layout)
        vj = vd_smem.load(o_layout)
        gl.thread_barrier()   # every warp has its copy before the next step's tiles overwrite them
        fence_async_shared()  # and those generic-proxy reads are ordered before the TMA writes
        if j + 1 < S:
            _issue_diag(kd_desc, vd_desc, kd_smem, vd_smem, d_bar, (j + 1) * T + start + m0, col)
        sj = gl.sum(qo.to(gl.float32) * kj.to(gl.float32), 1) * qk_scale
        m_j = gl.maximum(m_o, sj)
        alpha_j = gl.exp2(m_o - m_j)
        p_j = gl.exp2(sj - m_j)
        l_o = l_o * alpha_j + p_j
        acc = acc * alpha_j[:, None] + p_j[:, None] * vj.to(gl.float32)
        m_o = m_j
    mbarrier.invalidate(d_bar)

    store_rows(O + start * stride_ot, (acc / l_o[:, None]).to(gl.bfloat16), m0, BLOCK_M, seqlen, stride_ot,
               head * HEAD_DIM, num_warps)
    lse_rows = m0 + gl.arange(0, BLOCK_M, layout=row_o)
    gl.store(LSE + head * T + start + lse_rows, m_o + gl.log2(l_o), mask=lse_rows < seqlen)


def forward(q, k, v, cu_seqlens=None, max_len=None, scale=None, block_m=128, block_n=64, stages=3, warps=8):
    """o, lse as `kernels.ttt_attention._forward`: q [T, Hq, D]; k, v [S, T, Hkv, D]; bf16."""
    S, T, Hkv, D = k.shape
    Hq = q.shape[1]
    scale = D ** -0.5 if scale is None else scale
    o = torch.empty_like(q)
    lse = torch.empty(Hq, T, device=q.device, dtype=torch.float32)
    q2, k2, v2 = q.view(T, Hq * D), k[0].view(T, Hkv * D), v[0].view(T, Hkv * D)
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, D], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], gl.bfloat16)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [block_m, D], q_layout)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, D], kv_layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block_n, D], kv_layout)
    kd, vd = k.view(S * T, Hkv * D), v.view(S * T, Hkv * D)
    kd_desc = TensorDescriptor(kd, list(kd.shape), list(kd.stride()), [block_m, D], q_layout)
    vd_desc = TensorDescriptor(vd, list(vd.shape), list(vd.stride()), [block_m, D], q_layout)
    n_seq = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    max_len = T if max_len is None else max_len
    grid = (triton.cdiv(max_len, block_m), Hq, n_seq)
    _fwd_kernel[grid](q_desc, k_desc, v_desc, kd_desc, vd_desc, o, lse, cu_seqlens,
                      o.stride(0), T, S, scale * LOG2E,
                      GROUP=Hq // Hkv, HEAD_DIM=D, VARLEN=cu_seqlens is not None,
                      BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=stages, num_warps=warps)
    return o, lse


SHAPES = {"a": (4096, 64, 8), "c": (8192, 64, 64)}
CONFIGS = [(128, 64, 3, 8), (128, 64, 2, 8), (64, 64, 3, 4), (64, 64, 4, 4), (64, 128, 2, 4), (128, 128, 2, 8)]


def main(labels):
    import torch.nn.functional as F
    from kernels.reference import ttt_attention as reference
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for label in labels:
        T, hq, hkv = SHAPES[label]
        q = torch.randn(T, hq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(7, T, hkv, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(7, T, hkv, 128, device="cuda", dtype=torch.bfloat16)
        scale = 128 ** -0.5
        o_ref, lse_ref = tk._forward(q, k, v, None, 1, T, scale, True)
        if label == "a":   # fp32 reference at the smaller shape, and packed sequences
            exact = reference(q.float(), k.float(), v.float())
            o_g, _ = forward(q, k, v)
            rel = lambda x: ((x.float() - exact).abs().max() / exact.abs().max()).item()
            print(f"({label}) vs fp32: triton kernel {rel(o_ref):.2e}, gluon {rel(o_g):.2e}")
            lengths = [700, 300, 1000, 96, 1000, 500, 200, 300]
            cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
            o_p, lse_p = tk._forward(q, k, v, cu, len(lengths), max(lengths), scale, True)
            for bm, bn, st, w in CONFIGS:
                o_gp, lse_gp = forward(q, k, v, cu, max(lengths), block_m=bm, block_n=bn, stages=st, warps=w)
                print(f"  packed {lengths}, gluon {(bm, bn, st, w)} vs triton: o {(o_gp.float() - o_p.float()).abs().max().item():.2e}, "
                      f"lse {(lse_gp - lse_p).abs().max().item():.2e}")
        t_triton = triton.testing.do_bench(lambda: tk._forward(q, k, v, None, 1, T, scale, True), warmup=25, rep=200)
        qt, kt, vt = q.transpose(0, 1)[None], k[0].transpose(0, 1)[None], v[0].transpose(0, 1)[None]
        with torch.no_grad():
            t_sdpa = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True),
                                             warmup=25, rep=200)
        t_s1 = triton.testing.do_bench(lambda: tk._forward(q, k[:1], v[:1], None, 1, T, scale, True), warmup=25, rep=200)
        print(f"({label}) T={T} {hq}/{hkv} heads S=7: triton forward {t_triton:.3f} ms (S=1: {t_s1:.3f}), "
              f"SDPA causal forward {t_sdpa:.3f} ms, best triton tiling {tk.best_config('fwd')}")
        for bm, bn, st, w in CONFIGS:
            try:
                o, lse = forward(q, k, v, block_m=bm, block_n=bn, stages=st, warps=w)
                err_o = ((o.float() - o_ref.float()).abs().max() / o_ref.float().abs().max()).item()
                err_l = (lse - lse_ref).abs().max().item()
                t = triton.testing.do_bench(lambda: forward(q, k, v, block_m=bm, block_n=bn, stages=st, warps=w),
                                            warmup=25, rep=200)
                t1 = triton.testing.do_bench(lambda: forward(q, k[:1], v[:1], block_m=bm, block_n=bn, stages=st, warps=w),
                                             warmup=25, rep=200)
                print(f"  gluon ({bm}, {bn}, stages {st}, warps {w}): {t:.3f} ms (S=1: {t1:.3f}) = "
                      f"{t / t_triton:.3f}x triton, {t1 / t_sdpa:.3f}x SDPA at S=1; vs triton o {err_o:.1e}, lse {err_l:.1e}")
            except Exception as e:  # noqa: BLE001 - an experiment: report and go on
                print(f"  gluon ({bm}, {bn}, {st}, {w}): {type(e).__name__}: {str(e)[:300]}")


def compile_for(fn, types: dict, constexprs: dict, warps: int, capability: int = 90):
    """Build Gluon kernel `fn` for sm_`capability` without a GPU: (shared bytes, ptxas's register,
    spill and warning lines)."""
    import os
    import subprocess
    import tempfile
    from triton.backends.compiler import GPUTarget
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    src = gluon._runtime.GluonASTSource(fn=fn, signature=signature,
                                        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    built = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": warps})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(built.asm["ptx"])
        f.flush()
        r = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{capability}a", f.name, "-o", "/dev/null"],
                           capture_output=True, text=True)
    return built.metadata.shared, [l.strip() for l in r.stderr.splitlines()
                                   if "registers" in l or "spill" in l or "C75" in l]


def tile_desc(rows: int) -> str:
    """The signature type of a [rows, 128] bf16 TMA descriptor with the default swizzle."""
    layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gl.bfloat16)
    return f"tensordesc<bf16[{rows}, 128],{layout}>"


def build(config=(128, 64, 3, 8), capability=90):
    bm, bn, st, w = config
    types = {"q_desc": tile_desc(bm), "k_desc": tile_desc(bn), "v_desc": tile_desc(bn), "kd_desc": tile_desc(bm),
             "vd_desc": tile_desc(bm), "O": "*bf16", "LSE": "*fp32", "CU_SEQLENS": "*i32", "qk_scale": "fp32"}
    constexprs = {"GROUP": 8, "HEAD_DIM": 128, "VARLEN": False, "BLOCK_M": bm, "BLOCK_N": bn, "NUM_STAGES": st,
                  "num_warps": w}
    return compile_for(_fwd_kernel, types, constexprs, w, capability)


def script(main, build, configs):
    """`--build`: each tiling compiled for sm_90 here; else `main` on the shapes named (a and c by default)."""
    if "--build" in sys.argv:
        for c in configs:
            try:
                print(c, build(c))
            except Exception as e:  # noqa: BLE001 - an experiment: report and go on
                print(c, type(e).__name__, str(e)[:2000])
    else:
        main(sys.argv[1:] or ["a", "c"])


if __name__ == "__main__":
    script(main, build, CONFIGS)
