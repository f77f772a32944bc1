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

FP32_ARGS = {"g", "gc", "dbeta", "dg", "dqp", "dkp", "dbp", "dgp", "h0", "ht", "dht", "dh0"}
INT_ARGS = {"cu_seqlens", "chunk_indices", "chunk_offsets"}
SCALARS = {"scale": "fp32", "T": "i32"}
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
KERNELS = dict(fwd_prep=pk._fwd_prep, fwd_state=pk._fwd_state, fwd_out=pk._fwd_out,
               bwd_dv_local=pk._bwd_dv_local, bwd_state=pk._bwd_state, bwd_rows=pk._bwd_rows,
               bwd_local=pk._bwd_local, bwd_local_cc=pk._bwd_local_cc, bwd_local_dqk=pk._bwd_local_dqk)
FLAGS = dict(fwd_state=dict(HAS_H0=True, STORE_HT=True), bwd_state=dict(HAS_DHT=True, STORE_DH0=True))


def compile_sm90(kernel, consts, dtype, num_warps, num_stages):
    names = list(inspect.signature(kernel.fn).parameters)
    consts = {n: v for n, v in consts.items() if n in names}
    sig = {n: "constexpr" if n in consts else SCALARS.get(n, "*i32" if n in INT_ARGS else
                                                           "*fp32" if n in FP32_ARGS else f"*{TYPES[dtype]}")
           for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
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
                DT=pk._DOT_DTYPES[dtype], IS_VARLEN=varlen)
    worst = 0
    for name in kernels:
        if name not in cfg or (name == "bwd_rows" and NE == 0):
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
    args = ap.parse_args()
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
