"""
Registers and spills of the backward kernels for the H200 (sm_90a), with no GPU: Triton compiles
to PTX for that target and its bundled ptxas reports the resource use. bf16, K = V = 128, L = 1..4,
the two backward kernels that hold the most live state (_bwd_local, _bwd_rows).

    python bench/kernel_regs.py
"""
import inspect
import os
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import prism_kernel as pk  # noqa: E402

FP32_ARGS = {"gc", "beta", "dbeta", "dg", "dqp", "dkp", "dbp", "dgp"}   # other pointers: bf16
SCALARS = {"scale": "fp32", "T": "i32"}


def ptxas_report(kernel, consts, num_warps):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in consts else SCALARS.get(n, "*fp32" if n in FP32_ARGS else "*bf16")
           for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=1))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    os.unlink(f.name)
    return " | ".join(line.split(":", 1)[-1].strip() for line in out.splitlines()
                      if "spill" in line or "Used" in line)


def main():
    base = dict(H=6, K=128, V=128, BT=pk.CHUNK, BK=128, BV=32, F32=False, DT=tl.bfloat16)
    for L in (1, 2, 3, 4):
        print(f"_bwd_local L={L}: " + ptxas_report(pk._bwd_local, dict(base, NE=L - 1), 8), flush=True)
        if L > 1:
            print(f"_bwd_rows  L={L}: " + ptxas_report(pk._bwd_rows, dict(base, NE=L - 1), 8), flush=True)


if __name__ == "__main__":
    main()
