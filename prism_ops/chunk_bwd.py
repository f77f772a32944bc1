"""
The chunk backward of the PRISM recurrence, derived by hand (the algebra and the decay
gradients are in _bwd_local's comments; tests/test_kernel.py checks every gradient against
autograd through the float64 token-by-token recurrence). Per chunk, from the forward's G, Tm
and U (chunk_fwd.py), with S0 = h[n] the entering state and dS = dh[n] the gradient of the
leaving state:
    dU  = scale (Gam * tril(Q K^T))^T dO + diag(exp(G_C - G)) K dS
    dS0 = exp(G_C) dS + scale (diag(exp G) Q)^T dO - W^T dU          (reverse over the chunks)
    dR  = Tm^T dU;  dA = -strict(dR U^T);  dV = b dR;  dE_l = -diag(b) strict(dR Ve_l^T)
then dq, dk, dbeta and dg, dg as a "box sum" over the gated matrices (no cancellation).

_bwd launches (grid in brackets; NC chunks, NV value blocks, NK key blocks, N sequences, H heads):
    _fwd_w [NC, H] -> W again (from Tm)
    _bwd_dv_local [NV, NC, H] -> scale P^T dO   _bwd_state [NV, N*H] -> dh (reverse), dU, dS0
    _bwd_rows [NC, H, L-1] -> dke, dve and float32 partials of dq, dk, dbeta, dg
                              (one injected row per program)
    _fwd_rows [NV, NC, H] -> R again (L > 1)   _fwd_state (RECOMPUTE) [NV, N*H] -> h again, from U
    _bwd_local [NC, H] -> dq, dk, dv, dbeta, dg (GDN's chunk-local terms + the partials), or with
        K in blocks (launch_config's local_bk < K) _bwd_local_cc [NC, H] -> dv, dbeta, dg and
        _bwd_local_dqk [NK, NC, H] -> dq, dk
The sequential passes do the same work at every L (R comes precomputed; the backward state
pass never sees the rows). The injected rows' backward has programs of its own because holding
their terms and GDN's in one program spilled registers in proportion to L. Layouts: chunk_fwd.py.
"""
import torch
import triton
import triton.language as tl

from .chunk_fwd import _fwd_rows, _fwd_state, _fwd_w
from .tiles import _chunk_coords, _decay_masks, _dot, _empty, _pid_split, _ptrs, _seq_coords, _setup, _tile, _tile_t

@triton.jit(do_not_specialize=["T"])
def _bwd_dv_local(q, k, gc, do, du, scale, cu_seqlens, chunk_indices, T, H: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  F32: tl.constexpr, DT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # the output's direct pull on U: dU_local = scale (Gam * tril(Q K^T))^T dO
    i_v, i_c = _pid_split((V + BV - 1) // BV)
    i_h = tl.program_id(1)
    t0, nt, ch = _chunk_coords(i_c, i_h, H, cu_seqlens, chunk_indices, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    b_gc = tl.load(gc + ch * BT + o_t)
    _, gam_c = _decay_masks(b_gc, BT)
    p_q, m_k = _tile(q, (t0 * H + i_h) * K, H * K, nt, 0, K, BT, BK)
    p_k = _ptrs(k, (t0 * H + i_h) * K, H * K, 0, BT, BK)
    p_do, m_v = _tile(do, (t0 * H + i_h) * V, H * V, nt, i_v * BV, V, BT, BV)
    b_q = tl.load(p_q, mask=m_k, other=0.)
    b_k = tl.load(p_k, mask=m_k, other=0.)
    b_do = tl.load(p_do, mask=m_v, other=0.)
    b_P = _dot(b_q, tl.trans(b_k), F32, DT) * gam_c * scale
    b_du = _dot(tl.trans(b_P), b_do, F32, DT)
    p_du = _ptrs(du, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
    tl.store(p_du, b_du.to(p_du.dtype.element_ty), mask=m_v)


@triton.jit(do_not_specialize=["T"])
def _bwd_state(q, k, w, gc, do, du, dh, dht, dh0, scale, cu_seqlens, chunk_offsets, T, H: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               F32: tl.constexpr, DT: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
               IS_VARLEN: tl.constexpr):
    # reverse over chunks. dS = grad of the state leaving chunk n. Per chunk:
    #   dU  = dU_local + diag(exp(G_C - G)) K dS                      (stored over dU_local)
    #   dS0 = exp(G_C) dS + scale (diag(exp G) Q)^T dO - W^T dU          (W^T dU = K^T diag(b e^G) Tm^T dU)
    i_v, i_nh = _pid_split((V + BV - 1) // BV)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, boc = _seq_coords(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    s_off = i_nh.to(tl.int64) * K * V
    if HAS_DHT:
        p_dht, m_h = _tile(dht, s_off, V, K, i_v * BV, V, BK, BV)
        b_dh = tl.load(p_dht, mask=m_h, other=0.).to(tl.float32)
    else:
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    for i_t in range(tl.cdiv(eos - bos, BT) - 1, -1, -1):
        t0 = bos + i_t * BT
        nt = (eos - t0).to(tl.int32)      # valid rows of the chunk (masks stay 32-bit)
        ch = (boc + i_t) * H + i_h
        p_dh, m_h = _tile(dh, ch * K * V, V, K, i_v * BV, V, BK, BV)
        tl.store(p_dh, b_dh.to(p_dh.dtype.element_ty), mask=m_h)
        b_gc = tl.load(gc + ch * BT + o_t)
        b_gl = tl.load(gc + ch * BT + BT - 1)
        p_qT, m_kT = _tile_t(q, (t0 * H + i_h) * K, H * K, nt, K, BK, BT)
        p_wT, m_wT = _tile_t(w, (t0 * H + i_h) * K, H * K, nt, K, BK, BT)
        p_k, m_k = _tile(k, (t0 * H + i_h) * K, H * K, nt, 0, K, BT, BK)
        p_do, m_v = _tile(do, (t0 * H + i_h) * V, H * V, nt, i_v * BV, V, BT, BV)
        p_du = _ptrs(du, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        b_qT = tl.load(p_qT, mask=m_kT, other=0.)
        b_wT = tl.load(p_wT, mask=m_wT, other=0.)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_do = tl.load(p_do, mask=m_v, other=0.)
        b_du = tl.load(p_du, mask=m_v, other=0.).to(tl.float32)
        b_du += _dot(b_k, b_dh, F32, DT) * tl.exp(b_gl - b_gc)[:, None]
        tl.store(p_du, b_du.to(p_du.dtype.element_ty), mask=m_v)
        b_dos = b_do.to(tl.float32) * (scale * tl.exp(b_gc))[:, None]
        b_dh = b_dh * tl.exp(b_gl) + _dot(b_qT, b_dos, F32, DT) - _dot(b_wT, b_du, F32, DT)
    if STORE_DH0:
        p_dh0, m_h = _tile(dh0, s_off, V, K, i_v * BV, V, BK, BV)
        tl.store(p_dh0, b_dh, mask=m_h)


@triton.jit(do_not_specialize=["T"])
def _bwd_local(q, k, v, beta, gc, tinv, h, dh, u, du, do,
               dq, dk, dv, dbeta, dg, dqp, dkp, dbp, dgp, scale, cu_seqlens, chunk_indices, T, H: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, NE: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               F32: tl.constexpr, DT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # Everything chunk-local, given S0 = h[n], dS = dh[n] (grad of the leaving state) and the
    # full dU. Notation: R = diag(b)(V - sum_l E_l Ve_l - diag(e^G) K S0), U = Tm R.
    #   dR = Tm^T dU;  dA = -strict(dR U^T);  dV = b dR;  dE_l = -diag(b) strict(dR Ve_l^T)
    # Decay gradients without cancellation: a gated entry M[t,i] = Gam[t,i] X[t,i] (i < t) depends
    # on g_r for i < r <= t, so dg_r += sum_{t >= r > i} dM*M ("box sum" of D = sum of dM*M over
    # all gated matrices, diagonal excluded). Terms scaled by exp(G_t) (absolute in-chunk decay)
    # go to dG_t, and dg gets their reverse cumsum. Writing dg as rowsum - colsum of D instead
    # would cancel O(1) diagonal terms in float32 and drown the tiny true dg of fast decays.
    # Register budget: only dq, dk ([C, K] float32) and two C x C accumulators live across the
    # value loop; row sums such as k_i . (dS^T u_i) are taken as sum_v u_iv (K dS)_iv instead.
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, nt, ch = _chunk_coords(i_c, i_h, H, cu_seqlens, chunk_indices, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    m_t = o_t < nt
    m_s = o_t[:, None] > o_t[None, :]
    m_c = o_t[:, None] >= o_t[None, :]
    last = o_t == BT - 1
    b_gc = tl.load(gc + ch * BT + o_t)
    b_gl = tl.load(gc + ch * BT + BT - 1)
    e_g = tl.exp(b_gc)
    e_end = tl.exp(b_gl - b_gc)
    b_beta = tl.load(beta + t0 * H + i_h + o_t * H, mask=m_t, other=0.).to(tl.float32)
    p_q, m_k = _tile(q, (t0 * H + i_h) * K, H * K, nt, 0, K, BT, BK)
    p_k = _ptrs(k, (t0 * H + i_h) * K, H * K, 0, BT, BK)
    p_T = _ptrs(tinv, ch * BT * BT, BT, 0, BT, BT)
    b_q = tl.load(p_q, mask=m_k, other=0.)
    b_k = tl.load(p_k, mask=m_k, other=0.)
    b_Tt = tl.trans(tl.load(p_T))
    s_dk = -b_beta * e_g                               # row scale of dR S0^T in dk

    b_dA = tl.zeros([BT, BT], dtype=tl.float32)      # dR U^T
    b_dP = tl.zeros([BT, BT], dtype=tl.float32)      # dO U^T
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)      # dO S0^T (row-scaled after the loop)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)      # -b e^G dR S0^T + e^{G_C - G} U dS^T
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dgc = tl.zeros([BT], dtype=tl.float32)          # d/dG_t of the exp(G_t)-scaled terms
    b_x = tl.zeros([BT], dtype=tl.float32)            # k_i . (dS u_i)
    b_sc = tl.zeros([BV], dtype=tl.float32)          # <dS, S0> partial sums
    # the injected rows' dk and dbeta parts from _bwd_rows (dq's comes at the end: dq is rescaled
    # after the value loop); adding them here, where the accumulators are live anyway, spills least
    for l in tl.static_range(NE):
        p_dkp = _ptrs(dkp, ((t0 * H + i_h) * NE + l) * K, H * NE * K, 0, BT, BK)
        b_dk += tl.load(p_dkp, mask=m_k, other=0.)
        b_db += tl.load(dbp + (t0 * H + i_h) * NE + l + o_t * (H * NE), mask=m_t, other=0.)
    for i_v in range(tl.cdiv(V, BV)):
        p_du, m_v = _tile(du, (t0 * H + i_h) * V, H * V, nt, i_v * BV, V, BT, BV)
        p_u = _ptrs(u, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        p_do = _ptrs(do, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        p_v = _ptrs(v, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        p_h, m_h = _tile(h, ch * K * V, V, K, i_v * BV, V, BK, BV)
        p_dh = _ptrs(dh, ch * K * V, V, i_v * BV, BK, BV)
        b_du = tl.load(p_du, mask=m_v, other=0.)
        b_u = tl.load(p_u, mask=m_v, other=0.)
        b_do = tl.load(p_do, mask=m_v, other=0.)
        b_h = tl.load(p_h, mask=m_h, other=0.)
        b_dh = tl.load(p_dh, mask=m_h, other=0.)
        b_dr = _dot(b_Tt, b_du, F32, DT)
        p_dv = _ptrs(dv, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        tl.store(p_dv, (b_dr * b_beta[:, None]).to(p_dv.dtype.element_ty), mask=m_v)
        b_ks = _dot(b_k, b_h, F32, DT)
        b_db += tl.sum(b_dr * (tl.load(p_v, mask=m_v, other=0.).to(tl.float32) - e_g[:, None] * b_ks), axis=1)
        b_dgc += tl.sum(b_dr * b_ks, axis=1) * s_dk
        b_dgc += tl.sum(b_do.to(tl.float32) * _dot(b_q, b_h, F32, DT), axis=1) * (scale * e_g)
        b_x += tl.sum(b_u.to(tl.float32) * _dot(b_k, b_dh, F32, DT), axis=1)
        b_dA += _dot(b_dr, tl.trans(b_u), F32, DT)
        b_dP += _dot(b_do, tl.trans(b_u), F32, DT)
        b_dq += _dot(b_do, tl.trans(b_h), F32, DT)
        b_dk += _dot(b_dr * s_dk[:, None], tl.trans(b_h), F32, DT)
        b_dk += _dot(b_u.to(tl.float32) * e_end[:, None], tl.trans(b_dh), F32, DT)
        b_sc += tl.sum(b_dh.to(tl.float32) * b_h.to(tl.float32), axis=0)
    b_dq = b_dq * (scale * e_g)[:, None]
    gam_s, gam_c = _decay_masks(b_gc, BT)
    # exp(G_C - G_i) = Gam[C-1, i]: the state terms are one more row of D at t = C-1
    b_Ds = tl.where(last[:, None], (e_end * b_x)[None, :], 0.)
    b_dgc += tl.where(last, tl.exp(b_gl) * tl.sum(b_sc), 0.)
    # A = diag(b) Gam * strict(K K^T)
    b_Araw = _dot(b_k, tl.trans(b_k), F32, DT) * gam_s
    b_dA = -tl.where(m_s, b_dA, 0.)
    b_db += tl.sum(b_dA * b_Araw, axis=1)
    b_Ds += b_dA * b_Araw * b_beta[:, None]
    b_M = b_dA * gam_s * b_beta[:, None]
    b_dk += _dot(b_M, b_k, F32, DT) + _dot(tl.trans(b_M), b_k, F32, DT)
    # P = scale Gam * tril(Q K^T)
    b_dPs = tl.where(m_c, b_dP, 0.) * gam_c * scale
    b_Ds += b_dPs * _dot(b_q, tl.trans(b_k), F32, DT)
    b_dq += _dot(b_dPs, b_k, F32, DT)
    b_dk += _dot(tl.trans(b_dPs), b_q, F32, DT)

    # dg_r = sum_{s >= r} dG_s  +  sum_{t >= r} sum_{i < r} D[t, i]
    b_dg = tl.sum(tl.where(o_t[None, :] >= o_t[:, None], b_dgc[None, :], 0.), axis=1)
    # as Y[r, i] = sum_{t >= r} D[t, i] (an exact 0/1 matmul), then sum_{i < r}: no subtraction
    # anywhere, so O(1) terms that only reach padded positions never cancel into real ones
    b_Ds = tl.where(m_s, b_Ds, 0.)
    b_Y = tl.dot(tl.where(o_t[None, :] >= o_t[:, None], 1., 0.), b_Ds, input_precision="tf32x3")
    b_dg += tl.sum(tl.where(o_t[None, :] < o_t[:, None], b_Y, 0.), axis=1)
    for l in tl.static_range(NE):
        p_dqp = _ptrs(dqp, ((t0 * H + i_h) * NE + l) * K, H * NE * K, 0, BT, BK)
        b_dq += tl.load(p_dqp, mask=m_k, other=0.)
        b_dg += tl.load(dgp + (t0 * H + i_h) * NE + l + o_t * (H * NE), mask=m_t, other=0.)
    p_dq = _ptrs(dq, (t0 * H + i_h) * K, H * K, 0, BT, BK)
    p_dk = _ptrs(dk, (t0 * H + i_h) * K, H * K, 0, BT, BK)
    tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), mask=m_k)
    tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), mask=m_k)
    tl.store(dbeta + t0 * H + i_h + o_t * H, b_db, mask=m_t)
    tl.store(dg + t0 * H + i_h + o_t * H, b_dg, mask=m_t)


@triton.jit(do_not_specialize=["T"])
def _bwd_local_cc(q, k, v, beta, gc, tinv, h, dh, u, du, do, dv, dbeta, dg, dbp, dgp, mm, scale,
                  cu_seqlens, chunk_indices, T, H: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, NE: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  F32: tl.constexpr, DT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # _bwd_local with K in blocks of BK < K, first half: the per-token and C x C terms (dv, dbeta
    # and dg complete), every contraction over K summed block by block, so no [C, K] accumulator
    # lives anywhere. M = diag(b) Gam_s * dA and dPs = scale Gam_c * tril(dO U^T) go to mm for
    # _bwd_local_dqk. Same algebra as _bwd_local (see its comments).
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, nt, ch = _chunk_coords(i_c, i_h, H, cu_seqlens, chunk_indices, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    m_t = o_t < nt
    m_s = o_t[:, None] > o_t[None, :]
    m_c = o_t[:, None] >= o_t[None, :]
    last = o_t == BT - 1
    b_gc = tl.load(gc + ch * BT + o_t)
    b_gl = tl.load(gc + ch * BT + BT - 1)
    e_g = tl.exp(b_gc)
    e_end = tl.exp(b_gl - b_gc)
    b_beta = tl.load(beta + t0 * H + i_h + o_t * H, mask=m_t, other=0.).to(tl.float32)
    p_T = _ptrs(tinv, ch * BT * BT, BT, 0, BT, BT)
    b_Tt = tl.trans(tl.load(p_T))
    s_dk = -b_beta * e_g
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dP = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dgc = tl.zeros([BT], dtype=tl.float32)
    b_x = tl.zeros([BT], dtype=tl.float32)
    b_sc = tl.zeros([BV], dtype=tl.float32)
    for l in tl.static_range(NE):
        b_db += tl.load(dbp + (t0 * H + i_h) * NE + l + o_t * (H * NE), mask=m_t, other=0.)
    for i_v in range(tl.cdiv(V, BV)):
        p_du, m_v = _tile(du, (t0 * H + i_h) * V, H * V, nt, i_v * BV, V, BT, BV)
        p_u = _ptrs(u, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        p_do = _ptrs(do, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        p_v = _ptrs(v, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        b_du = tl.load(p_du, mask=m_v, other=0.)
        b_u = tl.load(p_u, mask=m_v, other=0.)
        b_do = tl.load(p_do, mask=m_v, other=0.)
        b_dr = _dot(b_Tt, b_du, F32, DT)
        p_dv = _ptrs(dv, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        tl.store(p_dv, (b_dr * b_beta[:, None]).to(p_dv.dtype.element_ty), mask=m_v)
        b_ks = tl.zeros([BT, BV], dtype=tl.float32)    # K S0, Q S0, K dS over this value block
        b_qh = tl.zeros([BT, BV], dtype=tl.float32)
        b_kdh = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            p_k, m_k = _tile(k, (t0 * H + i_h) * K, H * K, nt, i_k * BK, K, BT, BK)
            p_q = _ptrs(q, (t0 * H + i_h) * K, H * K, i_k * BK, BT, BK)
            p_h, m_h = _tile(h, ch * K * V + i_k * BK * V, V, K - i_k * BK, i_v * BV, V, BK, BV)
            p_dh = _ptrs(dh, ch * K * V + i_k * BK * V, V, i_v * BV, BK, BV)
            b_k = tl.load(p_k, mask=m_k, other=0.)
            b_q = tl.load(p_q, mask=m_k, other=0.)
            b_h = tl.load(p_h, mask=m_h, other=0.)
            b_dh = tl.load(p_dh, mask=m_h, other=0.)
            b_ks += _dot(b_k, b_h, F32, DT)
            b_qh += _dot(b_q, b_h, F32, DT)
            b_kdh += _dot(b_k, b_dh, F32, DT)
            b_sc += tl.sum(b_dh.to(tl.float32) * b_h.to(tl.float32), axis=0)
        b_db += tl.sum(b_dr * (tl.load(p_v, mask=m_v, other=0.).to(tl.float32) - e_g[:, None] * b_ks), axis=1)
        b_dgc += tl.sum(b_dr * b_ks, axis=1) * s_dk
        b_dgc += tl.sum(b_do.to(tl.float32) * b_qh, axis=1) * (scale * e_g)
        b_x += tl.sum(b_u.to(tl.float32) * b_kdh, axis=1)
        b_dA += _dot(b_dr, tl.trans(b_u), F32, DT)
        b_dP += _dot(b_do, tl.trans(b_u), F32, DT)
    gam_s, gam_c = _decay_masks(b_gc, BT)
    b_Ds = tl.where(last[:, None], (e_end * b_x)[None, :], 0.)
    b_dgc += tl.where(last, tl.exp(b_gl) * tl.sum(b_sc), 0.)
    b_Araw = tl.zeros([BT, BT], dtype=tl.float32)      # K K^T and Q K^T, block by block
    b_QK = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        p_k, m_k = _tile(k, (t0 * H + i_h) * K, H * K, nt, i_k * BK, K, BT, BK)
        p_q = _ptrs(q, (t0 * H + i_h) * K, H * K, i_k * BK, BT, BK)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_q = tl.load(p_q, mask=m_k, other=0.)
        b_Araw += _dot(b_k, tl.trans(b_k), F32, DT)
        b_QK += _dot(b_q, tl.trans(b_k), F32, DT)
    b_Araw = b_Araw * gam_s
    b_dA = -tl.where(m_s, b_dA, 0.)
    b_db += tl.sum(b_dA * b_Araw, axis=1)
    b_Ds += b_dA * b_Araw * b_beta[:, None]
    b_M = b_dA * gam_s * b_beta[:, None]
    b_dPs = tl.where(m_c, b_dP, 0.) * gam_c * scale
    b_Ds += b_dPs * b_QK
    b_dg = tl.sum(tl.where(o_t[None, :] >= o_t[:, None], b_dgc[None, :], 0.), axis=1)
    b_Ds = tl.where(m_s, b_Ds, 0.)
    b_Y = tl.dot(tl.where(o_t[None, :] >= o_t[:, None], 1., 0.), b_Ds, input_precision="tf32x3")
    b_dg += tl.sum(tl.where(o_t[None, :] < o_t[:, None], b_Y, 0.), axis=1)
    for l in tl.static_range(NE):
        b_dg += tl.load(dgp + (t0 * H + i_h) * NE + l + o_t * (H * NE), mask=m_t, other=0.)
    p_m = _ptrs(mm, ch * 2 * BT * BT, BT, 0, BT, BT)
    tl.store(p_m, b_M.to(p_m.dtype.element_ty))
    tl.store(p_m + BT * BT, b_dPs.to(p_m.dtype.element_ty))
    tl.store(dbeta + t0 * H + i_h + o_t * H, b_db, mask=m_t)
    tl.store(dg + t0 * H + i_h + o_t * H, b_dg, mask=m_t)


@triton.jit(do_not_specialize=["T"])
def _bwd_local_dqk(q, k, beta, gc, tinv, h, dh, u, du, do, mm, dq, dk, dqp, dkp, scale,
                   cu_seqlens, chunk_indices, T, H: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, NE: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   F32: tl.constexpr, DT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # second half: dq, dk for key block i_k (grid [NK, NC, H], NK and NC on axis 0), [C, BK] accumulators only
    i_k, i_c = _pid_split((K + BK - 1) // BK)
    i_h = tl.program_id(1)
    t0, nt, ch = _chunk_coords(i_c, i_h, H, cu_seqlens, chunk_indices, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    m_t = o_t < nt
    b_gc = tl.load(gc + ch * BT + o_t)
    b_gl = tl.load(gc + ch * BT + BT - 1)
    e_g = tl.exp(b_gc)
    e_end = tl.exp(b_gl - b_gc)
    b_beta = tl.load(beta + t0 * H + i_h + o_t * H, mask=m_t, other=0.).to(tl.float32)
    p_T = _ptrs(tinv, ch * BT * BT, BT, 0, BT, BT)
    b_Tt = tl.trans(tl.load(p_T))
    s_dk = -b_beta * e_g
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    p_k, m_k = _tile(k, (t0 * H + i_h) * K, H * K, nt, i_k * BK, K, BT, BK)
    for l in tl.static_range(NE):
        p_dkp = _ptrs(dkp, ((t0 * H + i_h) * NE + l) * K, H * NE * K, i_k * BK, BT, BK)
        b_dk += tl.load(p_dkp, mask=m_k, other=0.)
    for i_v in range(tl.cdiv(V, BV)):
        p_du, m_v = _tile(du, (t0 * H + i_h) * V, H * V, nt, i_v * BV, V, BT, BV)
        p_u = _ptrs(u, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        p_do = _ptrs(do, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        p_h, m_h = _tile(h, ch * K * V + i_k * BK * V, V, K - i_k * BK, i_v * BV, V, BK, BV)
        p_dh = _ptrs(dh, ch * K * V + i_k * BK * V, V, i_v * BV, BK, BV)
        b_du = tl.load(p_du, mask=m_v, other=0.)
        b_u = tl.load(p_u, mask=m_v, other=0.)
        b_do = tl.load(p_do, mask=m_v, other=0.)
        b_h = tl.load(p_h, mask=m_h, other=0.)
        b_dh = tl.load(p_dh, mask=m_h, other=0.)
        b_dr = _dot(b_Tt, b_du, F32, DT)
        b_dq += _dot(b_do, tl.trans(b_h), F32, DT)
        b_dk += _dot(b_dr * s_dk[:, None], tl.trans(b_h), F32, DT)
        b_dk += _dot(b_u.to(tl.float32) * e_end[:, None], tl.trans(b_dh), F32, DT)
    b_dq = b_dq * (scale * e_g)[:, None]
    p_m = _ptrs(mm, ch * 2 * BT * BT, BT, 0, BT, BT)
    b_M = tl.load(p_m)
    b_dPs = tl.load(p_m + BT * BT)
    b_k = tl.load(p_k, mask=m_k, other=0.)
    p_q = _ptrs(q, (t0 * H + i_h) * K, H * K, i_k * BK, BT, BK)
    b_q = tl.load(p_q, mask=m_k, other=0.)
    b_dk += _dot(b_M, b_k, F32, DT) + _dot(tl.trans(b_M), b_k, F32, DT) + _dot(tl.trans(b_dPs), b_q, F32, DT)
    b_dq += _dot(b_dPs, b_k, F32, DT)
    for l in tl.static_range(NE):
        p_dqp = _ptrs(dqp, ((t0 * H + i_h) * NE + l) * K, H * NE * K, i_k * BK, BT, BK)
        b_dq += tl.load(p_dqp, mask=m_k, other=0.)
    p_dq = _ptrs(dq, (t0 * H + i_h) * K, H * K, i_k * BK, BT, BK)
    p_dk = _ptrs(dk, (t0 * H + i_h) * K, H * K, i_k * BK, BT, BK)
    tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), mask=m_k)
    tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), mask=m_k)


@triton.jit(do_not_specialize=["T"])
def _bwd_rows(q, k, ke, ve, beta, gc, tinv, dh, du, do, dke, dve, dqp, dkp, dbp, dgp, scale,
              cu_seqlens, chunk_indices, T, H: tl.constexpr,
              K: tl.constexpr, V: tl.constexpr, NE: tl.constexpr,
              BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              F32: tl.constexpr, DT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # The injected rows: E_l in the solve, P_l in the output, (Ke_l, Ve_l) in the state; one row
    # l per program (grid [NC, H, NE]) so that no program holds the row terms and GDN's at once
    # (register spills). dke, dve are final; the dq, dk, dbeta and dg contributions go to float32
    # partials that _bwd_local adds. dg's part is this row's own box sum (the box sum is linear).
    i_c, i_h, l = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, nt, ch = _chunk_coords(i_c, i_h, H, cu_seqlens, chunk_indices, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    m_t = o_t < nt
    m_s = o_t[:, None] > o_t[None, :]
    m_c = o_t[:, None] >= o_t[None, :]
    last = o_t == BT - 1
    b_gc = tl.load(gc + ch * BT + o_t)
    b_gl = tl.load(gc + ch * BT + BT - 1)
    e_end = tl.exp(b_gl - b_gc)
    b_beta = tl.load(beta + t0 * H + i_h + o_t * H, mask=m_t, other=0.).to(tl.float32)
    p_q, m_k = _tile(q, (t0 * H + i_h) * K, H * K, nt, 0, K, BT, BK)
    p_k = _ptrs(k, (t0 * H + i_h) * K, H * K, 0, BT, BK)
    p_T = _ptrs(tinv, ch * BT * BT, BT, 0, BT, BT)
    p_ke = _ptrs(ke, ((t0 * H + i_h) * NE + l) * K, H * NE * K, 0, BT, BK)
    b_q = tl.load(p_q, mask=m_k, other=0.)
    b_k = tl.load(p_k, mask=m_k, other=0.)
    b_Tt = tl.trans(tl.load(p_T))
    b_ke = tl.load(p_ke, mask=m_k, other=0.)
    gam_s, gam_c = _decay_masks(b_gc, BT)
    b_E = _dot(b_k, tl.trans(b_ke), F32, DT) * gam_s
    b_Pl = _dot(b_q, tl.trans(b_ke), F32, DT) * gam_c * scale
    b_G = tl.zeros([BT, BT], dtype=tl.float32)    # dR Ve^T
    b_dPl = tl.zeros([BT, BT], dtype=tl.float32)  # dO Ve^T
    b_dke = tl.zeros([BT, BK], dtype=tl.float32)  # e^{G_C - G} Ve dS^T, then the rest
    b_xl = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        p_du, m_v = _tile(du, (t0 * H + i_h) * V, H * V, nt, i_v * BV, V, BT, BV)
        p_do = _ptrs(do, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        p_dh, m_h = _tile(dh, ch * K * V, V, K, i_v * BV, V, BK, BV)
        p_ve = _ptrs(ve, ((t0 * H + i_h) * NE + l) * V, H * NE * V, i_v * BV, BT, BV)
        b_du = tl.load(p_du, mask=m_v, other=0.)
        b_do = tl.load(p_do, mask=m_v, other=0.)
        b_dh = tl.load(p_dh, mask=m_h, other=0.)
        b_ve = tl.load(p_ve, mask=m_v, other=0.)
        b_dr = _dot(b_Tt, b_du, F32, DT)
        b_G += _dot(b_dr, tl.trans(b_ve), F32, DT)
        b_dPl += _dot(b_do, tl.trans(b_ve), F32, DT)
        # diag(e^{G_C - G}) Ke dh, the decay applied to the float32 product. The decayed keys
        # rounded to bf16 in registers as the dot's operand gave wrong dve and dg at K = 256 with
        # one row (H100, Triton 3.6: up to 27% of a chunk's norm; bench/results/kernel_sweep_before_*)
        b_kdh = _dot(b_ke, b_dh, F32, DT) * e_end[:, None]
        b_xl += tl.sum(b_ve.to(tl.float32) * b_kdh, axis=1)
        b_dke += _dot(b_ve.to(tl.float32) * e_end[:, None], tl.trans(b_dh), F32, DT)
        b_dve = (_dot(tl.trans(b_Pl), b_do, F32, DT) + b_kdh
                 - _dot(tl.trans(b_E), b_dr * b_beta[:, None], F32, DT))
        p_dve = _ptrs(dve, ((t0 * H + i_h) * NE + l) * V, H * NE * V, i_v * BV, BT, BV)
        tl.store(p_dve, b_dve.to(p_dve.dtype.element_ty), mask=m_v)
    b_db = -tl.sum(b_E * b_G, axis=1)
    b_dE = -tl.where(m_s, b_G, 0.) * b_beta[:, None]
    b_Ds = b_dE * b_E
    b_dEs = b_dE * gam_s
    b_dk = _dot(b_dEs, b_ke, F32, DT)
    b_dke += _dot(tl.trans(b_dEs), b_k, F32, DT)
    b_dPl = tl.where(m_c, b_dPl, 0.)
    b_Ds += b_dPl * b_Pl
    b_dPls = b_dPl * gam_c * scale
    b_dq = _dot(b_dPls, b_ke, F32, DT)
    b_dke += _dot(tl.trans(b_dPls), b_q, F32, DT)
    b_Ds += tl.where(last[:, None], b_xl[None, :], 0.)
    b_Ds = tl.where(m_s, b_Ds, 0.)
    b_Y = tl.dot(tl.where(o_t[None, :] >= o_t[:, None], 1., 0.), b_Ds, input_precision="tf32x3")
    b_dg = tl.sum(tl.where(o_t[None, :] < o_t[:, None], b_Y, 0.), axis=1)
    p_dke = _ptrs(dke, ((t0 * H + i_h) * NE + l) * K, H * NE * K, 0, BT, BK)
    tl.store(p_dke, b_dke.to(p_dke.dtype.element_ty), mask=m_k)
    p_dqp = _ptrs(dqp, ((t0 * H + i_h) * NE + l) * K, H * NE * K, 0, BT, BK)
    p_dkp = _ptrs(dkp, ((t0 * H + i_h) * NE + l) * K, H * NE * K, 0, BT, BK)
    tl.store(p_dqp, b_dq, mask=m_k)
    tl.store(p_dkp, b_dk, mask=m_k)
    tl.store(dbp + (t0 * H + i_h) * NE + l + o_t * (H * NE), b_db, mask=m_t)
    tl.store(dgp + (t0 * H + i_h) * NE + l + o_t * (H * NE), b_dg, mask=m_t)


# ----------------------------------------------------------------------------------------------
# host side

def _chunk_states(k, u, gc, ke, ve, h0, meta, cfg, tables, NE):
    """The chunk states h [NC,H,K,V] from the saved U (the forward's state pass minus its writes)."""
    cu, ci, co, N, NC = tables
    B, T, H, K = k.shape
    V = u.shape[-1]
    h = _empty(NC, H, K, V, dtype=k.dtype, device=k.device)
    hr = h
    if NE:   # the rows' state term, a temporary the size of h
        hr = _empty(NC, H, K, V, dtype=k.dtype, device=k.device)
        c = cfg["bwd_r"]
        _fwd_rows[(triton.cdiv(V, c["BV"]) * NC, H)](ke, ve, gc, hr, cu, ci, T, H, NE=NE, **meta, **c)
    c = cfg["bwd_h"]
    _fwd_state[(triton.cdiv(V, c["BV"]) * N * H,)](k, k, u, gc, hr, h, h0, h, cu, co, T, H, NE=NE,
                                                   **meta, HAS_H0=h0 is not None, STORE_HT=False,
                                                   RECOMPUTE=True, **c)
    return h


def _bwd(q, k, v, g, beta, ke, ve, scale, h0, saved, do, dht, cu_seqlens, tables):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NE, meta, cfg, (cu, ci, co, N, NC) = _setup(q, v, ke, cu_seqlens, tables)
    dev, dt = q.device, q.dtype
    gc, tinv, u = saved
    w = _empty(B, T, H, K, dtype=dt, device=dev)
    c = cfg["bwd_w"]
    _fwd_w[(NC, H)](k, beta, gc, tinv, w, cu, ci, T, H, K=K, BT=meta["BT"], BK=meta["BK"], F32=meta["F32"],
                    DT=meta["DT"], IS_VARLEN=meta["IS_VARLEN"], num_warps=c["num_warps"], num_stages=c["num_stages"])
    du = _empty(B, T, H, V, dtype=dt, device=dev)
    dh = _empty(NC, H, K, V, dtype=dt, device=dev)
    dh0 = _empty(N, H, K, V, dtype=torch.float32, device=dev) if h0 is not None else None
    c = cfg["bwd_dv_local"]
    _bwd_dv_local[(triton.cdiv(V, c["BV"]) * NC, H)](q, k, gc, do, du, scale, cu, ci, T, H, **meta, **c)
    c = cfg["bwd_state"]
    _bwd_state[(triton.cdiv(V, c["BV"]) * N * H,)](q, k, w, gc, do, du, dh, dht, dh0, scale, cu, co, T, H,
                                                   **meta, HAS_DHT=dht is not None,
                                                   STORE_DH0=h0 is not None, **c)
    del w
    dq = _empty(B, T, H, K, dtype=dt, device=dev)
    dk = _empty(B, T, H, K, dtype=dt, device=dev)
    dv = _empty(B, T, H, V, dtype=dt, device=dev)
    dke = _empty(*ke.shape, dtype=dt, device=dev) if NE else None
    dve = _empty(*ve.shape, dtype=dt, device=dev) if NE else None
    dbeta = _empty(B, T, H, dtype=torch.float32, device=dev)
    dg = _empty(B, T, H, dtype=torch.float32, device=dev)
    if NE:  # row terms first, in programs of their own; _bwd_local adds their partials
        dqp = _empty(B, T, H, NE, K, dtype=torch.float32, device=dev)
        dkp = _empty(B, T, H, NE, K, dtype=torch.float32, device=dev)
        dbp = _empty(B, T, H, NE, dtype=torch.float32, device=dev)
        dgp = _empty(B, T, H, NE, dtype=torch.float32, device=dev)
        _bwd_rows[(NC, H, NE)](q, k, ke, ve, beta, gc, tinv, dh, du, do, dke, dve,
                               dqp, dkp, dbp, dgp, scale, cu, ci, T, H, NE=NE, **meta, **cfg["bwd_rows"])
    else:
        dqp = dkp = dbp = dgp = dbeta  # GDN: no partials (NE = 0 never reads them)
    h = _chunk_states(k, u, gc, ke, ve, h0, meta, cfg, (cu, ci, co, N, NC), NE)   # for the local terms only
    if "bwd_local" in cfg:
        _bwd_local[(NC, H)](q, k, v, beta, gc, tinv, h, dh, u, du, do,
                            dq, dk, dv, dbeta, dg, dqp, dkp, dbp, dgp, scale, cu, ci, T, H,
                            NE=NE, **meta, **cfg["bwd_local"])
    else:   # K in blocks: C x C terms first, then dq, dk per key block
        mm = _empty(NC, H, 2, meta["BT"], meta["BT"], dtype=dt, device=dev)
        c = dict(cfg["bwd_local_cc"])
        _bwd_local_cc[(NC, H)](q, k, v, beta, gc, tinv, h, dh, u, du, do, dv, dbeta, dg, dbp, dgp, mm, scale,
                               cu, ci, T, H, NE=NE, **dict(meta, BK=c.pop("BK")), **c)
        c = dict(cfg["bwd_local_dqk"])
        bk = c.pop("BK")
        _bwd_local_dqk[(triton.cdiv(K, bk) * NC, H)](q, k, beta, gc, tinv, h, dh, u, du, do, mm, dq, dk,
                                                     dqp, dkp, scale, cu, ci, T, H, NE=NE, **dict(meta, BK=bk), **c)
    return dq, dk, dv, dg, dbeta, dke, dve, dh0
