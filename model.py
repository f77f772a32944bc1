"""
PRISM language model: Gated DeltaNet, PRISM and causal attention mixers in one file.

Read top to bottom:
  1. ModelConfig                 every knob, validated
  2. the recurrence              delta_rule_naive (ground truth) / delta_rule_chunk / triton hook
  3. mixers                      GatedDeltaNet -> PRISM (the solver write) ; Attention
  4. Block, Model                pre-norm residual stack, loss, generate, optimizer, MFU
  5. training arithmetic         chunked linear cross-entropy (no full logits), FLOPs per token
  6. decoding                    the static Cache, one-GEMM decode weights, sampling, CUDA graphs

The PRISM update lives in `PRISM.solver_rows` and `solver_chain` (PRISM_SPEC.md §2): the
solver's projections of the layer input, then the greedy steps that turn them into L-1 extra
(key, value) pairs per token; the recurrence writes them into the state without erasing, next
to GDN's own delta-rule write:

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T + sum_l ke_t^(l) ve_t^(l)^T
"""
import functools
import importlib
import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


# ----------------------------------------------------------------------------------------------
# 1. config

@dataclass
class ModelConfig:
    vocab_size: int = 32000          # Mistral-7B-v0.1 SentencePiece
    block_size: int = 2048           # training context; the recurrent mixers run at any length
    n_layer: int = 12                # blocks
    n_head: int = 6                  # heads per mixer
    n_embd: int = 768                # model width D
    head_dim: int = 128              # key width per head (GDN/PRISM); attention uses n_embd // n_head
    expand_v: float = 2.0            # value width per head = head_dim * expand_v (fla's GDN default)
    mlp_hidden: int = 0              # SwiGLU width; 0 = 8/3 * n_embd rounded up to a multiple of 256
    dropout: float = 0.0             # on the embeddings and residual branches; 0 for pretraining
    bias: bool = False               # bias in the Linear layers
    tie_embeddings: bool = True      # at 130M the 32000x768 table is 18% of the weights: share it
    mixer: str = "prism"             # "gdn" | "prism" | "attention"
    attn_layers: tuple = ()          # layer indices that use causal attention instead (hybrid)
    conv_size: int = 4               # causal depthwise conv on q, k, v
    norm_eps: float = 1e-6           # RMSNorm epsilon
    rope_theta: float = 10000.0      # RoPE base of the attention layers
    init_std: float = 0.02           # std of the normal init (GPT-2's)
    # PRISM solver (PRISM_SPEC.md §2.3); ignored unless mixer == "prism"
    solver_steps: int = 3            # L; 1 = GDN exactly
    solver_rank: int = 64            # r of the D -> r -> out projections from the anchor
    solver_nonlinear: bool = True    # GELU in delta = GELU(p * r)
    solver_anchor: bool = True       # anchor = silu(ShortConv(x)); False: silu(x), the token alone
    solver_gain: bool = True         # contextual gain p from the anchor; False: p = 1
    solver_keys: str = "own"         # "own" | "shared" | "base"
    solver_mode: str = "gelu"        # "gelu" (Algorithm 1) | "linear" (closed form)
    anchor_conv_size: int = 4        # width of the anchor's short conv
    # packed documents: train.bin joins them with EOS. reset_at_eos starts a new segment at every
    # EOS (the EOS is its first token): no state, conv tap or attention reaches across it
    reset_at_eos: bool = False       # start a new segment at every EOS: nothing reaches across documents
    eos_id: int = 2                  # Mistral's </s>; train.py checks it against the data's meta.json

    def __post_init__(self):
        self.attn_layers = tuple(int(i) for i in self.attn_layers)
        checks = [
            (self.mixer in ("gdn", "prism", "attention"), "mixer must be 'gdn', 'prism' or 'attention'"),
            (self.solver_keys in ("own", "shared", "base"), "solver_keys must be 'own', 'shared' or 'base'"),
            (self.solver_mode in ("gelu", "linear"), "solver_mode must be 'gelu' or 'linear'"),
            (self.solver_steps >= 1, "solver_steps must be >= 1"),
            # only attention splits the width into heads (fla's GDN-340M: 1024 wide, 6 heads)
            (self.n_embd % self.n_head == 0 or (self.mixer != "attention" and not self.attn_layers),
             "n_embd must be divisible by n_head (attention layers split the width into heads)"),
            (all(0 <= i < self.n_layer for i in self.attn_layers), f"attn_layers must lie in [0, {self.n_layer})"),
            (self.vocab_size > 0 and self.block_size > 0, "sizes must be positive"),
            (float(self.head_dim * self.expand_v).is_integer(), "head_dim * expand_v must be an integer"),
            (not self.reset_at_eos or 0 <= self.eos_id < self.vocab_size, "eos_id must lie in [0, vocab_size)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"ModelConfig: {msg} (got {self})")

    @classmethod
    def from_dict(cls, args):
        """A config from saved model args. Keys that older versions stored but that are run-time
        choices now (LEGACY_KEYS) are dropped; any other unknown key is an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known - set(LEGACY_KEYS))
        if unknown:
            raise ValueError(f"ModelConfig: unknown keys {unknown}")
        return cls(**{k: v for k, v in args.items() if k in known})

    @property
    def value_dim(self):
        return int(self.head_dim * self.expand_v)

    def layer_mixer(self, i):
        return "attention" if i in self.attn_layers else self.mixer


# older checkpoints stored these run-time choices (now Model attributes) with the hyperparameters
LEGACY_KEYS = ("backend", "chunk_size")
BACKENDS = ("naive", "chunk", "triton")


# ----------------------------------------------------------------------------------------------
# 2. the recurrence: one function, three backends
#
#   q, k [B,T,H,K]  v [B,T,H,V]  g [B,T,H] log-decay (<= 0)  beta [B,T,H]
#   ke [B,T,H,L-1,K]  ve [B,T,H,L-1,V] (already scaled by the step gates b^(l))
#   state [B,H,K,V], float32 (float64 when the inputs are float64)
#   cu_seqlens [N+1] (fla's varlen convention): B == 1 and N sequences lie back to back, sequence
#   n is tokens cu_seqlens[n]:cu_seqlens[n+1]; no state crosses from one into the next, and
#   initial_state / the final state are [N,H,K,V]

def each_sequence(fn, q, k, v, g, beta, ke, ve, cu_seqlens, initial_state, output_final_state, **kw):
    """cu_seqlens for the PyTorch backends: run `fn` on every sequence alone (a host loop; the
    Triton kernels do it natively)."""
    bounds = cu_seqlens.tolist()
    if q.shape[0] != 1 or bounds[0] != 0 or bounds[-1] != q.shape[1] or \
            any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to T = {q.shape[1]} with B == 1, "
                         f"got {bounds} for B = {q.shape[0]}")
    N = len(bounds) - 1
    if initial_state is not None and initial_state.shape[0] != N:
        raise ValueError(f"initial_state must hold one state per sequence ({N}), got {tuple(initial_state.shape)}")
    outs, finals = [], []
    for n in range(N):
        piece = [None if x is None else x[:, bounds[n]:bounds[n + 1]] for x in (q, k, v, g, beta, ke, ve)]
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, ht = fn(*piece, initial_state=h0, output_final_state=output_final_state, **kw)
        outs.append(o)
        finals.append(ht)
    return torch.cat(outs, 1), (torch.cat(finals) if output_final_state else None)


def float32_recurrence(fn):
    """fn (a PyTorch backend) with autocast off: it computes in float32 (float64 for float64
    inputs) as its inputs are cast, and as the Triton kernels do. Under bf16 autocast its einsums
    and matmuls would run in bf16, rounding the float32 state (and the chunk form's matrices) at
    every product, differently in the token loop and in the chunk form: the cached decoding
    steps (token loop) then left the full forward (chunk form) by 1-2% of the logits at random
    init (BENCHMARKS.md, decoding)."""
    @functools.wraps(fn)
    def run(q, *args, **kw):
        with torch.autocast(q.device.type, enabled=False):
            return fn(q, *args, **kw)
    return run


@float32_recurrence
def delta_rule_naive(q, k, v, g, beta, ke=None, ve=None, scale=None, initial_state=None,
                     output_final_state=False, cu_seqlens=None):
    """Token by token. The ground truth every other backend is tested against."""
    if cu_seqlens is not None:
        return each_sequence(delta_rule_naive, q, k, v, g, beta, ke, ve, cu_seqlens, initial_state,
                             output_final_state, scale=scale)
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    S = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    ke = ke.to(acc) if ke is not None else None
    ve = ve.to(acc) if ve is not None else None
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]                                   # forget: a_t S
        kS = torch.einsum("bhk,bhkv->bhv", k[:, t], S)                             # S^T k
        u = beta[:, t, :, None] * (v[:, t] - kS)                                   # delta-rule value
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        if ke is not None:                                                         # solver writes
            S = S + torch.einsum("bhlk,bhlv->bhkv", ke[:, t], ve[:, t])
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    # in v's dtype, as the chunk backend and the kernels return it: a bf16 step that kept its
    # float32 output went on through the output norm unrounded, which the full forward rounds
    # (the largest part of the bf16 gap between cached decoding and the full forward)
    o = torch.stack(out, 1).to(out_dtype)
    return o, (S if output_final_state else None)


def chunk_decay(g, C):
    """Pad [B,T,H] log-decays to a multiple of C and return the in-chunk cumulative sums
    [B,N,C,H]: G_t = sum_{s<=t} g_s. Padded tokens get g = 0 (no decay), so they leave the
    state untouched. Shared by the chunk backend and the kernels' reference."""
    B, T, H = g.shape
    N = (T + C - 1) // C
    g = F.pad(g, (0, 0, 0, N * C - T))
    return g.view(B, N, C, H).cumsum(2)


@float32_recurrence
def delta_rule_chunk(q, k, v, g, beta, ke=None, ve=None, scale=None, initial_state=None,
                     output_final_state=False, chunk_size=64, cu_seqlens=None):
    """Chunk-parallel form of PRISM_SPEC §3 in PyTorch (autograd; any T; CPU or GPU).

    Per chunk of C tokens with entering state S0, G = in-chunk cumulative log-decay:
      (I + diag(b) A_kk) U = diag(b) (V - sum_l A_ke^(l) Ve^(l)) - diag(b exp(G)) K S0
      O  = diag(exp(G)) Q S0 + (Gam * tril(Q K^T)) U + sum_l (Gam * tril(Q Ke^(l)^T)) Ve^(l)
      S' = exp(G_C) S0 + [K; Ke]^T diag(exp(G_C - G)) [U; Ve]
    The triangular solve is done for all chunks at once (the WY form U = Uh - W S0), so the
    only sequential part is the cheap state pass.
    """
    if cu_seqlens is not None:
        return each_sequence(delta_rule_chunk, q, k, v, g, beta, ke, ve, cu_seqlens, initial_state,
                             output_final_state, scale=scale, chunk_size=chunk_size)
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    C = chunk_size
    N = (T + C - 1) // C
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    pad = N * C - T

    def chunks(x):  # [B,T,H,...] -> [B,H,N,C,...] in the accumulation dtype, zero padded
        x = x.to(acc)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
        x = x.view(B, N, C, H, *x.shape[3:])
        return x.movedim(3, 1)

    q, k, v, beta = chunks(q) * scale, chunks(k), chunks(v), chunks(beta)
    G = chunk_decay(g.to(acc), C).movedim(3, 1)                      # [B,H,N,C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    # Gam[t,i] = exp(G_t - G_i) for i <= t; masked before exp so it never overflows
    diff = G[..., :, None] - G[..., None, :]
    Gam = diff.masked_fill(~causal, -math.inf).exp()                   # [B,H,N,C,C]

    A_kk = (k @ k.transpose(-1, -2)) * Gam * strict
    M = torch.eye(C, dtype=acc, device=q.device) + beta[..., None] * A_kk
    rhs_v = v
    A_qk = (q @ k.transpose(-1, -2)) * Gam * causal
    o_inj = 0
    if ke is not None:
        ke, ve = chunks(ke), chunks(ve)                               # [B,H,N,C,L-1,*]
        for l in range(ke.shape[-2]):
            A_ke = (k @ ke[..., l, :].transpose(-1, -2)) * Gam * strict
            rhs_v = rhs_v - A_ke @ ve[..., l, :]
            o_inj = o_inj + ((q @ ke[..., l, :].transpose(-1, -2)) * Gam * causal) @ ve[..., l, :]
    # WY form: U = Uh - W S0, both from one unit-lower-triangular solve per chunk
    eG = G.exp()
    Uh = torch.linalg.solve_triangular(M, beta[..., None] * rhs_v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(M, (beta * eG)[..., None] * k, upper=False, unitriangular=True)

    decay_to_end = (G[..., -1:] - G).exp()                            # exp(G_C - G_i)
    k_end = k * decay_to_end[..., None]
    if ke is not None:
        ke_end = ke * decay_to_end[..., None, None]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)
    outs = []
    for n in range(N):
        U = Uh[:, :, n] - W[:, :, n] @ S
        o = (q[:, :, n] * eG[:, :, n, :, None]) @ S + A_qk[:, :, n] @ U
        if ke is not None:
            o = o + o_inj[:, :, n]
        outs.append(o)
        S = S * eG[:, :, n, -1, None, None] + k_end[:, :, n].transpose(-1, -2) @ U
        if ke is not None:
            kn, vn = ke_end[:, :, n], ve[:, :, n]                     # [B,H,C,L-1,*]
            S = S + kn.flatten(2, 3).transpose(-1, -2) @ vn.flatten(2, 3)
    o = torch.stack(outs, 2).flatten(2, 3)[:, :, :T].transpose(1, 2)  # [B,T,H,V]
    return o.to(out_dtype), (S if output_final_state else None)


def delta_rule(q, k, v, g, beta, ke=None, ve=None, initial_state=None, output_final_state=False,
               backend="chunk", chunk_size=64, cu_seqlens=None, l2norm_qk=False):
    """Dispatch to a backend. One-token steps always take the naive path (it is the cheapest).
    l2norm_qk: q and k are l2-normalised first (inside the Triton op, which then saves only the
    normalised copies for the backward)."""
    if backend == "triton" and q.shape[1] > 1:
        # fixed length: custom ops that torch.compile keeps in its graph; packed sequences
        # (cu_seqlens) read their chunk tables on the host, so compiled code breaks there
        fn = _triton_delta_rule if cu_seqlens is None else _no_compile(_triton_delta_rule)
        return fn(q, k, v, g, beta, ke, ve, initial_state, output_final_state, cu_seqlens, l2norm_qk)
    if l2norm_qk:  # autocast normalises in float32; hand the recurrence one dtype
        q, k = (F.normalize(x, dim=-1).to(v.dtype) for x in (q, k))
    if backend == "naive" or q.shape[1] == 1:
        return delta_rule_naive(q, k, v, g, beta, ke, ve, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if backend == "chunk":
        return delta_rule_chunk(q, k, v, g, beta, ke, ve, initial_state=initial_state,
                                output_final_state=output_final_state, chunk_size=chunk_size,
                                cu_seqlens=cu_seqlens)
    raise ValueError(f"unknown backend {backend!r}")


def delta_rule_segments(seg, q, k, v, g, beta, ke=None, ve=None, initial_state=None,
                        output_final_state=False, **kw):
    """delta_rule under reset_at_eos: the [B,T] rows, laid back to back as [1,B*T], are cut at
    seg.cu_seqlens. initial_state [B] (a cache) enters a row's first segment only when that
    row continues (its first token is no EOS); the final state is each row's last segment's."""
    B, T = q.shape[:2]
    keep = seg.cont[:, 0, None, None, None]                            # [B,1,1,1]
    if T == 1:  # a decode step: each row either continues or starts anew
        h0 = None if initial_state is None else initial_state * keep
        return delta_rule(q, k, v, g, beta, ke, ve, initial_state=h0,
                          output_final_state=output_final_state, **kw)
    flat = [None if x is None else x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta, ke, ve)]
    h0 = None
    if initial_state is not None:
        h0 = initial_state.new_zeros(seg.cu_seqlens.numel() - 1, *initial_state.shape[1:])
        h0 = h0.index_copy(0, seg.first, initial_state * keep)
    o, ht = delta_rule(*flat, initial_state=h0, output_final_state=output_final_state,
                       cu_seqlens=seg.cu_seqlens, **kw)
    return o.view(B, T, *o.shape[2:]), (ht[seg.last] if output_final_state else None)


@functools.cache
def _no_compile(fn):
    # torch.compile leaves the Triton kernels alone and fuses around them. Wrapped on first use:
    # torch.compiler.disable imports dynamo (and triton), ~1 s that CPU users should not pay.
    return torch.compiler.disable(fn)


_KERNELS = None


def kernels():
    """prism_kernel (Triton), imported on first use. It is the file beside this one (its stages in
    prism_ops/ beside it too): a top-level module in this repo, a sibling submodule in a directory
    written by export_hf.py. Imported through importlib, not an import statement: transformers'
    remote-code loader requires every module that an import statement names to be installed,
    and this one needs Triton, which CPU users may lack.
    Kept in a global, which torch.compile reads as a constant (default_backend imports it first)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = importlib.import_module(f"{__package__}.prism_kernel" if __package__ else "prism_kernel")
    return _KERNELS


def _triton_delta_rule(q, k, v, g, beta, ke, ve, initial_state, output_final_state, cu_seqlens=None,
                       l2norm_qk=False):
    varlen = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    norm = {"l2norm_qk": True} if l2norm_qk else {}
    return kernels().chunk_prism(q, k, v, g, beta, ke, ve, initial_state=initial_state,
                                 output_final_state=output_final_state, **varlen, **norm)


def _triton_conv(x, weight, cu_seqlens=None):
    conv = kernels().causal_conv
    return conv(x, weight) if cu_seqlens is None else conv(x, weight, cu_seqlens=cu_seqlens)


def _conv_step(x, buf, weight, reset):
    return kernels().conv_step(x, buf, weight, reset)


def _add_rms_norm(x, y, norm):
    return kernels().add_rms_norm(x, y, norm.weight, norm.eps)


def default_backend(device):
    if device.type == "cuda":
        try:
            kernels()
            return "triton"
        except Exception:
            pass
    return "chunk"


@dataclass
class Segments:
    """Where documents start in one forward's tokens idx [B,T] (reset_at_eos): a segment starts
    at every EOS (its first token) and at every row start. Built once per forward, on the device.
      pos [B,T]          tokens since the segment start; a row's first segment counts from the
                         row start (with a cache it continues what the cache holds)
      cont [B,T] bool    the token lies before the row's first EOS: it continues the cache
      cu_seqlens [N+1]   int32, segment starts in the rows laid back to back ([B,T] -> [1,B*T]),
                         then B*T: fla's varlen convention
      first, last [B]    index of each row's first and last segment
    """
    pos: torch.Tensor
    cont: torch.Tensor
    cu_seqlens: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor


def segments_of(idx, eos_id):
    B, T = idx.shape
    eos = idx == eos_id
    start = eos.clone()
    start[:, 0] = True
    t = torch.arange(T, device=idx.device)
    pos = t - torch.where(start, t, 0).cummax(1).values
    cont = eos.cumsum(1) == 0
    per_row = start.sum(1)
    last = per_row.cumsum(0) - 1
    if T == 1:  # one segment per row: a decode step needs no host sync
        cu = torch.arange(B + 1, device=idx.device, dtype=torch.int32)
    else:  # the segment count sizes cu_seqlens: nonzero is this forward's one host sync
        cu = torch.cat([start.flatten().nonzero().flatten(), t.new_full((1,), B * T)]).int()
    return Segments(pos, cont, cu, last - per_row + 1, last)


# ----------------------------------------------------------------------------------------------
# 3. mixers

class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose weight follows the input's dtype, so bf16 autocast keeps the fused kernel."""

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class ShortConv(nn.Module):
    """Causal depthwise conv over time, then SiLU; fused=True runs the Triton kernels
    (prism_kernel.causal_conv, conv_step with a buffer). With `seg` (reset_at_eos) no tap
    reaches back across a segment start. With `buf` [B,w-1,C], the last w-1 inputs before x (a
    cache's), it continues from them and keeps x's last w-1 there; then `reset` [B,T] (the
    tokens that start a segment) drops every tap from before the latest one at or before a token."""

    def __init__(self, channels, width):
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.empty(channels, width))
        nn.init.uniform_(self.weight, -1 / math.sqrt(width), 1 / math.sqrt(width))

    def forward(self, x, buf=None, reset=None, fused=False, seg=None):  # x [B,T,C]
        B, T, C = x.shape
        if buf is not None:
            return _conv_step(x, buf, self.weight, reset) if fused else self.cached(x, buf, reset)
        if fused:
            if seg is None:   # a custom op in a compiled graph (see delta_rule)
                return _triton_conv(x, self.weight)
            y = _no_compile(_triton_conv)(x.reshape(1, B * T, C), self.weight, seg.cu_seqlens)
            return y.view(B, T, C)
        w = self.width - 1
        xp = torch.cat([x.new_zeros(B, w, C), x], 1)
        weight = self.weight.to(x.dtype)
        if seg is None:
            y = F.conv1d(xp.transpose(1, 2), weight[:, None, :], groups=C)
            return F.silu(y.transpose(1, 2))
        # tap s (s tokens back) reaches token t only within its segment; tokens before a row's
        # first EOS reach back to the row start, before which there are zeros. The taps are
        # summed in float32 and rounded once, as F.conv1d above does (see cached)
        reach = seg.pos.masked_fill(seg.cont, w)                        # [B,T]
        acc = torch.promote_types(x.dtype, torch.float32)
        y = sum(xp[:, w - s:w - s + T].to(acc) * weight[:, w - s].to(acc) * (reach >= s)[..., None].to(acc)
                for s in range(w + 1))
        return F.silu(y.to(x.dtype))

    def cached(self, x, buf, reset):
        """PyTorch's form of prism_kernel.conv_step (CPU, and the PyTorch backends)."""
        B, T, C = x.shape
        W, w = self.width, self.width - 1
        xp = torch.cat([buf.to(x.dtype), x], 1)
        taps = xp.unfold(1, W, 1)                                   # [B,T,C,W]: tap j is token t-w+j
        last = xp[:, T:]                                            # the new buffer: tokens T-w .. T-1
        if reset is not None:  # a tap counts only from its token's segment start on
            t = torch.arange(T, device=x.device)
            start = torch.where(reset, t, -W).cummax(1).values      # [B,T]
            tap_pos = t[:, None] - w + torch.arange(W, device=x.device)
            taps = taps * (tap_pos >= start[..., None])[:, :, None, :].to(x.dtype)
            kept = torch.arange(T - w, T, device=x.device) >= start[:, -1:]      # [B,w]
            last = last * kept[..., None].to(x.dtype)
        buf.copy_(last)
        # products and sum in float32, rounded once to x's dtype: what F.conv1d gives the full
        # forward (and the Triton kernels both forms). In bf16, products rounded to bf16 before
        # the sum moved one bf16 ulp in about a third of the outputs, the first difference
        # between cached decoding and the full forward (BENCHMARKS.md, decoding)
        acc = torch.promote_types(x.dtype, torch.float32)
        return F.silu((taps.to(acc) * self.weight.to(x.dtype).to(acc)).sum(-1).to(x.dtype))


class GatedDeltaNet(nn.Module):
    """PRISM_SPEC §1. `solver_write` is the hook PRISM fills in; for GDN it writes nothing.
    `layer_idx` is the layer's entry in a decoding Cache."""

    def __init__(self, cfg, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx
        D, H, K, V = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.value_dim
        self.cfg, self.H, self.K, self.V = cfg, H, K, V
        self.L = 1   # writes per token (PRISM: L)
        self.backend = None    # recurrence backend; None: default_backend of the input's device (Model.backend)
        self.chunk_size = 64   # the chunk backend's chunk length (Model.chunk_size)
        self.q_proj = nn.Linear(D, H * K, bias=cfg.bias)
        self.k_proj = nn.Linear(D, H * K, bias=cfg.bias)
        self.v_proj = nn.Linear(D, H * V, bias=cfg.bias)
        self.a_proj = nn.Linear(D, H, bias=False)      # decay input
        self.b_proj = nn.Linear(D, H, bias=False)      # delta-rule step size beta
        self.g_proj = nn.Linear(D, H * V, bias=cfg.bias)  # output gate
        self.o_proj = nn.Linear(H * V, D, bias=cfg.bias)
        self.conv = ShortConv(2 * H * K + H * V, cfg.conv_size)  # depthwise: q|k|v channels apart
        self.o_norm = RMSNorm(V, eps=cfg.norm_eps)
        # Mamba-2/GDN decay init: A ~ U(1, 16), dt ~ logU(1e-3, 1e-1) stored as softplus^-1(dt)
        self.A_log = nn.Parameter(torch.empty(H).uniform_(1, 16).log())
        dt = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))

    def qkv_proj(self, x):
        """q|k|v in one GEMM: the three weights are concatenated (a few MB), not the three
        [B,T,*] outputs; the parameters keep their names, so checkpoints load unchanged."""
        ps = (self.q_proj, self.k_proj, self.v_proj)
        bias = torch.cat([p.bias for p in ps]) if self.cfg.bias else None
        return F.linear(x, torch.cat([p.weight for p in ps]), bias)

    def cache_buffers(self, batch_size, max_len, device, dtype):
        """This layer's decoding buffers (Model.init_cache): the state S (float32) and the
        short convs' last inputs. Neither grows with max_len."""
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        conv = self.conv.weight.shape[0]
        return {"state": torch.zeros(batch_size, self.H, self.K, self.V, dtype=acc, device=device),
                "conv": torch.zeros(batch_size, self.conv.width - 1, conv, dtype=dtype, device=device)}

    def solver_write(self, x, k, v, buf=None, reset=None, fused=False, seg=None):
        return None, None

    def solver_step(self, x, buf, reset):
        return None

    def forward(self, x, seg=None, cache=None):
        B, T, _ = x.shape
        H, K, V = self.H, self.K, self.V
        backend = self.backend or default_backend(x.device)
        buf = cache.layers[self.layer_idx] if cache is not None else {}
        reset = cache.reset if cache is not None else None
        # under autocast: cast once here, not once per projection (four casts of x in the
        # forward, four float32 gradients of x summed in the backward)
        x = x.to(compute_dtype(x))
        qkv = self.qkv_proj(x)
        fused = backend == "triton"   # Triton short conv too
        q, k, v = self.conv(qkv, buf.get("conv"), reset, fused, seg).split([H * K, H * K, H * V], -1)
        q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V)   # q, k l2-normalised in delta_rule
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        beta = self.b_proj(x).sigmoid()
        if self.L > 1:  # one copy of v, saved by both the solver rows and the recurrence
            v = v.contiguous()
        ke, ve = self.solver_write(x, k, v, buf.get("anchor"), reset, fused, seg)
        rule = delta_rule if seg is None else functools.partial(delta_rule_segments, seg)
        s0 = buf.get("state")
        if s0 is not None and s0.dtype == torch.bfloat16:   # a bf16 cache: the update runs in float32
            s0 = s0.float()
        o, state = rule(q, k, v, g, beta, ke, ve, initial_state=s0,
                        output_final_state=cache is not None, backend=backend, chunk_size=self.chunk_size,
                        l2norm_qk=True)
        if cache is not None:  # the cache's buffer keeps its address
            buf["state"].copy_(state)
        o = self.o_norm(o) * F.silu(self.g_proj(x).view(B, T, H, V))
        return self.o_proj(o.reshape(B, T, H * V))

    def step(self, x, cache):
        """forward(x, cache=cache) of a few tokens on the Triton decoding kernels: one GEMM for
        every input projection, then a kernel each for the short conv, the recurrence (with the
        q/k norm, the gates and PRISM's solver write inside) and the output norm and gate.
        In bf16 it equals forward() less closely than the PyTorch backends' cached path does:
        the chunk kernels' dots take bf16 operands where this step updates the float32 state in
        float32, and its fused kernels round once where forward()'s separate ops round each
        result (BENCHMARKS.md, decoding)."""
        pk = kernels()
        B, T, _ = x.shape
        H, K, V = self.H, self.K, self.V
        buf, C = cache.layers[self.layer_idx], 2 * H * K + H * V
        parts = (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.g_proj)
        z = F.linear(x, *stacked_weights(self, "in", parts, compute_dtype(x)))
        qkv = _conv_step(z[..., :C], buf["conv"], self.conv.weight, cache.reset)
        q, k, v = qkv.split([H * K, H * K, H * V], -1)
        o, _ = pk.recurrent_prism_step(q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V),
                                       z[..., C:C + H], z[..., C + H:C + 2 * H], state=buf["state"],
                                       reset=cache.reset, gates=(self.A_log, self.dt_bias),
                                       solver=self.solver_step(x, buf, cache.reset), l2norm_qk=True)
        gate = z[..., C + 2 * H:C + 2 * H + H * V]
        return self.o_proj(pk.gated_rms_norm(o, gate, self.o_norm.weight, self.o_norm.eps))


def solver_chain(v, u, gains, keys, steps, mode="gelu", nonlinear=True):
    """Algorithm 1's greedy steps (PRISM_SPEC §2.2) from the solver's projections: v [B,T,H,V]
    the layer's values; u [B,T,H*V] the proxy of S_{t-1} k_t; gains: L-1 of [B,T,H*V] (none:
    p = 1); keys: L-1 raw keys [B,T,H*K], or one for every step; steps [B,T,H*(L-1)] logits of
    the step sizes b. Returns ke [B,T,H,L-1,K] (unit keys) and ve = b * delta [B,T,H,L-1,V].
    The Triton backend runs prism_kernel.solver_chain, the same chain in one kernel each way:
    a change here needs the same change there, or `fused_chain = False` on the PRISM layers."""
    B, T, H, V = v.shape
    n = steps.shape[-1] // H                                  # L - 1
    r = v - u.view(B, T, H, V)                                # residual after GDN's write
    keys = [F.normalize(k.view(B, T, H, -1), dim=-1) for k in keys]
    b = steps.view(B, T, H, n).sigmoid()
    ke, deltas = [], []
    for l in range(n):
        p = gains[l].view(B, T, H, V) if gains else torch.ones_like(r)
        if mode == "gelu":
            d = F.gelu(p * r) if nonlinear else p * r
        else:  # closed form: preconditioner sigmoid(p), r <- (1 - sigmoid(p)) r
            d = torch.sigmoid(p) * r
        r = r - d                                             # greedy residual subtraction
        deltas.append(d)
        ke.append(keys[l] if len(keys) > 1 else keys[0])
    ke = torch.stack(ke, 3)
    ve = torch.stack(deltas, 3) * b[..., None]
    return ke.to(v.dtype), ve.to(v.dtype)


class PRISM(GatedDeltaNet):
    """PRISM_SPEC §2: GDN's forgetting and write, plus a rank-(L-1) solver correction computed
    from the input alone (an anchor a_t = silu(ShortConv(x))_t standing in for S_{t-1} k_t)."""

    def __init__(self, cfg, layer_idx=0):
        super().__init__(cfg, layer_idx)
        L, D, H, K, V, r = cfg.solver_steps, cfg.n_embd, self.H, self.K, self.V, cfg.solver_rank
        self.L = L
        if L == 1:
            return  # GDN exactly: no extra parameters
        n_keys = {"own": L - 1, "shared": 1, "base": 0}[cfg.solver_keys]
        n_gains = L - 1 if cfg.solver_gain else 0
        self.n_keys, self.n_gains = n_keys, n_gains
        if cfg.solver_anchor:
            self.anchor_conv = ShortConv(D, cfg.anchor_conv_size)
        # all D -> r down-projections in one GEMM: [u | keys... | gains...]
        self.solver_down = nn.Linear(D, (1 + n_keys + n_gains) * r, bias=False)
        self.u_up = nn.Linear(r, H * V, bias=False)
        self.key_up = nn.ModuleList(nn.Linear(r, H * K, bias=False) for _ in range(n_keys))
        self.gain_up = nn.ModuleList(nn.Linear(r, H * V, bias=False) for _ in range(n_gains))
        self.step_proj = nn.Linear(D, H * (L - 1), bias=False)   # b^(l), per head and step
        self.recompute = True   # solver_write: recompute the rows in the backward (Model.recompute_solver)
        self.fused_chain = True  # Triton backend: prism_kernel.solver_chain in place of solver_chain

    def cache_buffers(self, batch_size, max_len, device, dtype):
        bufs = super().cache_buffers(batch_size, max_len, device, dtype)
        if self.L > 1 and self.cfg.solver_anchor:
            w = self.anchor_conv.width - 1
            bufs["anchor"] = torch.zeros(batch_size, w, self.cfg.n_embd, dtype=dtype, device=device)
        return bufs

    def solver_write(self, x, k, v, buf=None, reset=None, fused=False, seg=None):
        """Returns ke [B,T,H,L-1,K] and ve = b * delta [B,T,H,L-1,V] (PRISM_SPEC §2.2); k is the
        layer's key before its l2 norm."""
        if self.L == 1:
            return None, None
        base = k if self.cfg.solver_keys == "base" else None
        if self.recompute and buf is None and torch.is_grad_enabled():
            # keep the inputs x and v (held for the layer's other backward terms anyway), not
            # the anchor, the up-projections and the residuals: the backward reruns the anchor
            # conv, the small GEMMs and the elementwise chain
            return checkpoint(self.solver_rows, x, v, base, fused, seg, use_reentrant=False)
        return self.solver_rows(x, v, base, fused, seg, buf, reset)

    def solver_rows(self, x, v, base, fused=False, seg=None, buf=None, reset=None):
        """Algorithm 1 from the layer input x [B,T,D] and its values v [B,T,H,V]: the anchor, its
        rank-r down-projections and their up-projections, the step logits, then `solver_chain`,
        the greedy residual steps (base: the layer's own keys, for solver_keys="base")."""
        cfg = self.cfg
        a = self.anchor_conv(x, buf, reset, fused, seg) if cfg.solver_anchor else F.silu(x)
        z = self.solver_down(a).split(cfg.solver_rank, -1)
        u = self.u_up(z[0])                                       # proxy of S_{t-1} k_t, [B,T,H*V]
        keys = [base] if base is not None else [self.key_up[i](z[1 + i]) for i in range(self.n_keys)]
        gains = [self.gain_up[i](z[1 + self.n_keys + i]) for i in range(self.n_gains)]
        steps = self.step_proj(a)                                 # logits of b^(l), [B,T,H*(L-1)]
        chain = solver_chain
        if fused and self.fused_chain and self.L <= 4:
            chain = kernels().solver_chain   # the same chain in one Triton kernel each way
        return chain(v, u, gains, keys, steps, cfg.solver_mode, cfg.solver_nonlinear)

    def solver_step(self, x, buf, reset):
        """solver_write's projections for the decoding kernel, which forms ke, ve from them
        (prism_kernel.recurrent_prism_step's `solver`): the anchor conv, then one GEMM for the
        step gates and every up-projection of its down-projection. Down and up are both linear,
        so the decoding step multiplies by their product [step_proj; blockdiag(ups) solver_down]
        (formed once in float32, memoised): one small GEMM per layer and token instead of two."""
        if self.L == 1:
            return None
        cfg, H, K, V, B, T = self.cfg, self.H, self.K, self.V, x.shape[0], x.shape[1]
        nk, ng, S = self.n_keys, self.n_gains, H * (self.L - 1)
        a = _conv_step(x, buf["anchor"], self.anchor_conv.weight, reset) if cfg.solver_anchor else F.silu(x)
        dt = compute_dtype(x)
        ups = (self.u_up, *self.key_up, *self.gain_up)

        def product():
            acc = torch.float64 if dt == torch.float64 else torch.float32
            up = torch.block_diag(*(m.weight.to(acc) for m in ups))
            return padded_rows(torch.cat([self.step_proj.weight.to(acc), up @ self.solver_down.weight.to(acc)]).to(dt))
        w = memoised(self, ("solver", dt), [self.step_proj.weight, self.solver_down.weight] +
                     [m.weight for m in ups], product)
        sizes = [S, H * V, nk * H * K, ng * H * V]
        steps, u, keys, gains, _ = F.linear(a, w).split(sizes + [w.shape[0] - sum(sizes)], -1)
        return dict(u=u.view(B, T, H, V), keys=keys.view(B, T, nk, H, K) if nk else None,
                    gains=gains.view(B, T, ng, H, V) if ng else None,
                    steps=steps.view(B, T, H, self.L - 1), keys_mode=cfg.solver_keys,
                    mode=cfg.solver_mode, nonlinear=cfg.solver_nonlinear)


def rope(x, pos, theta):
    """Rotary embedding on [B,T,H,D] at integer positions pos [T] or [B,T] (half-split convention)."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    ang = pos.float()[..., None] * inv
    cos, sin = ang.cos().unsqueeze(-2), ang.sin().unsqueeze(-2)       # [(B,)T,1,D/2]
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def causal_attention(q, k, v):
    """Causal softmax attention over q, k, v [B,T,H,D]; FlashAttention when importable."""
    if _flash_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return _flash_attn(q, k, v, causal=True)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Attention(nn.Module):
    """Causal softmax attention with RoPE; FlashAttention when importable, else SDPA.
    With `seg` (reset_at_eos) it is document-causal and positions restart at every segment
    start, so a segment's q and k are bitwise those of its tokens run alone. `layer_idx` is the
    layer's entry in a decoding Cache."""

    def __init__(self, cfg, layer_idx=0):
        super().__init__()
        self.cfg, self.H, self.hd = cfg, cfg.n_head, cfg.n_embd // cfg.n_head
        self.layer_idx = layer_idx
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def cache_buffers(self, batch_size, max_len, device, dtype):
        """A static KV cache: k, v [batch_size, max_len, H, D]."""
        shape = (batch_size, max_len, self.H, self.hd)
        return {"k": torch.zeros(shape, dtype=dtype, device=device),
                "v": torch.zeros(shape, dtype=dtype, device=device)}

    def forward(self, x, seg=None, cache=None):
        B, T, D = x.shape
        qkv = self.qkv(x)
        if cache is not None:
            return self.o_proj(self.cached(qkv, cache, fused=False).reshape(B, T, D))
        q, k, v = qkv.view(B, T, 3, self.H, self.hd).unbind(2)
        pos = torch.arange(T, device=x.device) if seg is None else seg.pos
        q, k = rope(q, pos, self.cfg.rope_theta), rope(k, pos, self.cfg.rope_theta)
        flash = _flash_attn is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
        if seg is None:
            y = causal_attention(q, k, v)
        elif flash:
            cu = seg.cu_seqlens  # T bounds every segment's length: no host sync for the true maximum
            y = _flash_attn_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, T, T,
                                   causal=True).view(B, T, self.H, self.hd)
        else:  # document-causal: query t sees keys begin_t .. t
            t = torch.arange(T, device=x.device)
            mask = (t <= t[:, None]) & (t >= (t - seg.pos)[..., None])      # [B,T,T]
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
            with sdpa_kernel(DECODE_SDPA):
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]).transpose(1, 2)
        return self.o_proj(y.reshape(B, T, D))

    def step(self, x, cache):
        """forward(x, cache=cache) on the decoding path: one token takes the Triton kernels."""
        B, T, D = x.shape
        return self.o_proj(self.cached(self.qkv(x), cache, fused=True).reshape(B, T, D))

    def cached(self, qkv, cache, fused):
        """Attention of the new tokens (qkv [B,T,3*D]) over the cache's window, which they join.
        Keys are the cache indices begin .. the token's own; RoPE positions count from the
        segment start (reset_at_eos), i.e. from 0. One token on the Triton path: a kernel writes
        k, v and another attends (flash-decoding) over the static cache."""
        B, T, _ = qkv.shape
        buf, theta = cache.layers[self.layer_idx], self.cfg.rope_theta
        kc, vc = buf["k"], buf["v"]
        if fused and T == 1:
            begin = cache.begins[:, 0] if cache.begins is not None else cache.begin
            q = kernels().rope_kv_write(qkv, *cache.rope, cache.pos, begin, kc, vc)
            return kernels().decode_attention(q, kc, vc, begin, cache.pos)
        q, k, v = qkv.view(B, T, 3, self.H, self.hd).unbind(2)
        t = cache.pos + torch.arange(T, device=qkv.device)              # the tokens' cache indices
        rp = t if cache.begins is None else t - cache.begins
        q, k = rope(q, rp, theta), rope(k, rp, theta)
        kc.index_copy_(1, t, k.to(kc.dtype))
        vc.index_copy_(1, t, v.to(vc.dtype))
        if T > 1 and cache.length == 0 and cache.begins is None:      # a first prefill
            return causal_attention(q, k, v)
        n = cache.max_len if T == 1 else cache.length + T  # one token reads no host value (graphs)
        j = torch.arange(n, device=qkv.device)
        mask = j <= t[:, None]                                          # [T,n]
        if cache.begins is not None:
            mask = mask & (j >= cache.begins[..., None])                # [B,T,n]
        mask = mask if mask.dim() == 3 else mask[None]
        # cuDNN's attention re-plans for every new key length: slow for decoding
        with sdpa_kernel(DECODE_SDPA):
            y = F.scaled_dot_product_attention(q.transpose(1, 2), kc[:, :n].to(q.dtype).transpose(1, 2),
                                               vc[:, :n].to(q.dtype).transpose(1, 2), attn_mask=mask[:, None])
        return y.transpose(1, 2)


try:
    from flash_attn import flash_attn_func as _flash_attn, flash_attn_varlen_func as _flash_attn_varlen
except Exception:
    _flash_attn = _flash_attn_varlen = None
from torch.nn.attention import SDPBackend, sdpa_kernel
DECODE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# ----------------------------------------------------------------------------------------------
# 4. the model

class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = cfg.mlp_hidden or 256 * math.ceil(8 * cfg.n_embd / 3 / 256)
        self.w_gate = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.w_up = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.w_down = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.recompute = False  # Model.activation_checkpointing = "mlp" sets it

    def forward(self, x, step=False):
        if step:  # decoding on the Triton path: one GEMM for gate and up, one kernel for the product
            gate_up = stacked_weights(self, "gate_up", (self.w_gate, self.w_up), compute_dtype(x))
            return self.w_down(kernels().silu_mul(F.linear(x, *gate_up)))
        if self.recompute and torch.is_grad_enabled():  # keep x, not the [B,T,hidden] pair
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x):
        x = x.to(compute_dtype(x))  # one cast under autocast, not one per projection
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


# The mixer protocol. Every class in MIXERS is built as cls(cfg, layer_idx) and has
#   forward(x, seg=None, cache=None)   x [B,T,D] -> [B,T,D], a sequence. seg: the Segments of the
#       packed documents (reset_at_eos), or None. With a cache (Model.init_cache) the sequence
#       continues the one the cache holds and updates it: a prefill, or PyTorch-backend decoding.
#   step(x, cache)   the same function (to rounding) of a few tokens continuing the cache, on the
#       Triton decoding kernels; segment starts come from the cache (cache.reset, cache.begins).
#   cache_buffers(batch_size, max_len, device, dtype)   the layer's buffers in a Cache.
# Model.forward alone chooses step or forward. Run-time kernel choices (backend, chunk_size,
# PRISM's recompute and fused_chain) are layer attributes that Model's setters write, never
# forward arguments; attention has none.
MIXERS = {"gdn": GatedDeltaNet, "prism": PRISM, "attention": Attention}


class Block(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.mixer_name = cfg.layer_mixer(i)
        self.norm1 = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mixer = MIXERS[self.mixer_name](cfg, i)
        self.norm2 = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, seg=None, cache=None):
        x = x + self.drop(self.mixer(self.norm1(x), seg, cache))
        return x + self.drop(self.mlp(self.norm2(x)))

    def step(self, x, h, cache, next_norm):
        """The block on the Triton decoding path (no dropout), given h = norm1(x): each residual
        add is one kernel with the norm after it, this block's norm2, then `next_norm` (the next
        block's norm1 or the final norm). Returns (x, next_norm(x))."""
        x, h = _add_rms_norm(x, self.mixer.step(h, cache), self.norm2)
        return _add_rms_norm(x, self.mlp(h, step=True), next_norm)


class Model(nn.Module):
    """`backend` ("naive" | "chunk" | "triton" | None = Triton on CUDA when importable, else chunk)
    and `chunk_size` (the PyTorch chunk backend's chunk length; the Triton kernels use 64) are
    run-time choices that compute the same function: attributes, not hyperparameters. So are
    `activation_checkpointing` (True: every block keeps only its input and is rerun in the
    backward; "mlp": only the MLPs are, the cheap-to-recompute half holding the widest
    activations; False: nothing is recomputed), `recompute_solver` (True, the default: PRISM
    layers rerun their solver write in the backward from the layer's input and values, instead
    of saving its anchor, [B,T,H,V] up-projections and residuals) and `fused_loss` (True: the loss is
    linear_cross_entropy, which never holds the [B*T, vocab] logits; None = on CUDA; False:
    logits, then F.cross_entropy). The setters of backend, chunk_size, recompute_solver and
    fused_chain write the choice onto every layer that uses it; the mixers read their own
    attributes, never forward arguments."""

    def __init__(self, config, backend=None, chunk_size=64):
        super().__init__()
        self.config = cfg = config
        self.fused_loss = None
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.backend = backend        # after the blocks: both setters write onto the layers
        self.chunk_size = chunk_size
        self._recompute_solver = True
        self.activation_checkpointing = False   # (sets each PRISM layer's solver recompute too)
        self.norm_f = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 n_layer)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "w_down.weight")):
                nn.init.normal_(p, 0.0, cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, self.config.init_std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, self.config.init_std)

    def num_params(self, non_embedding=True):
        """Unique parameters (a tied head counts once). non_embedding drops the token table."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel()
        return n

    @property
    def backend(self):
        b = self._backend
        return b if b is not None else default_backend(self.wte.weight.device)

    @backend.setter
    def backend(self, name):
        if name not in (None, *BACKENDS):
            raise ValueError(f"backend must be None or one of {BACKENDS}, got {name!r}")
        self._backend = name
        for m in self.modules():
            if isinstance(m, GatedDeltaNet):
                m.backend = name

    @property
    def activation_checkpointing(self):
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, mode):
        if mode not in (False, True, "mlp"):
            raise ValueError(f"activation_checkpointing must be False, True or 'mlp', got {mode!r}")
        self._checkpointing = mode
        for b in self.blocks:
            b.mlp.recompute = mode == "mlp"
        self._set_solver_recompute()

    @property
    def recompute_solver(self):
        return self._recompute_solver

    @recompute_solver.setter
    def recompute_solver(self, on):
        self._recompute_solver = bool(on)
        self._set_solver_recompute()

    @property
    def fused_chain(self):
        """PRISM layers on the Triton backend run their solver chain as prism_kernel.solver_chain
        (True, the default) or as model.solver_chain's PyTorch ops (False: for a changed rule)."""
        return all(m.fused_chain for m in self.modules() if isinstance(m, PRISM))

    @fused_chain.setter
    def fused_chain(self, on):
        for m in self.modules():
            if isinstance(m, PRISM):
                m.fused_chain = bool(on)

    def _set_solver_recompute(self):
        # inside a block that is itself rerun (activation_checkpointing=True) the solver's own
        # recompute would only run it a third time
        on = self._recompute_solver and self._checkpointing is not True
        for b in self.blocks:
            if isinstance(b.mixer, PRISM):
                b.mixer.recompute = on

    @property
    def chunk_size(self):
        return self._chunk_size

    @chunk_size.setter
    def chunk_size(self, c):
        if not (isinstance(c, int) and c > 0):
            raise ValueError(f"chunk_size must be a positive int, got {c!r}")
        self._chunk_size = c
        for m in self.modules():
            if isinstance(m, GatedDeltaNet):
                m.chunk_size = c

    def forward(self, idx, targets=None, cache=None, return_logits=False, last_only=False):
        """Returns (logits, loss). Without `targets`: the logits [B,T,V] of every position
        (last_only: of the last one, [B,1,V]; a prefill needs no more) and loss None. With
        `targets` [B,T]: the mean cross-entropy over the targets that are not -1, and logits
        None unless return_logits=True (the fused loss never builds them; asking for them takes
        the plain path). With `cache` (from init_cache) the call continues the
        sequence held in the cache: recurrent state and conv buffers, or the KV cache.
        With config.reset_at_eos every EOS in idx starts a new document (see Segments): a row
        whose first token is EOS starts afresh, any other continues the cache."""
        # checked where it is free: on CUDA it would sync every step, so train.py scans the data
        # once at start-up and the tokenizers cannot produce ids beyond the vocabulary
        if not idx.is_cuda and (idx.min() < 0 or idx.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}); got "
                             f"[{int(idx.min())}, {int(idx.max())}]")
        x = self.drop(self.wte(idx))
        T = idx.shape[1]
        # the one place that picks the mixers' step (decoding kernels) over their forward
        step = cache is not None and self.backend == "triton" and T <= STEP_TOKENS
        if cache is not None:
            cache.begin_step(idx)
        seg = None  # the decoding kernels take the cache's per-token resets instead
        if self.config.reset_at_eos and not step:
            seg = _no_compile(segments_of)(idx, self.config.eos_id)
        if step:
            h = self.blocks[0].norm1(x)
            for block, nxt in zip(self.blocks, [b.norm1 for b in self.blocks[1:]] + [self.norm_f]):
                x, h = block.step(x, h, cache, nxt)
            x = h
        else:
            recompute = self._checkpointing is True and cache is None and torch.is_grad_enabled()
            for block in self.blocks:
                if recompute:  # keep only the block's input; rerun the block in the backward
                    x = checkpoint(block, x, seg, use_reentrant=False)
                else:
                    x = block(x, seg, cache)
            x = self.norm_f(x)
        if cache is not None:
            cache.end_step(T)
        if last_only:
            x = x[:, -1:]
        if targets is None:
            return self.lm_head(x), None
        fused = self.fused_loss if self.fused_loss is not None else x.is_cuda
        if fused and not return_logits:
            loss = _no_compile(linear_cross_entropy)(x.flatten(0, 1), self.lm_head.weight,
                                                      targets.reshape(-1))
            return None, loss
        logits = self.lm_head(x)
        acc = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 in tests
        loss = F.cross_entropy(logits.flatten(0, 1).to(acc), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX)
        return (logits if return_logits else None), loss

    def init_cache(self, batch_size, max_len, device=None, dtype=None, state_dtype=None):
        """Preallocated decoding buffers (Cache) for batch_size rows of up to max_len tokens: per
        GDN/PRISM layer the state S (float32) and the short convs' last inputs, which do not grow
        with max_len; per attention layer a static KV cache [batch_size, max_len, H, D]. Buffers
        other than the state are in `dtype` (default: the parameters'), on `device` (default:
        the parameters'). state_dtype=torch.bfloat16 keeps S in bf16 between calls (as a
        transformer keeps its KV cache in bf16): half the state bytes a decoding step moves (at
        batch 64 the largest part of the step); each call still updates S in float32 and rounds it
        once when it stores it, so the logits drift from the float32 state's by bf16 rounding."""
        if not (batch_size >= 1 and max_len >= 1):
            raise ValueError(f"init_cache: batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
        if state_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"init_cache: state_dtype must be None (float32), torch.float32 or "
                             f"torch.bfloat16, got {state_dtype}")
        cfg, p = self.config, self.wte.weight
        device = p.device if device is None else torch.device(device)
        dtype = p.dtype if dtype is None else dtype
        layers = [b.mixer.cache_buffers(batch_size, max_len, device, dtype) for b in self.blocks]
        if state_dtype is not None and dtype != torch.float64:   # float64 runs keep a float64 state
            for buf in layers:
                if "state" in buf:
                    buf["state"] = buf["state"].to(state_dtype)
        rope_tables = None
        if any(b.mixer_name == "attention" for b in self.blocks):  # cos, sin as rope() forms them
            D = cfg.n_embd // cfg.n_head
            inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
            ang = torch.arange(max_len, device=device).float()[..., None] * inv
            rope_tables = (ang.cos(), ang.sin())
        return Cache(layers, batch_size, max_len, device, rope_tables,
                     cfg.eos_id if cfg.reset_at_eos else None)

    @torch.no_grad()
    def prefill(self, idx, cache):
        """Feed idx [B,T] into the cache, in pieces of at most PREFILL_TOKENS tokens for models
        with recurrent layers (the chunk kernels' activations and offsets stay bounded);
        returns the logits of the last position [B, vocab]."""
        B, T = idx.shape
        recurrent = any(b.mixer_name != "attention" for b in self.blocks)
        piece = max(1, PREFILL_TOKENS // B) if recurrent else T
        for s in range(0, T, piece):
            logits, _ = self(idx[:, s:s + piece], cache=cache, last_only=True)
        return logits[:, -1]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, eos_id=None,
                 pad_id=None, graph=None, state_dtype=None):
        """Continue every row of idx [B,T] by max_new_tokens tokens; returns [B, T + n].

        temperature 0 is greedy (top_k=1 too, but for exact ties); else a draw from
        softmax(logits / temperature), cut to the top_k tokens and then to the top_p nucleus
        when given (filter_logits: the sets transformers' sampling keeps). eos_id (an id or a
        list of ids) stops rows as transformers' generate does: a row that drew one takes pad_id
        (default: the EOS, the first of several) for the rest, and decoding ends once every row
        has (checked every EOS_CHECK tokens, the only host syncs); the result then ends with the
        token at which the last row drew its EOS, so n may be less than max_new_tokens. The
        prompt goes through the cache with the chunk kernels (prefill); each further token is
        one step of the whole model through the cache (init_cache: static buffers, no
        reallocation), sampled on the device. On CUDA the step is captured once in a CUDA graph
        and replayed per token (graph=False: eager steps).
        Under autocast the buffers take the autocast dtype; state_dtype as in init_cache."""
        if idx.dim() != 2 or idx.shape[1] < 1:
            raise ValueError(f"generate: idx must be [B,T] token ids with T >= 1, got {tuple(idx.shape)}")
        B, T0 = idx.shape
        if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1) or \
                (top_p is not None and not 0 <= top_p <= 1):
            raise ValueError(f"generate: need max_new_tokens >= 0, temperature >= 0, top_k >= 1 or None, "
                             f"0 <= top_p <= 1 or None; got {max_new_tokens}, {temperature}, {top_k}, {top_p}")
        if max_new_tokens == 0:
            return idx
        dev = idx.device
        eos = None
        if eos_id is not None:  # on the device before any capture: the step reads no host value
            eos = torch.as_tensor(eos_id, dtype=torch.long, device=dev).view(-1)
            if eos.numel() == 0:
                eos = None
        pad = None if eos is None or pad_id is None else torch.as_tensor(pad_id, dtype=torch.long, device=dev)
        autocast = torch.is_autocast_enabled(dev.type)
        dtype = torch.get_autocast_dtype(dev.type) if autocast else self.wte.weight.dtype
        cache = self.init_cache(B, T0 + max_new_tokens, dev, dtype, state_dtype)
        seq = idx.new_empty(B, T0 + max_new_tokens)
        seq[:, :T0] = idx
        done = torch.zeros(B, dtype=torch.bool, device=dev) if eos is not None else None
        draw = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos, done=done, pad_id=pad)
        seq[:, T0] = sample_next(self.prefill(idx, cache), **draw)
        step = self.decode_step(seq, cache, **draw)
        n = 1
        if (dev.type == "cuda" if graph is None else graph) and max_new_tokens > 1 + GRAPH_WARMUP:
            step = cuda_graph(step, GRAPH_WARMUP)
            n += GRAPH_WARMUP
        while n < max_new_tokens and not (eos is not None and n % EOS_CHECK == 0 and bool(done.all())):
            step()
            n += 1
        if eos is not None and bool(done.all()):
            # end where the last row drew its EOS (as transformers does), not at the check after it
            hit = (seq[:, T0:T0 + n, None] == eos).any(-1)
            n = int(hit.int().argmax(1).max()) + 1
        return seq[:, :T0 + n]

    def decode_step(self, seq, cache, temperature=1.0, top_k=None, top_p=None, eos_id=None, done=None,
                    pad_id=None):
        """One decoding step as a function of no arguments, all on the device: it feeds
        seq[:, cache.pos] (the last drawn token) through the cache and draws the next token into
        seq[:, cache.pos + 1] (sample_next). This is what generate captures in a CUDA graph."""
        def step():
            tok = seq.index_select(1, cache.pos.view(1))
            logits, _ = self(tok, cache=cache, last_only=True)
            nxt = sample_next(logits[:, -1], temperature, top_k, top_p, eos_id, done, pad_id)
            seq.index_copy_(1, cache.pos.view(1), nxt[:, None])
        dev = seq.device.type
        if not torch.is_autocast_enabled(dev):
            return step

        def autocast_step():  # a captured graph must not hold autocast's cached weight casts
            with torch.autocast(dev, dtype=torch.get_autocast_dtype(dev), cache_enabled=False):
                step()
        return autocast_step

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        # decay matrices only: norms, biases, A_log and dt_bias (all 1-D) stay undecayed
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        # fused on every device: one kernel per step, and its found_inf lets train.py skip a
        # non-finite step on the device without waiting for the GPU
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)

    def flops_per_token(self, T=None):
        """Training FLOPs per token at context T (default block_size): training_flops_per_token
        with this model's parameters (a tied head counts once, an untied input table not at all)."""
        cfg = self.config
        n = self.num_params(non_embedding=not cfg.tie_embeddings)
        return training_flops_per_token(cfg, T or cfg.block_size, n)

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops=None):
        """Model FLOPs utilisation of fwdbwd_per_iter sequences of block_size tokens in dt
        seconds, against `peak_flops` (default PEAK_FLOPS: H100/H200 dense bf16)."""
        T = self.config.block_size
        return self.flops_per_token(T) * T * fwdbwd_per_iter / dt / (peak_flops or PEAK_FLOPS)


# ----------------------------------------------------------------------------------------------
# 5. training arithmetic: the loss without full logits, and FLOPs per token

IGNORE_INDEX = -1      # targets equal to this are left out of the loss (and of its mean)
LOSS_CHUNK = 4096      # rows of logits alive at once in linear_cross_entropy
PEAK_FLOPS = 989e12    # H100 / H200 SXM dense bf16 tensor-core peak, FLOP/s


def linear_cross_entropy(h, weight, targets, chunk=None):
    """F.cross_entropy(h @ weight.T, targets, ignore_index=-1) (the mean over the targets that
    are not -1; nan when there are none, as there) without ever holding more than `chunk` rows
    of logits (default LOSS_CHUNK): h [N,D], weight [V,D], targets [N].

    Each chunk of rows gets its logits in the autocast dtype (what nn.Linear would give), a
    float32 log-sum-exp, its loss, and at once its gradients w.r.t. h and weight (the softmax
    minus the one-hot, over the number of counted targets); the backward only scales them by
    the incoming gradient. Memory is O(chunk x V) instead of the four [N,V] float32 tensors of
    logits.float(), log_softmax and their gradients."""
    if h.dim() != 2 or weight.dim() != 2 or targets.shape != h.shape[:1] or h.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: need h [N,D], weight [V,D], targets [N]; got "
                         f"{tuple(h.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    chunk = LOSS_CHUNK if chunk is None else chunk
    if not (isinstance(chunk, int) and chunk > 0):
        raise ValueError(f"linear_cross_entropy: chunk must be a positive int, got {chunk!r}")
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(h, weight, targets, chunk, dtype, grad)


class _LinearCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, dtype, grad):
        # needs_input_grad is set under no_grad too: `grad` says whether a backward can come
        need_h, need_w = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        rows = _compiled_ce_rows() if h.is_cuda else _ce_rows
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            n = (targets != IGNORE_INDEX).sum()
            scale = 1.0 / n.clamp(min=1).to(acc)  # a tensor: no host sync
            loss = torch.zeros((), dtype=acc, device=h.device)
            dh = torch.empty_like(h) if need_h else None
            dw = torch.zeros_like(weight) if need_w else None
            for s in range(0, h.shape[0], chunk):
                hc = h[s:s + chunk].to(dtype)
                part, g = rows(hc @ w.t(), targets[s:s + chunk], scale, need_h or need_w)
                loss = loss + part
                if need_h:
                    dh[s:s + chunk] = g @ w
                if need_w:
                    dw += g.t() @ hc  # in the autocast dtype, summed in the weight's
        ctx.save_for_backward(dh, dw)
        return loss / n

    @staticmethod
    def backward(ctx, dloss):
        dh, dw = ctx.saved_tensors
        dh = dh * dloss.to(dh.dtype) if dh is not None else None
        dw = dw * dloss.to(dw.dtype) if dw is not None else None
        return dh, dw, None, None, None, None


def _ce_rows(logits, targets, scale, grad):
    """One chunk: the summed loss of its counted rows and, if grad, scale * (softmax - onehot)
    in the logits' dtype (zero on rows whose target is IGNORE_INDEX)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    lse = x.logsumexp(-1)
    valid = targets != IGNORE_INDEX
    t = torch.where(valid, targets, 0)
    picked = x.gather(1, t[:, None])[:, 0]
    loss = torch.where(valid, lse - picked, 0.0).sum()
    if not grad:
        return loss, None
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == t[:, None]
    g = ((x - lse[:, None]).exp() - onehot.to(x.dtype)) * torch.where(valid, scale, 0.0)[:, None]
    return loss, g.to(logits.dtype)


@functools.cache
def _compiled_ce_rows():
    # on CUDA one fused reduction and one pointwise kernel per chunk instead of ~8 passes over
    # [chunk, V] float32; compiled on first use (CPU users pay nothing)
    return torch.compile(_ce_rows, dynamic=None)


def training_flops_per_token(cfg, T, n_params):
    """FLOPs of one training step per token, forward + backward = 3 x forward, with

      forward = 2 * n_params      every weight does one multiply-add per token (n_params: all
                                  parameters, a tied head once, an untied input table not at all)
              + per attention layer   2 * T * D             QK^T and AV under the causal mask
              + per GDN/PRISM layer   2 * H * (C (3K + 2V) + 3 K V)             (chunk form)
                                      + 2 * H * (L-1) * (C (2K + 2V) + K V)     (PRISM's rows)

    C = 64 is the Triton kernels' chunk. The GDN term counts the kernels' matmuls per chunk of C
    tokens and head: K K^T and Q K^T (C^2 K each), the triangular system for W and U (C^2 (K+V)),
    A U (C^2 V), the state's W S, Q S and K^T U (C K V each). Each extra PRISM row adds its
    K/Q x Ke^T (2 C^2 K), the products with Ve (2 C^2 V) and its write Ke^T Ve (C K V).
    The same formula, with the peer's own parameter count, gives every row of bench.py its MFU."""
    fwd = 2 * n_params
    D, H, K, V, C = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.value_dim, 64
    for i in range(cfg.n_layer):
        mixer = cfg.layer_mixer(i)
        if mixer == "attention":
            fwd += 2 * T * D
        else:
            rows = cfg.solver_steps - 1 if mixer == "prism" else 0
            fwd += 2 * H * (C * (3 * K + 2 * V) + 3 * K * V)
            fwd += 2 * H * rows * (C * (2 * K + 2 * V) + K * V)
    return 3 * fwd


# ----------------------------------------------------------------------------------------------
# 6. decoding

STEP_TOKENS = 64        # with a cache, up to this many tokens take the token-by-token kernels
PREFILL_TOKENS = 2**18  # tokens per prefill piece (all rows) for models with recurrent layers
GRAPH_WARMUP = 2        # eager decoding steps before the CUDA graph is captured
EOS_CHECK = 32          # generate() looks whether every row has ended every this many tokens


class Cache:
    """Static decoding buffers for Model.forward(idx, cache=...), from Model.init_cache.

    layers[i] holds layer i's buffers (its mixer's cache_buffers): GDN/PRISM the state S and the
    short convs' last inputs, attention k, v [B, max_len, H, D]. `pos` (0-d int64 tensor) counts
    the tokens fed so far: the next one's index. With reset_at_eos (eos_id set) `begin` [B] is
    each row's current segment start. `length` is pos on the host, read only to size a prefill's
    attention. Every buffer keeps its shape and address and a one-token step reads no host value,
    so the step can be captured in a CUDA graph (Model.generate does). Per forward, begin_step sets
    `reset` [B,T] (the tokens that start a segment) and `begins` [B,T] (each token's segment
    start) for the layers; end_step advances."""

    def __init__(self, layers, batch_size, max_len, device, rope=None, eos_id=None):
        self.layers, self.batch_size, self.max_len = layers, batch_size, max_len
        self.rope, self.eos_id = rope, eos_id
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.begin = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0
        self.reset = self.begins = None

    def __iter__(self):
        return iter(self.layers)

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def nbytes(self):
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())

    def begin_step(self, idx):
        B, T = idx.shape
        if B != self.batch_size:
            raise ValueError(f"cache is for {self.batch_size} rows, got {B}")
        if self.rope is not None and self.length + T > self.max_len:
            raise ValueError(f"cache holds {self.max_len} tokens: {self.length} fed, {T} more do not fit")
        if self.eos_id is not None:  # an EOS starts a segment: the window begins at it
            self.reset = idx == self.eos_id
            t = self.pos + torch.arange(T, device=idx.device)
            self.begins = torch.where(self.reset, t, self.begin[:, None]).cummax(1).values

    def end_step(self, T):
        self.pos += T
        self.length += T
        if self.begins is not None:
            self.begin.copy_(self.begins[:, -1])
        self.reset = self.begins = None


def compute_dtype(x):
    """The dtype x's matmuls run in: autocast's when it is on, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def memoised(owner, name, params, build):
    """build() (tensors derived from `params`), kept on `owner` under `name` and built again
    once any of params changes: an optimizer step or load_state_dict bumps its version, a move
    or cast gives it new storage."""
    key = tuple((p.data_ptr(), p._version, p.dtype) for p in params)
    memo = owner.__dict__.setdefault("_decode_memo", {})
    if name not in memo or memo[name][0] != key:
        with torch.no_grad():
            memo[name] = (key, build())
    return memo[name][1]


def padded_rows(w, multiple=64):
    """w [N, ...] with zero rows appended up to a multiple of `multiple`. A decoding GEMM's
    output rows must be 16-byte aligned for cuBLAS's fast kernels: at N = 4620 (GDN's stacked
    input projection) batch 64 fell back to an sm80 kernel, 11 us per call against 5 us padded
    to 4672 (H200, bench/bench_decode.py --profile)."""
    return F.pad(w, (0, 0) * (w.dim() - 1) + (0, -w.shape[0] % multiple))


def stacked_weights(owner, name, layers, dtype):
    """(weight, bias) of Linear `layers` that read the same input, stacked along the output in
    `dtype` and padded (padded_rows; callers slice the outputs they need): a decoding step does
    one GEMM instead of len(layers) (memoised)."""
    params = [p for m in layers for p in m.parameters()]

    def build():
        w = padded_rows(torch.cat([m.weight for m in layers]).to(dtype))
        if all(m.bias is None for m in layers):
            return w, None
        b = [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in layers]
        return w, padded_rows(torch.cat(b).to(dtype))
    return memoised(owner, (name, dtype), params, build)


def filter_logits(logits, temperature=1.0, top_k=None, top_p=None):
    """logits [B, vocab] as float32 / temperature, with -inf outside the tokens a draw may take:
    the top_k largest (ties at the k-th kept), then of those the nucleus, the smallest set whose
    probability sums to >= top_p (always at least one token). Computed as transformers'
    TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper compute it (the same sort and
    cumulative sum), so a draw can take exactly the tokens that transformers' sampling can."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        # ascending: a token goes when the tokens up to and including it hold <= 1 - top_p
        # of the mass, i.e. when those above it already hold >= top_p; the largest never goes
        sorted_logits, order = torch.sort(logits, descending=False)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1:] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), -math.inf)
    return logits


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, eos_id=None, done=None, pad_id=None):
    """The next token per row from logits [B, vocab], on the device with no host sync: greedy
    for temperature 0, else a draw from softmax(filter_logits(...)) (top_k, top_p; top_k 1 is
    greedy too, up to exact ties for the largest logit, which it draws among as transformers does).
    With eos_id (an id, or a 1-D tensor of ids on the device) rows marked in `done` [B] bool
    take pad_id (default: the EOS, the first of several), and rows that draw an EOS are marked."""
    if temperature == 0:
        nxt = logits.argmax(-1)
    else:
        probs = F.softmax(filter_logits(logits, temperature, top_k, top_p), -1)
        # argmax of p / Exp(1) noise is a draw from p (torch.multinomial would sync the host)
        nxt = (probs / torch.empty_like(probs).exponential_()).argmax(-1)
    if eos_id is not None:
        eos = torch.as_tensor(eos_id, device=nxt.device).view(-1)
        pad = eos[0] if pad_id is None else pad_id
        nxt = torch.where(done, pad, nxt)
        done |= (nxt[:, None] == eos).any(-1)
    return nxt


def cuda_graph(fn, warmup=GRAPH_WARMUP):
    """fn captured in a CUDA graph; returns the graph's replay. fn first runs `warmup` times,
    for real, on a side stream (kernels compile and the allocator and cuBLAS settle before the
    capture, as the CUDA graphs notes ask). Capturing runs nothing."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
