"""
Triton kernels for the PRISM recurrence: the gated delta rule plus L-1 extra rank-1 writes
per token (PRISM_SPEC.md §3), forward and backward, chunk-parallel (chunks of C = 64 tokens;
32 where a key row passes 256 bytes: float32 at K >= 128, bf16/fp16 at K = 256), fixed-length
batches or packed sequences (cu_seqlens).

    S_t = exp(g_t) S_{t-1};  u_t = beta_t (v_t - S_t^T k_t);  S_t += k_t u_t^T + sum_l ke_tl ve_tl^T
    o_t = S_t^T (scale q_t)

Entry points:
    chunk_prism(q, k, v, g, beta, ke=None, ve=None, scale=None, initial_state=None,
                output_final_state=False, cu_seqlens=None, l2norm_qk=False) -> (o, final_state)
    recurrent_prism_step, conv_step, ...  # decoding against a cache: prism_ops/decode.py documents them
    causal_conv(x, weight, silu=True, cu_seqlens=None) -> y   # the layers' short conv, autograd-aware
    solver_chain(v, u, gains, keys, steps, mode, nonlinear) -> (ke, ve)   # model.solver_chain fused
Fixed-length calls run as torch.library custom ops (<module>::chunk_fwd / chunk_bwd, conv_fwd /
conv_bwd, solver_fwd / solver_bwd, with fake-tensor shapes), so torch.compile keeps a model using them in one graph.

This file holds the entry points, their argument checks and the custom ops and autograd that
compose the stages. The kernels live in prism_ops/, one file per stage or op family, each with
its maths at the top (the per-chunk algebra: chunk_fwd.py; the backward's: chunk_bwd.py):
    prism_ops/tiles.py      what the chunk kernels share: tile helpers, chunk and sequence
                            coordinates, the dot's precision rule, launch_config, packed-sequence tables
    prism_ops/chunk_fwd.py  _fwd_prep [NC, H] -> G, Tm, W, U', R   _fwd_state [NV, N*H] -> h, U
                            _fwd_out [NV, NC, H] -> O   (_fwd_w, _fwd_rows: W, R again for the backward)
    prism_ops/chunk_bwd.py  _bwd_dv_local, _bwd_state (reverse over chunks) -> dU, dh, dS0;
                            _bwd_rows (one injected row per program); _bwd_local -> dq, dk, dv, dbeta, dg
                            (at K > 128 the pair _bwd_local_cc, _bwd_local_dqk, K in blocks)
    prism_ops/l2norm.py     l2norm_qk=True: q and k normalised inside the op (and back-propagated)
    prism_ops/conv.py       causal_conv's kernels
    prism_ops/solver.py     solver_chain's kernels
    prism_ops/decode.py     the decoding steps
(grids: NC chunks over all sequences, NV value blocks, N sequences, H heads). The forward keeps
G, Tm and U for the backward, not W or h (the largest activation); the backward rebuilds them.
Packed sequences: every sequence starts a new chunk (chunk_indices maps a chunk program to its
sequence and chunk); the state passes run one program per sequence, head and value block.
All loads are plain pointer arithmetic with masks (no block pointers: Triton 3.6 to 3.9), and
every offset that is a product of sizes is int64. launch_config holds every block size, warp
count and pipeline depth (bench/KERNEL_NOTES.md: the rules and their shared-memory estimates);
OVERRIDES (or PRISM_KERNEL_CONFIG) changes them. tests/test_kernel.py checks every gradient
against autograd through the float64 token-by-token recurrence.

Precision: the state and all accumulators are float32. float32 inputs use tf32x3 dot
products (about float32 accuracy on the tensor cores); bf16/fp16 inputs feed the tensor cores
in their own dtype (like flash-linear-attention), the saved chunk states h and pseudo-values U
are kept in that dtype.
"""
import re
from typing import List, Optional, Tuple

import torch

if __package__:   # a copy inside a package (the directory export_hf.py writes) runs the prism_ops/ beside it
    from .prism_ops import chunk_bwd, chunk_fwd, conv, decode, l2norm, solver, tiles
else:
    from prism_ops import chunk_bwd, chunk_fwd, conv, decode, l2norm, solver, tiles

# the stages: each launch site looks its kernels up in its own module (a recorder patches them all)
_STAGES = (tiles, chunk_fwd, chunk_bwd, l2norm, conv, solver, decode)
# the launch table and the decoding steps, as this module's names
OVERRIDES, SMEM_LIMIT = tiles.OVERRIDES, tiles.SMEM_LIMIT
launch_config, smem_estimate = tiles.launch_config, tiles.smem_estimate
conv_step, recurrent_prism_step, SOLVER_KEYS = decode.conv_step, decode.recurrent_prism_step, decode.SOLVER_KEYS
gated_rms_norm, add_rms_norm, silu_mul = decode.gated_rms_norm, decode.add_rms_norm, decode.silu_mul
rope_kv_write, decode_attention = decode.rope_kv_write, decode.decode_attention
attention_splits = decode.attention_splits


def _fwd_normed(q, k, v, g, beta, ke, ve, scale, h0, output_final_state, cu_seqlens, l2norm_qk):
    """chunk_fwd._fwd, with q and k l2-normalised first where l2norm_qk. Returns (o, ht, q and k
    as the kernels ran on them, their inverse norms or None, the saved tensors, the tables)."""
    rq = rk = None
    if l2norm_qk:
        (q, rq), (k, rk) = l2norm._l2norm_rows(q), l2norm._l2norm_rows(k)
    o, ht, saved, tables = chunk_fwd._fwd(q, k, v, g, beta, ke, ve, scale, h0, output_final_state, cu_seqlens)
    return o, ht, q, k, rq, rk, saved, tables


def _bwd_normed(q, k, v, g, beta, ke, ve, scale, h0, saved, do, dht, cu_seqlens, tables, rq, rk):
    """chunk_bwd._bwd, then back through the l2 norm where rq, rk (the inverse norms) are given;
    q and k are the normalised copies. Returns (dq, dk, dv, dg, dbeta [float32], dke, dve, dh0)."""
    dq, dk, *rest = chunk_bwd._bwd(q, k, v, g, beta, ke, ve, scale, h0, saved, do.contiguous(),
                                   None if dht is None else dht.contiguous(), cu_seqlens, tables)
    if rq is not None:
        dq, dk = l2norm._l2norm_rows_grad(q, rq, dq), l2norm._l2norm_rows_grad(k, rk, dk)
    return (dq, dk, *rest)


# torch.compile: the fixed-length recurrence is a pair of torch.library custom ops (forward and
# backward, each with a fake-tensor shape function, tied by register_autograd), so a compiled
# model stays one graph through every layer: no graph break per call, and Inductor fuses and
# plans memory across the op instead of around a break. The forward returns what its backward
# needs as extra outputs. Packed sequences (cu_seqlens) size their chunk tables from the data
# (a host read) and keep the autograd.Function below (compiled code breaks the graph there).
# The namespace is the module's name: the copy export_hf.py writes registers ops of its own.
_NS = re.sub(r"\W", "_", __name__)


def _ops():
    return getattr(torch.ops, _NS)


@torch.library.custom_op(f"{_NS}::chunk_fwd", mutates_args=())
def _chunk_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  ke: Optional[torch.Tensor], ve: Optional[torch.Tensor], h0: Optional[torch.Tensor],
                  scale: float, output_final_state: bool, l2norm_qk: bool
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, ht, q and k as normalised, their inverse norms, G, Tm, U); a tensor that does not
    apply is empty ([0]): ht without output_final_state, the four norm outputs without l2norm_qk."""
    o, ht, qn, kn, rq, rk, (gc, tinv, u), _ = _fwd_normed(q, k, v, g, beta, ke, ve, scale, h0,
                                                          output_final_state, None, l2norm_qk)
    empty = lambda dtype: q.new_empty(0, dtype=dtype)   # outputs may not alias the inputs
    if not l2norm_qk:
        qn, kn, rq, rk = empty(q.dtype), empty(q.dtype), empty(torch.float32), empty(torch.float32)
    return o, empty(torch.float32) if ht is None else ht, qn, kn, rq, rk, gc, tinv, u


@_chunk_fwd_op.register_fake
def _(q, k, v, g, beta, ke, ve, h0, scale, output_final_state, l2norm_qk):
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT = tiles.launch_config(K, V, q.dtype, 0 if ke is None else ke.shape[3], B * H)[0]
    NC = B * ((T + BT - 1) // BT)
    f32 = torch.float32
    ht = q.new_empty(B, H, K, V, dtype=f32) if output_final_state else q.new_empty(0, dtype=f32)
    norm = ((q.new_empty(B, T, H, K), q.new_empty(B, T, H, K), q.new_empty(B, T, H, dtype=f32),
             q.new_empty(B, T, H, dtype=f32)) if l2norm_qk else
            (q.new_empty(0), q.new_empty(0), q.new_empty(0, dtype=f32), q.new_empty(0, dtype=f32)))
    return (q.new_empty(B, T, H, V), ht, *norm, q.new_empty(NC, H, BT, dtype=f32),
            q.new_empty(NC, H, BT, BT), q.new_empty(B, T, H, V))


@torch.library.custom_op(f"{_NS}::chunk_bwd", mutates_args=())
def _chunk_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  ke: Optional[torch.Tensor], ve: Optional[torch.Tensor], h0: Optional[torch.Tensor],
                  gc: torch.Tensor, tinv: torch.Tensor, u: torch.Tensor, rq: torch.Tensor, rk: torch.Tensor,
                  do: torch.Tensor, dht: Optional[torch.Tensor], scale: float, l2norm_qk: bool
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta [float32], dke, dve, dh0); dke, dve, dh0 are empty where their
    input is absent. With l2norm_qk, q and k are the normalised copies and dq, dk are the raw
    inputs' gradients."""
    norms = (rq, rk) if l2norm_qk else (None, None)
    dq, dk, dv, dg, dbeta, dke, dve, dh0 = _bwd_normed(q, k, v, g, beta, ke, ve, scale, h0, (gc, tinv, u),
                                                       do, dht, None, None, *norms)
    return (dq, dk, dv, dg, dbeta, *(q.new_empty(0) if x is None else x for x in (dke, dve)),
            q.new_empty(0, dtype=torch.float32) if dh0 is None else dh0)


@_chunk_bwd_op.register_fake
def _(q, k, v, g, beta, ke, ve, h0, gc, tinv, u, rq, rk, do, dht, scale, l2norm_qk):
    f32 = torch.float32
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), g.new_empty(g.shape, dtype=f32),
            beta.new_empty(beta.shape, dtype=f32),
            *(q.new_empty(0) if x is None else torch.empty_like(x) for x in (ke, ve)),
            q.new_empty(0, dtype=f32) if h0 is None else torch.empty_like(h0, dtype=f32))


def _chunk_setup_context(ctx, inputs, output):
    q, k, v, g, beta, ke, ve, h0, scale, _, l2norm_qk = inputs
    _, _, qn, kn, rq, rk, gc, tinv, u = output
    if l2norm_qk:   # the backward runs on the normalised copies, not the raw inputs
        q, k = qn, kn
    ctx.save_for_backward(q, k, v, g, beta, ke, ve, h0, gc, tinv, u, rq, rk)
    ctx.scale, ctx.l2norm_qk = scale, l2norm_qk
    ctx.mark_non_differentiable(*output[2:])


def _chunk_backward(ctx, do, dht, *_):
    q, k, v, g, beta, ke, ve, h0, gc, tinv, u, rq, rk = ctx.saved_tensors
    dht = None if dht is None or dht.numel() == 0 else dht
    dq, dk, dv, dg, dbeta, dke, dve, dh0 = _ops().chunk_bwd(
        q, k, v, g, beta, ke, ve, h0, gc, tinv, u, rq, rk, do, dht, ctx.scale, ctx.l2norm_qk)
    return (dq, dk, dv, dg.to(g.dtype), dbeta.to(beta.dtype), None if ke is None else dke,
            None if ve is None else dve, None if h0 is None else dh0, None, None, None)


_chunk_fwd_op.register_autograd(_chunk_backward, setup_context=_chunk_setup_context)


class ChunkPrismFunction(torch.autograd.Function):
    # packed sequences (cu_seqlens); fixed-length batches take the custom ops above

    @staticmethod
    def forward(ctx, q, k, v, g, beta, ke, ve, scale, initial_state, output_final_state, cu_seqlens, l2norm_qk):
        o, ht, q, k, rq, rk, saved, tables = _fwd_normed(q, k, v, g, beta, ke, ve, scale, initial_state,
                                                         output_final_state, cu_seqlens, l2norm_qk)
        ctx.save_for_backward(q, k, v, g, beta, ke, ve, initial_state, cu_seqlens, rq, rk, *saved)
        ctx.scale, ctx.tables = scale, tables
        if ht is not None:
            return o, ht
        return o

    @staticmethod
    def backward(ctx, do, dht=None):
        q, k, v, g, beta, ke, ve, h0, cu_seqlens, rq, rk, *saved = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dke, dve, dh0 = _bwd_normed(q, k, v, g, beta, ke, ve, ctx.scale, h0, saved, do,
                                                           dht, cu_seqlens, ctx.tables, rq, rk)
        return (dq, dk, dv, dg.to(g.dtype), dbeta.to(beta.dtype), dke, dve, None, dh0, None, None, None)


def _check(q, k, v, g, beta, ke, ve, initial_state, cu_seqlens):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"chunk_prism: q and k must be [B,T,H,K] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"chunk_prism: v must be [B,T,H,V] with B,T,H = {B},{T},{H}, got {tuple(v.shape)}")
    V = v.shape[-1]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, H):
            raise ValueError(f"chunk_prism: {name} must be [B,T,H] = {(B, T, H)}, got {tuple(x.shape)}")
    if (ke is None) != (ve is None):
        raise ValueError("chunk_prism: pass ke and ve together (or neither)")
    if ke is not None:
        if ke.dim() != 5 or ke.shape[:3] != (B, T, H) or ke.shape[4] != K:
            raise ValueError(f"chunk_prism: ke must be [B,T,H,L-1,K], got {tuple(ke.shape)}")
        if ve.shape != (B, T, H, ke.shape[3], V):
            raise ValueError(f"chunk_prism: ve must be [B,T,H,L-1,V] = {(B, T, H, ke.shape[3], V)}, got {tuple(ve.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)) + ((("ke", ke), ("ve", ve)) if ke is not None else ()):
        if x.dtype not in tiles._DOT_DTYPES:
            raise ValueError(f"chunk_prism: {name} must be float32, bfloat16 or float16, got {x.dtype} "
                             "(use model.delta_rule_chunk for float64)")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"chunk_prism: with cu_seqlens the sequences are packed along T and B must be 1, got B={B}")
        N = cu_seqlens.numel() - 1 if isinstance(cu_seqlens, torch.Tensor) else -1
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"chunk_prism: initial_state must be [N,H,K,V] = {(N, H, K, V)} "
                         f"(N = {'sequences in cu_seqlens' if cu_seqlens is not None else 'batch'}), "
                         f"got {tuple(initial_state.shape)}")
    if not q.is_cuda and not tiles._interpreting():
        raise ValueError("chunk_prism: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU)")


def _kernel_dtype(dt, K, V):
    """The kernels' compute dtype for inputs promoted to dt. Head dims below 64 in half precision
    run in float32 on a GPU: in bf16 at K = 16 the forward gave non-finite outputs on the H200
    (Triton 3.6; float32 passed at the same shapes), and the GPU-tested matrix starts at 64. Heads
    that small serve tests and debugging, not speed. The CPU interpreter keeps dt (its half
    precision paths are what the tiny CPU tests check)."""
    if dt != torch.float32 and min(K, V) < 64 and not tiles._interpreting():
        return torch.float32
    return dt


def chunk_prism(q, k, v, g, beta, ke=None, ve=None, scale=None, initial_state=None,
                output_final_state=False, cu_seqlens=None, l2norm_qk=False):
    """PRISM / gated delta rule, chunk-parallel Triton kernels; exact semantics of
    model.delta_rule_naive. q, k [B,T,H,K] (already l2-normalised), v [B,T,H,V], g [B,T,H]
    log-decay <= 0, beta [B,T,H], ke [B,T,H,L-1,K], ve [B,T,H,L-1,V] or None (GDN).
    cu_seqlens (int32/int64 [N+1], 0 = start < ... < end = T): B == 1 and the inputs hold N
    sequences back to back, each run from its own initial state (flash-linear-attention's
    convention); no state or chunk crosses a boundary.
    l2norm_qk: q and k are raw and are l2-normalised here (F.normalize over K), inside the op, so
    only the normalised copies are kept for the backward; they may be views into a wider tensor.
    Returns (o [B,T,H,V] in v's dtype, final state [N,H,K,V] float32 or None), N = B or len(cu_seqlens)-1."""
    _check(q, k, v, g, beta, ke, ve, initial_state, cu_seqlens)
    if ke is not None and ke.shape[3] == 0:
        ke = ve = None
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # one compute dtype for the matmul operands (mixed inputs, e.g. under autocast, are promoted,
    # never silently rounded down); the output comes back in v's dtype like delta_rule_naive's
    out_dtype = v.dtype
    dt = q.dtype
    for x in (k, v, ke, ve):
        dt = dt if x is None else torch.promote_types(dt, x.dtype)
    dt = _kernel_dtype(dt, q.shape[-1], v.shape[-1])
    q, k = (x.to(dt) if l2norm_qk else x.to(dt).contiguous() for x in (q, k))   # _l2norm_rows reads views
    v, g, beta = v.to(dt).contiguous(), g.contiguous(), beta.contiguous()
    if ke is not None:
        ke, ve = ke.to(dt).contiguous(), ve.to(dt).contiguous()
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    if cu_seqlens is None:
        o, ht = _ops().chunk_fwd(q, k, v, g, beta, ke, ve, initial_state, scale,
                                                     bool(output_final_state), bool(l2norm_qk))[:2]
        return o.to(out_dtype), (ht if output_final_state else None)
    out = ChunkPrismFunction.apply(q, k, v, g, beta, ke, ve, scale, initial_state, output_final_state, cu_seqlens,
                                   bool(l2norm_qk))
    o, ht = out if output_final_state else (out, None)
    return o.to(out_dtype), ht


# ----------------------------------------------------------------------------------------------
# causal_conv (prism_ops/conv.py: the kernels and their maths)

# fixed-length batches: custom ops, as the recurrence's (compiled models keep one graph)
@torch.library.custom_op(f"{_NS}::conv_fwd", mutates_args=())
def _conv_fwd_op(x: torch.Tensor, w: torch.Tensor, act: bool) -> torch.Tensor:
    return conv._conv_forward(x, w, act, None)


@_conv_fwd_op.register_fake
def _(x, w, act):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{_NS}::conv_bwd", mutates_args=())
def _conv_bwd_op(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, act: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return conv._conv_backward(x, w, dy, act, None)


@_conv_bwd_op.register_fake
def _(x, w, dy, act):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w)


def _conv_setup_context(ctx, inputs, output):
    x, w, act = inputs
    ctx.save_for_backward(x, w)
    ctx.act = act


def _conv_op_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw = _ops().conv_bwd(x, w, dy, ctx.act)
    return dx, dw, None


_conv_fwd_op.register_autograd(_conv_op_backward, setup_context=_conv_setup_context)


class CausalConvFunction(torch.autograd.Function):
    # packed sequences (pos from cu_seqlens); fixed-length batches take the custom ops above

    @staticmethod
    def forward(ctx, x, w, act, pos):
        ctx.save_for_backward(x, w, pos)
        ctx.act = act
        return conv._conv_forward(x, w, act, pos)

    @staticmethod
    def backward(ctx, dy):
        x, w, pos = ctx.saved_tensors
        dx, dw = conv._conv_backward(x, w, dy, ctx.act, pos)
        return dx, dw, None, None


def causal_conv(x, weight, silu=True, cu_seqlens=None):
    """Causal depthwise conv of x [B,T,C] with weight [C,W] (tap W-1 is the current token),
    optionally followed by SiLU; the semantics of model.ShortConv without a cache.
    cu_seqlens (int32/int64 [N+1]): x is [1,T,C] holding N sequences back to back, and no tap
    reaches across a sequence start (each sequence sees zeros before its first token)."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"causal_conv: x must be [B,T,C] and weight [C,W], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if not x.is_cuda and not tiles._interpreting():
        raise ValueError("causal_conv: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    pos = None
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(f"causal_conv: with cu_seqlens x must be [1,T,C] (sequences packed along T), got {tuple(x.shape)}")
        pos = conv._conv_positions(cu_seqlens, x.shape[1], x.device)
    if pos is None:
        return _ops().conv_fwd(x.contiguous(), weight.contiguous(), bool(silu))
    return CausalConvFunction.apply(x.contiguous(), weight.contiguous(), bool(silu), pos)


# ----------------------------------------------------------------------------------------------
# solver_chain (prism_ops/solver.py: the kernels and their maths)

@torch.library.custom_op(f"{_NS}::solver_fwd", mutates_args=())
def _solver_fwd_op(v: torch.Tensor, u: torch.Tensor, p0: Optional[torch.Tensor], p1: Optional[torch.Tensor],
                   p2: Optional[torch.Tensor], k0: torch.Tensor, k1: Optional[torch.Tensor],
                   k2: Optional[torch.Tensor], steps: torch.Tensor, mode: int) -> Tuple[torch.Tensor, torch.Tensor]:
    B, T, H, V, K, NE = solver._solver_shapes(v, k0, steps)
    NK = 1 if k1 is None else NE
    ke = tiles._empty(B, T, H, NE, K, dtype=v.dtype, device=v.device)
    ve = tiles._empty(B, T, H, NE, V, dtype=v.dtype, device=v.device)
    gain = p0 is not None
    p = [x if x is not None else v for x in (p0, p1, p2)]
    k = [x if x is not None else k0 for x in (k0, k1, k2)]
    solver._solver_launch(solver._solver_fwd, B * T * H, V, K, NE, NK, gain, mode, v, u, *p, *k, steps, ke, ve)
    return ke, ve


@_solver_fwd_op.register_fake
def _(v, u, p0, p1, p2, k0, k1, k2, steps, mode):
    B, T, H, V, K, NE = solver._solver_shapes(v, k0, steps)
    return v.new_empty(B, T, H, NE, K), v.new_empty(B, T, H, NE, V)


@torch.library.custom_op(f"{_NS}::solver_bwd", mutates_args=())
def _solver_bwd_op(v: torch.Tensor, u: torch.Tensor, p0: Optional[torch.Tensor], p1: Optional[torch.Tensor],
                   p2: Optional[torch.Tensor], k0: torch.Tensor, k1: Optional[torch.Tensor],
                   k2: Optional[torch.Tensor], steps: torch.Tensor, dke: torch.Tensor, dve: torch.Tensor,
                   mode: int) -> List[torch.Tensor]:
    """[dv, du, dsteps, dk0, dp0..] with one dk per key given and one dp per gain given"""
    B, T, H, V, K, NE = solver._solver_shapes(v, k0, steps)
    NK = 1 if k1 is None else NE
    gain = p0 is not None
    new = lambda x: tiles._empty(*x.shape, dtype=x.dtype, device=x.device)
    dv, du, dst = new(v), new(u), tiles._empty(*steps.shape, dtype=torch.float32, device=v.device)
    dks = [new(x) for x in (k0, k1, k2) if x is not None]
    dps = [new(x) for x in (p0, p1, p2) if x is not None]
    p = [x if x is not None else v for x in (p0, p1, p2)]
    k = [x if x is not None else k0 for x in (k0, k1, k2)]
    dp = (dps + [dv] * 3)[:3]
    dk = (dks + [dks[0]] * 3)[:3]
    solver._solver_launch(solver._solver_bwd, B * T * H, V, K, NE, NK, gain, mode, v, u, *p, *k, steps,
                          dke.contiguous(), dve.contiguous(), dv, du, *dp, *dk, dst)
    return [dv, du, dst.to(steps.dtype), *dks, *dps]


@_solver_bwd_op.register_fake
def _(v, u, p0, p1, p2, k0, k1, k2, steps, dke, dve, mode):
    return [torch.empty_like(x) for x in (v, u, steps, k0, k1, k2, p0, p1, p2) if x is not None]


def _solver_setup_context(ctx, inputs, output):
    *tensors, mode = inputs
    ctx.save_for_backward(*tensors)
    ctx.mode = mode


def _solver_backward(ctx, dke, dve):
    v, u, p0, p1, p2, k0, k1, k2, steps = ctx.saved_tensors
    dv, du, dst, *rest = _ops().solver_bwd(v, u, p0, p1, p2, k0, k1, k2, steps, dke, dve, ctx.mode)
    nk = sum(x is not None for x in (k0, k1, k2))
    dks, dps = iter(rest[:nk]), iter(rest[nk:])
    pick = lambda x, it: None if x is None else next(it)
    return (dv, du, *(pick(x, dps) for x in (p0, p1, p2)), *(pick(x, dks) for x in (k0, k1, k2)), dst, None)


_solver_fwd_op.register_autograd(_solver_backward, setup_context=_solver_setup_context)


def solver_chain(v, u, gains, keys, steps, mode="gelu", nonlinear=True):
    """model.solver_chain in one kernel each way (same arguments, same results up to rounding:
    the chain runs in float32 registers and is rounded once, to v's dtype).
    v [B,T,H,V]; u and each gain [B,T,H*V]; keys: L-1 of [B,T,H*K] (one per step) or one
    ([B,T,H*K] or [B,T,H,K]) for every step; steps [B,T,H*(L-1)] logits. Returns
    ke [B,T,H,L-1,K] (l2-normalised keys) and ve [B,T,H,L-1,V], in v's dtype. L-1 <= 3."""
    B, T, H, V, K, NE = solver._solver_shapes(v, keys[0], steps)
    if not 1 <= NE <= 3 or steps.shape[-1] != H * NE:
        raise ValueError(f"solver_chain: steps must be [B,T,H*(L-1)] with 1 <= L-1 <= 3, got {tuple(steps.shape)} for H={H}")
    if len(keys) not in (1, NE) or len(gains) not in (0, NE):
        raise ValueError(f"solver_chain: {len(keys)} keys and {len(gains)} gains for L-1={NE} steps "
                         "(keys: 1 or L-1; gains: 0 or L-1)")
    if (mode, bool(nonlinear)) not in solver._SOLVER_MODES:
        raise ValueError(f"solver_chain: mode must be 'gelu' or 'linear', got {mode!r}")
    tiles._launchable(v, "solver_chain")
    dt = v.dtype
    if dt not in tiles._DOT_DTYPES:
        raise ValueError(f"solver_chain: v must be float32, bfloat16 or float16, got {dt} "
                         "(use model.solver_chain for float64)")
    flat = lambda x, D: x.to(dt).reshape(B, T, H * D).contiguous()
    ks = [flat(x, K) for x in keys] + [None] * (3 - len(keys))
    ps = [flat(x, V) for x in gains] + [None] * (3 - len(gains))
    return _ops().solver_fwd(v.contiguous(), flat(u, V), *ps, *ks, steps.to(dt).contiguous(),
                             solver._SOLVER_MODES[mode, bool(nonlinear)])
