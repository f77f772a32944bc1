"""
Decoding: a few tokens per call against a cache (model.Cache), forward only.
    conv_step              the short conv continued from a buffer of the last W-1 inputs
    recurrent_prism_step   the recurrence token by token, the state updated in place; for the
                           model's step also the l2-norm of q and k, the gates and PRISM's solver
                           write, so a layer's recurrence is one launch
    gated_rms_norm         RMSNorm(o) * silu(gate), per head
    add_rms_norm           a residual add and the RMSNorm after it
    silu_mul               silu(a) * b, SwiGLU's product
    rope_kv_write, decode_attention   one token of attention against a static KV cache
Plain pointer arithmetic (no block pointers); offsets that can pass 2^31 are int64. Positions
and segment starts are read from device tensors, so a decoding step holds no host value that
changes from one token to the next and can be captured in a CUDA graph.
reset [B,T] (optional): the token starts a new segment (reset_at_eos): the state, the conv
taps and the attention window before it are dropped before the token is processed.
"""
import torch
import triton
import triton.language as tl

from .l2norm import _l2norm
from .solver import _SOLVER_MODES, _solver_delta
from .tiles import OVERRIDES, _empty, _launchable, _pid_split

def _rows(x):
    """x [B,T,...]: (x, row stride) such that token (b, t) starts (b*T + t) * stride elements in
    and its trailing dims are contiguous; rows of a wider tensor (a slice of a fused projection)
    pass as they are, anything else is copied."""
    B, T = x.shape[:2]
    ok = all(x.shape[i] == 1 or x.stride(i) == x.shape[i + 1:].numel() for i in range(2, x.dim()))
    s = x.stride(0) if T == 1 else x.stride(1)
    if not ok or (T > 1 and B > 1 and x.stride(0) != T * s):
        x = x.contiguous()
        s = x.shape[2:].numel()
    return x, s


def _flags(reset, B, T, device):
    if reset is None:
        return torch.empty(1, dtype=torch.uint8, device=device), False
    if reset.shape != (B, T):
        raise ValueError(f"reset must be [B,T] = {(B, T)}, got {tuple(reset.shape)}")
    flags = reset if reset.dtype == torch.bool else reset != 0
    return flags.contiguous().view(torch.uint8), True


@triton.jit(do_not_specialize=["T"])
def _conv_step(x, buf, w, y, reset, T, C, sx_b, sx_t,
               W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr,
               ACT: tl.constexpr, HAS_RESET: tl.constexpr):
    # y[t] = act(sum_d w[W-1-d] z[t-d]) with z = the buffer's W-1 inputs, then x; a tap from
    # before a reset at or before t reads zero. Only the time-block-0 programs read the buffer
    # (BT >= W-1), and they write it back: no other program races with them.
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_t = o_t < T
    m_c = o_c < C
    xb = x + i_b.to(tl.int64) * sx_b
    bb = buf + i_b.to(tl.int64) * (W - 1) * C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    keep = m_t
    for d in tl.static_range(W):
        if HAS_RESET and d > 0:  # a reset at token t-d+1 cuts this tap and every older one
            s = o_t - d + 1
            r = tl.load(reset + i_b * T + tl.where(s >= 0, s, 0), mask=m_t & (s >= 0), other=0)
            keep = keep & (r == 0)
        p = o_t - d
        in_x = p >= 0
        vx = tl.load(xb + tl.where(in_x, p, 0).to(tl.int64)[:, None] * sx_t + o_c[None, :],
                     mask=(keep & in_x)[:, None] & m_c[None, :], other=0.)
        vb = tl.load(bb + tl.where(in_x, 0, W - 1 + p)[:, None] * C + o_c[None, :],
                     mask=(keep & (p < 0))[:, None] & m_c[None, :], other=0.)
        wd = tl.load(w + o_c * W + (W - 1 - d), mask=m_c, other=0.).to(tl.float32)
        acc += (vx.to(tl.float32) + vb.to(tl.float32)) * wd[None, :]
    if ACT:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + (i_b.to(tl.int64) * T + o_t[:, None]) * C + o_c[None, :], acc.to(y.dtype.element_ty),
             mask=m_t[:, None] & m_c[None, :])
    if i_t == 0:  # names of their own: Triton's compiler refuses a loop variable re-typed here
        # the buffer after this call: the inputs at tokens T-(W-1) .. T-1, zero where a later
        # reset (up to T-1) cut them off
        o_e = tl.arange(0, BW)
        m_e = o_e < W - 1
        pe = T - (W - 1) + o_e
        keep_e = m_e
        if HAS_RESET:
            for d in tl.static_range(1, W - 1):
                se = pe + d
                ok = m_e & (se >= 0) & (se < T)
                r_e = tl.load(reset + i_b * T + tl.where(ok, se, 0), mask=ok, other=0)
                keep_e = keep_e & (r_e == 0)
        in_e = pe >= 0
        ex = tl.load(xb + tl.where(in_e, pe, 0).to(tl.int64)[:, None] * sx_t + o_c[None, :],
                     mask=(keep_e & in_e)[:, None] & m_c[None, :], other=0.)
        eb = tl.load(bb + tl.where(in_e, 0, W - 1 + pe)[:, None] * C + o_c[None, :],
                     mask=(keep_e & ~in_e)[:, None] & m_c[None, :], other=0.)
        new = ex.to(tl.float32) + eb.to(tl.float32)
        tl.debug_barrier()  # every read of the old buffer is done
        tl.store(bb + o_e[:, None] * C + o_c[None, :], new.to(buf.dtype.element_ty),
                 mask=m_e[:, None] & m_c[None, :])


def conv_step(x, buf, weight, reset=None, silu=True):
    """The causal depthwise conv of x [B,T,C] continued from buf [B,W-1,C] (the W-1 inputs
    before x, updated in place to the last W-1 inputs), optionally followed by SiLU: the cached
    semantics of model.ShortConv. x's rows may be strided (a slice of a wider projection) with
    contiguous channels. Returns y [B,T,C] in x's dtype."""
    B, T, C = x.shape
    W = weight.shape[1]
    if weight.shape != (C, W) or buf.shape != (B, W - 1, C) or not buf.is_contiguous():
        raise ValueError(f"conv_step: need x [B,T,C], weight [C,W], contiguous buf [B,W-1,C]; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(buf.shape)}")
    _launchable(x, "conv_step")
    if x.stride(-1) != 1:
        x = x.contiguous()
    flags, has_reset = _flags(reset, B, T, x.device)
    BW = triton.next_power_of_2(max(W - 1, 1))
    BT = max(min(64, triton.next_power_of_2(T)), BW)
    BC = min(128, triton.next_power_of_2(C))
    y = _empty(B, T, C, dtype=x.dtype, device=x.device)
    _conv_step[(triton.cdiv(T, BT), triton.cdiv(C, BC), B)](
        x, buf, weight.contiguous(), y, flags, T, C, x.stride(0), x.stride(1),
        W=W, BT=BT, BC=BC, BW=BW, ACT=bool(silu), HAS_RESET=has_reset)
    return y




@triton.jit(do_not_specialize=["T"])
def _recurrent_fwd(q, k, v, g, beta, ke, ve, st, o, reset, A_log, dt_bias, u, steps,
                   scale, T, H, s_q, s_k, s_v, s_g, s_b, s_ke, h_ke, l_ke, s_ve, h_ve, l_ve, s_u, s_st,
                   K: tl.constexpr, V: tl.constexpr, NE: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, NORM_QK: tl.constexpr, GATES: tl.constexpr,
                   SOLVER: tl.constexpr, KEYS: tl.constexpr, GAIN: tl.constexpr,
                   MODE: tl.constexpr, HAS_RESET: tl.constexpr):
    # one program: batch row b, head h, a BV-wide slice of the value dim; tokens in order.
    # Row pointers: token (b, t) is row b*T + t of each input, `s_*` apart; heads h_*, steps l_*.
    # Without SOLVER, ke/ve are the injected rows [.., L-1, K] / [.., L-1, V]. With SOLVER (PRISM_SPEC
    # §2.2) ke holds the raw solver keys, ve the gains, u the proxy W_u a, steps the step logits:
    #   r = v - u;  per l: d = GELU(p r) | p r | sigmoid(p) r (MODE 0 | 1 | 2);  r -= d
    #   ke_l = l2norm(key_l) (KEYS 0 own) | l2norm(key_0) (1 shared) | k (2 base);  ve_l = sigmoid(step_l) d
    # GATES: g and beta hold the projections a, b: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).
    i_v, i_bh = _pid_split((V + BV - 1) // BV)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    p_s = st + i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.).to(tl.float32)   # a bf16 state is updated in float32
    if GATES:
        neg_a = -tl.exp(tl.load(A_log + i_h).to(tl.float32))
        b_dt = tl.load(dt_bias + i_h).to(tl.float32)
    for t in range(T):
        row = (i_b * T + t).to(tl.int64)
        if HAS_RESET:
            b_s = tl.where(tl.load(reset + row) != 0, 0., b_s)
        b_q = tl.load(q + row * s_q + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(k + row * s_k + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + row * s_v + i_h * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_g = tl.load(g + row * s_g + i_h).to(tl.float32)
        b_beta = tl.load(beta + row * s_b + i_h).to(tl.float32)
        if NORM_QK:
            b_q = _l2norm(b_q)
            b_k = _l2norm(b_k)
        if GATES:
            x_a = b_g + b_dt
            b_g = neg_a * tl.where(x_a > 20., x_a, tl.log(1. + tl.exp(x_a)))  # F.softplus
            b_beta = tl.sigmoid(b_beta)
        b_s = b_s * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_k[:, None] * b_s, axis=0))
        b_s += b_k[:, None] * b_u[None, :]
        if SOLVER:
            b_r = b_v - tl.load(u + row * s_u + i_h * V + o_v, mask=m_v, other=0.).to(tl.float32)
        for l in tl.static_range(NE):
            if SOLVER:
                if KEYS == 2:
                    b_e = b_k
                else:
                    if KEYS == 0:
                        p_e = ke + row * s_ke + i_h * h_ke + l * l_ke + o_k
                    else:
                        p_e = ke + row * s_ke + i_h * h_ke + o_k
                    b_e = _l2norm(tl.load(p_e, mask=m_k, other=0.).to(tl.float32))
                if GAIN:
                    b_p = tl.load(ve + row * s_ve + i_h * h_ve + l * l_ve + o_v, mask=m_v, other=0.).to(tl.float32)
                else:
                    b_p = tl.full([BV], 1., tl.float32)
                b_d, _, _ = _solver_delta(b_p, b_r, GAIN, MODE)
                b_r = b_r - b_d
                b_w = b_d * tl.sigmoid(tl.load(steps + row * s_st + i_h * NE + l).to(tl.float32))
            else:
                b_e = tl.load(ke + row * s_ke + i_h * h_ke + l * l_ke + o_k, mask=m_k, other=0.).to(tl.float32)
                b_w = tl.load(ve + row * s_ve + i_h * h_ve + l * l_ve + o_v, mask=m_v, other=0.).to(tl.float32)
            b_s += b_e[:, None] * b_w[None, :]
        b_o = tl.sum(b_q[:, None] * b_s, axis=0) * scale
        tl.store(o + row * H * V + i_h * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_s.to(st.dtype.element_ty), mask=m_s)   # bf16: rounded to nearest even


SOLVER_KEYS = {"own": 0, "shared": 1, "base": 2}


def recurrent_prism_step(q, k, v, g, beta, ke=None, ve=None, scale=None, state=None, reset=None,
                         gates=None, solver=None, l2norm_qk=False):
    """The recurrence token by token (decoding and short continuations, as fla's fused_recurrent),
    forward only; the semantics of model.delta_rule_naive with initial_state=state.

    q, k [B,T,H,K], v [B,T,H,V], g, beta [B,T,H], ke [B,T,H,L-1,K], ve [B,T,H,L-1,V] or None; a
    single token may also come without the T axis ([B,H,...]), and the output follows. Rows of
    each input may be strided (slices of a wider projection). state [B,H,K,V] float32 contiguous
    is updated in place (None: start from zeros); a bfloat16 state is read, updated in float32
    over the call's tokens and rounded once when stored. reset [B,T] bool: the state is dropped before
    that token. Returns (o [B,T,H,V] in v's dtype, state).

    The model's decoding step hands over its raw projections instead, so the layer's recurrence
    is one launch: l2norm_qk=True normalises q and k here; gates=(A_log, dt_bias) makes g, beta
    the projections a, b (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b));
    solver=dict(u, keys, gains, steps, keys_mode, mode, nonlinear) forms PRISM's rows from the
    solver's projections (PRISM.solver_write): u [B,T,H,V], keys [B,T,n,H,K] before the l2-norm
    (None for keys_mode "base"), gains [B,T,L-1,H,V] (None: no gain), steps [B,T,H,L-1] logits.
    """
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v, g, beta = q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None]
        ke = ke[:, None] if ke is not None else None
        ve = ve[:, None] if ve is not None else None
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (B, T, H) or g.shape != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"recurrent_prism_step: need q, k [B,T,H,K], v [B,T,H,V], g, beta [B,T,H]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(g.shape)}, {tuple(beta.shape)}")
    if (ke is None) != (ve is None) or (solver is not None and ke is not None):
        raise ValueError("recurrent_prism_step: pass ke and ve together, or solver, or neither")
    _launchable(q, "recurrent_prism_step")
    if state is None:
        state = torch.zeros(B, H, K, V, dtype=torch.float32, device=q.device)
    elif state.shape != (B, H, K, V) or state.dtype not in (torch.float32, torch.bfloat16) \
            or not state.is_contiguous():
        raise ValueError(f"recurrent_prism_step: state must be float32 (or bfloat16) contiguous [B,H,K,V] = "
                         f"{(B, H, K, V)}, got {state.dtype} {tuple(state.shape)}")
    scale = K ** -0.5 if scale is None else float(scale)
    (q, s_q), (k, s_k), (v, s_v) = _rows(q), _rows(k), _rows(v)
    (g, s_g), (beta, s_b) = _rows(g), _rows(beta)
    flags, has_reset = _flags(reset, B, T, q.device)
    NE, keys_mode, gain, mode = 0, 0, False, 0
    dummy = g
    ke_, ve_, u, steps = dummy, dummy, dummy, dummy
    s_ke = h_ke = l_ke = s_ve = h_ve = l_ve = s_u = s_st = 0
    if ke is not None:
        NE = ke.shape[3]
        if ke.shape != (B, T, H, NE, K) or ve.shape != (B, T, H, NE, V):
            raise ValueError(f"recurrent_prism_step: ke must be [B,T,H,L-1,K], ve [B,T,H,L-1,V]; got "
                             f"{tuple(ke.shape)}, {tuple(ve.shape)}")
        (ke_, s_ke), (ve_, s_ve) = _rows(ke), _rows(ve)
        h_ke, l_ke, h_ve, l_ve = NE * K, K, NE * V, V
    if solver is not None:
        keys, gains = solver.get("keys"), solver.get("gains")
        NE = solver["steps"].shape[-1]
        keys_mode = SOLVER_KEYS[solver["keys_mode"]]
        mode = _SOLVER_MODES[solver["mode"], bool(solver["nonlinear"])]
        u, s_u = _rows(solver["u"])
        steps, s_st = _rows(solver["steps"])
        if keys_mode != 2:
            ke_, s_ke = _rows(keys)
            h_ke, l_ke = K, H * K
        if gains is not None:
            gain = True
            ve_, s_ve = _rows(gains)
            h_ve, l_ve = V, H * V
    if NE == 0:
        solver = None
    BK = triton.next_power_of_2(K)
    BV = min(OVERRIDES.get("step_bv", 32), triton.next_power_of_2(V))
    o = _empty(B, T, H, V, dtype=v.dtype, device=q.device)
    A_log, dt_bias = gates if gates is not None else (dummy, dummy)
    _recurrent_fwd[(triton.cdiv(V, BV) * B * H,)](
        q, k, v, g, beta, ke_, ve_, state, o, flags, A_log, dt_bias, u, steps,
        scale, T, H, s_q, s_k, s_v, s_g, s_b, s_ke, h_ke, l_ke, s_ve, h_ve, l_ve, s_u, s_st,
        K=K, V=V, NE=NE, BK=BK, BV=BV, NORM_QK=bool(l2norm_qk), GATES=gates is not None,
        SOLVER=solver is not None, KEYS=keys_mode, GAIN=gain, MODE=mode, HAS_RESET=has_reset,
        num_warps=OVERRIDES.get("step_warps", 4 if BK * BV <= 4096 else 8))
    return (o[:, 0] if squeeze else o), state


@triton.jit
def _gated_norm(o, gate, w, y, eps, H, s_g, V: tl.constexpr, BV: tl.constexpr):
    # one (token, head): y = o / rms(o) * w * silu(gate)
    i = tl.program_id(0).to(tl.int64)
    t, h = i // H, i % H
    o_v = tl.arange(0, BV)
    m = o_v < V
    b_o = tl.load(o + i * V + o_v, mask=m, other=0.).to(tl.float32)
    b_g = tl.load(gate + t * s_g + h * V + o_v, mask=m, other=0.).to(tl.float32)
    b_w = tl.load(w + o_v, mask=m, other=0.).to(tl.float32)
    rstd = 1. / tl.sqrt(tl.sum(b_o * b_o, axis=0) / V + eps)
    tl.store(y + i * V + o_v, (b_o * rstd * b_w * b_g * tl.sigmoid(b_g)).to(y.dtype.element_ty), mask=m)


def gated_rms_norm(o, gate, weight, eps):
    """RMSNorm over the last dim of o [B,T,H,V] (weight [V]) times silu(gate), gate [B,T,H*V]
    (rows may be strided). Returns [B,T,H*V] in o's dtype."""
    B, T, H, V = o.shape
    if gate.shape != (B, T, H * V) or weight.shape != (V,):
        raise ValueError(f"gated_rms_norm: need o [B,T,H,V], gate [B,T,H*V], weight [V]; got "
                         f"{tuple(o.shape)}, {tuple(gate.shape)}, {tuple(weight.shape)}")
    _launchable(o, "gated_rms_norm")
    gate, s_g = _rows(gate)
    o = o.contiguous()
    y = _empty(B, T, H * V, dtype=o.dtype, device=o.device)
    _gated_norm[(B * T * H,)](o, gate, weight, y, float(eps), H, s_g, V=V, BV=triton.next_power_of_2(V))
    return y


@triton.jit
def _add_norm(x, y, s, h, w, eps, D: tl.constexpr, BD: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m = o_d < D
    b_s = tl.load(x + i * D + o_d, mask=m, other=0.).to(tl.float32) + tl.load(y + i * D + o_d, mask=m, other=0.).to(tl.float32)
    b_s = b_s.to(s.dtype.element_ty)  # the norm sees the sum as stored, as x + y then a norm would
    tl.store(s + i * D + o_d, b_s, mask=m)
    b_s = b_s.to(tl.float32)
    rstd = 1. / tl.sqrt(tl.sum(b_s * b_s, axis=0) / D + eps)
    b_w = tl.load(w + o_d, mask=m, other=0.).to(tl.float32)
    tl.store(h + i * D + o_d, (b_s * rstd * b_w).to(h.dtype.element_ty), mask=m)


def add_rms_norm(x, y, weight, eps):
    """A residual add and the RMSNorm after it in one pass: returns (x + y, RMSNorm(x + y))
    for x, y [..., D], both in x's dtype (weight [D])."""
    if y.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: need x, y [..., D] of one shape and weight [D]; got "
                         f"{tuple(x.shape)}, {tuple(y.shape)}, {tuple(weight.shape)}")
    _launchable(x, "add_rms_norm")
    x, y = x.contiguous(), y.contiguous()
    D = x.shape[-1]
    s, h = torch.empty_like(x), torch.empty_like(x)
    _add_norm[(x.numel() // D,)](x, y, s, h, weight, float(eps), D=D, BD=triton.next_power_of_2(D))
    return s, h


@triton.jit
def _silu_mul(x, y, N, s_x, BN: tl.constexpr):
    i, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_n = j * BN + tl.arange(0, BN)
    m = o_n < N
    a = tl.load(x + i * s_x + o_n, mask=m, other=0.).to(tl.float32)
    b = tl.load(x + i * s_x + N + o_n, mask=m, other=0.).to(tl.float32)
    tl.store(y + i * N + o_n, (a * tl.sigmoid(a) * b).to(y.dtype.element_ty), mask=m)


def silu_mul(x):
    """silu(x[..., :N]) * x[..., N:] for x [..., 2N] (contiguous rows)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    _launchable(x, "silu_mul")
    N = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * N)
    y = _empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    BN = min(1024, triton.next_power_of_2(N))
    _silu_mul[(rows.shape[0], triton.cdiv(N, BN))](rows, y, N, rows.stride(0), BN=BN)
    return y


@triton.jit
def _rope_kv(qkv, cos, sin, pos, begin, q_out, kc, vc, H, L, s_x,
             D: tl.constexpr, BD: tl.constexpr):
    # one (row b, head h) of a one-token step: rotate q and k at the token's position in its
    # segment, write k and v to the cache at the token's index there
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    idx = tl.load(pos)
    rp = idx - tl.load(begin + i_b)
    o_d = tl.arange(0, BD)
    m = o_d < D // 2
    c = tl.load(cos + rp * (D // 2) + o_d, mask=m, other=0.)
    s = tl.load(sin + rp * (D // 2) + o_d, mask=m, other=0.)
    base = qkv + i_b.to(tl.int64) * s_x + i_h * D
    q1 = tl.load(base + o_d, mask=m, other=0.).to(tl.float32)
    q2 = tl.load(base + D // 2 + o_d, mask=m, other=0.).to(tl.float32)
    k1 = tl.load(base + H * D + o_d, mask=m, other=0.).to(tl.float32)
    k2 = tl.load(base + H * D + D // 2 + o_d, mask=m, other=0.).to(tl.float32)
    vv1 = tl.load(base + 2 * H * D + o_d, mask=m, other=0.)
    vv2 = tl.load(base + 2 * H * D + D // 2 + o_d, mask=m, other=0.)
    qo = q_out + i_bh.to(tl.int64) * D
    tl.store(qo + o_d, (q1 * c - q2 * s).to(q_out.dtype.element_ty), mask=m)
    tl.store(qo + D // 2 + o_d, (q2 * c + q1 * s).to(q_out.dtype.element_ty), mask=m)
    co = ((i_b.to(tl.int64) * L + idx) * H + i_h) * D
    tl.store(kc + co + o_d, (k1 * c - k2 * s).to(kc.dtype.element_ty), mask=m)
    tl.store(kc + co + D // 2 + o_d, (k2 * c + k1 * s).to(kc.dtype.element_ty), mask=m)
    tl.store(vc + co + o_d, vv1.to(vc.dtype.element_ty), mask=m)
    tl.store(vc + co + D // 2 + o_d, vv2.to(vc.dtype.element_ty), mask=m)


def rope_kv_write(qkv, cos, sin, pos, begin, k_cache, v_cache):
    """One token of attention input, qkv [B,1,3*H*D] (q|k|v, rows may be strided): rotates q and
    k (half-split RoPE, tables cos, sin [max_len, D/2] float32) at position pos - begin[b] (pos:
    0-d int64 tensor, the token's index in the cache; begin [B]: its segment's first index) and
    writes k, v to k_cache, v_cache [B,max_len,H,D] at index pos. Returns q [B,1,H,D]."""
    B, L, H, D = k_cache.shape
    if qkv.shape != (B, 1, 3 * H * D) or v_cache.shape != k_cache.shape or D % 2:
        raise ValueError(f"rope_kv_write: need qkv [B,1,3*H*D] and caches [B,L,H,D] with even D; got "
                         f"{tuple(qkv.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    _launchable(qkv, "rope_kv_write")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = _empty(B, 1, H, D, dtype=qkv.dtype, device=qkv.device)
    _rope_kv[(B * H,)](qkv, cos, sin, pos, begin, q, k_cache, v_cache, H, L, qkv.stride(0),
                       D=D, BD=triton.next_power_of_2(D // 2))
    return q


@triton.jit
def _attn_part(q, kc, vc, begin, pos, m_out, l_out, acc_out, scale, H, L, SPLIT, NS,
               D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    # split i_s of the keys [begin_b, pos] of one (row, head): an online softmax over its share
    i_s, i_bh = _pid_split(NS)
    i_b, i_h = i_bh // H, i_bh % H
    hi = tl.minimum(tl.load(pos) + 1, (i_s + 1) * SPLIT)
    lo = tl.maximum(tl.load(begin + i_b), i_s * SPLIT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_q = tl.load(q + i_bh.to(tl.int64) * D + o_d, mask=m_d, other=0.).to(tl.float32) * scale
    base = i_b.to(tl.int64) * L * H * D + i_h * D
    b_m = tl.full([], float("-inf"), tl.float32)
    b_l = tl.zeros([], dtype=tl.float32)
    b_acc = tl.zeros([BD], dtype=tl.float32)
    for j0 in range(lo, hi, BN):
        o_n = j0 + tl.arange(0, BN)
        m_n = o_n < hi
        off = base + o_n.to(tl.int64)[:, None] * H * D + o_d[None, :]
        b_k = tl.load(kc + off, mask=m_n[:, None] & m_d[None, :], other=0.).to(tl.float32)
        b_sc = tl.where(m_n, tl.sum(b_k * b_q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_sc, axis=0))
        b_p = tl.exp(b_sc - m_new)
        alpha = tl.exp(b_m - m_new)
        b_v = tl.load(vc + off, mask=m_n[:, None] & m_d[None, :], other=0.).to(tl.float32)
        b_l = b_l * alpha + tl.sum(b_p, axis=0)
        b_acc = b_acc * alpha + tl.sum(b_p[:, None] * b_v, axis=0)
        b_m = m_new
    part = i_bh.to(tl.int64) * NS + i_s
    tl.store(m_out + part, b_m)
    tl.store(l_out + part, b_l)
    tl.store(acc_out + part * D + o_d, b_acc, mask=m_d)


@triton.jit
def _attn_combine(m_in, l_in, acc_in, o, NS, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr):
    i_bh = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BS)
    m_s = o_s < NS
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_m = tl.load(m_in + i_bh * NS + o_s, mask=m_s, other=float("-inf"))
    b_l = tl.load(l_in + i_bh * NS + o_s, mask=m_s, other=0.)
    b_acc = tl.load(acc_in + (i_bh * NS + o_s)[:, None] * D + o_d[None, :],
                    mask=m_s[:, None] & m_d[None, :], other=0.)
    w = tl.exp(b_m - tl.max(b_m, axis=0))  # empty splits have m = -inf: weight 0
    out = tl.sum(w[:, None] * b_acc, axis=0) / tl.sum(w * b_l, axis=0)
    tl.store(o + i_bh * D + o_d, out.to(o.dtype.element_ty), mask=m_d)


def attention_splits(batch, heads, max_len):
    """Key splits per (row, head) for decode_attention: enough programs to fill the GPU, none
    shorter than 256 keys; fixed for a cache, so a captured step keeps its grid."""
    return max(1, min(triton.cdiv(max_len, 256), triton.cdiv(4 * 132, batch * heads)))


def decode_attention(q, k_cache, v_cache, begin, pos, splits=None, scale=None):
    """Softmax attention of one query per row, q [B,1,H,D], over the keys at cache indices
    begin[b] .. pos (pos: 0-d int64 tensor; begin [B] int64) of k_cache, v_cache [B,L,H,D]
    (flash-decoding: the keys are split among programs, the partial softmaxes merged after).
    Returns [B,1,H,D] in q's dtype."""
    B, L, H, D = k_cache.shape
    if q.shape != (B, 1, H, D) or v_cache.shape != k_cache.shape or begin.shape != (B,):
        raise ValueError(f"decode_attention: need q [B,1,H,D], caches [B,L,H,D], begin [B]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(begin.shape)}")
    _launchable(q, "decode_attention")
    NS = splits or attention_splits(B, H, L)
    BN = 64
    SPLIT = triton.cdiv(triton.cdiv(L, NS), BN) * BN
    scale = D ** -0.5 if scale is None else float(scale)
    dev = q.device
    m = _empty(B * H, NS, dtype=torch.float32, device=dev)
    l = _empty(B * H, NS, dtype=torch.float32, device=dev)
    acc = _empty(B * H, NS, D, dtype=torch.float32, device=dev)
    BD = triton.next_power_of_2(D)
    _attn_part[(NS * B * H,)](q.contiguous(), k_cache, v_cache, begin, pos, m, l, acc, scale, H, L, SPLIT, NS,
                              D=D, BD=BD, BN=BN, num_warps=4)
    o = _empty(B, 1, H, D, dtype=q.dtype, device=dev)
    _attn_combine[(B * H,)](m, l, acc, o, NS, D=D, BD=BD, BS=triton.next_power_of_2(NS))
    return o
