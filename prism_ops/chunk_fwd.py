"""
The chunk forward of the PRISM recurrence (prism_kernel.chunk_prism). Per chunk (local
positions t, i; G = in-chunk cumulative log-decay; Gam[t,i] = exp(G_t - G_i)):
    A  = diag(beta) (Gam * strict_tril(K K^T)),   E_l = Gam * strict_tril(K Ke_l^T)
    Tm = (I + A)^-1                                 (forward substitution; in half precision
                                                     16 x 16 diagonal blocks, then merged)
    W  = Tm diag(beta exp(G)) K,   U' = Tm diag(beta) (V - sum_l E_l Ve_l)
    R  = sum_l Ke_l^T diag(exp(G_C - G)) Ve_l       (the rows' own state term: no S0 in it)
    U  = U' - W S0                                  (in the sequential state pass)
    O  = scale [diag(exp G) Q S0 + (Gam * tril(Q K^T)) U + sum_l (Gam * tril(Q Ke_l^T)) Ve_l]
    S' = exp(G_C) S0 + K^T diag(exp(G_C - G)) U + R
Every decay is exp of a difference of in-chunk cumulative log-decays with the later index
first, so it lies in [0, 1]: no overflow for any T and any decay (masked entries are zeroed
before exp). The injected rows write without erasing, so the triangular solve stays C x C.

Kernels (grid in brackets; NC chunks over all sequences, NV value blocks, N sequences, H heads;
NV and the next size launch as one grid axis, NV fastest: _pid_split):
    _fwd_prep [NC, H] -> G, Tm, W, U', R    _fwd_state [NV, N*H] -> h (chunk states), U
    _fwd_out [NV, NC, H] -> O
    _fwd_w [NC, H] -> W again, _fwd_rows [NV, NC, H] -> R again, _fwd_state (RECOMPUTE) -> h
    again from U: the backward's (chunk_bwd.py)
_fwd launches the forward. It keeps G, Tm and U for the backward, not W or h (the largest activation).

Layouts: token tensors [B,T,H,D] (packed: B = 1), rows of one head have stride H*D; ke, ve
[B,T,H,NE,D], stride H*NE*D. Per-chunk buffers are indexed by chunk-head ch = i_c * H + i_h:
gc [NC,H,BT] float32, tinv [NC,H,BT,BT], h and dh [NC,H,K,V]. Every product that can pass
2^31 (token * H * D, ch * K * V) is formed in int64.
"""
import torch
import triton
import triton.language as tl

from .tiles import _chunk_coords, _decay_masks, _dot, _empty, _pid_split, _ptrs, _seq_coords, _setup, _tile, _tile_t

@triton.jit
def _unit_lower_inverse(b_A, BT: tl.constexpr, F32: tl.constexpr):
    # (I + A)^-1 for A [BT, BT] float32, strictly lower triangular.
    # float32 inputs (the reference and debugging path): plain forward substitution, row i =
    # e_i - sum_{j<i} A[i, j] T[j, :], exact float32 FMAs (BT - 1 sequential steps).
    # bf16/fp16 inputs, in two steps:
    # 1. forward substitution inside the 16 x 16 diagonal blocks, all NB blocks at once
    #    ([NB, 16, 16] tensors: 15 steps instead of BT - 1);
    # 2. the blocks merged: with D = (I + diag blocks of A)^-1 and M = D L (L = A below the
    #    diagonal blocks, so M^NB = 0), (I + A)^-1 = (I + M)^-1 D = (I - M + M^2 - ...) D,
    #    NB + 1 tensor-core products. The sum is the block forward substitution written out (no
    #    series truncated). The products are tf32: Tm then feeds bf16/fp16 products, and
    #    tf32x3 would cost ~1 KB/thread of register spills in _fwd_prep on sm_90. The solve was
    #    most of _fwd_prep's time: blocking it took 410 -> 214 us at 8 x 2048, H = 6, K = 128 (H200).
    o_t = tl.arange(0, BT)
    if F32:
        b_T = tl.where(o_t[:, None] == o_t[None, :], 1., 0.)
        for i in range(1, BT):
            a_i = tl.sum(tl.where(o_t[:, None] == i, b_A, 0.), axis=0)
            row = -tl.sum(a_i[:, None] * b_T, axis=0) + tl.where(o_t == i, 1., 0.)
            b_T = tl.where(o_t[:, None] == i, row[None, :], b_T)
        return b_T
    else:
        BB: tl.constexpr = 16 if BT > 16 else BT
        NB: tl.constexpr = BT // BB
        o_r = tl.arange(0, BB)
        o_b = tl.arange(0, NB)
        same = o_b[:, None] == o_b[None, :]
        # [BT, BT] -> [NB, BB, NB, BB] -> [NB, NB, BB, BB]; the diagonal blocks as [NB, BB, BB]
        a4 = tl.permute(tl.reshape(b_A, (NB, BB, NB, BB)), (0, 2, 1, 3))
        a3 = tl.sum(tl.where(same[:, :, None, None], a4, 0.), axis=1)
        row_i = o_r[None, :, None]
        t3 = tl.where(row_i == o_r[None, None, :], 1., 0.) + tl.zeros([NB, BB, BB], dtype=tl.float32)
        for i in range(1, BB):   # row i of each block: e_i - sum_{j<i} A[i, j] T[j, :]
            a_i = tl.sum(tl.where(row_i == i, a3, 0.), axis=1)
            r_i = tl.where(o_r == i, 1., 0.)[None, :] - tl.sum(a_i[:, :, None] * t3, axis=1)
            t3 = tl.where(row_i == i, r_i[:, None, :], t3)
        d4 = tl.where(same[:, :, None, None], t3[:, None, :, :], 0.)
        b_D = tl.reshape(tl.permute(d4, (0, 2, 1, 3)), (BT, BT))
        eye = tl.where(o_t[:, None] == o_t[None, :], 1., 0.)
        b_M = tl.dot(b_D, tl.where(o_t[:, None] // BB > o_t[None, :] // BB, b_A, 0.), input_precision="tf32")
        b_X = eye
        for _ in tl.static_range(NB - 1):   # Horner: X = I - M X, NB - 1 times
            b_X = eye - tl.dot(b_M, b_X, input_precision="tf32")
        return tl.dot(b_X, b_D, input_precision="tf32")


@triton.jit(do_not_specialize=["T"])
def _fwd_prep(k, v, ke, ve, g, beta, gc, tinv, w, u, hr, cu_seqlens, chunk_indices, T, H: tl.constexpr,
              K: tl.constexpr, V: tl.constexpr, NE: tl.constexpr,
              BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              F32: tl.constexpr, DT: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, nt, ch = _chunk_coords(i_c, i_h, H, cu_seqlens, chunk_indices, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    m_t = o_t < nt
    # in-chunk cumulative log-decay; padded tokens have g = 0, so G stays at its last value
    b_g = tl.load(g + t0 * H + i_h + o_t * H, mask=m_t, other=0.).to(tl.float32)
    b_gc = tl.cumsum(b_g, axis=0)
    tl.store(gc + ch * BT + o_t, b_gc)
    b_beta = tl.load(beta + t0 * H + i_h + o_t * H, mask=m_t, other=0.).to(tl.float32)
    p_k, m_k = _tile(k, (t0 * H + i_h) * K, H * K, nt, 0, K, BT, BK)
    b_k = tl.load(p_k, mask=m_k, other=0.)
    gam_s, _ = _decay_masks(b_gc, BT)
    b_A = _dot(b_k, tl.trans(b_k), F32, DT) * gam_s * b_beta[:, None]
    b_T = _unit_lower_inverse(b_A, BT, F32)
    p_T = _ptrs(tinv, ch * BT * BT, BT, 0, BT, BT)
    tl.store(p_T, b_T.to(p_T.dtype.element_ty))
    # W = Tm diag(beta exp(G)) K
    b_w = _dot(b_T, b_k.to(tl.float32) * (b_beta * tl.exp(b_gc))[:, None], F32, DT)
    p_w = _ptrs(w, (t0 * H + i_h) * K, H * K, 0, BT, BK)
    tl.store(p_w, b_w.to(p_w.dtype.element_ty), mask=m_k)
    # U' = Tm diag(beta) (V - sum_l E_l Ve_l); the rows' own state term per chunk,
    # R = sum_l Ke_l^T diag(exp(G_C - G)) Ve_l, does not depend on the state: it is formed here,
    # in parallel over chunks, and the sequential pass only adds it
    b_gl = tl.sum(tl.where(o_t == BT - 1, b_gc, 0.), axis=0)
    e_end = tl.exp(b_gl - b_gc)
    for i_v in range(tl.cdiv(V, BV)):
        p_v, m_v = _tile(v, (t0 * H + i_h) * V, H * V, nt, i_v * BV, V, BT, BV)
        b_acc = tl.load(p_v, mask=m_v, other=0.).to(tl.float32)
        if NE > 0:
            b_r = tl.zeros([BK, BV], dtype=tl.float32)
        for l in tl.static_range(NE):
            p_keT, m_keT = _tile_t(ke, ((t0 * H + i_h) * NE + l) * K, H * NE * K, nt, K, BK, BT)
            p_ve = _ptrs(ve, ((t0 * H + i_h) * NE + l) * V, H * NE * V, i_v * BV, BT, BV)
            b_keT = tl.load(p_keT, mask=m_keT, other=0.)
            b_ve = tl.load(p_ve, mask=m_v, other=0.)
            b_E = _dot(b_k, b_keT, F32, DT) * gam_s
            b_acc -= _dot(b_E, b_ve, F32, DT)
            b_r += _dot(b_keT, b_ve.to(tl.float32) * e_end[:, None], F32, DT)
        b_u = _dot(b_T, b_acc * b_beta[:, None], F32, DT)
        p_u = _ptrs(u, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
        tl.store(p_u, b_u.to(p_u.dtype.element_ty), mask=m_v)
        if NE > 0:
            p_r, m_r = _tile(hr, ch * K * V, V, K, i_v * BV, V, BK, BV)
            tl.store(p_r, b_r.to(p_r.dtype.element_ty), mask=m_r)


@triton.jit(do_not_specialize=["T"])
def _fwd_rows(ke, ve, gc, hr, cu_seqlens, chunk_indices, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              NE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              F32: tl.constexpr, DT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # R = sum_l Ke_l^T diag(exp(G_C - G)) Ve_l per chunk again, as _fwd_prep forms it, for the
    # backward's state pass: in parallel over chunks, so that pass stays as light as the forward's
    i_v, i_c = _pid_split((V + BV - 1) // BV)
    i_h = tl.program_id(1)
    t0, nt, ch = _chunk_coords(i_c, i_h, H, cu_seqlens, chunk_indices, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    b_gc = tl.load(gc + ch * BT + o_t)
    e_end = tl.exp(tl.load(gc + ch * BT + BT - 1) - b_gc)
    b_r = tl.zeros([BK, BV], dtype=tl.float32)
    for l in tl.static_range(NE):
        p_keT, m_keT = _tile_t(ke, ((t0 * H + i_h) * NE + l) * K, H * NE * K, nt, K, BK, BT)
        p_ve, m_v = _tile(ve, ((t0 * H + i_h) * NE + l) * V, H * NE * V, nt, i_v * BV, V, BT, BV)
        b_keT = tl.load(p_keT, mask=m_keT, other=0.)
        b_ve = tl.load(p_ve, mask=m_v, other=0.)
        b_r += _dot(b_keT, b_ve.to(tl.float32) * e_end[:, None], F32, DT)
    p_r, m_r = _tile(hr, ch * K * V, V, K, i_v * BV, V, BK, BV)
    tl.store(p_r, b_r.to(p_r.dtype.element_ty), mask=m_r)


@triton.jit(do_not_specialize=["T"])
def _fwd_w(k, beta, gc, tinv, w, cu_seqlens, chunk_indices, T, H: tl.constexpr, K: tl.constexpr,
           BT: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # W = Tm diag(beta exp(G)) K again, for the backward (_fwd_prep's product, from the saved Tm:
    # the dot rounds both operands to the input dtype either way, so it is the same W)
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, nt, ch = _chunk_coords(i_c, i_h, H, cu_seqlens, chunk_indices, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    b_gc = tl.load(gc + ch * BT + o_t)
    b_beta = tl.load(beta + t0 * H + i_h + o_t * H, mask=o_t < nt, other=0.).to(tl.float32)
    p_k, m_k = _tile(k, (t0 * H + i_h) * K, H * K, nt, 0, K, BT, BK)
    b_k = tl.load(p_k, mask=m_k, other=0.)
    b_T = tl.load(_ptrs(tinv, ch * BT * BT, BT, 0, BT, BT))
    b_w = _dot(b_T, b_k.to(tl.float32) * (b_beta * tl.exp(b_gc))[:, None], F32, DT)
    p_w = _ptrs(w, (t0 * H + i_h) * K, H * K, 0, BT, BK)
    tl.store(p_w, b_w.to(p_w.dtype.element_ty), mask=m_k)


@triton.jit(do_not_specialize=["T"])
def _fwd_state(k, w, u, gc, hr, h, h0, ht, cu_seqlens, chunk_offsets, T, H: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, NE: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               F32: tl.constexpr, DT: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
               RECOMPUTE: tl.constexpr, IS_VARLEN: tl.constexpr):
    # sequential over one sequence's chunks: store the entering state, turn U' into U, advance
    #   U = U' - W S0;   S' = exp(G_C) S0 + K^T diag(exp(G_C - G)) U + R   (R: the rows, from _fwd_prep)
    # The decay scales the narrow [BT, BV] operand, and K comes transposed from memory.
    # RECOMPUTE (the backward): u already holds U, so only the chunk states h are rebuilt (not
    # saved by the forward: they are the largest activation); R comes from _fwd_rows.
    i_v, i_nh = _pid_split((V + BV - 1) // BV)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, boc = _seq_coords(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    s_off = i_nh.to(tl.int64) * K * V
    if HAS_H0:
        p_h0, m_h = _tile(h0, s_off, V, K, i_v * BV, V, BK, BV)
        b_h = tl.load(p_h0, mask=m_h, other=0.).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_t in range(tl.cdiv(eos - bos, BT)):
        t0 = bos + i_t * BT
        nt = (eos - t0).to(tl.int32)      # valid rows of the chunk (masks stay 32-bit)
        ch = (boc + i_t) * H + i_h
        p_h, m_h = _tile(h, ch * K * V, V, K, i_v * BV, V, BK, BV)
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=m_h)
        p_kT, m_kT = _tile_t(k, (t0 * H + i_h) * K, H * K, nt, K, BK, BT)
        p_u, m_v = _tile(u, (t0 * H + i_h) * V, H * V, nt, i_v * BV, V, BT, BV)
        b_kT = tl.load(p_kT, mask=m_kT, other=0.)
        if RECOMPUTE:
            b_u = tl.load(p_u, mask=m_v, other=0.).to(tl.float32)
        else:
            p_w, m_k = _tile(w, (t0 * H + i_h) * K, H * K, nt, 0, K, BT, BK)
            b_w = tl.load(p_w, mask=m_k, other=0.)
            b_u = tl.load(p_u, mask=m_v, other=0.).to(tl.float32) - _dot(b_w, b_h, F32, DT)
            tl.store(p_u, b_u.to(p_u.dtype.element_ty), mask=m_v)
        b_gc = tl.load(gc + ch * BT + o_t)
        b_gl = tl.load(gc + ch * BT + BT - 1)
        e_end = tl.exp(b_gl - b_gc)
        b_h = b_h * tl.exp(b_gl) + _dot(b_kT, b_u * e_end[:, None], F32, DT)
        if NE > 0:
            p_r = _ptrs(hr, ch * K * V, V, i_v * BV, BK, BV)
            b_h += tl.load(p_r, mask=m_h, other=0.).to(tl.float32)
    if STORE_HT:
        p_ht, m_h = _tile(ht, s_off, V, K, i_v * BV, V, BK, BV)
        tl.store(p_ht, b_h, mask=m_h)


@triton.jit(do_not_specialize=["T"])
def _fwd_out(q, k, ke, ve, u, gc, h, o, scale, cu_seqlens, chunk_indices, T, H: tl.constexpr,
             K: tl.constexpr, V: tl.constexpr, NE: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             F32: tl.constexpr, DT: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_v, i_c = _pid_split((V + BV - 1) // BV)
    i_h = tl.program_id(1)
    t0, nt, ch = _chunk_coords(i_c, i_h, H, cu_seqlens, chunk_indices, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    b_gc = tl.load(gc + ch * BT + o_t)
    _, gam_c = _decay_masks(b_gc, BT)
    p_q, m_k = _tile(q, (t0 * H + i_h) * K, H * K, nt, 0, K, BT, BK)
    p_k = _ptrs(k, (t0 * H + i_h) * K, H * K, 0, BT, BK)
    p_h, m_h = _tile(h, ch * K * V, V, K, i_v * BV, V, BK, BV)
    p_u, m_v = _tile(u, (t0 * H + i_h) * V, H * V, nt, i_v * BV, V, BT, BV)
    b_q = tl.load(p_q, mask=m_k, other=0.)
    b_k = tl.load(p_k, mask=m_k, other=0.)
    b_h = tl.load(p_h, mask=m_h, other=0.)
    b_u = tl.load(p_u, mask=m_v, other=0.)
    b_o = _dot(b_q, b_h, F32, DT) * tl.exp(b_gc)[:, None]
    b_P = _dot(b_q, tl.trans(b_k), F32, DT) * gam_c
    b_o += _dot(b_P, b_u, F32, DT)
    for l in tl.static_range(NE):
        p_ke = _ptrs(ke, ((t0 * H + i_h) * NE + l) * K, H * NE * K, 0, BT, BK)
        p_ve = _ptrs(ve, ((t0 * H + i_h) * NE + l) * V, H * NE * V, i_v * BV, BT, BV)
        b_ke = tl.load(p_ke, mask=m_k, other=0.)
        b_ve = tl.load(p_ve, mask=m_v, other=0.)
        b_Pl = _dot(b_q, tl.trans(b_ke), F32, DT) * gam_c
        b_o += _dot(b_Pl, b_ve, F32, DT)
    p_o = _ptrs(o, (t0 * H + i_h) * V, H * V, i_v * BV, BT, BV)
    tl.store(p_o, (b_o * scale).to(p_o.dtype.element_ty), mask=m_v)


# ----------------------------------------------------------------------------------------------
# host side

def _fwd(q, k, v, g, beta, ke, ve, scale, h0, output_final_state, cu_seqlens):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NE, meta, cfg, tables = _setup(q, v, ke, cu_seqlens)
    cu, ci, co, N, NC = tables
    BT = meta["BT"]
    dev, dt = q.device, q.dtype
    ke_, ve_ = (ke, ve) if NE else (k, v)  # dummies, never read when NE == 0
    gc = _empty(NC, H, BT, dtype=torch.float32, device=dev)
    tinv = _empty(NC, H, BT, BT, dtype=dt, device=dev)
    w = _empty(B, T, H, K, dtype=dt, device=dev)
    u = _empty(B, T, H, V, dtype=dt, device=dev)
    h = _empty(NC, H, K, V, dtype=dt, device=dev)
    ht = _empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    o = _empty(B, T, H, V, dtype=dt, device=dev)
    # the injected rows' per-chunk state term (a temporary, in the state's dtype)
    hr = _empty(NC, H, K, V, dtype=dt, device=dev) if NE else h
    _fwd_prep[(NC, H)](k, v, ke_, ve_, g, beta, gc, tinv, w, u, hr, cu, ci, T, H, NE=NE, **meta,
                       **cfg["fwd_prep"])
    c = cfg["fwd_state"]
    _fwd_state[(triton.cdiv(V, c["BV"]) * N * H,)](k, w, u, gc, hr, h, h0, ht, cu, co, T, H, NE=NE,
                                                   **meta, HAS_H0=h0 is not None, STORE_HT=output_final_state,
                                                   RECOMPUTE=False, **c)
    del hr
    c = cfg["fwd_out"]
    _fwd_out[(triton.cdiv(V, c["BV"]) * NC, H)](q, k, ke_, ve_, u, gc, h, o, scale, cu, ci, T, H, NE=NE,
                                                **meta, **c)
    # h and W are not saved: the backward rebuilds h from U (one sequential pass, like fla's) and
    # W from Tm (one product per chunk), which keeps the largest activation, [chunks, H, K, V],
    # and a [B,T,H,K] one out of the memory held between the passes
    return o, ht, (gc, tinv, u), tables
