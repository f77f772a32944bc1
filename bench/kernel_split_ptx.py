"""
Two builds of the kernels compile to the same code: by default prism_kernel.py as committed on
main (one file, or with its prism_ops/) against this checkout's prism_kernel.py and prism_ops/.
No GPU needed: Triton compiles for the H100/H200 (sm_90) on the CPU.

  1. sources: every @triton.jit function has the same name and the same source text
     (decorator included) in both builds, and neither has one the other lacks;
  2. launches: representative calls run on each build with every launch recorded instead of
     run (kernel, grid, the JIT's specialization of every argument: dtypes, 16-byte alignment,
     integer specializations, constexprs; warps, stages; tensor shapes and strides, scalars):
     the two lists are identical, so the host code launches the same kernels the same way;
  3. PTX: every distinct launch is compiled by both builds with the specialization the JIT
     gives it on a GPU. Compiled without line info (TRITON_DISABLE_LINE_INFO=1) the PTX text
     and the cubin must be byte-identical; compiled with it (the default), the PTX must be
     identical once the debug line info is dropped (the .file and .loc lines and the DWARF
     sections, which name the source file and line numbers, and nothing else).
Nothing is read from or written to Triton's cache: every compile is a fresh one.

The calls use the 130M model's shapes: B = 2, T = 256, H = 6, K = 128, V = 256, L = 1 and 3,
bf16 and fp32, with q and k normalised inside the op (as the layers call it), packed sequences
with an initial and a final state, the local backward in key blocks; the short conv at the
q|k|v and anchor widths (3072, 768), packed too; the solver chain's modes; every decoding step.

    python bench/kernel_split_ptx.py                    # main against this checkout, 2 processes
    python bench/kernel_split_ptx.py --ref HEAD~1 -j 4
    python bench/kernel_split_ptx.py --kernels _fwd_prep,_bwd_local --no-lineinfo-pass

Writes bench/results/kernel_split_ptx_<date>.json (--out to choose): per launch and per kernel
whether the code is identical, the Triton version and target. Exit status 1 on any difference.
"""
import argparse
import datetime
import hashlib
import inspect
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)   # the kernels must be JITFunctions (compilable), not interpreted
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # never a cache hit: each build's compile is its own
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernel_split_ptx_cache_")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import prism_kernel  # noqa: E402
from kernel_build import load_build  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)   # H100 / H200
BACKEND = make_backend(TARGET)


def build_from_git(ref):
    """prism_kernel.py (and prism_ops/, where the commit has it) of `ref`, in a temporary
    folder, imported under a name of its own. Returns (module, commit)."""
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", ref], capture_output=True, text=True,
                            check=True).stdout.strip()
    files = subprocess.run(["git", "-C", ROOT, "ls-tree", "-r", "--name-only", commit, "--", "prism_kernel.py",
                            "prism_ops"], capture_output=True, text=True, check=True).stdout.split()
    d = tempfile.mkdtemp(prefix="kernel_split_ptx_ref_")
    for f in files:
        os.makedirs(os.path.join(d, os.path.dirname(f)), exist_ok=True)
        with open(os.path.join(d, f), "wb") as fh:
            fh.write(subprocess.run(["git", "-C", ROOT, "show", f"{commit}:{f}"], capture_output=True,
                                    check=True).stdout)
    return load_build(os.path.join(d, "prism_kernel.py")), commit


def modules(pk):
    """The build's modules that launch kernels: prism_kernel and its stages (a one-file build: itself)."""
    return (pk, *getattr(pk, "_STAGES", ()))


def jit_functions(pk):
    """{name: JITFunction} of every @triton.jit function the build defines."""
    out = {}
    for mod in modules(pk):
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and fn.__module__ == mod.__name__:
                assert name not in out, name
                out[name] = fn
    return out


def compare_sources(old, new):
    a, b = jit_functions(old), jit_functions(new)
    rows = {}
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            rows[name] = dict(identical=False, only_in="ref" if name in a else "new")
            continue
        same_src = inspect.getsource(a[name].fn) == inspect.getsource(b[name].fn) and a[name].src == b[name].src
        same_flags = all(getattr(a[name], f) == getattr(b[name], f)
                         for f in ("do_not_specialize", "do_not_specialize_on_alignment", "noinline", "debug"))
        rows[name] = dict(identical=same_src and same_flags,
                          module_ref=a[name].__module__.split(".", 1)[-1], module_new=b[name].__module__)
    return rows


def representative_calls(pk):
    """(label, call) pairs that between them launch every kernel in its variants, at the 130M
    model's shapes. Public entry points only, so that any build runs them."""
    B, T, H, K, V = 2, 256, 6, 128, 256

    def r(*s, dt=torch.bfloat16, grad=True):
        x = torch.randn(*s).to(dt)
        return x.requires_grad_() if grad else x

    def chunk(dt, L, packed=False, local_bk=0):
        pk.OVERRIDES.clear()
        if local_bk:
            pk.OVERRIDES["local_bk"] = local_bk
        b, t = (1, 2 * T) if packed else (B, T)
        q, k, v = r(b, t, H, K, dt=dt), r(b, t, H, K, dt=dt), r(b, t, H, V, dt=dt)
        g, beta = r(b, t, H, dt=torch.float32), r(b, t, H, dt=dt)
        ke, ve = (r(b, t, H, L - 1, K, dt=dt), r(b, t, H, L - 1, V, dt=dt)) if L > 1 else (None, None)
        cu = torch.tensor([0, 100, 2 * T]) if packed else None
        h0 = torch.zeros(2, H, K, V, requires_grad=True) if packed else None
        o, ht = pk.chunk_prism(q, k, v, g, beta, ke, ve, initial_state=h0, output_final_state=packed,
                               cu_seqlens=cu, l2norm_qk=True)
        (o.float().sum() + (ht.sum() if packed else 0)).backward()
        pk.OVERRIDES.clear()

    for dt in (torch.bfloat16, torch.float32):
        for L in (1, 3):
            yield f"chunk_prism {'bf16' if dt == torch.bfloat16 else 'fp32'} L={L}", lambda dt=dt, L=L: chunk(dt, L)
    yield "chunk_prism bf16 L=3 packed", lambda: chunk(torch.bfloat16, 3, packed=True)
    yield "chunk_prism fp32 L=1 packed", lambda: chunk(torch.float32, 1, packed=True)
    yield "chunk_prism bf16 L=3 local_bk=64", lambda: chunk(torch.bfloat16, 3, local_bk=64)
    yield "chunk_prism fp32 L=1 local_bk=64", lambda: chunk(torch.float32, 1, local_bk=64)

    def conv(C, dt, packed=False):
        b, t = (1, 2 * T) if packed else (B, T)
        x, w = r(b, t, C, dt=dt), r(C, 4, dt=dt)
        pk.causal_conv(x, w, cu_seqlens=torch.tensor([0, 100, 2 * T]) if packed else None).float().sum().backward()
    yield "causal_conv bf16 C=3072", lambda: conv(3072, torch.bfloat16)
    yield "causal_conv bf16 C=768", lambda: conv(768, torch.bfloat16)
    yield "causal_conv fp32 C=3072", lambda: conv(3072, torch.float32)
    yield "causal_conv bf16 C=3072 packed", lambda: conv(3072, torch.bfloat16, packed=True)

    def solver(NE, nk, gain, mode, nonlinear, dt=torch.bfloat16):
        ke, ve = pk.solver_chain(r(B, T, H, V, dt=dt), r(B, T, H * V, dt=dt),
                                 [r(B, T, H * V, dt=dt) for _ in range(NE if gain else 0)],
                                 [r(B, T, H * K, dt=dt) for _ in range(nk)], r(B, T, H * NE, dt=dt),
                                 mode, nonlinear)
        (ke.float().sum() + ve.float().sum()).backward()
    yield "solver_chain L=3 own keys, gains, GELU", lambda: solver(2, 2, True, "gelu", True)
    yield "solver_chain L=3 shared key, no gain, closed form", lambda: solver(2, 1, False, "linear", True)
    yield "solver_chain L=3 no GELU", lambda: solver(2, 2, True, "gelu", False)
    yield "solver_chain L=3 fp32", lambda: solver(2, 2, True, "gelu", True, torch.float32)

    def decode():
        bf = torch.bfloat16
        x, buf = r(B, 20, 3072, grad=False), torch.zeros(B, 3, 3072, dtype=bf)
        pk.conv_step(x, buf, r(3072, 4, grad=False), torch.zeros(B, 20, dtype=torch.bool))   # a prefill
        pk.conv_step(x[:, :1], buf, r(3072, 4, grad=False))
        q, k, v = r(B, 1, H, K, grad=False), r(B, 1, H, K, grad=False), r(B, 1, H, V, grad=False)
        g, beta = torch.randn(B, 1, H), torch.rand(B, 1, H)
        pk.recurrent_prism_step(q, k, v, g, beta)
        pk.recurrent_prism_step(q, k, v, g, beta, r(B, 1, H, 2, K, grad=False), r(B, 1, H, 2, V, grad=False),
                                reset=torch.zeros(B, 1, dtype=torch.bool))
        gates = (torch.randn(H), torch.randn(H))
        pk.recurrent_prism_step(q, k, v, g, beta, gates=gates, l2norm_qk=True)
        for keys_mode, mode, gains in (("own", "gelu", True), ("shared", "linear", False), ("base", "gelu", True)):
            keys = None if keys_mode == "base" else r(B, 1, 2 if keys_mode == "own" else 1, H, K, grad=False)
            pk.recurrent_prism_step(q, k, v, g, beta, gates=gates, l2norm_qk=True,
                                    solver=dict(u=r(B, 1, H, V, grad=False), keys=keys,
                                                gains=r(B, 1, 2, H, V, grad=False) if gains else None,
                                                steps=r(B, 1, H, 2, grad=False), keys_mode=keys_mode, mode=mode,
                                                nonlinear=True))
        pk.gated_rms_norm(r(B, 1, H, V, grad=False), r(B, 1, H * V, grad=False), torch.ones(V), 1e-6)
        pk.add_rms_norm(r(B, 1, 768, grad=False), r(B, 1, 768, grad=False), torch.ones(768), 1e-6)
        pk.silu_mul(r(B, 1, 2 * 2048, grad=False))
        Ha, D, Lc = 12, 64, 1024   # an attention layer of the hybrid: 12 heads of 64, a 1024-token cache
        kc, vc = torch.zeros(B, Lc, Ha, D, dtype=bf), torch.zeros(B, Lc, Ha, D, dtype=bf)
        begin, pos = torch.zeros(B, dtype=torch.int64), torch.tensor(300)
        qr = pk.rope_kv_write(r(B, 1, 3 * Ha * D, grad=False), torch.ones(Lc, D // 2), torch.zeros(Lc, D // 2),
                              pos, begin, kc, vc)
        pk.decode_attention(qr, kc, vc, begin, pos)
    yield "decoding steps", decode


def record(pk):
    """[(label, kernel, grid, args, kwargs)] of every launch the representative calls make on
    build `pk`, none of them run."""
    log, saved = [], {}

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kw: log.append((label, self.fn, tuple(grid), args, kw))

    for mod in modules(pk):
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction):
                saved[mod, name] = fn
    home = getattr(pk, "tiles", pk)   # where the chunk calls read _dot_dtype (a one-file build: itself)
    dot_dtype = home._dot_dtype
    os.environ["TRITON_INTERPRET"] = "1"   # the host checks accept CPU tensors; the kernels are recorded
    try:
        home._dot_dtype = lambda dt: home._DOT_DTYPES[dt]   # bf16 dots as a GPU runs them
        for (mod, name), fn in saved.items():
            setattr(mod, name, Recorder(fn))
        torch.manual_seed(0)
        for label, call in representative_calls(pk):
            call()
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        home._dot_dtype = dot_dtype
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
    return log


def jit_spec(fn, args, kw):
    """What fn[grid](*args, **kw) compiles on an sm_90 GPU: (signature, constexprs, attrs,
    options), from Triton's own binder and argument packing (the JIT's run())."""
    kw = dict(kw)
    kw["debug"] = kw.get("debug", fn.debug) or triton.knobs.runtime.debug
    kw["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(BACKEND, kw, bound, specialization, options)
    return signature, constexprs, attrs, options


def describe(label, fn, grid, args, kw):
    """A recorded launch as plain data: equal for two builds iff they launch alike."""
    signature, constexprs, attrs, options = jit_spec(fn, args, kw)
    bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in kw.items() if k not in ("num_warps", "num_stages")})
    host = {}
    for name, v in bound.arguments.items():
        if isinstance(v, torch.Tensor):
            host[name] = [str(v.dtype), list(v.shape), list(v.stride())]
        elif not isinstance(v, (bool, int, float, type(None))):
            host[name] = repr(v)
        else:
            host[name] = v
    return dict(call=label, kernel=fn.fn.__name__, grid=list(grid), signature=signature,
                constexprs={str(k): repr(v) for k, v in constexprs.items()},
                attrs={str(k): repr(v) for k, v in attrs.items()},
                num_warps=options.num_warps, num_stages=options.num_stages, host=host)


def strip_line_info(ptx):
    """PTX without its debug line info: the .file and .loc directives and the DWARF sections
    (from the first .section .debug_* to the end), which carry source paths and line numbers."""
    head = re.split(r"^\s*\.section\s+\.debug_", ptx, maxsplit=1, flags=re.M)[0]
    return "\n".join(ln for ln in head.splitlines() if not re.match(r"\s*\.(loc|file)\s", ln))


def compile_both(i):
    """Compile launch i with the reference build's kernel and with the new one's, in each mode
    of MODES. Returns (i, {mode: results})."""
    (_, fn_old, _, args_old, kw_old), (_, fn_new, _, args_new, kw_new) = PAIRS[i]
    out = {}
    for mode in MODES:
        os.environ["TRITON_DISABLE_LINE_INFO"] = "1" if mode == "no_line_info" else "0"
        comp = []
        for fn, args, kw in ((fn_old, args_old, kw_old), (fn_new, args_new, kw_new)):
            signature, constexprs, attrs, options = jit_spec(fn, args, kw)
            t0 = time.time()
            c = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
            comp.append((c, time.time() - t0))
        (a, ta), (b, tb) = comp
        pa, pb = a.asm["ptx"], b.asm["ptx"]
        assert f".entry {fn_new.fn.__name__}(" in pb, "no kernel entry in the PTX"
        r = dict(ptx_identical=pa == pb, ptx_sha256=hashlib.sha256(pb.encode()).hexdigest()[:16],
                 ptx_lines=len(pb.splitlines()), compile_s=[round(ta, 1), round(tb, 1)])
        if mode == "no_line_info":
            r["cubin_identical"] = a.asm["cubin"] == b.asm["cubin"]
            r["has_loc"] = bool(re.search(r"^\s*\.loc\s", pb, re.M))
        else:
            sa, sb = strip_line_info(pa), strip_line_info(pb)
            r["ptx_identical_without_line_info"] = sa == sb
            r["stripped_lines"] = len(pb.splitlines()) - len(sb.splitlines())
        out[mode] = r
    os.environ.pop("TRITON_DISABLE_LINE_INFO", None)
    return i, out


PAIRS, MODES = [], ()


def main(argv=None):
    global PAIRS, MODES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="main", help="the reference build: a commit of this repo (default main)")
    ap.add_argument("--kernels", default="", help="compile only these kernels (comma-separated names)")
    ap.add_argument("--no-lineinfo-pass", action="store_true",
                    help="compile only without line info (skip the default-mode comparison)")
    ap.add_argument("-j", type=int, default=2, help="compiling processes (default 2)")
    ap.add_argument("--out", default="", help="JSON path (default bench/results/kernel_split_ptx_<date>.json)")
    a = ap.parse_args(argv)
    MODES = ("no_line_info",) if a.no_lineinfo_pass else ("no_line_info", "line_info")
    old, commit = build_from_git(a.ref)
    new = prism_kernel
    sources = compare_sources(old, new)
    print(f"sources: {sum(r['identical'] for r in sources.values())} of {len(sources)} jit functions identical",
          flush=True)
    log_old, log_new = record(old), record(new)
    desc_old = [describe(*x) for x in log_old]
    desc_new = [describe(*x) for x in log_new]
    same_launches = desc_old == desc_new
    print(f"launches: {len(desc_new)} recorded, identical lists: {same_launches}", flush=True)
    if not same_launches:
        for k, (x, y) in enumerate(zip(desc_old, desc_new)):
            if x != y:
                print(f"  first difference at launch {k}:\n    ref {x}\n    new {y}")
                break
    # distinct compiles (launches differing only in grid or shapes compile alike)
    keys, PAIRS = {}, []
    for x, y, d in zip(log_old, log_new, desc_new):
        if a.kernels and d["kernel"] not in a.kernels.split(","):
            continue
        key = json.dumps([d["kernel"], d["signature"], d["constexprs"], d["attrs"], d["num_warps"], d["num_stages"]])
        if key not in keys:
            keys[key] = len(PAIRS)
            PAIRS.append((x, y))
    print(f"compiling {len(PAIRS)} distinct launches with both builds ({', '.join(MODES)}), {a.j} processes",
          flush=True)
    results = [None] * len(PAIRS)
    t0 = time.time()
    ctx = mp.get_context("fork")
    with ctx.Pool(a.j) if a.j > 1 else _Serial() as pool:
        for n, (i, res) in enumerate(pool.imap_unordered(compile_both, range(len(PAIRS)))):
            results[i] = res
            x = PAIRS[i][1]
            d = describe(*x)
            ok = all(r.get("ptx_identical" if m == "no_line_info" else "ptx_identical_without_line_info")
                     for m, r in res.items())
            print(f"[{n + 1:3d}/{len(PAIRS)} {time.time() - t0:6.0f}s] {'same' if ok else 'DIFFERENT'}  "
                  f"{d['kernel']:<16} ({d['call']})", flush=True)
    launches = []
    for (x, y), res in zip(PAIRS, results):
        d = describe(*y)
        launches.append(dict(kernel=d["kernel"], call=d["call"], constexprs=d["constexprs"],
                             signature=d["signature"], attrs=d["attrs"], num_warps=d["num_warps"],
                             num_stages=d["num_stages"], **res))
    per_kernel = {}
    for L in launches:
        ok = L["no_line_info"]["ptx_identical"] and L["no_line_info"]["cubin_identical"] and \
            ("line_info" not in L or L["line_info"]["ptx_identical_without_line_info"])
        k = per_kernel.setdefault(L["kernel"], dict(specializations=0, identical=True))
        k["specializations"] += 1
        k["identical"] = k["identical"] and ok
    launched = {d["kernel"] for d in desc_new}
    identical = all(r["identical"] for r in sources.values()) and same_launches and \
        all(k["identical"] for k in per_kernel.values())
    summary = dict(
        identical=identical,
        jit_functions=len(sources), jit_sources_identical=sum(r["identical"] for r in sources.values()),
        kernels_launched=len(launched), kernels_compiled=len(per_kernel),
        kernels_identical=sum(k["identical"] for k in per_kernel.values()),
        launches_recorded=len(desc_new), launch_lists_identical=same_launches,
        specializations_compiled=len(launches),
        ptx_identical_no_line_info=sum(L["no_line_info"]["ptx_identical"] for L in launches),
        cubin_identical_no_line_info=sum(L["no_line_info"]["cubin_identical"] for L in launches),
        ptx_identical_line_info_raw=sum(L["line_info"]["ptx_identical"] for L in launches if "line_info" in L),
        ptx_identical_line_info_stripped=sum(L["line_info"]["ptx_identical_without_line_info"]
                                             for L in launches if "line_info" in L))
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                ref=a.ref, ref_commit=commit, ref_layout="prism_ops/" if hasattr(old, "_STAGES") else "one file",
                new="this checkout (prism_kernel.py + prism_ops/)", triton=triton.__version__,
                torch=torch.__version__, target="cuda sm_90, warp size 32 (compiled on the CPU, no GPU)",
                comparison="no_line_info: TRITON_DISABLE_LINE_INFO=1, PTX and cubin byte for byte; line_info: "
                           "the default compile, PTX with .file/.loc lines and .section .debug_* dropped "
                           "(ptx_identical: the raw text, which names the source file and lines)")
    out = a.out or os.path.join(ROOT, "bench", "results",
                                f"kernel_split_ptx_{datetime.date.today().isoformat()}.json")
    from fileio import atomic_write
    atomic_write(out, (json.dumps(dict(meta=meta, summary=summary, per_kernel=per_kernel, sources=sources,
                                       launches=launches), indent=1) + "\n").encode())
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0 if identical else 1


class _Serial:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap_unordered(self, f, it):
        return map(f, it)


if __name__ == "__main__":
    sys.exit(main())
