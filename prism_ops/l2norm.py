"""
F.normalize's semantics, x / max(|x|, 1e-12), in Triton:
    _l2norm, _l2norm_grad      rows in registers (the solver chain's keys, the decoding step's q, k)
    _l2norm_fwd, _l2norm_bwd   q and k l2-normalised inside the chunk op (l2norm_qk=True, as the
                               model's layers call it): the op saves the normalised copies it runs
                               on and their inverse norms, not the raw inputs as well
    y = r x with r = 1 / max(|x|, eps);  dx = r (dy - y <y, dy>) where |x| > eps, else r dy
"""
import torch
import triton
import triton.language as tl

from .tiles import _empty

@triton.jit
def _l2norm(x):
    # F.normalize(x, dim=-1): x / max(|x|, 1e-12) over the last axis (a vector, or a tile's rows)
    return x / tl.maximum(tl.sqrt(tl.sum(x * x, axis=len(x.shape) - 1, keep_dims=True)), 1e-12)


@triton.jit
def _l2norm_grad(x, dy):
    # the gradient of _l2norm over a tile's rows, from the raw rows x
    n = tl.sqrt(tl.sum(x * x, axis=1))
    nc = tl.maximum(n, 1e-12)[:, None]
    y = x / nc
    return dy / nc - tl.where(n > 1e-12, tl.sum(y * dy, axis=1), 0.)[:, None] * y / nc


@triton.jit
def _l2norm_fwd(x, y, rn, N, s_n, H: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # rows (token n, head i_h) of x [N, H, K] whose token stride is s_n (a view into a wider
    # tensor, e.g. the short conv's q|k|v output); y [N, H, K] contiguous, rn [N, H] float32
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    o_n = (i_n * BN + tl.arange(0, BN)).to(tl.int64)
    o_k = tl.arange(0, BK)
    m = (o_n < N)[:, None] & (o_k < K)[None, :]
    b_x = tl.load(x + o_n[:, None] * s_n + i_h * K + o_k[None, :], mask=m, other=0.).to(tl.float32)
    b_r = 1. / tl.maximum(tl.sqrt(tl.sum(b_x * b_x, axis=1)), 1e-12)
    tl.store(y + (o_n * H + i_h)[:, None] * K + o_k[None, :], (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rn + o_n * H + i_h, b_r, mask=o_n < N)


@triton.jit
def _l2norm_bwd(y, rn, dy, dx, N, H: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # dx = r (dy - y <y, dy>) where |x| > eps, else r dy (there x / eps is linear); y, dy, dx [N, H, K]
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    o_n = (i_n * BN + tl.arange(0, BN)).to(tl.int64)
    o_k = tl.arange(0, BK)
    m = (o_n < N)[:, None] & (o_k < K)[None, :]
    off = (o_n * H + i_h)[:, None] * K + o_k[None, :]
    b_y = tl.load(y + off, mask=m, other=0.).to(tl.float32)
    b_dy = tl.load(dy + off, mask=m, other=0.).to(tl.float32)
    b_r = tl.load(rn + o_n * H + i_h, mask=o_n < N, other=0.)
    proj = tl.where(b_r < 1e12, tl.sum(b_y * b_dy, axis=1), 0.)
    tl.store(dx + off, (b_r[:, None] * (b_dy - b_y * proj[:, None])).to(dx.dtype.element_ty), mask=m)


def _l2norm_blocks(K):
    BK = max(16, triton.next_power_of_2(K))
    return max(1, 8192 // BK), BK   # ~8K elements per program


def _l2norm_rows(x):
    """(x / max(|x|, eps), 1 / max(|x|, eps)) over the last dim of x [B,T,H,K]; x may be a view
    whose (B, T) merge into one token stride (a split of a wider [B,T,C])."""
    B, T, H, K = x.shape
    if not (x.stride(3) == 1 and x.stride(2) == K and (B == 1 or x.stride(0) == T * x.stride(1))):
        x = x.contiguous()
    BN, BK = _l2norm_blocks(K)
    y = _empty(B, T, H, K, dtype=x.dtype, device=x.device)
    rn = _empty(B, T, H, dtype=torch.float32, device=x.device)
    _l2norm_fwd[(triton.cdiv(B * T, BN), H)](x, y, rn, B * T, x.stride(1), H=H, K=K, BN=BN, BK=BK)
    return y, rn


def _l2norm_rows_grad(y, rn, dy):
    B, T, H, K = y.shape
    BN, BK = _l2norm_blocks(K)
    dx = _empty(B, T, H, K, dtype=y.dtype, device=y.device)
    _l2norm_bwd[(triton.cdiv(B * T, BN), H)](y, rn, dy, dx, B * T, H=H, K=K, BN=BN, BK=BK)
    return dx
