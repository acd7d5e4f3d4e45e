"""Fused TTT loss, forward and backward: per chunk of valid rows z = h_c wᵀ (cuBLAS, one reused buffer), a row kernel
for loss, α, argmax and dz in place, dh_c = dz w, dw += dzᵀ h_c (docs/losses.md, docs/kernels.md)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from eagle3.kernels import fp8_cast
from eagle3.kernels.reference import ALPHA_EPS, LOSSES, loss_index

# rows per chunk: full-rate GEMMs, few bf16 roundings of dw, buffers under 1 GiB (8192 rows at V = 32000 in bf16)
CHUNK_BYTES = 512 * 2**20

# the kernel's LOSS: the index in kernels.reference.LOSSES
KL, TV, NLA, LK_HYBRID, PQ = (tl.constexpr(LOSSES.index(n)) for n in ("kl", "tv", "nla", "lk_hybrid", "pq"))
EPS: tl.constexpr = tl.constexpr(ALPHA_EPS)
FLT_MIN: tl.constexpr = tl.constexpr(1.1754943508222875e-38)   # the smallest normal fp32


@triton.jit
def _q_p_tile(z_row, p_row, cols, V, inv_t, lse):
    """(q = softmax(z / τ) from the row's lse, p, cols < V) of one tile, q and p fp32, 0 past V."""
    mask = cols < V
    z = tl.load(z_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.exp(z * inv_t - lse), p, mask


@triton.jit
def _ttt_loss_kernel(
    z_ptr, z_stride,        # [n, V] logits of the chunk; overwritten by dz when WRITE_GRAD
    p_ptr, p_stride,        # [P, V] target probabilities, any float dtype, unit column stride
    rows_ptr,               # [n] int64: the row of the outputs for chunk row i
    p_rows_ptr,             # [n] int64: the row of p for chunk row i
    g_ptr,                  # [N] fp32 upstream gradient per row (read only when WRITE_GRAD)
    loss_ptr, argmax_ptr,   # [N] fp32, [N] int64 outputs
    alpha_ptr,              # [N] fp32 output: α = Σ min(p, q)
    inv_t, eta,             # fp32: 1 / temperature; lk_hybrid's λ = exp(-eta α)
    V: tl.constexpr,        # constexpr: the interpreter (numpy 2) cannot loop to a run-time bound
    LOSS: tl.constexpr,     # KL, TV, NLA, LK_HYBRID or PQ
    WRITE_GRAD: tl.constexpr,
    FAST_LOG: tl.constexpr, # lk_hybrid's log p by the GPU's approximate log (libdevice, not interpretable)
    BLOCK_V: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    z_row = z_ptr + i.to(tl.int64) * z_stride
    p_row = p_ptr + tl.load(p_rows_ptr + i) * p_stride
    offs = tl.arange(0, BLOCK_V)

    # Pass 1: online max / sum-exp of x = z/τ, Σp, Σp·x, the first argmax of z and (pq) Σp·e^(x - m).
    m, s, psum, px, pe = float("-inf"), 0.0, 0.0, 0.0, 0.0
    best, best_idx = float("-inf"), 0
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        # fp32 upcast: exact for bf16 inputs, and required by the interpreter.
        z = tl.load(z_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float32)
        blk_max = tl.max(z, 0)
        blk_idx = tl.argmax(z, 0) + start        # first index of the block max
        best_idx = tl.where(blk_max > best, blk_idx, best_idx)   # strict: keep the earlier tie
        best = tl.maximum(best, blk_max)
        x = z * inv_t                            # τ > 0: max x = (max z)/τ, rounding is monotone
        m_new = tl.maximum(m, blk_max * inv_t)
        scale = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        s = s * scale + tl.sum(e, 0)
        if LOSS == PQ:
            pe = pe * scale + tl.sum(p * e, 0)
        m = m_new
        psum += tl.sum(p, 0)
        px += tl.sum(p * tl.where(mask, x, 0.0), 0)   # masked lanes hold -inf: avoid 0 · -inf
    lse = m + tl.log(s)
    ce = lse * psum - px                 # -Σ p (x - lse) = -Σ p log q
    tl.store(argmax_ptr + row, best_idx.to(tl.int64))
    if WRITE_GRAD:
        g = tl.load(g_ptr + row) * inv_t   # ∂/∂z = (1/τ) ∂/∂x

    if LOSS == KL:
        tl.store(loss_ptr + row, ce)
    if LOSS == PQ:
        A = pe / s
        tl.store(loss_ptr + row, -tl.log(tl.maximum(A, EPS)))
        if WRITE_GRAD:
            g = tl.where(A >= EPS, g / A, 0.0)

    acc = tl.zeros([BLOCK_V], dtype=tl.float32)   # α, summed once after the loop
    if LOSS == KL or LOSS == PQ:
        # Pass 2: α and dz in place; the row was just read (partly still in L2).
        #   kl: dz = g (q Σp - p);  pq: dz = g q (A - p) / A
        if WRITE_GRAD:
            a = g * psum if LOSS == KL else g * A
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            q, p, mask = _q_p_tile(z_row, p_row, cols, V, inv_t, lse)
            acc += tl.minimum(p, q)
            if WRITE_GRAD:
                dz = a * q - g * p if LOSS == KL else q * (a - g * p)
                tl.store(z_row + cols, dz.to(z_ptr.dtype.element_ty), mask=mask)
        alpha = tl.sum(acc, 0)
    else:
        # Pass 2 (read only): α, S = Σ [q <= p] q and (lk_hybrid) Σ p log p.
        acc_s = tl.zeros([BLOCK_V], dtype=tl.float32)
        acc_h = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            q, p, mask = _q_p_tile(z_row, p_row, cols, V, inv_t, lse)
            below = q <= p
            acc += tl.where(below, q, p)
            acc_s += tl.where(below, q, 0.0)
            if LOSS == LK_HYBRID:   # Σ p log p; p < FLT_MIN adds under 1e-36 (and 0 log 0 = 0)
                p_ok = tl.where(p >= FLT_MIN, p, 1.0)   # the fast log flushes subnormals to -inf
                # FAST_LOG: libdevice's accurate logf would make this pass compute-bound
                acc_h += p * (libdevice.fast_logf(p_ok) if FAST_LOG else tl.log(p_ok))
        alpha = tl.sum(acc, 0)
        S = tl.sum(acc_s, 0)
        # The gradient is a q (S - I) [+ b (q Σp - p) for lk_hybrid], ∂α/∂x = q (I - S).
        if LOSS == TV:
            tl.store(loss_ptr + row, 1.0 - alpha)
            if WRITE_GRAD:
                a = g
        if LOSS == NLA:
            tl.store(loss_ptr + row, -tl.log(tl.maximum(alpha, EPS)))
            if WRITE_GRAD:
                a = tl.where(alpha >= EPS, g / alpha, 0.0)
        if LOSS == LK_HYBRID:
            lam = tl.exp(-eta * alpha)
            tl.store(loss_ptr + row, lam * (tl.sum(acc_h, 0) + ce) + (1.0 - lam) * (1.0 - alpha))
            if WRITE_GRAD:
                a = g * (1.0 - lam)
                b = g * lam
        # Pass 3: dz = a q (S - I) + b (q Σp - p), in place.
        if WRITE_GRAD:
            for start in range(0, V, BLOCK_V):
                cols = start + offs
                q, p, mask = _q_p_tile(z_row, p_row, cols, V, inv_t, lse)
                dz = a * q * (S - tl.where(q <= p, 1.0, 0.0))
                if LOSS == LK_HYBRID:
                    dz += b * (q * psum - p)
                tl.store(z_row + cols, dz.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(alpha_ptr + row, alpha)


# on the GPU BLOCK_V and warps autotuned per (V, LOSS, WRITE_GRAD), z restored between trials (written in place)
_tuned_kernel = triton.autotune([triton.Config({"BLOCK_V": b}, num_warps=nw)
                                 for b, nw in ((2048, 4), (4096, 8), (4096, 16), (8192, 16))],
                                key=["V", "LOSS", "WRITE_GRAD"], restore_value=["z_ptr"])(_ttt_loss_kernel)


def chosen_configs() -> dict[str, str]:
    """The autotuned configs chosen so far, by key (V, LOSS, WRITE_GRAD, ...)."""
    return {str(k): str(c) for k, c in _tuned_kernel.cache.items()}


def _row_kernel(z, p, rows, p_rows, g, out, spec) -> None:
    """The row kernel over the chunk z, one program per row; g=None: no gradient.
    out = (loss, argmax, alpha) [N]; spec = (LOSS index, 1/τ, eta)."""
    n, V = z.shape
    kind, inv_t, eta = spec
    args = (z, z.stride(0), p, p.stride(0), rows, p_rows, out[0] if g is None else g, *out, inv_t, eta, V, kind)
    if z.is_cuda:
        _tuned_kernel[(n,)](*args, WRITE_GRAD=g is not None, FAST_LOG=True)
    else:
        block = min(4096, triton.next_power_of_2(V))
        _ttt_loss_kernel[(n,)](*args, WRITE_GRAD=g is not None, FAST_LOG=False, BLOCK_V=block, num_warps=8)


class _Workspace:
    """The chunk buffers, allocated once per call and reused by every chunk and step, and the two
    GEMMs that read w: in w's dtype, or (float8) as scaled fp8 GEMMs of w cast once per call."""

    def __init__(self, w: torch.Tensor, chunk: int | None, max_rows: int, float8: bool = False):
        V, H = w.shape
        if chunk is None:
            chunk = max(128, CHUNK_BYTES // (V * w.element_size()) // 128 * 128)
        self.chunk = max(1, min(chunk, max_rows))
        self.z = w.new_empty(self.chunk + -self.chunk % 16, V)   # fp8 GEMMs write rows in 16s
        self._w, self._h, self._dh, self.float8 = w, None, None, float8
        if float8:   # w [V, H] and wᵀ [H, V] in e4m3, one scale: B of the logits and of dh
            self._wq, self._wq_t, self._sw = fp8_cast.to_fp8(w, fp8_cast.E4M3)

    def logits(self, h_c: torch.Tensor) -> torch.Tensor:
        """z = h_c wᵀ [n, V], in the workspace."""
        n = h_c.shape[0]
        if not self.float8:
            return torch.matmul(h_c, self._w.t(), out=self.z[:n])
        hq, _, sh = fp8_cast.to_fp8(h_c, fp8_cast.E4M3, transposed=False)             # [n16, H]
        torch._scaled_mm(hq, self._wq.t(), scale_a=sh, scale_b=self._sw, out_dtype=self.z.dtype,
                         out=self.z[:hq.shape[0]])
        return self.z[:n]

    def input_grad(self, dz: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [n, H] = dz w (fp8: dz in e5m2, one scale per chunk, as the draft's layers take their gradients)."""
        if not self.float8:
            return torch.matmul(dz, self._w, out=out)
        dq, _, sd = fp8_cast.to_fp8(dz, fp8_cast.E5M2, transposed=False)                # [n16, V]
        full = dq.shape[0] == out.shape[0]
        y = torch._scaled_mm(dq, self._wq_t.t(), scale_a=sd, scale_b=self._sw, out_dtype=out.dtype,
                             out=out if full else None)
        return y if full else out.copy_(y[:out.shape[0]])

    def gathered(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, H] buffers for compacted rows of h and dh (only when some rows are not valid)."""
        if self._h is None:
            self._h = self._w.new_empty(self.chunk, self._w.shape[1])
            self._dh = torch.empty_like(self._h)
        return self._h[:n], self._dh[:n]


def _valid_rows(valid: torch.Tensor | None, N: int, device) -> torch.Tensor:
    """int64 indices of the rows that get logits (all when valid is None). A bool mask costs a host
    sync (the number of rows decides the chunks); indices given by the caller do not."""
    if valid is None:
        return torch.arange(N, device=device)
    if valid.dtype in (torch.int64, torch.int32):
        if valid.dim() != 1 or valid.numel() > N:
            raise ValueError(f"ttt_loss: valid row indices have shape {tuple(valid.shape)}, expected (n <= {N},)")
        return valid.long()
    if valid.dtype != torch.bool:
        raise TypeError(f"ttt_loss: valid must be a bool mask or int64/int32 row indices, got {valid.dtype}")
    if valid.shape != (N,):
        raise ValueError(f"ttt_loss: valid has shape {tuple(valid.shape)}, expected ({N},)")
    return valid.nonzero().squeeze(1)


def _score_rows(h, w, p, rows, ws, out, spec, g=None, dh=None, dw=None, dw_fresh=True, p_rows=None) -> bool:
    """Loss, argmax and α (`out`) of `rows`, chunk by chunk, h's row i reading p's row p_rows[i]; with g (fp32 [N])
    also dh[rows] and dw (overwritten first when dw_fresh) -> whether dw is still unwritten."""
    n_rows = rows.numel()
    p_of = rows if p_rows is None else p_rows[rows]
    dense = n_rows == h.shape[0]   # all rows valid: plain slices, no gather / scatter
    for a in range(0, n_rows, ws.chunk):
        b = min(a + ws.chunk, n_rows)
        r = rows[a:b]
        if dense:
            h_c = h[a:b]
        else:
            h_buf, dh_buf = ws.gathered(b - a)
            h_c = torch.index_select(h, 0, r, out=h_buf)
        z = ws.logits(h_c)
        _row_kernel(z, p, r, p_of[a:b], g, out, spec)
        if g is None:
            continue
        if dh is not None and dense:
            ws.input_grad(z, dh[a:b])
        elif dh is not None:
            dh.index_copy_(0, r, ws.input_grad(z, dh_buf))
        if dw is not None:
            if dw_fresh:
                torch.matmul(z.t(), h_c, out=dw)
                dw_fresh = False
            else:
                dw.addmm_(z.t(), h_c)
    return dw_fresh


def _check(h, w, p, p_rows=None) -> torch.Tensor:
    N, H = h.shape
    rows_ok = p.shape[0] == N if p_rows is None else (p_rows.shape == (N,) and p_rows.dtype == torch.int64)
    if w.dim() != 2 or w.shape[1] != H or p.dim() != 2 or p.shape[1] != w.shape[0] or not rows_ok or h.dtype != w.dtype:
        rows = "" if p_rows is None else f", p_rows {tuple(p_rows.shape)} {p_rows.dtype} (expected ({N},) int64)"
        raise ValueError(f"ttt_loss: bad shapes/dtypes h {tuple(h.shape)} {h.dtype}, "
                         f"w {tuple(w.shape)} {w.dtype}, p {tuple(p.shape)}{rows}")
    return p if p.stride(1) == 1 else p.contiguous()


def _spec(loss: str, temperature: float, eta: float) -> tuple[int, float, float]:
    """(LOSS index, 1/τ, eta) for the kernel; ValueError for an unknown loss or τ <= 0."""
    return loss_index(loss, temperature), 1.0 / float(temperature), float(eta)


def _outputs(N: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """loss 0, argmax -1 and α 0: what rows that are not valid keep."""
    zero = torch.zeros(N, dtype=torch.float32, device=device)
    return zero, torch.full((N,), -1, dtype=torch.int64, device=device), zero.clone()


def _grad_buffer(t: torch.Tensor, needed: bool, dense: bool):
    if not needed:
        return None
    return torch.empty_like(t) if dense else torch.zeros_like(t)


class TTTLossFunction(torch.autograd.Function):
    """One step for any upstream gradient: forward stores nothing beyond its inputs, backward
    recomputes the logits (dw = Σ_i g_i dz_iᵀ h_i cannot be rescaled after the sum; 4 GEMMs a step)."""

    @staticmethod
    def forward(ctx, h, w, p, valid, chunk, spec):
        p = _check(h, w, p)
        h, w = h.contiguous(), w.contiguous()
        rows = _valid_rows(valid, h.shape[0], h.device)
        out = _outputs(h.shape[0], h.device)
        if rows.numel():
            ws = _Workspace(w, chunk, rows.numel())
            _score_rows(h, w, p, rows, ws, out, spec)
        ctx.save_for_backward(h, w, p, rows)
        ctx.chunk, ctx.spec = chunk, spec
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, dloss, _dargmax, _dalpha):
        h, w, p, rows = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        dh = _grad_buffer(h, need_h, rows.numel() == h.shape[0])
        dw = _grad_buffer(w, need_w, True)
        if rows.numel() == 0:
            dh, dw = [t.zero_() if t is not None else None for t in (dh, dw)]
        else:
            ws = _Workspace(w, ctx.chunk, rows.numel())
            g = dloss.float().contiguous()
            _score_rows(h, w, p, rows, ws, _outputs(h.shape[0], h.device), ctx.spec, g=g, dh=dh, dw=dw)
        return dh, dw, None, None, None, None


def ttt_loss(h: torch.Tensor, w: torch.Tensor, p: torch.Tensor, valid: torch.Tensor | None = None,
             chunk: int | None = None, *, loss: str = "kl", temperature: float = 1.0, eta: float = 3.0,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused `kernels.reference.ttt_loss` (same arguments and outputs), differentiable in h, w;
    `valid` may also be row indices; `chunk` rows per chunk (default: 512 MiB of logits)."""
    return TTTLossFunction.apply(h, w, p, valid, chunk, _spec(loss, temperature, eta))


class TTTLossStepsFunction(torch.autograd.Function):
    """K steps with known weights: gradients computed in forward (3 GEMMs a step), backward scales them."""

    @staticmethod
    def forward(ctx, w, meta, *hs):
        ps, p_rows, valids, weights, chunk, grad_mode, float8, spec = meta
        # needs_input_grad ignores torch.no_grad(): grad_mode comes from the caller.
        need_w = grad_mode and ctx.needs_input_grad[0]
        need_h = [grad_mode and n for n in ctx.needs_input_grad[2:]]
        grads = need_w or any(need_h)
        rows = [_valid_rows(v, h.shape[0], h.device) for h, v in zip(hs, valids)]
        ws = _Workspace(w, chunk, max([r.numel() for r in rows] + [1]), float8)
        dw = torch.zeros_like(w) if need_w else None
        dw_fresh, total = True, 0.0
        losses, argmaxes, alphas, dhs = ([None] * len(hs) for _ in range(4))
        # last step first: the bf16 dw accumulator takes the largest terms (0.8^k) last, as autograd's order does
        for k in reversed(range(len(hs))):
            h, p, r = hs[k], ps[k], rows[k]
            out = _outputs(h.shape[0], h.device)
            dh = _grad_buffer(h, need_h[k], r.numel() == h.shape[0])
            g = torch.as_tensor(weights[k], dtype=torch.float32, device=h.device).expand(h.shape[0]).contiguous()
            if r.numel():
                dw_fresh = _score_rows(h, w, p, r, ws, out, spec, g=g if grads else None,
                                       dh=dh, dw=dw, dw_fresh=dw_fresh, p_rows=p_rows[k])
            elif dh is not None:
                dh.zero_()
            total = total + (out[0] * g).sum()
            (losses[k], argmaxes[k], alphas[k]), dhs[k] = out, dh
        ctx.dw, ctx.dhs = dw, dhs
        ctx.mark_non_differentiable(*losses, *argmaxes, *alphas)
        total = torch.as_tensor(total, dtype=torch.float32, device=w.device)
        return (total, *losses, *argmaxes, *alphas)

    @staticmethod
    def backward(ctx, dtotal, *_):
        # Drop ctx's references so that autograd can adopt the buffers as .grad without a copy.
        dw, dhs = ctx.dw, ctx.dhs
        ctx.dw = ctx.dhs = None
        # Always scale rather than test dtotal == 1, a host sync in every training step.
        for t in [dw, *dhs]:
            if t is not None:
                t.mul_(dtotal.to(t.dtype))
        return (dw, None, *dhs)


def ttt_loss_steps(hs: Sequence[torch.Tensor], w: torch.Tensor, ps: Sequence[torch.Tensor],
                   valids: Sequence[torch.Tensor | None] | None = None,
                   weights: Sequence[float | torch.Tensor] | None = None, chunk: int | None = None,
                   float8: bool = False, p_rows: Sequence[torch.Tensor | None] | None = None, *,
                   loss: str = "kl", temperature: float = 1.0, eta: float = 3.0,
                   ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """All K TTT steps at once: `kernels.reference.ttt_loss_steps`'s contract, plus `chunk` and `float8` (the logits and
    dh GEMMs in scaled fp8 where gradients are computed; V and H multiples of 16); docs/kernels.md."""
    spec = _spec(loss, temperature, eta)
    K = len(hs)
    valids = [None] * K if valids is None else list(valids)
    weights = [1.0] * K if weights is None else list(weights)
    p_rows = [None] * K if p_rows is None else list(p_rows)
    if not (len(ps) == len(valids) == len(weights) == len(p_rows) == K):
        raise ValueError("ttt_loss_steps: hs, ps, valids, weights and p_rows need one entry per step")
    ps = [_check(h, w, p, r) for h, p, r in zip(hs, ps, p_rows)]
    hs = [h.contiguous() for h in hs]
    if float8 and (w.shape[0] % 16 or w.shape[1] % 16):
        raise ValueError(f"ttt_loss_steps: float8 needs V and H multiples of 16, w is {tuple(w.shape)}")
    grad_mode = torch.is_grad_enabled()
    meta = (ps, p_rows, valids, weights, chunk, grad_mode, float8 and grad_mode, spec)
    outs = TTTLossStepsFunction.apply(w.contiguous(), meta, *hs)
    return outs[0], list(outs[1:1 + K]), list(outs[1 + K:1 + 2 * K]), list(outs[1 + 2 * K:])
