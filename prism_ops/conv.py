"""
Causal depthwise short convolution (+ SiLU), the q/k/v and anchor pre-mixing of GDN and PRISM
(prism_kernel.causal_conv; model.ShortConv without a cache).
    y[t, c] = act(sum_j w[c, j] x[t - (W-1) + j, c]), zero before t = 0, x and y [B, T, C]
    backward: da = dy * act'(pre-activation), dx[t] = sum_j w[c, j] da[t + W-1-j],
              dw[c, j] = sum_t da[t] x[t - (W-1) + j] (partial sums per batch and time block)
cuDNN's depthwise conv1d needs [B, C, T] (two transposed copies) and its backward is slow for
thousands of channels; these work on [B, T, C] directly. A program's tile is BT // BR rows of
BR consecutive tokens by BD channels, and a row's tokens are unrolled into a tuple of
registers: a tap s tokens back is the register s places earlier, not another load, so each
input is read (BR + W - 1) / BR times in the forward, and the backward recomputes the
pre-activation gradient at its W-1 halo tokens in registers instead of a float32 round trip
through memory. Packed sequences: pos[t] = t - the start of t's sequence, and a tap s reaches
only where s <= pos[t].
"""
import torch
import triton
import triton.language as tl

from .tiles import OVERRIDES, _empty, _seq_cache, _seq_lengths

@triton.jit
def _conv_pos(pos, p, T, VARLEN: tl.constexpr):
    # pos[p] = p - start of p's sequence (packed sequences); tap s of token p is inside p's
    # sequence iff s <= pos[p]. Without packing every tap is (zeros before t = 0 come from masks)
    if VARLEN:
        return tl.load(pos + p, mask=(p >= 0) & (p < T), other=0)
    else:
        return p


@triton.jit
def _conv_load(x, base, p, T, C, o_d, m_d):
    m = ((p >= 0) & (p < T))[:, None] & m_d[None, :]
    return tl.load(x + base + p.to(tl.int64)[:, None] * C + o_d[None, :], mask=m, other=0.).to(tl.float32)


@triton.jit
def _conv_pre(xs, ws, pp, i, W: tl.constexpr, VARLEN: tl.constexpr):
    # pre-activation at tuple position i of the outputs: taps xs[i .. i + W-1]
    acc = xs[i] * 0.
    for j in tl.static_range(W):
        s = W - 1 - j
        xj = xs[i + j]
        if VARLEN:
            xj = tl.where((s <= pp)[:, None], xj, 0.)
        acc += xj * ws[j][None, :]
    return acc


@triton.jit(do_not_specialize=["T"])
def _conv_fwd(x, w, y, pos, T, C, W: tl.constexpr, ACT: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr,
              BD: tl.constexpr, VARLEN: tl.constexpr):
    i_t, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT // BR) * BR     # first token of each row
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < C
    base = i_b.to(tl.int64) * T * C
    ws = ()
    for j in tl.static_range(W):
        ws += (tl.load(w + o_d * W + j, mask=m_d, other=0.).to(tl.float32),)
    xs = ()   # xs[i] = x at token o_t + i - (W-1)
    for i in tl.static_range(BR + W - 1):
        xs += (_conv_load(x, base, o_t + i - (W - 1), T, C, o_d, m_d),)
    for i in tl.static_range(BR):
        p = o_t + i
        acc = _conv_pre(xs, ws, _conv_pos(pos, p, T, VARLEN), i, W, VARLEN)
        if ACT:
            acc = acc * tl.sigmoid(acc)
        m = (p < T)[:, None] & m_d[None, :]
        tl.store(y + base + p.to(tl.int64)[:, None] * C + o_d[None, :], acc.to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T"])
def _conv_bwd(x, w, dy, dx, dw_part, pos, T, C, NT, W: tl.constexpr, ACT: tl.constexpr, BT: tl.constexpr,
              BR: tl.constexpr, BD: tl.constexpr, VARLEN: tl.constexpr):
    # da = dy * act'(pre-activation) at the row's tokens and the W-1 after them (recomputed from
    # x), then dx[t] = sum_j w[j] da[t + s] (s = W-1-j, over the outputs whose tap s reaches t)
    # and dw partial sums per (batch, time block)
    i_t, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT // BR) * BR
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < C
    base = i_b.to(tl.int64) * T * C
    ws = ()
    for j in tl.static_range(W):
        ws += (tl.load(w + o_d * W + j, mask=m_d, other=0.).to(tl.float32),)
    xs = ()   # xs[i] = x at token o_t + i - (W-1)
    for i in tl.static_range(BR + 2 * W - 2):
        xs += (_conv_load(x, base, o_t + i - (W - 1), T, C, o_d, m_d),)
    das, pps = (), ()   # at tokens o_t + i, i < BR + W - 1
    for i in tl.static_range(BR + W - 1):
        p = o_t + i
        pp = _conv_pos(pos, p, T, VARLEN)
        g = _conv_load(dy, base, p, T, C, o_d, m_d)
        if ACT:
            acc = _conv_pre(xs, ws, pp, i, W, VARLEN)
            sg = tl.sigmoid(acc)
            g = g * (sg + acc * sg * (1 - sg))
        das += (g,)
        pps += (pp,)
    dws = ()
    for j in tl.static_range(W):
        dws += (das[0] * 0.,)
    for i in tl.static_range(BR):
        p = o_t + i
        acc = das[i] * 0.
        dws_new = ()
        for j in tl.static_range(W):
            # tap s = W-1-j (tuple indices must be constexpr expressions, not assigned names)
            g = das[i + W - 1 - j]
            xj = xs[i + j]
            if VARLEN:
                g = tl.where((W - 1 - j <= pps[i + W - 1 - j])[:, None], g, 0.)
                xj = tl.where((W - 1 - j <= pps[i])[:, None], xj, 0.)
            acc += g * ws[j][None, :]
            dws_new += (dws[j] + das[i] * xj,)
        dws = dws_new
        m = (p < T)[:, None] & m_d[None, :]
        tl.store(dx + base + p.to(tl.int64)[:, None] * C + o_d[None, :], acc.to(dx.dtype.element_ty), mask=m)
    part = dw_part + (i_b.to(tl.int64) * NT + i_t) * C * W
    for j in tl.static_range(W):
        tl.store(part + o_d * W + j, tl.sum(dws[j], 0), mask=m_d)


def _conv_blocks(T, C):
    """(BT, BR, BD, num_warps) of the short-conv kernels: BT tokens per program in rows of BR."""
    ov = OVERRIDES
    BT = min(ov.get("conv_bt", 64), max(16, triton.next_power_of_2(T)))
    BR = min(BT, ov.get("conv_br", 16))
    BD = min(ov.get("conv_bd", 64), max(16, triton.next_power_of_2(C)))   # 128 spills in the backward at 4 warps
    return BT, BR, BD, ov.get("conv_warps", 4)


def _conv_positions(cu_seqlens, T, device):
    """Validated cu_seqlens -> pos[t] = t - start of t's sequence (int32 [T] on `device`)."""
    lens = _seq_lengths(cu_seqlens, T, "causal_conv")
    cache = _seq_cache(cu_seqlens)
    key = ("pos", T, str(device))
    if key not in cache:
        starts = cu_seqlens[:-1].to(device, torch.int64).repeat_interleave(lens.to(device), output_size=T)
        cache[key] = (torch.arange(T, device=device) - starts).to(torch.int32)
    return cache[key]


def _conv_forward(x, w, act, pos):
    B, T, C = x.shape
    BT, BR, BD, nw = _conv_blocks(T, C)
    y = _empty(B, T, C, dtype=x.dtype, device=x.device)
    _conv_fwd[(triton.cdiv(T, BT), triton.cdiv(C, BD), B)](
        x, w, y, x if pos is None else pos, T, C, W=w.shape[1], ACT=act, BT=BT, BR=BR, BD=BD,
        VARLEN=pos is not None, num_warps=nw)
    return y


def _conv_backward(x, w, dy, act, pos):
    B, T, C = x.shape
    BT, BR, BD, nw = _conv_blocks(T, C)
    NT = triton.cdiv(T, BT)
    dw_part = _empty(B * NT, C, w.shape[1], dtype=torch.float32, device=x.device)
    dx = _empty(B, T, C, dtype=x.dtype, device=x.device)
    _conv_bwd[(NT, triton.cdiv(C, BD), B)](x, w, dy.contiguous(), dx, dw_part, x if pos is None else pos, T, C, NT,
                                          W=w.shape[1], ACT=act, BT=BT, BR=BR, BD=BD, VARLEN=pos is not None,
                                          num_warps=nw)
    return dx, dw_part.sum(0).to(w.dtype)
