"""
What the chunk stages share (chunk_fwd.py, chunk_bwd.py) and the helpers every stage allocates
and checks with.

Tile helpers (@triton.jit, inlined where they are called): _ptrs, _tile (with its mask) and
_tile_t (the transposed tile, a dot's left operand straight from memory) address a [rows, cols]
tile of a row-major view; _decay_masks gives Gam[t, i] = exp(G_t - G_i) over the strict and the
inclusive lower triangle; _dot is the precision rule (float32 inputs: tf32x3; bf16/fp16: the
input dtype; float32 accumulation); _pid_split puts (inner blocks x chunks or sequences) on grid
axis 0; _chunk_coords and _seq_coords map a program to its chunk or sequence, fixed-length or
packed. Every offset that is a product of sizes is int64; in-tile offsets fit int32.

Host side: launch_config holds every block size, warp count and pipeline depth of the chunk
kernels (OVERRIDES changes them without editing the rules; smem_estimate bounds the shared
memory each depth needs: bench/KERNEL_NOTES.md); the packed-sequence tables are read from
cu_seqlens once per tensor; _setup turns a call's shapes into the kernels' constexprs and
tables. POISON = True (the tests set it) makes _empty fill every buffer with NaN.
"""
import os

import torch
import triton
import triton.language as tl

# Debug: fill every buffer the stages allocate (through _empty) with NaN before the kernels write
# it, so a test can prove every element it reads back was written (the tests set it).
POISON = False


def _interpreting():
    # Triton's CPU interpreter (TRITON_INTERPRET=1): the kernels take CPU tensors there
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _empty(*shape, dtype, device):
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _dot(a, b, F32: tl.constexpr, DT: tl.constexpr):
    # float32 inputs: tf32x3 (three tf32 products, ~float32 accuracy on the tensor cores; plain
    # tf32 would cost ~1e-3 relative error, 'ieee' compiles to very long FMA code);
    # otherwise both operands in the input dtype, float32 accumulation
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _decay_masks(b_gc, BT: tl.constexpr):
    # Gam over the strict / inclusive lower triangle, exp taken only where it is <= 1
    o_t = tl.arange(0, BT)
    diff = b_gc[:, None] - b_gc[None, :]
    m_s = o_t[:, None] > o_t[None, :]
    m_c = o_t[:, None] >= o_t[None, :]
    gam_s = tl.where(m_s, tl.exp(tl.where(m_s, diff, 0.)), 0.)
    gam_c = tl.where(m_c, tl.exp(tl.where(m_c, diff, 0.)), 0.)
    return gam_s, gam_c


@triton.jit
def _ptrs(x, off, stride, c0, BR: tl.constexpr, BC: tl.constexpr):
    # pointers of the [BR, BC] tile at rows 0..BR-1, columns c0.. of a row-major view starting at
    # x + off (off int64) with row stride `stride`; in-tile offsets (< BR * stride) fit int32
    return x + off + tl.arange(0, BR)[:, None] * stride + (c0 + tl.arange(0, BC))[None, :]


@triton.jit
def _tile(x, off, stride, n_rows, c0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    # pointers and mask of the [BR, BC] tile at rows 0..BR-1, columns c0.. of a row-major view
    # that starts at x + off (off int64) with row stride `stride`; rows >= n_rows and columns
    # >= n_cols are masked. In-tile offsets are < BR * stride, so int32 is enough there.
    o_r = tl.arange(0, BR)
    o_c = c0 + tl.arange(0, BC)
    return x + off + o_r[:, None] * stride + o_c[None, :], (o_r < n_rows)[:, None] & (o_c < n_cols)[None, :]


@triton.jit
def _tile_t(x, off, stride, n_rows, n_cols, BC: tl.constexpr, BR: tl.constexpr):
    # the same view's [BR, BC] tile loaded transposed, as [BC, BR] (column c, row r): a dot's
    # left operand straight from memory, no transpose in registers
    o_r = tl.arange(0, BR)
    o_c = tl.arange(0, BC)
    return x + off + o_c[:, None] + o_r[None, :] * stride, (o_c < n_cols)[:, None] & (o_r < n_rows)[None, :]


@triton.jit
def _pid_split(n_inner):
    # a launch of (inner blocks x chunks or sequences) programs has both on grid axis 0, inner
    # fastest: the same program order as an (inner, outer) grid, but CUDA takes 2^31 - 1 programs
    # on axis 0 and only 65535 on axes 1 and 2, which the chunks of one call pass at 4.2M tokens
    # (2.1M in chunks of 32) and a packed call's sequences x heads at 65536 / H sequences
    pid = tl.program_id(0)
    return pid % n_inner, pid // n_inner


@triton.jit
def _chunk_coords(i_c, i_h, H, cu_seqlens, chunk_indices, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # chunk program (chunk i_c, head i_h) -> (its first token t0 (int64), its valid rows nt
    # (int32: masks stay 32-bit), its chunk-head index ch = i_c * H + i_h (int64)).
    # Fixed length: B sequences of T back to back, chunk id = i_b * NT + i_t.
    # Packed: chunk_indices[i_c] = (sequence, chunk); every sequence starts a new chunk.
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2)
        i_t = tl.load(chunk_indices + i_c * 2 + 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        NT = tl.cdiv(T, BT)
        i_t = i_c % NT
        bos = (i_c // NT).to(tl.int64) * T
        eos = bos + T
    t0 = bos + i_t * BT
    return t0, (eos - t0).to(tl.int32), i_c.to(tl.int64) * H + i_h


@triton.jit
def _seq_coords(i_n, cu_seqlens, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # sequence program -> (first token, end token, id of its first chunk), all int64
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        boc = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        boc = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return bos, eos, boc


# ----------------------------------------------------------------------------------------------
# host side: the launch table, packed-sequence tables, a chunk call's constexprs

_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _dot_dtype(dt):
    # The CPU interpreter (Triton 3.6, 3.7 and 3.9 alike) multiplies bf16 bit patterns as integers
    # in tl.dot (float16 is exact): there bf16 operands, already rounded by the loads and stores,
    # are multiplied in float32
    if dt == torch.bfloat16 and _interpreting():
        return tl.float32
    return _DOT_DTYPES[dt]


SMEM_LIMIT = 232448   # bytes of shared memory per block on the H100/H200 (sm_90)
# Launch choices to try without editing the rules below, e.g. {"state_bv": 16} (bench_kernel.py
# --bv sets it); also from the environment: PRISM_KERNEL_CONFIG="state_bv=16,stages=2"; a key
# "kernel.field" sets one kernel's BV, num_warps, num_stages (BK: the key-block pair only)
OVERRIDES = {k: int(v) for k, v in (kv.split("=") for kv in
                                    os.environ.get("PRISM_KERNEL_CONFIG", "").split(",") if kv)}


def smem_estimate(name, BT, BK, BV, es, NE, stages):
    """Shared memory (bytes) of one kernel from its tile sizes, an upper estimate: the tiles a
    loop iteration loads are buffered `stages` times by the software pipeline, and every dot
    operand that is not loaded in the loop is staged once. es = bytes per input element (the
    saved h, W, U and Tm are in the input dtype too); float32 scratch tiles count 4 bytes.
    bench/kernel_regs.py prints the compiled figure next to this one for every configuration."""
    tk, tv, hk, cc = BT * BK * es, BT * BV * es, BK * BV * es, BT * BT * es
    loop, fixed = {
        "fwd_prep": (tv + NE * (tk + tv), tk + 3 * cc + BK * BV * 4 + BT * BT * 4),
        "fwd_state": (2 * tk + tv + (hk if NE else 0), BK * BV * 4),
        "bwd_h": (tk + tv + (hk if NE else 0), BK * BV * 4),
        "bwd_r": (0, NE * (tk + tv) + BK * BV * 4),
        "bwd_w": (0, 2 * tk + cc),
        "fwd_out": (0, 2 * tk + hk + tv + NE * (tk + tv) + BT * BT * 4),
        "bwd_dv_local": (0, 2 * tk + tv + BT * BT * 4),
        "bwd_state": (3 * tk + 2 * tv, BK * BV * 4),
        "bwd_rows": (3 * tv + hk, 3 * tk + cc + 2 * BT * BT * 4),
        "bwd_local": (4 * tv + 2 * hk, 2 * tk + cc + 2 * BT * BT * 4),
        "bwd_local_cc": (4 * tv + 2 * tk + 2 * hk, cc + 4 * BT * BT * 4),
        "bwd_local_dqk": (3 * tv + 2 * hk, 2 * tk + 3 * cc),
    }[name]
    return stages * loop + fixed


def launch_config(K, V, dtype, NE, n_seq):
    """Every block size, warp count and pipeline depth in one place. n_seq = sequences x heads,
    the program count of the sequential state passes per value block.
    Returns (BT, BK, {kernel name: dict(BV=, num_warps=, num_stages=)}). BK is always the whole
    key dim (the triangular solve and the state need all of K); BT is the chunk length."""
    ov = OVERRIDES
    es = torch.tensor([], dtype=dtype).element_size()
    BK = max(16, triton.next_power_of_2(K))
    Vp = max(16, triton.next_power_of_2(V))
    # chunks of 64 where a key row is at most 256 bytes (bf16/fp16 K <= 128, float32 K <= 64),
    # else 32: float32 at K = 256 would need 288 KB of shared memory in the local backward, and
    # at 512-byte rows (float32 K = 128, bf16/fp16 K = 256) Triton 3.6 for sm_90 miscompiles
    # chunks of 64: _bwd_state's dots read shared memory out of bounds (illegal memory access,
    # compute-sanitizer). The local backward in key blocks (below) also runs at 32: at 64 its
    # _bwd_local_cc with key blocks (cc_bk < K) gives a wrong dv and dbeta for bf16/fp16 (same
    # compiler). Chunks of 32 pass. local_bk is the dq/dk kernel's key block, cc_bk the first
    # kernel's: all of K up to 128 (its key loop then runs once).
    local_bk = min(BK, ov.get("local_bk", BK if BK <= 128 else 64))
    cc_bk = min(BK, ov.get("cc_bk", BK if BK <= 128 else local_bk))
    BT = ov.get("chunk", 64 if BK * es <= 256 and cc_bk == BK else 32)
    # state passes: the [BK, BV] float32 state stays in registers (no spills at BK <= 128 and BV
    # <= 64 with ptxas for sm_90). The value block is the widest that still gives at least one
    # program per SM (132): 64 at the 130M model's shape (B = 16, H = 6, V = 256), 32 or 16 for
    # few sequences x heads (B*H = 6 at 1x32768), twice or four times the programs
    fill = lambda widths: next((w for w in widths if n_seq * triton.cdiv(V, w) >= 132), 16)
    small = BK <= 128
    state_bv = min(Vp, ov.get("state_bv", fill((64, 32) if small else (32,))))
    bv = min(Vp, ov.get("bv", 32))
    # Warps: 4 wherever measured faster (16 x 2048, H = 6, K = 128, V = 256, bf16, H200): the
    # kernels that run out of registers at 8 warps (255 per thread: one program per SM) run two
    # programs per SM at 4, which hides more latency than their extra spills cost (the local
    # backward 1716 -> 1239 us, the prep 460 -> 231; bench/results/kernel_sweep_2026-12-01_1719.json).
    # The injected rows' backward stays at 8 (1340 us against 1929 at 4). Wider value blocks for
    # the output pass (64) and dU_local (128): fewer programs re-reading the same Q, K tiles.
    # The reverse state pass keeps the narrower state_bv rule of before (measured at 32, 4 warps).
    # The local backward in one kernel holds dq, dk ([BT, K] float32) across its value loop: it
    # spills ~1.6 KB/thread at K = 128 (4 warps; 0.9 at 8) and ~2.7 KB at K = 256 (bf16, sm_90).
    # With local_bk < K it runs as two kernels with K in blocks (_bwd_local_cc, _bwd_local_dqk;
    # like fla's dq/dk kernel), at the price of reading dU, U, dO, h and dh once more.
    # Not at 4 warps: faster at K = 128, but Triton 3.6 for sm_90 then gives wrong dq, dk, dg in
    # ~0.3% of chunks (bench/KERNEL_NOTES.md, "Local backward in key blocks").
    # With injected rows (NE > 0) the prep and the output pass also take wider value blocks (64
    # and 128 at K <= 128 in bf16/fp16): they re-read Ke and the rows' tiles once per value block
    # (bench/results/kernel_sweep_2026-12-01_1745.txt: L = 3 prep 679 -> 510 us, output 321 -> 287).
    rows = NE > 0 and small and es == 2
    cfg = dict(
        fwd_prep=dict(BV=min(Vp, ov.get("bv", 64 if rows else 32)), num_warps=4 if small else 8),
        fwd_state=dict(BV=state_bv, num_warps=4),
        bwd_h=dict(BV=state_bv, num_warps=4),
        bwd_w=dict(BV=bv, num_warps=4),   # BV unused
        bwd_r=dict(BV=bv, num_warps=4),
        fwd_out=dict(BV=min(Vp, ov.get("bv", 128 if rows else 64)), num_warps=4),
        bwd_dv_local=dict(BV=min(Vp, ov.get("bv", 128)), num_warps=4),
        bwd_state=dict(BV=min(Vp, ov.get("state_bv", fill((32,)))), num_warps=4 if small else 8),
        bwd_rows=dict(BV=bv, num_warps=4 if BK <= 64 else 8),
        bwd_local=dict(BV=bv, num_warps=4),
        bwd_local_cc=dict(BV=min(Vp, ov.get("cc_bv", 16)), BK=cc_bk, num_warps=8),
        bwd_local_dqk=dict(BV=bv, BK=local_bk, num_warps=8),
    )
    for key, val in ov.items():   # one kernel's launch, e.g. "bwd_local.num_stages=1"
        name, _, field = key.partition(".")
        if not field:
            continue
        # a kernel's own fields only (BK exists for the key-block pair alone: the others take all of K)
        if name not in cfg or (field not in cfg[name] and field != "num_stages"):
            raise ValueError(f"prism_kernel.OVERRIDES: unknown launch override {key!r}; per-kernel keys are "
                             f"<kernel>.<field> with <kernel> one of {', '.join(cfg)} and <field> one of "
                             f"its own ({', '.join(cfg.get(name, {}))}) or num_stages")
        cfg[name][field] = val
    if local_bk == BK:
        del cfg["bwd_local_cc"], cfg["bwd_local_dqk"]
    else:
        del cfg["bwd_local"]
    # the deepest software pipeline (3, 2 or 1 copies of the loop's tiles) that fits with a margin
    for name, c in cfg.items():
        if "num_stages" not in c:
            c["num_stages"] = ov.get("stages", next(
                (s for s in (3, 2) if smem_estimate(name, BT, c.get("BK", BK), c["BV"], es, NE, s)
                 <= 0.9 * SMEM_LIMIT), 1))
    return BT, BK, cfg


_SEQ_CACHE = {}   # id(cu_seqlens) -> (the tensor, its version, {derived tables}); a few entries


def _seq_cache(cu_seqlens):
    """Tables derived from one cu_seqlens tensor, kept while it is unchanged: a model passes the
    same tensor to every layer and conv, so one host read serves a whole forward and backward.
    The entry holds the tensor (its id cannot be reused meanwhile); an in-place change bumps its
    version and starts a new entry."""
    try:
        version = cu_seqlens._version
    except RuntimeError:      # inference tensors keep no version counter: no caching
        return {}
    e = _SEQ_CACHE.get(id(cu_seqlens))
    if e is None or e[0] is not cu_seqlens or e[1] != version:
        e = _SEQ_CACHE[id(cu_seqlens)] = (cu_seqlens, version, {})
        while len(_SEQ_CACHE) > 8:
            del _SEQ_CACHE[next(iter(_SEQ_CACHE))]
    return e[2]


def _seq_lengths(cu_seqlens, T, who="chunk_prism"):
    """Validate cu_seqlens (one host read per tensor) and return the sequence lengths (CPU int64)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{who}: cu_seqlens must be a 1-D int32/int64 tensor [N+1] of sequence starts and the end")
    cache = _seq_cache(cu_seqlens)
    if ("lens", T) not in cache:
        cache[("lens", T)] = _check_lengths(cu_seqlens.tolist(), T, who)
    return cache[("lens", T)]


def _check_lengths(c, T, who):
    if c[0] != 0 or c[-1] != T:
        raise ValueError(f"{who}: cu_seqlens must start at 0 and end at T = {T}, got {c[0]} .. {c[-1]}")
    lens = torch.tensor(c[1:], dtype=torch.int64) - torch.tensor(c[:-1], dtype=torch.int64)
    if (lens <= 0).any():
        raise ValueError(f"{who}: cu_seqlens must be strictly increasing "
                         f"(empty sequence at index {int((lens <= 0).nonzero()[0])})")
    return lens


def _seq_tables(cu_seqlens, T, BT, device):
    """Packed-sequence tables on cu_seqlens' device: chunk_indices [NC, 2] = (sequence, chunk in
    it) per chunk program, chunk_offsets [N+1] = first chunk of each sequence. Every sequence is
    padded to whole chunks in this index space. Built on `device` (the inputs'), wherever
    cu_seqlens lives."""
    lens = _seq_lengths(cu_seqlens, T)
    cache = _seq_cache(cu_seqlens)
    key = ("tables", T, BT, str(device))
    if key not in cache:
        cache[key] = _build_tables(cu_seqlens, lens, BT, device)
    return cache[key]


def _build_tables(cu_seqlens, lens, BT, dev):
    nts = (lens + BT - 1) // BT
    offsets = torch.cat([nts.new_zeros(1), nts.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(len(nts)), nts)
    chunk = torch.arange(int(offsets[-1])) - offsets[:-1].repeat_interleave(nts)
    return (cu_seqlens.to(dev, torch.int32).contiguous(),
            torch.stack([seq, chunk], 1).to(dev, torch.int32).contiguous(),
            offsets.to(dev, torch.int32), len(nts), int(offsets[-1]))


def _setup(q, v, ke, cu_seqlens, tables=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NE = 0 if ke is None else ke.shape[3]
    n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BT, BK, cfg = launch_config(K, V, q.dtype, NE, n_seq * H)
    meta = dict(K=K, V=V, BT=BT, BK=BK, F32=q.dtype == torch.float32, DT=_dot_dtype(q.dtype),
                IS_VARLEN=cu_seqlens is not None)
    if cu_seqlens is None:   # fixed length: program ids map arithmetically, the tables are unused
        tables = (q, q, q, B, B * triton.cdiv(T, BT))
    elif tables is None:     # the forward builds them (one host read), the backward reuses them
        tables = _seq_tables(cu_seqlens, T, BT, q.device)
    return NE, meta, cfg, tables


def _launchable(x, name):
    if not x.is_cuda and not _interpreting():
        raise ValueError(f"{name}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
