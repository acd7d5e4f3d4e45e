"""Fused TTT attention in Triton, forward and backward, each gradient with one writer (docs/kernels.md).
Layouts: q, o [T, Hq, D]; k, v [S, T, Hkv, D]; lse, delta [Hq, T] fp32 (log-sum-exp in base 2);
ds [S-1, Hq, T] fp32; packed sequences as cu_seqlens int32 [n+1]."""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from eagle3.kernels import tiles
from eagle3.kernels.reference import steps_shape
from eagle3.kernels.interpreter import INTERPRET

try:   # host-side TMA descriptors, in recent Triton releases; without them, pointer loads only
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30   # the window of full causal attention: no row of a sequence is this far back
# Interpreter tilings (tests swap them): fwd/dq need BLOCK_M % BLOCK_N == 0, dkdv BLOCK_N % BLOCK_M == 0.
INTERPRET_BLOCKS = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16), "rows": 16}
ROWS_BLOCK_GPU = 32  # rows per program of the two elementwise backward kernels


@triton.jit
def sequence(CU_SEQLENS, seq, T, VARLEN: tl.constexpr):
    """(first token, length) of packed sequence `seq`; the whole batch when there is no cu_seqlens."""
    if VARLEN:
        start = tl.load(CU_SEQLENS + seq)
        return start, tl.load(CU_SEQLENS + seq + 1) - start
    else:
        return 0, T


@triton.jit
def _query_tile(CU_SEQLENS, T, GROUP: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """(q head, kv head, sequence start, sequence length, first query position) of this program;
    the heaviest (last) query tiles first, so the causal imbalance does not land in the tail."""
    head = tl.program_id(1)
    start, seqlen = sequence(CU_SEQLENS, tl.program_id(2), T, VARLEN)
    return head, head // GROUP, start, seqlen, (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M


@triton.jit
def load_rows(base, rows, row_stride, offs_d, row_mask, UPCAST: tl.constexpr):
    """A [rows, D] tile of a row-major matrix; zeros on masked rows (they then add nothing)."""
    x = tl.load(base + rows[:, None] * row_stride + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_tile(desc, row0, col, base, rows, row_stride, offs_d, row_mask,
               TMA: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr):
    """A [rows, D] tile: with TMA through `desc` at (row0, col) of the [T, H * D] matrix (rows of the
    next packed sequence come as they are: the callers' masks drop them), else by pointers at `base`."""
    if TMA:
        x = desc.load([row0, col])
    else:
        x = tl.load(base + rows[:, None] * row_stride + offs_d[None, :], mask=row_mask[:, None] if MASK else None,
                    other=0.0 if MASK else None)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_key_tile(K0, V0, Kd, Vd, row0, col, stride_kt, offs_n, offs_d, seqlen,
                   TMA: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr):
    """k, v of step-0 keys offs_n; bounds-checked only on tiles that straddle the diagonal, where the
    causal mask drops keys past the sequence however they loaded."""
    k = _load_tile(Kd, row0, col, K0, offs_n, stride_kt, offs_d, offs_n < seqlen, TMA, MASK, UPCAST)
    v = _load_tile(Vd, row0, col, V0, offs_n, stride_kt, offs_d, offs_n < seqlen, TMA, MASK, UPCAST)
    return k, v


@triton.jit
def _visible(q, k, window):
    """Whether step-0 key position k is visible to query position q (broadcast: [M, 1] and [1, N], or transposed):
    causal, and within the window."""
    return (q >= k) & (q - k < window)


@triton.jit
def _fwd_causal_tile(acc, m_i, l_i, q, K0, V0, Kd, Vd, start, col, stride_kt, n0, offs_m, offs_d, seqlen,
                     qk_scale, window, TMA: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                     UPCAST: tl.constexpr):
    """The online-softmax update of one step-0 key tile; MASK only on tiles that straddle the diagonal or the
    window's edge."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k, v = _load_key_tile(K0, V0, Kd, Vd, start + n0, col, stride_kt, offs_n, offs_d, seqlen, TMA, MASK, UPCAST)
    s = tl.dot(q, tl.trans(k))
    if MASK:
        s = tl.where(_visible(offs_m[:, None], offs_n[None, :], window), s, float("-inf"))
    return softmax_update(acc, m_i, l_i, s, v, qk_scale, MASK)


@triton.jit
def softmax_update(acc, m_i, l_i, s, v, qk_scale, UNSEEN: tl.constexpr):
    """The online softmax's (acc, m, l) after one tile's scores s [M, N] (unscaled) and values v [N, Dv]; UNSEEN: a
    row may see no key yet (masked below its window), whose m stays -inf: subtract 0, not -inf."""
    # scaled inside the max and the exponent: one FMA per score, no separate pass
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if UNSEEN:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s * qk_scale - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _key_tiles(m0, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first key tile, first tile wholly inside every row's window) of query tile m0, BLOCK_N-aligned: the tiles
    between them straddle the window's edge."""
    lo = tl.maximum(m0 - window + 1, 0) // BLOCK_N * BLOCK_N
    inside = tl.cdiv(tl.maximum(m0 + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N
    return lo, tl.minimum(inside, m0)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU_SEQLENS,
                stride_qt, stride_qh, stride_ks, stride_kt, stride_kh, stride_ot, stride_oh,
                T, S, qk_scale, seqlen_bucket, window, Qd, Kd, Vd,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, TMA: tl.constexpr,
                UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    head, kv_head, start, seqlen, m0 = _query_tile(CU_SEQLENS, T, GROUP, VARLEN, BLOCK_M)
    if m0 >= seqlen:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)  # positions inside the sequence
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < seqlen  # rows past it are computed from whatever loaded, and not stored
    q = _load_tile(Qd, start + m0, head * HEAD_DIM, Q + start * stride_qt + head * stride_qh, offs_m,
                   stride_qt, offs_d, row_mask, TMA, True, UPCAST)
    kv_base = start * stride_kt + kv_head * stride_kh
    K0, V0 = K + kv_base, V + kv_base
    col = kv_head * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # diagonal keys first (a q.k product per row and step): every valid row's running max finite before any mask
    qf = q.to(tl.float32)
    Kj, Vj = K0, V0
    for _ in range(1, S):
        Kj += stride_ks  # pointers advance step by step: no 32-bit overflow of j * stride_ks
        Vj += stride_ks
        # both loads before any arithmetic: this loop is latency-bound
        kj = load_rows(Kj, offs_m, stride_kt, offs_d, row_mask, UPCAST)
        vj = load_rows(Vj, offs_m, stride_kt, offs_d, row_mask, UPCAST)
        s = tl.sum(qf * kj.to(tl.float32), 1) * qk_scale
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * vj.to(tl.float32)
        m_i = m_new
    lo, inside = _key_tiles(m0, window, BLOCK_M, BLOCK_N)
    for n0 in range(lo, inside, BLOCK_N):
        acc, m_i, l_i = _fwd_causal_tile(acc, m_i, l_i, q, K0, V0, Kd, Vd, start, col, stride_kt, n0, offs_m,
                                         offs_d, seqlen, qk_scale, window, TMA, BLOCK_N, True, UPCAST)
    for n0 in range(inside, m0, BLOCK_N):
        acc, m_i, l_i = _fwd_causal_tile(acc, m_i, l_i, q, K0, V0, Kd, Vd, start, col, stride_kt, n0, offs_m,
                                         offs_d, seqlen, qk_scale, window, TMA, BLOCK_N, False, UPCAST)
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, seqlen), BLOCK_N):
        acc, m_i, l_i = _fwd_causal_tile(acc, m_i, l_i, q, K0, V0, Kd, Vd, start, col, stride_kt, n0, offs_m,
                                         offs_d, seqlen, qk_scale, window, TMA, BLOCK_N, True, UPCAST)
    o = acc / l_i[:, None]
    o_ptrs = O + (start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_mask[:, None])
    tl.store(LSE + head * T + start + offs_m, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit
def bwd_preprocess(O, DO, DELTA, stride_ot, stride_oh, stride_dot, stride_doh, T,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """delta = rowsum(dO * O), one value per (head, row)."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = rows < T
    o = load_rows(O + head * stride_oh, rows, stride_ot, offs_d, mask, True)
    do = load_rows(DO + head * stride_doh, rows, stride_dot, offs_d, mask, True)
    tl.store(DELTA + head * T + rows, tl.sum(o * do, 1), mask=mask)


@triton.jit
def _bwd_diag_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DS,
                     stride_qt, stride_qh, stride_ks, stride_kt, stride_kh, stride_dot, stride_doh,
                     T, S, H_Q, qk_scale, sm_scale,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """dk_j, dv_j of the diagonal keys (j >= 1), summed over the GQA group in registers, and
    ds_j = p_j (dp_j - delta) for the dq kernel. A diagonal key never crosses a sequence boundary."""
    kv_head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = rows < T
    kv = kv_head * stride_kh + rows[:, None] * stride_kt + offs_d[None, :]
    for j in range(1, S):
        K += stride_ks  # pointers advance step by step: no 32-bit overflow of j * stride_ks
        V += stride_ks
        DK += stride_ks
        DV += stride_ks
        kj = tl.load(K + kv, mask=mask[:, None], other=0.0).to(tl.float32)
        vj = tl.load(V + kv, mask=mask[:, None], other=0.0).to(tl.float32)
        dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
        for g in range(GROUP):
            head = kv_head * GROUP + g
            q = load_rows(Q + head * stride_qh, rows, stride_qt, offs_d, mask, True)
            do = load_rows(DO + head * stride_doh, rows, stride_dot, offs_d, mask, True)
            lse = tl.load(LSE + head * T + rows, mask=mask, other=0.0)
            delta = tl.load(DELTA + head * T + rows, mask=mask, other=0.0)
            p = tl.exp2(tl.sum(q * kj, 1) * qk_scale - lse)
            ds = p * (tl.sum(do * vj, 1) - delta)
            dv += p[:, None] * do
            dk += ds[:, None] * q
            tl.store(DS + ((j - 1) * H_Q + head) * T + rows, ds, mask=mask)
        tl.store(DK + kv, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask[:, None])
        tl.store(DV + kv, dv.to(DV.dtype.element_ty), mask=mask[:, None])


@triton.jit
def _bwd_dkdv_tile(dk, dv, k, v, Qh, DOh, Qd, DOd, row0, col, LSEh, DELTAh, stride_qt, stride_dot, m0,
                   offs_n, offs_d, seqlen, qk_scale, window, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                   MASK: tl.constexpr, UPCAST: tl.constexpr):
    """dk, dv += one query tile's part (batch rows row0..), transposed: keys are rows."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_mask = offs_m < seqlen
    # Rows past the sequence (zeros, or with TMA the next sequence's) get lse = +inf: p = 0.
    q = _load_tile(Qd, row0, col, Qh, offs_m, stride_qt, offs_d, row_mask, TMA, True, UPCAST)
    do = _load_tile(DOd, row0, col, DOh, offs_m, stride_dot, offs_d, row_mask, TMA, True, UPCAST)
    lse = tl.load(LSEh + offs_m, mask=row_mask, other=float("inf"))
    delta = tl.load(DELTAh + offs_m, mask=row_mask, other=0.0)
    p_t = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
    if MASK:
        p_t = tl.where(_visible(offs_m[None, :], offs_n[:, None], window), p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv)
    ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU_SEQLENS,
                     stride_qt, stride_qh, stride_ks, stride_kt, stride_kh, stride_dot, stride_doh,
                     T, qk_scale, sm_scale, seqlen_bucket, window, Qd, Kd, Vd, DOd,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, TMA: tl.constexpr,
                     UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk_0, dv_0 of key tiles i and n_tiles-1-i of one kv head, summed over its q heads (pairing each tile with its
    mirror evens the causal work of the few programs GQA leaves); keys past the sequence are not stored."""
    pair = tl.program_id(0)
    kv_head = tl.program_id(1)
    start, seqlen = sequence(CU_SEQLENS, tl.program_id(2), T, VARLEN)
    mirror = tl.cdiv(seqlen, BLOCK_N) - 1 - pair
    # Visits tile `pair` and then `mirror`; once if they coincide, never if `mirror` came first.
    for tile in range(pair, mirror + 1, tl.maximum(mirror - pair, 1)):
        n0 = tile * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        key_mask = offs_n < seqlen
        kv_base = start * stride_kt + kv_head * stride_kh
        k, v = _load_key_tile(K + kv_base, V + kv_base, Kd, Vd, start + n0, kv_head * HEAD_DIM, stride_kt, offs_n,
                              offs_d, seqlen, TMA, True, UPCAST)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        diag_end = tl.minimum(n0 + BLOCK_N, seqlen)
        # the window's query rows: unmasked up to `edge` (its first tile with a row past a key's window), then masked
        last = tl.minimum(n0 + BLOCK_N - 1 + window, seqlen)
        edge = tl.minimum(tl.maximum(tl.cdiv(n0 + window - BLOCK_M + 1, BLOCK_M) * BLOCK_M, n0 + BLOCK_N), last)
        for g in range(GROUP):
            head = kv_head * GROUP + g
            Qh = Q + start * stride_qt + head * stride_qh
            DOh = DO + start * stride_dot + head * stride_doh
            LSEh = LSE + head * T + start
            DELTAh = DELTA + head * T + start
            # Query tiles that straddle the diagonal need the causal mask; the ones after do not.
            for m0 in range(n0, diag_end, BLOCK_M):
                dk, dv = _bwd_dkdv_tile(dk, dv, k, v, Qh, DOh, Qd, DOd, start + m0, head * HEAD_DIM, LSEh,
                                        DELTAh, stride_qt, stride_dot, m0, offs_n, offs_d, seqlen, qk_scale,
                                        window, TMA, BLOCK_M, True, UPCAST)
            for m0 in range(n0 + BLOCK_N, edge, BLOCK_M):
                dk, dv = _bwd_dkdv_tile(dk, dv, k, v, Qh, DOh, Qd, DOd, start + m0, head * HEAD_DIM, LSEh,
                                        DELTAh, stride_qt, stride_dot, m0, offs_n, offs_d, seqlen, qk_scale,
                                        window, TMA, BLOCK_M, False, UPCAST)
            for m0 in range(edge, last, BLOCK_M):
                dk, dv = _bwd_dkdv_tile(dk, dv, k, v, Qh, DOh, Qd, DOd, start + m0, head * HEAD_DIM, LSEh,
                                        DELTAh, stride_qt, stride_dot, m0, offs_n, offs_d, seqlen, qk_scale,
                                        window, TMA, BLOCK_M, True, UPCAST)
        out = kv_base + offs_n[:, None] * stride_kt + offs_d[None, :]
        tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_mask[:, None])
        tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_mask[:, None])


@triton.jit
def _bwd_dq_tile(dq, q, do, lse, delta, K0, V0, Kd, Vd, start, col, stride_kt, n0, offs_m, offs_d, seqlen,
                 qk_scale, window, TMA: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                 UPCAST: tl.constexpr):
    """dq += dS k for one step-0 key tile, the scores recomputed from the saved log-sum-exp."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k, v = _load_key_tile(K0, V0, Kd, Vd, start + n0, col, stride_kt, offs_n, offs_d, seqlen, TMA, MASK, UPCAST)
    p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
    if MASK:
        p = tl.where(_visible(offs_m[:, None], offs_n[None, :], window), p, 0.0)
    ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DS, DQ, CU_SEQLENS,
                   stride_qt, stride_qh, stride_ks, stride_kt, stride_kh, stride_dot, stride_doh,
                   stride_dqt, stride_dqh, T, S, H_Q, qk_scale, sm_scale, seqlen_bucket, window, Qd, Kd, Vd, DOd,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, TMA: tl.constexpr,
                   UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq for one query tile of one q head: the diagonal terms, then the causal step-0 tiles (rows
    past the sequence are computed from whatever loaded, and not stored)."""
    head, kv_head, start, seqlen, m0 = _query_tile(CU_SEQLENS, T, GROUP, VARLEN, BLOCK_M)
    if m0 >= seqlen:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < seqlen
    q = _load_tile(Qd, start + m0, head * HEAD_DIM, Q + start * stride_qt + head * stride_qh, offs_m,
                   stride_qt, offs_d, row_mask, TMA, True, UPCAST)
    do = _load_tile(DOd, start + m0, head * HEAD_DIM, DO + start * stride_dot + head * stride_doh, offs_m,
                    stride_dot, offs_d, row_mask, TMA, True, UPCAST)
    lse = tl.load(LSE + head * T + start + offs_m, mask=row_mask, other=0.0)
    delta = tl.load(DELTA + head * T + start + offs_m, mask=row_mask, other=0.0)
    kv_base = start * stride_kt + kv_head * stride_kh
    K0, V0 = K + kv_base, V + kv_base
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    Kj = K0
    for j in range(1, S):   # the diagonal keys: ds_j (from _bwd_diag_kernel) times k_j, row by row
        Kj += stride_ks
        kj = load_rows(Kj, offs_m, stride_kt, offs_d, row_mask, True)
        ds = tl.load(DS + ((j - 1) * H_Q + head) * T + start + offs_m, mask=row_mask, other=0.0)
        dq += ds[:, None] * kj
    col = kv_head * HEAD_DIM
    lo, inside = _key_tiles(m0, window, BLOCK_M, BLOCK_N)
    for n0 in range(lo, inside, BLOCK_N):
        dq = _bwd_dq_tile(dq, q, do, lse, delta, K0, V0, Kd, Vd, start, col, stride_kt, n0, offs_m, offs_d,
                          seqlen, qk_scale, window, TMA, BLOCK_N, True, UPCAST)
    for n0 in range(inside, m0, BLOCK_N):
        dq = _bwd_dq_tile(dq, q, do, lse, delta, K0, V0, Kd, Vd, start, col, stride_kt, n0, offs_m, offs_d,
                          seqlen, qk_scale, window, TMA, BLOCK_N, False, UPCAST)
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, seqlen), BLOCK_N):
        dq = _bwd_dq_tile(dq, q, do, lse, delta, K0, V0, Kd, Vd, start, col, stride_kt, n0, offs_m, offs_d,
                          seqlen, qk_scale, window, TMA, BLOCK_N, True, UPCAST)
    dq_ptrs = DQ + (start + offs_m)[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_mask[:, None])


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per GPU family (`kernels.tiles`): "large" timed on an H200
# (`python -m benchmarks.attention_sweep`), the others the tilings that fit their shared memory, untimed;
# FALLBACK (48 KB or less at HEAD_DIM=128 in bf16) ends every list and fits every GPU Triton supports.
FALLBACK = (32, 32, 4, 2)
_LARGE = {
    "fwd": [(64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), FALLBACK],
    "dkdv": [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (32, 128, 8, 2), (16, 128, 8, 3),
             (16, 64, 4, 3), FALLBACK],
    "dq": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 32, 4, 3), FALLBACK],
}
CONFIGS = {
    "large": _LARGE,
    "a100": {
        "fwd": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3), FALLBACK],
        "dkdv": _LARGE["dkdv"],   # every one fits 163 KB
        "dq": [(128, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3), FALLBACK],
    },
    "small": {
        "fwd": [(64, 64, 4, 2), (64, 32, 4, 3), FALLBACK],
        "dkdv": [(32, 128, 8, 2), (16, 128, 8, 3), (16, 64, 4, 3), (32, 64, 4, 2), FALLBACK],
        "dq": [(64, 64, 4, 2), (64, 32, 4, 3), FALLBACK],
    },
}
# seqlen_bucket, the longest sequence rounded up to a power of two: one tuning per size class
_TUNE_KEY = ["HEAD_DIM", "GROUP", "VARLEN", "TMA", "seqlen_bucket"]
# the TMA descriptor arguments and the block size that counts their tiles' rows
DESCRIPTOR_ROWS = {"Qd": "BLOCK_M", "DOd": "BLOCK_M", "Kd": "BLOCK_N", "Vd": "BLOCK_N"}


def block_rows(nargs: dict) -> None:
    """Give each TMA descriptor of a launch its tiling's tile rows, in place (the tuner launches the
    very objects it hands its pre-hook)."""
    for name, block in DESCRIPTOR_ROWS.items():
        if nargs.get(name) is not None:
            nargs[name].block_shape = [nargs[block], nargs[name].block_shape[-1]]


KERNELS = {"fwd": _fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel}
# the autotuned kernels (benchmarks.attention_sweep swaps one for a single config)
TUNED = {} if INTERPRET else {name: tiles.autotuned(k, {family: configs[name] for family, configs in CONFIGS.items()},
                                                    _TUNE_KEY, block_rows) for name, k in KERNELS.items()}


def best_config(name: str) -> tuple | None:
    """The autotuner's last pick for kernel `name` (None before it tuned, or under the interpreter)."""
    best = getattr(TUNED.get(name), "best_config", None)
    return None if best is None else tiles.as_tuple(best, ("BLOCK_M", "BLOCK_N"))


def _launch(name, grid, *args, **kwargs):
    """The autotuned kernel, else one fixed tiling under the interpreter (TMA descriptors come as
    keywords, so that the tuner's pre-hook sees them)."""
    if not INTERPRET:
        return TUNED[name][grid](*args, **kwargs)
    block_m, block_n = INTERPRET_BLOCKS[name]
    kwargs.update(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=1)
    block_rows(kwargs)
    return KERNELS[name][grid](*args, **kwargs)


_tma_forced: bool | None = None   # None: TMA where it pays (`uses_tma`); True / False: forced


@contextlib.contextmanager
def tma_loads(enabled: bool):
    """Load tiles through TMA descriptors (`enabled`) or through pointers, whatever the device."""
    global _tma_forced
    before, _tma_forced = _tma_forced, bool(enabled)
    try:
        yield
    finally:
        _tma_forced = before


def uses_tma(device: torch.device) -> bool:
    """Whether the kernels on `device` load tiles through TMA: on the "large" family, where Triton
    pipelines them (on sm_120 Triton 3.6 builds them single-buffered), with host descriptors."""
    if _tma_forced is not None:
        return _tma_forced and TensorDescriptor is not None
    return (TensorDescriptor is not None and not INTERPRET and device.type == "cuda"
            and tiles.family(torch.cuda.get_device_capability(device), torch.version.hip is not None) == "large")


def _aligned(*tensors) -> bool:
    """TMA needs each base 16-byte aligned (row strides H * D * 2 bytes always are, at D = 64, 128 or 256)."""
    return all(x.data_ptr() % 16 == 0 for x in tensors)


def _descriptors(tma: bool, **tensors) -> dict:
    """A TMA descriptor over each tensor's [T, H * D] rows (None each without TMA); its [16, D] tile
    is a placeholder that `block_rows` sets at launch."""
    if not tma:
        return dict.fromkeys(tensors)
    return {name: TensorDescriptor(x, [x.shape[-3], x.shape[-2] * x.shape[-1]], [x.shape[-2] * x.shape[-1], 1],
                                   [16, x.shape[-1]]) for name, x in tensors.items()}


def seqlen_info(cu_seqlens, T, device, max_seqlen=None):
    """(cu_seqlens int32 on device or None, number of sequences, longest length), checked (pinned host boundaries
    cost no sync); with `max_seqlen` (a bound, as in a CUDA graph) they are neither read nor checked."""
    if cu_seqlens is None:
        return None, 1, T
    if max_seqlen is not None:
        return cu_seqlens.to(device=device, dtype=torch.int32).contiguous(), cu_seqlens.numel() - 1, max_seqlen
    bounds = cu_seqlens.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"ttt_attention: cu_seqlens must rise from 0 to T={T}, got {bounds[:4]}...{bounds[-2:]}")
    max_len = max(b - a for a, b in zip(bounds, bounds[1:]))
    return cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True).contiguous(), len(bounds) - 1, max_len


def _backward(do, q, k, v, o, lse, cu, n_seq, max_len, scale, tma, window):
    S, T, Hkv, D = k.shape
    Hq = q.shape[1]
    group = Hq // Hkv
    qk_scale = scale * LOG2E
    rows = INTERPRET_BLOCKS["rows"] if INTERPRET else ROWS_BLOCK_GPU
    dq, dk, dv, delta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse)
    ds = torch.empty(max(S - 1, 1), Hq, T, device=q.device, dtype=torch.float32)
    bucket = triton.next_power_of_2(max_len)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), do.stride(0), do.stride(1))
    bwd_preprocess[(triton.cdiv(T, rows), Hq)](
        o, do, delta, o.stride(0), o.stride(1), do.stride(0), do.stride(1), T, HEAD_DIM=D, BLOCK=rows)
    if S > 1:
        _bwd_diag_kernel[(triton.cdiv(T, rows), Hkv)](q, k, v, do, lse, delta, dk, dv, ds, *strides, T, S, Hq,
                                                      qk_scale, scale, GROUP=group, HEAD_DIM=D, BLOCK=rows)
    # one set for both passes: each launch sets the tiles of its own tiling before it runs
    descriptors = _descriptors(tma, Qd=q, Kd=k[0], Vd=v[0], DOd=do)
    consts = dict(GROUP=group, HEAD_DIM=D, VARLEN=cu is not None, TMA=tma, UPCAST=INTERPRET)
    grid_kv = lambda meta: (triton.cdiv(triton.cdiv(max_len, meta["BLOCK_N"]), 2), Hkv, n_seq)
    _launch("dkdv", grid_kv, q, k, v, do, lse, delta, dk, dv, cu, *strides, T, qk_scale, scale, bucket, window,
            **descriptors, **consts)
    grid_q = lambda meta: (triton.cdiv(max_len, meta["BLOCK_M"]), Hq, n_seq)
    _launch("dq", grid_q, q, k, v, do, lse, delta, ds, dq, cu, *strides, dq.stride(0), dq.stride(1), T, S, Hq, qk_scale,
            scale, bucket, window, **descriptors, **consts)
    return dq, dk, dv


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cu_seqlens, scale, max_seqlen, window, per_step, *kv):
        """kv: the keys, then the values: one [S, T, Hkv, D] tensor each, or (per_step) S [T, Hkv, D] tensors each.
        Per-step tensors are saved as given and stacked again in the backward: a TTT unroll then keeps each step's
        keys once, not a stacked copy per step (S(S+1)/2 copies over S steps)."""
        q, n = q.contiguous(), len(kv) // 2
        k, v = (torch.stack(kv[:n]), torch.stack(kv[n:])) if per_step else (kv[0].contiguous(), kv[1].contiguous())
        S, T, Hkv, D = k.shape
        Hq = q.shape[1]
        cu, n_seq, max_len = seqlen_info(cu_seqlens, T, q.device, max_seqlen)
        tma = uses_tma(q.device) and _aligned(q, k, v)   # the backward loads as the forward did
        o = torch.empty_like(q)
        lse = torch.empty(Hq, T, device=q.device, dtype=torch.float32)
        grid = lambda meta: (triton.cdiv(max_len, meta["BLOCK_M"]), Hq, n_seq)
        _launch("fwd", grid, q, k, v, o, lse, cu,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), o.stride(0), o.stride(1),
                T, S, scale * LOG2E, triton.next_power_of_2(max_len), window,
                **_descriptors(tma, Qd=q, Kd=k[0], Vd=v[0]),
                GROUP=Hq // Hkv, HEAD_DIM=D, VARLEN=cu is not None, TMA=tma, UPCAST=INTERPRET)
        ctx.save_for_backward(q, o, lse, cu, *(kv if per_step else (k, v)))
        ctx.meta = (n_seq, max_len, scale, tma, window, per_step)
        return o

    @staticmethod
    def backward(ctx, do):
        q, o, lse, cu, *kv = ctx.saved_tensors
        n_seq, max_len, scale, tma, window, per_step = ctx.meta
        n = len(kv) // 2
        k, v = (torch.stack(kv[:n]), torch.stack(kv[n:])) if per_step else kv
        do = do.contiguous()
        if tma and not _aligned(do):
            do = do.clone()   # a fresh allocation is aligned
        dq, dk, dv = _backward(do, q, k, v, o, lse, cu, n_seq, max_len, scale, tma, window)
        return dq, None, None, None, None, None, *((*dk.unbind(0), *dv.unbind(0)) if per_step else (dk, dv))


def ttt_attention(q: torch.Tensor, k: torch.Tensor | list, v: torch.Tensor | list,
                  cu_seqlens: torch.Tensor | None = None, scale: float | None = None, max_seqlen: int | None = None,
                  window: int = 0) -> torch.Tensor:
    """`kernels.reference.ttt_attention` fused: q [T, Hq, D], k, v [S, T, Hkv, D] (or lists of S per-step [T, Hkv, D]:
    what a TTT unroll keeps, saved without a stacked copy), D 64, 128 or 256 -> [T, Hq, D]; `max_seqlen` bounds the
    lengths of boundaries on the device that the launch must not read (CUDA graphs); `window` > 0: query i sees the
    step-0 keys j with i - j < window."""
    per_step = not isinstance(k, torch.Tensor)
    if per_step == isinstance(v, torch.Tensor):
        raise ValueError("ttt_attention: k and v must both be tensors or both lists of per-step tensors")
    keys, values = (tuple(x) if per_step else (x,) for x in (k, v))
    (S, T, Hkv, D), v_shape = steps_shape(k), steps_shape(v)
    Hq = q.shape[1]
    if q.shape != (T, Hq, D) or v_shape != (S, T, Hkv, D) or Hq % Hkv or S < 1:
        raise ValueError(f"ttt_attention: bad shapes q {tuple(q.shape)} k {(S, T, Hkv, D)} v {v_shape}")
    if D not in (64, 128, 256):  # the head dims tested (256: an MLA draft's 192-wide q/k heads zero-padded)
        raise ValueError(f"ttt_attention: head dim {D} not supported (64, 128 or 256)")
    if len({q.dtype, *(x.dtype for x in keys + values)}) > 1:
        raise ValueError(f"ttt_attention: q, k, v dtypes differ ({q.dtype}, {keys[0].dtype}, {values[0].dtype})")
    scale = D ** -0.5 if scale is None else float(scale)
    if T == 0:
        return q.new_empty(q.shape)
    return _TTTAttention.apply(q, cu_seqlens, scale, max_seqlen, window or NO_WINDOW, per_step, *keys, *values)
