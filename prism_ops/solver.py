"""
PRISM's solver chain (PRISM_SPEC §2.2; model.solver_chain is its PyTorch form and the reference
the tests hold this to): from the layer's values v and the solver's projections (the proxy u,
the gains p_l, the raw keys, the step logits s_l) the injected keys ke_l = l2norm(key_l) and
values ve_l = sigmoid(s_l) d_l, with r_0 = v - u, d_l = f(p_l, r_l), r_{l+1} = r_l - d_l.
One pass over the rows each way, in float32 registers; the backward recomputes the chain from
the same inputs instead of saving r_l, d_l. Compiled, the same chain as PyTorch ops took two
passes forward and several backward, each a round trip of [B,T,H,V] tensors through HBM.
A row is one (token, head): v, u, p_l are [rows, V], keys [rows, K], steps [rows, L-1].
MODE 0: d = GELU(p r) (exact erf GELU); 1: d = p r; 2: d = sigmoid(p) r (closed form).
Without GAIN, p = 1. NK = 1: one key for every step (solver_keys "shared" and "base").
prism_kernel.solver_chain is the entry point (custom ops around _solver_fwd, _solver_bwd).
"""
import triton
import triton.language as tl

from .l2norm import _l2norm, _l2norm_grad

@triton.jit
def _pick3(l: tl.constexpr, a, b, c):
    return a if l == 0 else (b if l == 1 else c)


@triton.jit
def _solver_delta(p, r, GAIN: tl.constexpr, MODE: tl.constexpr):
    # d = f(p, r) and its partial derivatives dd/dr, dd/dp
    if MODE == 2:
        sg = tl.sigmoid(p)
        d = sg * r
        d_r = sg
        d_p = sg * (1. - sg) * r
    else:
        if GAIN:
            x = p * r
        else:
            x = r
        if MODE == 0:   # exact GELU: x Phi(x), and Phi(x) + x phi(x)
            erf = tl.erf(x * 0.7071067811865476)
            d = 0.5 * x * (1. + erf)
            gx = 0.5 * (1. + erf) + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
        else:
            gx = x * 0. + 1.
            d = x
        if GAIN:
            d_r = gx * p
        else:
            d_r = gx
        d_p = gx * r
    return d, d_r, d_p


@triton.jit
def _solver_tiles(N, V: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr):
    # this program's rows (int64: rows x V passes 2^31 near 1.4M tokens at H = 6, V = 256), masks
    # and element offsets into the [rows, V] and [rows, K] inputs
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < N
    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_v = m_r[:, None] & (o_v < V)[None, :]
    m_k = m_r[:, None] & (o_k < K)[None, :]
    return rows, m_r, o_v, o_k, m_v, m_k, rows[:, None] * V + o_v[None, :], rows[:, None] * K + o_k[None, :]


@triton.jit
def _solver_gain(l: tl.constexpr, p0, p1, p2, x_v, m_v, GAIN: tl.constexpr):
    # step l's gain tile (float32), or ones without gains
    if GAIN:
        b_p = tl.load(_pick3(l, p0, p1, p2) + x_v, mask=m_v, other=0.).to(tl.float32)
    else:
        b_p = tl.full(x_v.shape, 1., tl.float32)
    return b_p


@triton.jit
def _solver_fwd(v, u, p0, p1, p2, k0, k1, k2, st, ke, ve, N, V: tl.constexpr, K: tl.constexpr,
                NE: tl.constexpr, NK: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                GAIN: tl.constexpr, MODE: tl.constexpr):
    rows, m_r, o_v, o_k, m_v, m_k, x_v, x_k = _solver_tiles(N, V, K, BR, BV, BK)
    b_r = (tl.load(v + x_v, mask=m_v, other=0.).to(tl.float32)
           - tl.load(u + x_v, mask=m_v, other=0.).to(tl.float32))
    b_e = tl.zeros([BR, BK], dtype=tl.float32)
    if NK == 1:
        b_e = _l2norm(tl.load(k0 + x_k, mask=m_k, other=0.).to(tl.float32))
    for l in tl.static_range(NE):
        b_p = _solver_gain(l, p0, p1, p2, x_v, m_v, GAIN)
        b_d, _, _ = _solver_delta(b_p, b_r, GAIN, MODE)
        b_r = b_r - b_d
        b_b = tl.sigmoid(tl.load(st + rows * NE + l, mask=m_r, other=0.).to(tl.float32))
        tl.store(ve + (rows * NE + l)[:, None] * V + o_v[None, :], (b_d * b_b[:, None]).to(ve.dtype.element_ty),
                 mask=m_v)
        if NK > 1:
            b_e = _l2norm(tl.load(_pick3(l, k0, k1, k2) + x_k, mask=m_k, other=0.).to(tl.float32))
        tl.store(ke + (rows * NE + l)[:, None] * K + o_k[None, :], b_e.to(ke.dtype.element_ty), mask=m_k)


@triton.jit
def _solver_bwd(v, u, p0, p1, p2, k0, k1, k2, st, dke, dve, dv, du, dp0, dp1, dp2, dk0, dk1, dk2, dst, N,
                V: tl.constexpr, K: tl.constexpr, NE: tl.constexpr, NK: tl.constexpr, BR: tl.constexpr,
                BV: tl.constexpr, BK: tl.constexpr, GAIN: tl.constexpr, MODE: tl.constexpr):
    # reverse over the steps; r_l is recomputed from r_0 for each (NE <= 3: at most 3 extra sweeps)
    #   g = b_l dve_l - dr_{l+1};  dr_l = dr_{l+1} + g dd/dr;  dp_l = g dd/dp;  ds_l = b'(s_l) sum_v dve_l d_l
    rows, m_r, o_v, o_k, m_v, m_k, x_v, x_k = _solver_tiles(N, V, K, BR, BV, BK)
    b_r0 = (tl.load(v + x_v, mask=m_v, other=0.).to(tl.float32)
            - tl.load(u + x_v, mask=m_v, other=0.).to(tl.float32))
    b_dr = tl.zeros([BR, BV], dtype=tl.float32)
    b_dks = tl.zeros([BR, BK], dtype=tl.float32)   # NK = 1: the shared key's gradient, summed over steps
    for j in tl.static_range(NE):
        b_r = b_r0
        for i in tl.static_range(NE - 1 - j):
            b_p = _solver_gain(i, p0, p1, p2, x_v, m_v, GAIN)
            b_d, _, _ = _solver_delta(b_p, b_r, GAIN, MODE)
            b_r = b_r - b_d
        b_p = _solver_gain(NE - 1 - j, p0, p1, p2, x_v, m_v, GAIN)
        b_d, d_r, d_p = _solver_delta(b_p, b_r, GAIN, MODE)
        b_b = tl.sigmoid(tl.load(st + rows * NE + NE - 1 - j, mask=m_r, other=0.).to(tl.float32))
        b_dve = tl.load(dve + (rows * NE + NE - 1 - j)[:, None] * V + o_v[None, :], mask=m_v, other=0.).to(tl.float32)
        tl.store(dst + rows * NE + NE - 1 - j, tl.sum(b_dve * b_d, axis=1) * b_b * (1. - b_b), mask=m_r)
        b_g = b_dve * b_b[:, None] - b_dr
        b_dr = b_dr + b_g * d_r
        if GAIN:
            tl.store(_pick3(NE - 1 - j, dp0, dp1, dp2) + x_v, (b_g * d_p).to(dp0.dtype.element_ty), mask=m_v)
        b_dke = tl.load(dke + (rows * NE + NE - 1 - j)[:, None] * K + o_k[None, :], mask=m_k, other=0.).to(tl.float32)
        if NK == 1:
            b_dks += b_dke
        else:
            b_x = tl.load(_pick3(NE - 1 - j, k0, k1, k2) + x_k, mask=m_k, other=0.).to(tl.float32)
            tl.store(_pick3(NE - 1 - j, dk0, dk1, dk2) + x_k, _l2norm_grad(b_x, b_dke).to(dk0.dtype.element_ty),
                     mask=m_k)
    if NK == 1:
        b_x = tl.load(k0 + x_k, mask=m_k, other=0.).to(tl.float32)
        tl.store(dk0 + x_k, _l2norm_grad(b_x, b_dks).to(dk0.dtype.element_ty), mask=m_k)
    tl.store(dv + x_v, b_dr.to(dv.dtype.element_ty), mask=m_v)
    tl.store(du + x_v, (-b_dr).to(du.dtype.element_ty), mask=m_v)


_SOLVER_MODES = {("gelu", True): 0, ("gelu", False): 1, ("linear", True): 2, ("linear", False): 2}


def _solver_blocks(V, K):
    BV, BK = triton.next_power_of_2(V), triton.next_power_of_2(K)
    return max(1, min(64, 2048 // BV)), BV, BK


def _solver_launch(kernel, n_rows, V, K, NE, NK, gain, mode, *args):
    BR, BV, BK = _solver_blocks(V, K)
    kernel[(triton.cdiv(n_rows, BR),)](*args, n_rows, V=V, K=K, NE=NE, NK=NK, BR=BR, BV=BV, BK=BK,
                                       GAIN=gain, MODE=mode, num_warps=4)


def _solver_shapes(v, key, steps):
    """B, T, H, V, K, L-1 of a chain's inputs (a key [B,T,H*K] or [B,T,H,K])"""
    B, T, H, V = v.shape
    return B, T, H, V, key.shape[-1] if key.dim() == 4 else key.shape[-1] // H, steps.shape[-1] // H
