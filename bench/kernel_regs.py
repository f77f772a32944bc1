"""
Shared memory, registers and spills of every chunk_prism kernel for the H100/H200 (sm_90a),
with no GPU: Triton compiles to PTX and cubin for that target on the CPU; the shared memory a
launch needs is the compiled kernel's metadata (a launch fails with OutOfResources when it is
over 232448 B), registers and spills come from the bundled ptxas.

The launch choices are prism_kernel.launch_config's, so this checks exactly what a call with
these head dims and dtype launches. Shared memory depends on dtype size, K and the tile widths;
V only sets the number of value blocks.

    python bench/kernel_regs.py                        # K in 64,128,256, fp32 and bf16, L = 1..4
    python bench/kernel_regs.py --K 128 --V 256 --dtype bfloat16 --L 3 --ptxas
    python bench/kernel_regs.py --kernels bwd_local,bwd_rows --ptxas --n_seq 6
    PRISM_KERNEL_CONFIG=local_bk=64 python bench/kernel_regs.py --K 128 --ptxas   # a variant
    python bench/kernel_regs.py --every-launch    # compile every kernel the module launches (CI)
    python bench/kernel_regs.py --every-launch --ptxas   # ... with registers and spills (the solver chain's too)

--every-launch runs the host functions at small shapes with each kernel launch recorded instead
of run, then compiles every distinct launch for sm_90 (front-end and ptxas errors that the CPU
interpreter never sees: type checks of loop-carried values, constexpr branches, resources).
"""
import argparse
import inspect
import os
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import prism_kernel as pk  # noqa: E402
from prism_ops import chunk_bwd, chunk_fwd, tiles  # noqa: E402

FP32_ARGS = {"g", "gc", "dbeta", "dg", "dqp", "dkp", "dbp", "dgp", "h0", "ht", "dht", "dh0"}
INT_ARGS = {"cu_seqlens", "chunk_indices", "chunk_offsets"}
SCALARS = {"scale": "fp32", "T": "i32"}
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
KERNELS = dict(fwd_prep=chunk_fwd._fwd_prep, fwd_state=chunk_fwd._fwd_state, bwd_h=chunk_fwd._fwd_state,
               bwd_w=chunk_fwd._fwd_w, bwd_r=chunk_fwd._fwd_rows, fwd_out=chunk_fwd._fwd_out,
               bwd_dv_local=chunk_bwd._bwd_dv_local, bwd_state=chunk_bwd._bwd_state, bwd_rows=chunk_bwd._bwd_rows,
               bwd_local=chunk_bwd._bwd_local, bwd_local_cc=chunk_bwd._bwd_local_cc,
               bwd_local_dqk=chunk_bwd._bwd_local_dqk)
FLAGS = dict(fwd_state=dict(HAS_H0=True, STORE_HT=True, RECOMPUTE=False),
             bwd_h=dict(HAS_H0=True, STORE_HT=False, RECOMPUTE=True),   # _fwd_state rebuilding h
             bwd_state=dict(HAS_DHT=True, STORE_DH0=True))


def compile_sm90(kernel, consts, dtype, num_warps, num_stages):
    names = list(inspect.signature(kernel.fn).parameters)
    consts = {n: v for n, v in consts.items() if n in names}
    sig = {n: "constexpr" if n in consts else SCALARS.get(n, "*i32" if n in INT_ARGS else
                                                           "*fp32" if n in FP32_ARGS else f"*{TYPES[dtype]}")
           for n in names}
    # every pointer 16-byte aligned, as the JIT marks torch's allocations: without that hint the
    # software pipeliner leaves every masked tile load synchronous and the report is not the GPU's
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_report(compiled):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = spill = "?"
    for line in out.splitlines():
        if "Used" in line and "registers" in line:
            regs = line.split("Used", 1)[1].split("registers")[0].strip()
        if "spill stores" in line:
            spill = line.split("bytes stack frame,", 1)[-1].split("bytes spill stores")[0].strip()
    return regs, spill


def report(K, V, dtype, L, n_seq, kernels, ptxas, varlen=False):
    NE = L - 1
    BT, BK, cfg = pk.launch_config(K, V, dtype, NE, n_seq)
    es = torch.tensor([], dtype=dtype).element_size()
    base = dict(H=6, K=K, V=V, NE=NE, BT=BT, BK=BK, F32=dtype == torch.float32,
                DT=tiles._DOT_DTYPES[dtype], IS_VARLEN=varlen)
    worst = 0
    for name in kernels:
        if name not in cfg or (name in ("bwd_rows", "bwd_r") and NE == 0):
            continue
        c = cfg[name]
        consts = dict(base, BV=c["BV"], BK=c.get("BK", BK), **FLAGS.get(name, {}))
        try:
            comp = compile_sm90(KERNELS[name], consts, dtype, c["num_warps"], c["num_stages"])
        except Exception as e:  # noqa: BLE001
            print(f"{TYPES[dtype]} K={K} V={V} L={L} {name:<13} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            worst = float("inf")
            continue
        shared = comp.metadata.shared
        worst = max(worst, shared)
        extra = ""
        if ptxas:
            regs, spill = ptxas_report(comp)
            extra = f" regs {regs:>3} spill {spill:>5} B"
        est = pk.smem_estimate(name, BT, c.get("BK", BK), c["BV"], es, NE, c["num_stages"])
        flag = "" if shared <= pk.SMEM_LIMIT else "  OVER THE LIMIT"
        flag += "" if shared <= est else "  (estimate too low)"
        print(f"{TYPES[dtype]} K={K} V={V} L={L} {name:<13} BT={BT} BK={c.get('BK', BK):<3} BV={c['BV']:<3} warps={c['num_warps']} "
              f"stages={c['num_stages']} shared {shared:>6} B (estimate {est:>6}){extra}{flag}", flush=True)
    return worst


TORCH_TYPES = {**TYPES, torch.float64: "fp64", torch.int32: "i32", torch.int64: "i64",
               torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}


def record_launches(run):
    """The launches `run()` makes, as (kernel, args, kwargs), none of them executed: every
    JITFunction of prism_kernel and of its prism_ops stages is replaced by a recorder meanwhile
    (each launch site reads its own module's name). Buffers stay unwritten, so this suits host
    code that never reads kernel outputs back (the chunk and decoding entry points)."""
    log, saved = [], {}

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kw: log.append((self.fn, args, kw))

    for mod in (pk, *pk._STAGES):
        for name, fn in vars(mod).items():
            if isinstance(fn, triton.runtime.jit.JITFunction):
                saved[mod, name] = fn
    try:
        for (mod, name), fn in saved.items():
            setattr(mod, name, Recorder(fn))
        run()
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
    return log


def compile_launch(fn, args, kw):
    """Compile one recorded launch for sm_90 with the argument types and constants it had."""
    kw = dict(kw)
    opts = {n: kw.pop(n) for n in ("num_warps", "num_stages") if n in kw}
    bound = inspect.signature(fn.fn).bind(*args, **kw)
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = bound.arguments.get(p.name)
        if p.is_constexpr or v is None:
            sig[p.name], consts[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TORCH_TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:   # the JIT's alignment hint (see compile_sm90)
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        else:
            sig[p.name] = "fp32"
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def representative_calls():
    """Small calls that between them launch every kernel of prism_kernel in each of its
    variants (flags, dtypes, the one-kernel and the key-block local backward, packed sequences)."""
    os.environ["TRITON_INTERPRET"] = "1"   # the host checks accept CPU tensors; kernels are recorded
    dot_dtype = tiles._dot_dtype   # read by tiles._setup
    tiles._dot_dtype = lambda dt: tiles._DOT_DTYPES[dt]   # compile bf16 as the GPU runs it
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s).to(dt).requires_grad_()
    try:
        def prism(dt, K, V, NE, packed, local_bk):
            pk.OVERRIDES.pop("local_bk", None)
            if local_bk:
                pk.OVERRIDES["local_bk"] = local_bk
            T = 40
            q, k, v = r(1, T, 2, K, dt=dt), r(1, T, 2, K, dt=dt), r(1, T, 2, V, dt=dt)
            g, beta = r(1, T, 2, dt=torch.float32), r(1, T, 2, dt=torch.float32)
            ke, ve = (r(1, T, 2, NE, K, dt=dt), r(1, T, 2, NE, V, dt=dt)) if NE else (None, None)
            cu = torch.tensor([0, 15, T]) if packed else None
            h0 = torch.zeros(2 if packed else 1, 2, K, V) if packed else None
            o, ht = pk.chunk_prism(q, k, v, g, beta, ke, ve, initial_state=h0, output_final_state=packed,
                                   cu_seqlens=cu)
            (o.float().sum() + (ht.sum() if packed else 0)).backward()
            pk.OVERRIDES.pop("local_bk", None)

        yield "chunk bf16 K64 L3 packed", lambda: prism(torch.bfloat16, 64, 64, 2, True, 0)
        yield "chunk fp32 K64 L1 key blocks", lambda: prism(torch.float32, 64, 32, 0, False, 32)
        yield "chunk fp16 K64 L2 key blocks packed", lambda: prism(torch.float16, 64, 64, 1, True, 32)

        def conv(packed):
            x, w = r(1, 40, 96), r(96, 4)
            pk.causal_conv(x, w, cu_seqlens=torch.tensor([0, 15, 40]) if packed else None).float().sum().backward()
        yield "causal_conv", lambda: conv(False)
        yield "causal_conv packed", lambda: conv(True)

        def solver(NE, nk, gain, mode, nonlinear, dt=torch.bfloat16):
            B, T, H, K, V = 1, 4, 2, 128, 256   # the 130M layer's head dims
            ke, ve = pk.solver_chain(r(B, T, H, V, dt=dt), r(B, T, H * V, dt=dt),
                                     [r(B, T, H * V, dt=dt) for _ in range(NE if gain else 0)],
                                     [r(B, T, H * K, dt=dt) for _ in range(nk)], r(B, T, H * NE, dt=dt),
                                     mode, nonlinear)
            (ke.float().sum() + ve.float().sum()).backward()
        yield "solver chain L3 own keys", lambda: solver(2, 2, True, "gelu", True)
        yield "solver chain L4 shared key, no gain, closed form", lambda: solver(3, 1, False, "linear", True)
        yield "solver chain L2 no GELU fp32", lambda: solver(1, 1, True, "gelu", False, torch.float32)

        def decode():
            B, H, K, V = 2, 2, 64, 64
            x = torch.randn(B, 20, 96).bfloat16()    # a prefill (time blocks wider than the taps)
            buf = torch.zeros(B, 3, 96).bfloat16()
            pk.conv_step(x, buf, torch.randn(96, 4).bfloat16(), torch.zeros(B, 20, dtype=torch.bool))
            pk.conv_step(x[:, :1], buf, torch.randn(96, 4).bfloat16())
            q, k = torch.randn(B, 1, H, K).bfloat16(), torch.randn(B, 1, H, K).bfloat16()
            v = torch.randn(B, 1, H, V).bfloat16()
            g, beta = torch.randn(B, 1, H), torch.rand(B, 1, H)
            pk.recurrent_prism_step(q, k, v, g, beta, torch.randn(B, 1, H, 2, K).bfloat16(),
                                    torch.randn(B, 1, H, 2, V).bfloat16(), reset=torch.zeros(B, 1, dtype=torch.bool))
            pk.recurrent_prism_step(q, k, v, g, beta, gates=(torch.randn(H), torch.randn(H)), l2norm_qk=True)
            for keys_mode, mode in (("own", "gelu"), ("shared", "linear")):   # PRISM's step, solver inside
                pk.recurrent_prism_step(q, k, v, g, beta, gates=(torch.randn(H), torch.randn(H)), l2norm_qk=True,
                                        solver=dict(u=torch.randn(B, 1, H, V).bfloat16(),
                                                    keys=torch.randn(B, 1, 2 if keys_mode == "own" else 1, H, K).bfloat16(),
                                                    gains=torch.randn(B, 1, 2, H, V).bfloat16(),
                                                    steps=torch.randn(B, 1, H, 2).bfloat16(), keys_mode=keys_mode,
                                                    mode=mode, nonlinear=True))
            pk.gated_rms_norm(torch.randn(B, 1, H, V).bfloat16(), torch.randn(B, 1, H * V).bfloat16(),
                              torch.ones(V), 1e-6)
            pk.add_rms_norm(torch.randn(B, 1, 128).bfloat16(), torch.randn(B, 1, 128).bfloat16(), torch.ones(128), 1e-6)
            pk.silu_mul(torch.randn(B, 1, 256).bfloat16())
            L, D = 16, 32
            kc, vc = torch.zeros(B, L, H, D).bfloat16(), torch.zeros(B, L, H, D).bfloat16()
            begin, pos = torch.zeros(B, dtype=torch.int64), torch.tensor(3)
            qr = pk.rope_kv_write(torch.randn(B, 1, 3 * H * D).bfloat16(), torch.ones(L, D // 2),
                                  torch.zeros(L, D // 2), pos, begin, kc, vc)
            pk.decode_attention(qr, kc, vc, begin, pos, splits=2)
        yield "decoding", decode
    finally:
        tiles._dot_dtype = dot_dtype
        os.environ.pop("TRITON_INTERPRET", None)


def every_launch(ptxas=False):
    """Record the representative calls' launches and compile each distinct one for sm_90
    (with ptxas: also registers and spill bytes per thread)."""
    seen, failed = set(), 0
    for what, run in representative_calls():
        for fn, args, kw in record_launches(run):
            key = (fn.fn.__name__, tuple(type(a).__name__ + (str(a.dtype) if isinstance(a, torch.Tensor) else
                                                             "" if not isinstance(a, (bool, int)) else str(a))
                                         for a in args), tuple(sorted(kw.items(), key=lambda x: x[0])).__repr__())
            if key in seen:
                continue
            seen.add(key)
            try:
                c = compile_launch(fn, args, kw)
                extra = " regs {} spill {} B".format(*ptxas_report(c)) if ptxas else ""
                print(f"ok      {fn.fn.__name__:<16} ({what}) shared {c.metadata.shared} B{extra}", flush=True)
            except Exception as e:  # noqa: BLE001
                failed += 1
                print(f"FAILED  {fn.fn.__name__:<16} ({what}) {type(e).__name__}: {str(e)[:400]}", flush=True)
    print(f"{len(seen)} launches compiled for sm_90, {failed} failed (triton {triton.__version__})")
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--K", default="64,128,256")
    ap.add_argument("--V", default=None, help="default: V = K (V only sets the number of value blocks)")
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--L", default="1,2,4")
    ap.add_argument("--n_seq", type=int, default=48, help="sequences x heads (sets the state passes' BV)")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--ptxas", action="store_true", help="also registers and spill bytes per thread")
    ap.add_argument("--varlen", action="store_true", help="the packed-sequence (cu_seqlens) variants")
    ap.add_argument("--every-launch", action="store_true", help="compile every launch of small representative calls")
    args = ap.parse_args()
    if args.every_launch:
        return every_launch(args.ptxas)
    worst = 0
    for dt in args.dtype.split(","):
        for K in (int(x) for x in args.K.split(",")):
            for L in (int(x) for x in args.L.split(",")):
                V = int(args.V) if args.V else K
                worst = max(worst, report(K, V, getattr(torch, dt), L, args.n_seq,
                                          args.kernels.split(","), args.ptxas, args.varlen))
    print(f"largest shared memory: {worst} B (limit {pk.SMEM_LIMIT} B)")
    return 0 if worst <= pk.SMEM_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
