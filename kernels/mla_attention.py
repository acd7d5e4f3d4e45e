"""The TTT attention of an MLA draft in Triton, forward and backward, without padding (docs/kernels.md): each head's
query and key are Dn "nope" dims plus Dr rotary dims whose key is one vector every head shares, its value Dv dims.
Layouts: q [T, H, Dn + Dr] (nope first), o [T, H, Dv]; per step j its own tensors, as the TTT unroll keeps them:
k_j [T, H, Dn], v_j [T, H, Dv], pe_j [T, 1, Dr], each found through a step table (int64 [S, 3]: its element offset
from step 0's tensor, its row and head strides); lse, delta [H, T] fp32 (log-sum-exp in base 2); ds [S-1, H, T] fp32.
The torch ground truth is `kernels.reference.ttt_attention(..., k_pe=...)` (the CPU runs it without Triton)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from eagle3.kernels import tiles
from eagle3.kernels.interpreter import INTERPRET
from eagle3.kernels.reference import steps_shape
from eagle3.kernels.ttt_attention import (FALLBACK, LOG2E, bwd_preprocess, load_rows, seqlen_info, sequence,
                                    softmax_update)

DIMS = (16, 32, 64, 128, 256)   # nope, rope and value widths served: powers of two (tl.arange), >= 16 (tl.dot)
# heads per program of the two key-gradient kernels: the shared rotary key's gradient sums over heads in registers
# there, then over the programs' head groups in torch (deterministic, no atomics; DKDV_GROUPS x [T, Dr] fp32)
DKDV_GROUPS, DIAG_GROUPS = 8, 4
# Interpreter tilings (tests swap them): fwd/dq need BLOCK_M % BLOCK_N == 0, dkdv BLOCK_N % BLOCK_M == 0.
INTERPRET_BLOCKS = {"fwd": (16, 16), "dkdv": (16, 16), "dq": (16, 16), "rows": 16}
ROWS_BLOCK_GPU = 32


@triton.jit
def _rows(base, rows, row_stride, WIDTH: tl.constexpr, row_mask, MASK: tl.constexpr, UPCAST: tl.constexpr):
    """A [rows, WIDTH] tile of a matrix with unit column stride; bounds-checked with MASK (zeros there)."""
    ptrs = base + rows[:, None] * row_stride + tl.arange(0, WIDTH)[None, :]
    if MASK:
        x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        x = tl.load(ptrs)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _step_at(BASE, TABLE, j, head, ALIGN: tl.constexpr):
    """(the pointer to head `head` of step j's tensor at row 0, its row stride), from its step table's row."""
    entry = TABLE + j * 3
    offset, row_stride, head_stride = tl.load(entry), tl.load(entry + 1), tl.load(entry + 2)
    # offsets and strides that are multiples of 16 bytes (checked on the host) keep the loads vectorised
    offset, row_stride = tl.multiple_of(offset, ALIGN), tl.multiple_of(row_stride, ALIGN)
    return BASE + offset + head * tl.multiple_of(head_stride, ALIGN), row_stride


@triton.jit
def _step_rows(BASE, TABLE, j, rows, head, WIDTH: tl.constexpr, row_mask, ALIGN: tl.constexpr):
    """Rows `rows` of head `head` of step j's tensor, in fp32."""
    base, row_stride = _step_at(BASE, TABLE, j, head, ALIGN)
    return load_rows(base, rows, row_stride, tl.arange(0, WIDTH), row_mask, True)


@triton.jit
def _key_tile(Kh, Vh, PEs, offs_n, stride_kt, stride_vt, stride_pt, seqlen, NOPE: tl.constexpr,
              ROPE: tl.constexpr, VDIM: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr):
    """k_nope, the shared k_pe and v of step-0 keys offs_n; bounds-checked only on tiles that straddle the diagonal,
    where the causal mask drops keys past the sequence however they loaded."""
    key_mask = offs_n < seqlen
    kn = _rows(Kh, offs_n, stride_kt, NOPE, key_mask, MASK, UPCAST)
    kr = _rows(PEs, offs_n, stride_pt, ROPE, key_mask, MASK, UPCAST)
    v = _rows(Vh, offs_n, stride_vt, VDIM, key_mask, MASK, UPCAST)
    return kn, kr, v


@triton.jit
def _fwd_tile(acc, m_i, l_i, qn, qr, Kh, Vh, PEs, n0, offs_m, stride_kt, stride_vt, stride_pt, seqlen, qk_scale,
              NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
              UPCAST: tl.constexpr):
    """The online-softmax update of one step-0 key tile: scores of the nope and rotary parts in one accumulator."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kn, kr, v = _key_tile(Kh, Vh, PEs, offs_n, stride_kt, stride_vt, stride_pt, seqlen, NOPE, ROPE, VDIM, MASK,
                          UPCAST)
    s = tl.dot(qr, tl.trans(kr), tl.dot(qn, tl.trans(kn)))
    if MASK:
        s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    return softmax_update(acc, m_i, l_i, s, v, qk_scale, False)   # causal, no window: every row sees a key


@triton.jit
def _query_tile(CU_SEQLENS, T, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """(head, sequence start, sequence length, first query position) of this program; the heaviest (last) query
    tiles first, so the causal imbalance does not land in the tail."""
    start, seqlen = sequence(CU_SEQLENS, tl.program_id(2), T, VARLEN)
    return tl.program_id(1), start, seqlen, (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M


@triton.jit
def _fwd_kernel(Q, K, V, PE, O, LSE, CU_SEQLENS, K_STEPS, V_STEPS, PE_STEPS,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, stride_ot, stride_oh,
                T, S, qk_scale, seqlen_bucket,
                NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, VARLEN: tl.constexpr,
                ALIGN: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    head, start, seqlen, m0 = _query_tile(CU_SEQLENS, T, VARLEN, BLOCK_M)
    if m0 >= seqlen:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)   # positions inside the sequence
    row_mask = offs_m < seqlen            # rows past it are computed from whatever loaded, and not stored
    Qh = Q + start * stride_qt + head * stride_qh
    qn = _rows(Qh, offs_m, stride_qt, NOPE, row_mask, True, UPCAST)
    qr = _rows(Qh + NOPE, offs_m, stride_qt, ROPE, row_mask, True, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, VDIM], tl.float32)
    # diagonal keys first (a q.k product per row and step): every valid row's running max finite before any mask
    qnf, qrf, rows = qn.to(tl.float32), qr.to(tl.float32), start + offs_m
    for j in range(1, S):
        kn = _step_rows(K, K_STEPS, j, rows, head, NOPE, row_mask, ALIGN)
        kr = _step_rows(PE, PE_STEPS, j, rows, 0, ROPE, row_mask, ALIGN)
        vj = _step_rows(V, V_STEPS, j, rows, head, VDIM, row_mask, ALIGN)
        s = (tl.sum(qnf * kn, 1) + tl.sum(qrf * kr, 1)) * qk_scale
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * vj
        m_i = m_new
    Kh, Vh = K + start * stride_kt + head * stride_kh, V + start * stride_vt + head * stride_vh
    PEs = PE + start * stride_pt
    for n0 in range(0, m0, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, qn, qr, Kh, Vh, PEs, n0, offs_m, stride_kt, stride_vt, stride_pt,
                                  seqlen, qk_scale, NOPE, ROPE, VDIM, BLOCK_N, False, UPCAST)
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, seqlen), BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, qn, qr, Kh, Vh, PEs, n0, offs_m, stride_kt, stride_vt, stride_pt,
                                  seqlen, qk_scale, NOPE, ROPE, VDIM, BLOCK_N, True, UPCAST)
    o = acc / l_i[:, None]
    o_ptrs = O + (start + offs_m)[:, None] * stride_ot + head * stride_oh + tl.arange(0, VDIM)[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_mask[:, None])
    tl.store(LSE + head * T + start + offs_m, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit
def _bwd_diag_kernel(Q, K, V, PE, DO, LSE, DELTA, DK, DV, DPE, DS, K_STEPS, V_STEPS, PE_STEPS, DK_STEPS, DV_STEPS,
                     stride_qt, stride_qh, stride_dot, stride_doh, T, S, H, qk_scale, sm_scale,
                     NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, GROUP: tl.constexpr,
                     ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """dk_j, dv_j of the diagonal keys (j >= 1) per head; the rotary key's dpe_j summed over this program's GROUP heads
    into its group's row of DPE [H / GROUP, S-1, T, Dr] fp32; ds_j = p_j (dp_j - delta) for the dq kernel. A diagonal
    key never crosses a sequence boundary."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    group = tl.program_id(1)
    mask = rows < T
    offs_r = tl.arange(0, ROPE)
    for j in range(1, S):
        kr = _step_rows(PE, PE_STEPS, j, rows, 0, ROPE, mask, ALIGN)
        dpe = tl.zeros([BLOCK, ROPE], tl.float32)
        for g in range(GROUP):
            head = group * GROUP + g
            Qh = Q + head * stride_qh
            qn = load_rows(Qh, rows, stride_qt, tl.arange(0, NOPE), mask, True)
            qr = load_rows(Qh + NOPE, rows, stride_qt, offs_r, mask, True)
            do = load_rows(DO + head * stride_doh, rows, stride_dot, tl.arange(0, VDIM), mask, True)
            lse = tl.load(LSE + head * T + rows, mask=mask, other=0.0)
            delta = tl.load(DELTA + head * T + rows, mask=mask, other=0.0)
            kn = _step_rows(K, K_STEPS, j, rows, head, NOPE, mask, ALIGN)
            vj = _step_rows(V, V_STEPS, j, rows, head, VDIM, mask, ALIGN)
            p = tl.exp2((tl.sum(qn * kn, 1) + tl.sum(qr * kr, 1)) * qk_scale - lse)
            ds = p * (tl.sum(do * vj, 1) - delta)
            dk_base, dk_stride = _step_at(DK, DK_STEPS, j, head, ALIGN)
            dv_base, dv_stride = _step_at(DV, DV_STEPS, j, head, ALIGN)
            tl.store(dk_base + rows[:, None] * dk_stride + tl.arange(0, NOPE)[None, :],
                     (ds[:, None] * qn * sm_scale).to(DK.dtype.element_ty), mask=mask[:, None])
            tl.store(dv_base + rows[:, None] * dv_stride + tl.arange(0, VDIM)[None, :],
                     (p[:, None] * do).to(DV.dtype.element_ty), mask=mask[:, None])
            tl.store(DS + ((j - 1) * H + head) * T + rows, ds, mask=mask)
            dpe += ds[:, None] * qr
        part = DPE + ((group * (S - 1) + j - 1) * T + rows[:, None]) * ROPE + offs_r[None, :]
        tl.store(part, dpe * sm_scale, mask=mask[:, None])


@triton.jit
def _bwd_dkdv_tile(dk, dv, dpe, kn, kr, v, Qh, DOh, LSEh, DELTAh, stride_qt, stride_dot, m0, offs_n, seqlen, qk_scale,
                   NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   MASK: tl.constexpr, UPCAST: tl.constexpr):
    """dk, dv, dpe += one query tile's part, transposed: keys are rows. Rows past the sequence get lse = +inf: p = 0."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_mask = offs_m < seqlen
    qn = _rows(Qh, offs_m, stride_qt, NOPE, row_mask, True, UPCAST)
    qr = _rows(Qh + NOPE, offs_m, stride_qt, ROPE, row_mask, True, UPCAST)
    do = _rows(DOh, offs_m, stride_dot, VDIM, row_mask, True, UPCAST)
    lse = tl.load(LSEh + offs_m, mask=row_mask, other=float("inf"))
    delta = tl.load(DELTAh + offs_m, mask=row_mask, other=0.0)
    p_t = tl.exp2(tl.dot(kr, tl.trans(qr), tl.dot(kn, tl.trans(qn))) * qk_scale - lse[None, :])
    if MASK:
        p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv)
    ds_t = (p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(qn.dtype)
    return tl.dot(ds_t, qn, dk), dv, tl.dot(ds_t, qr, dpe)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, PE, DO, LSE, DELTA, DK, DV, DPE, CU_SEQLENS,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, stride_dot,
                     stride_doh, T, H, qk_scale, sm_scale, seqlen_bucket,
                     NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, GROUP: tl.constexpr,
                     VARLEN: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk_0, dv_0 of key tiles i and n_tiles-1-i (each tile paired with its mirror evens the causal work) for GROUP
    heads, one after another; the shared rotary key's dpe_0 summed over them into the group's row of DPE
    [H / GROUP, T, Dr] fp32. dk_0, dv_0 are contiguous [T, H, Dn] and [T, H, Dv]; keys past the sequence not stored."""
    pair, group = tl.program_id(0), tl.program_id(1)
    start, seqlen = sequence(CU_SEQLENS, tl.program_id(2), T, VARLEN)
    mirror = tl.cdiv(seqlen, BLOCK_N) - 1 - pair
    # Visits tile `pair` and then `mirror`; once if they coincide, never if `mirror` came first.
    for tile in range(pair, mirror + 1, tl.maximum(mirror - pair, 1)):
        n0 = tile * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_mask = offs_n < seqlen
        kr = _rows(PE + start * stride_pt, offs_n, stride_pt, ROPE, key_mask, True, UPCAST)
        dpe = tl.zeros([BLOCK_N, ROPE], tl.float32)
        diag_end = tl.minimum(n0 + BLOCK_N, seqlen)
        for g in range(GROUP):
            head = group * GROUP + g
            kn = _rows(K + start * stride_kt + head * stride_kh, offs_n, stride_kt, NOPE, key_mask, True, UPCAST)
            v = _rows(V + start * stride_vt + head * stride_vh, offs_n, stride_vt, VDIM, key_mask, True, UPCAST)
            dk = tl.zeros([BLOCK_N, NOPE], tl.float32)
            dv = tl.zeros([BLOCK_N, VDIM], tl.float32)
            Qh = Q + start * stride_qt + head * stride_qh
            DOh = DO + start * stride_dot + head * stride_doh
            LSEh, DELTAh = LSE + head * T + start, DELTA + head * T + start
            # Query tiles that straddle the diagonal need the causal mask; the ones after do not.
            for m0 in range(n0, diag_end, BLOCK_M):
                dk, dv, dpe = _bwd_dkdv_tile(dk, dv, dpe, kn, kr, v, Qh, DOh, LSEh, DELTAh, stride_qt, stride_dot, m0,
                                             offs_n, seqlen, qk_scale, NOPE, ROPE, VDIM, BLOCK_M, True, UPCAST)
            for m0 in range(n0 + BLOCK_N, seqlen, BLOCK_M):
                dk, dv, dpe = _bwd_dkdv_tile(dk, dv, dpe, kn, kr, v, Qh, DOh, LSEh, DELTAh, stride_qt, stride_dot, m0,
                                             offs_n, seqlen, qk_scale, NOPE, ROPE, VDIM, BLOCK_M, False, UPCAST)
            out = (start + offs_n)[:, None] * H + head
            tl.store(DK + out * NOPE + tl.arange(0, NOPE)[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
                     mask=key_mask[:, None])
            tl.store(DV + out * VDIM + tl.arange(0, VDIM)[None, :], dv.to(DV.dtype.element_ty), mask=key_mask[:, None])
        part = DPE + (group * T + start + offs_n[:, None]) * ROPE + tl.arange(0, ROPE)[None, :]
        tl.store(part, dpe * sm_scale, mask=key_mask[:, None])


@triton.jit
def _bwd_dq_tile(dqn, dqr, qn, qr, do, lse, delta, Kh, Vh, PEs, n0, offs_m, stride_kt, stride_vt, stride_pt, seqlen,
                 qk_scale, NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASK: tl.constexpr, UPCAST: tl.constexpr):
    """dq += dS k for one step-0 key tile (nope and rotary parts), the scores recomputed from the saved lse."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kn, kr, v = _key_tile(Kh, Vh, PEs, offs_n, stride_kt, stride_vt, stride_pt, seqlen, NOPE, ROPE, VDIM, MASK,
                          UPCAST)
    p = tl.exp2(tl.dot(qr, tl.trans(kr), tl.dot(qn, tl.trans(kn))) * qk_scale - lse[:, None])
    if MASK:
        p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
    ds = (p * (tl.dot(do, tl.trans(v)) - delta[:, None])).to(kn.dtype)
    return tl.dot(ds, kn, dqn), tl.dot(ds, kr, dqr)


@triton.jit
def _bwd_dq_kernel(Q, K, V, PE, DO, LSE, DELTA, DS, DQ, CU_SEQLENS, K_STEPS, PE_STEPS,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, stride_dot, stride_doh,
                   T, S, H, qk_scale, sm_scale, seqlen_bucket,
                   NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, VARLEN: tl.constexpr,
                   ALIGN: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq ([T, H, Dn + Dr] like q) for one query tile of one head: the diagonal terms, then the causal step-0 tiles."""
    head, start, seqlen, m0 = _query_tile(CU_SEQLENS, T, VARLEN, BLOCK_M)
    if m0 >= seqlen:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_mask = offs_m < seqlen
    Qh = Q + start * stride_qt + head * stride_qh
    qn = _rows(Qh, offs_m, stride_qt, NOPE, row_mask, True, UPCAST)
    qr = _rows(Qh + NOPE, offs_m, stride_qt, ROPE, row_mask, True, UPCAST)
    do = _rows(DO + start * stride_dot + head * stride_doh, offs_m, stride_dot, VDIM, row_mask, True, UPCAST)
    lse = tl.load(LSE + head * T + start + offs_m, mask=row_mask, other=0.0)
    delta = tl.load(DELTA + head * T + start + offs_m, mask=row_mask, other=0.0)
    dqn = tl.zeros([BLOCK_M, NOPE], tl.float32)
    dqr = tl.zeros([BLOCK_M, ROPE], tl.float32)
    rows = start + offs_m
    for j in range(1, S):   # the diagonal keys: ds_j (from _bwd_diag_kernel) times k_j, row by row
        ds = tl.load(DS + ((j - 1) * H + head) * T + rows, mask=row_mask, other=0.0)
        dqn += ds[:, None] * _step_rows(K, K_STEPS, j, rows, head, NOPE, row_mask, ALIGN)
        dqr += ds[:, None] * _step_rows(PE, PE_STEPS, j, rows, 0, ROPE, row_mask, ALIGN)
    Kh, Vh = K + start * stride_kt + head * stride_kh, V + start * stride_vt + head * stride_vh
    PEs = PE + start * stride_pt
    for n0 in range(0, m0, BLOCK_N):
        dqn, dqr = _bwd_dq_tile(dqn, dqr, qn, qr, do, lse, delta, Kh, Vh, PEs, n0, offs_m, stride_kt, stride_vt,
                                stride_pt, seqlen, qk_scale, NOPE, ROPE, VDIM, BLOCK_N, False, UPCAST)
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, seqlen), BLOCK_N):
        dqn, dqr = _bwd_dq_tile(dqn, dqr, qn, qr, do, lse, delta, Kh, Vh, PEs, n0, offs_m, stride_kt, stride_vt,
                                stride_pt, seqlen, qk_scale, NOPE, ROPE, VDIM, BLOCK_N, True, UPCAST)
    DQh = DQ + rows[:, None] * (H * (NOPE + ROPE)) + head * (NOPE + ROPE)
    tl.store(DQh + tl.arange(0, NOPE)[None, :], (dqn * sm_scale).to(DQ.dtype.element_ty), mask=row_mask[:, None])
    tl.store(DQh + NOPE + tl.arange(0, ROPE)[None, :], (dqr * sm_scale).to(DQ.dtype.element_ty),
             mask=row_mask[:, None])


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per GPU family (`kernels.tiles`), untimed: the GQA kernel's shapes
# with a third operand (the rotary key) per key tile; FALLBACK ends every list.
CONFIGS = {
    "large": {"fwd": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3), FALLBACK],
              "dkdv": [(64, 128, 8, 2), (32, 128, 8, 2), (32, 64, 4, 3), (16, 64, 4, 3), FALLBACK],
              "dq": [(128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3), FALLBACK]},
    "a100": {"fwd": [(64, 64, 4, 3), (64, 32, 4, 3), FALLBACK],
             "dkdv": [(32, 64, 4, 3), (16, 64, 4, 3), FALLBACK],
             "dq": [(64, 64, 4, 2), (64, 32, 4, 3), FALLBACK]},
    "small": {"fwd": [(64, 32, 4, 2), FALLBACK], "dkdv": [(16, 64, 4, 2), FALLBACK], "dq": [(64, 32, 4, 2), FALLBACK]},
}
KERNELS = {"fwd": _fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel}
_TUNE_KEY = ["NOPE", "ROPE", "VDIM", "VARLEN", "seqlen_bucket"]
TUNED = {} if INTERPRET else {name: tiles.autotuned(k, {family: configs[name] for family, configs in CONFIGS.items()},
                                                    _TUNE_KEY) for name, k in KERNELS.items()}


def best_config(name: str) -> tuple | None:
    """The autotuner's last pick for kernel `name` (None before it tuned, or under the interpreter)."""
    best = getattr(TUNED.get(name), "best_config", None)
    return None if best is None else tiles.as_tuple(best, ("BLOCK_M", "BLOCK_N"))


def _launch(name, grid, *args, **kwargs):
    """The autotuned kernel, else one fixed tiling under the interpreter."""
    if not INTERPRET:
        return TUNED[name][grid](*args, **kwargs)
    block_m, block_n = INTERPRET_BLOCKS[name]
    return KERNELS[name][grid](*args, **kwargs, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=1)


def _table(steps: list[torch.Tensor]) -> torch.Tensor:
    """The step table of per-step tensors [T, H, D] (unit last stride): per step its element offset from step 0's
    tensor, row stride, head stride; int64 [S, 3] on their device, sent from pinned memory (no host sync)."""
    base, size = steps[0].data_ptr(), steps[0].element_size()
    table = torch.tensor([((x.data_ptr() - base) // size, x.stride(0), x.stride(1)) for x in steps], dtype=torch.int64,
                         pin_memory=steps[0].is_cuda)
    return table.to(steps[0].device, non_blocking=True)


def _align(tensors: list[torch.Tensor]) -> int:
    """The elements in 16 bytes when every tensor's address and every row and head stride is a multiple of 16 bytes
    (the kernels then tell the compiler so, for vector loads), else 1."""
    size = tensors[0].element_size()
    aligned = all(x.data_ptr() % 16 == 0 and x.stride(0) * size % 16 == 0 and x.stride(1) * size % 16 == 0
                  for x in tensors)
    return 16 // size if aligned else 1


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(q, ks, vs, pes, cu, n_seq, max_len, scale):
    T, H, _ = q.shape
    (nope, rope, vdim), S = (x[0].shape[-1] for x in (ks, pes, vs)), len(ks)
    o = q.new_empty(T, H, vdim)
    lse = torch.empty(H, T, device=q.device, dtype=torch.float32)
    k0, v0, pe0 = ks[0], vs[0], pes[0]
    grid = lambda meta: (triton.cdiv(max_len, meta["BLOCK_M"]), H, n_seq)
    _launch("fwd", grid, q, k0, v0, pe0, o, lse, cu, _table(ks), _table(vs), _table(pes),
            q.stride(0), q.stride(1), k0.stride(0), k0.stride(1), v0.stride(0), v0.stride(1), pe0.stride(0),
            o.stride(0), o.stride(1), T, S, scale * LOG2E, triton.next_power_of_2(max_len),
            NOPE=nope, ROPE=rope, VDIM=vdim, VARLEN=cu is not None, ALIGN=_align([*ks, *vs, *pes]), UPCAST=INTERPRET)
    return o, lse


def _backward(do, q, o, lse, ks, vs, pes, cu, n_seq, max_len, scale):
    """(dq, [dk_j], [dv_j], [dpe_j]): each step's key gradients a tensor of its own, freed as autograd consumes it."""
    T, H, _ = q.shape
    (nope, rope, vdim), S = (x[0].shape[-1] for x in (ks, pes, vs)), len(ks)
    qk_scale, rows = scale * LOG2E, INTERPRET_BLOCKS["rows"] if INTERPRET else ROWS_BLOCK_GPU
    dq, delta = q.new_empty(q.shape), torch.empty_like(lse)   # dq contiguous, as the dq kernel stores it
    dks = [q.new_empty(T, H, nope) for _ in ks]
    dvs = [q.new_empty(T, H, vdim) for _ in vs]
    k0, v0, pe0 = ks[0], vs[0], pes[0]
    align = _align([q, do, *ks, *vs, *pes, *dks, *dvs])
    bwd_preprocess[(triton.cdiv(T, rows), H)](o, do, delta, o.stride(0), o.stride(1), do.stride(0), do.stride(1), T,
                                              HEAD_DIM=vdim, BLOCK=rows)
    ds = torch.empty(max(S - 1, 1), H, T, device=q.device, dtype=torch.float32)
    k_steps, pe_steps = _table(ks), _table(pes)
    dpes = []
    if S > 1:
        groups = math.gcd(H, DIAG_GROUPS)
        part = torch.empty(groups, S - 1, T, rope, device=q.device, dtype=torch.float32)
        _bwd_diag_kernel[(triton.cdiv(T, rows), groups)](
            q, k0, v0, pe0, do, lse, delta, dks[0], dvs[0], part, ds, k_steps, _table(vs), pe_steps, _table(dks),
            _table(dvs), q.stride(0), q.stride(1), do.stride(0), do.stride(1), T, S, H, qk_scale, scale,
            NOPE=nope, ROPE=rope, VDIM=vdim, GROUP=H // groups, ALIGN=align, BLOCK=rows)
        dpes = list(part.sum(0).to(q.dtype).unsqueeze(2).unbind(0))   # [T, 1, Dr] each
    strides = (q.stride(0), q.stride(1), k0.stride(0), k0.stride(1), v0.stride(0), v0.stride(1), pe0.stride(0),
               do.stride(0), do.stride(1))
    consts = dict(NOPE=nope, ROPE=rope, VDIM=vdim, VARLEN=cu is not None, UPCAST=INTERPRET)
    groups = math.gcd(H, DKDV_GROUPS)
    part = torch.empty(groups, T, rope, device=q.device, dtype=torch.float32)
    grid_kv = lambda meta: (triton.cdiv(triton.cdiv(max_len, meta["BLOCK_N"]), 2), groups, n_seq)
    _launch("dkdv", grid_kv, q, k0, v0, pe0, do, lse, delta, dks[0], dvs[0], part, cu, *strides, T, H, qk_scale, scale,
            triton.next_power_of_2(max_len), GROUP=H // groups, **consts)
    dpes.insert(0, part.sum(0).to(q.dtype).unsqueeze(1))
    grid_q = lambda meta: (triton.cdiv(max_len, meta["BLOCK_M"]), H, n_seq)
    _launch("dq", grid_q, q, k0, v0, pe0, do, lse, delta, ds, dq, cu, k_steps, pe_steps, *strides, T, S, H,
            qk_scale, scale, triton.next_power_of_2(max_len), ALIGN=align, **consts)
    return dq, dks, dvs, dpes


class _MLAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cu_seqlens, scale, *steps):
        """steps: the S keys [T, H, Dn], then the S values [T, H, Dv], then the S rotary keys [T, 1, Dr], saved as given
        (no stacked copy): a TTT unroll keeps each step's keys once."""
        S = len(steps) // 3
        ks, vs, pes = (list(steps[i * S:(i + 1) * S]) for i in range(3))
        cu, n_seq, max_len = seqlen_info(cu_seqlens, q.shape[0], q.device)
        o, lse = _forward(q, ks, vs, pes, cu, n_seq, max_len, scale)
        ctx.save_for_backward(q, o, lse, cu, *steps)
        ctx.meta = (S, n_seq, max_len, scale)
        return o

    @staticmethod
    def backward(ctx, do):
        q, o, lse, cu, *steps = ctx.saved_tensors
        S, n_seq, max_len, scale = ctx.meta
        ks, vs, pes = (steps[i * S:(i + 1) * S] for i in range(3))
        dq, dks, dvs, dpes = _backward(_unit_last(do), q, o, lse, ks, vs, pes, cu, n_seq, max_len, scale)
        return dq, None, None, *dks, *dvs, *dpes


def _steps(x, name: str, shape: tuple) -> list[torch.Tensor]:
    """Per-step tensors (a list, or the steps of one [S, ...] tensor) of [T, heads, width] `shape`."""
    steps = [_unit_last(t) for t in (list(x) if not isinstance(x, torch.Tensor) else x.unbind(0))]
    if not steps or any(tuple(t.shape) != shape for t in steps):
        raise ValueError(f"ttt_attention_mla: {name} must be steps of {shape}, got {steps_shape(x)}")
    return steps


def ttt_attention_mla(q: torch.Tensor, k: torch.Tensor | list, v: torch.Tensor | list,
                      cu_seqlens: torch.Tensor | None = None, scale: float | None = None, window: int = 0,
                      k_pe: torch.Tensor | list | None = None) -> torch.Tensor:
    """`kernels.reference.ttt_attention` with `k_pe`, fused, unpadded: q [T, H, Dn + Dr], k [S, T, H, Dn], v
    [S, T, H, Dv], k_pe [S, T, 1, Dr] (or lists of S per-step tensors: what a TTT unroll keeps, saved as given), each
    width in DIMS -> [T, H, Dv]. No window: the engines' MLA drafts attend over every key."""
    if k_pe is None or window:
        raise ValueError("ttt_attention_mla: needs k_pe (the rotary key every head shares) and takes no window")
    T, H, width = q.shape
    (nope, rope), vdim = (steps_shape(x)[-1] for x in (k, k_pe)), steps_shape(v)[-1]
    if nope + rope != width or any(d not in DIMS for d in (nope, rope, vdim)):
        raise ValueError(f"ttt_attention_mla: q width {width} must be nope {nope} + rope {rope}, each and v {vdim} "
                         f"in {DIMS}")
    ks, vs, pes = _steps(k, "k", (T, H, nope)), _steps(v, "v", (T, H, vdim)), _steps(k_pe, "k_pe", (T, 1, rope))
    if not len(ks) == len(vs) == len(pes) or len({q.dtype, *(x.dtype for x in ks + vs + pes)}) > 1:
        raise ValueError("ttt_attention_mla: k, v, k_pe must give every step, all in q's dtype")
    scale = width ** -0.5 if scale is None else float(scale)
    if T == 0:
        return q.new_empty(T, H, vdim)
    return _MLAttention.apply(_unit_last(q), cu_seqlens, scale, *ks, *vs, *pes)
