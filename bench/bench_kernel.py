"""
Benchmark prism_kernel.chunk_prism (L = 1..4) against flash-linear-attention's
chunk_gated_delta_rule in the same run: forward and forward+backward time (do_bench median),
activation memory (held between forward and backward) and peak memory of forward+backward;
then packed documents (cu_seqlens) against the same tokens as fixed-length rows.

    python bench/bench_kernel.py                 # the table (default launch choices and the
                                                 # local_bk=64 variant), targets, kernel_bench.json
    python bench/bench_kernel.py --bv 16,32,64   # also sweep the state passes' value block
    python bench/bench_kernel.py --configs bv=64 state_bv=16,stages=2   # any launch_config overrides
    python bench/bench_kernel.py --profile       # per-kernel times (every shape: fla, L=1, L=3)
    python bench/bench_kernel.py --warm          # compile every kernel variant the GPU tests and
                                                 # this bench launch, in parallel processes

Needs a CUDA GPU. fla is optional (import it if present). Launch choices are set through --bv and
--configs here (PRISM_KERNEL_CONFIG from the environment is not used by this script). Writes $RESULTS_DIR/kernel_bench.json (or
bench/results/kernel_bench.json when RESULTS_DIR is unset) with the date, GPU and versions.
Every row has both clocks: wall time (do_bench, host work included) and GPU time (the sum of
its kernels' durations under torch.profiler). Targets checked at the end, on both: L=1 <= 0.7x
fla, L=3 <= 1.3x our L=1 (every shape); packed documents <= 1.1x the same tokens unpacked.
"""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import prism_kernel  # noqa: E402
from prism_kernel import chunk_prism  # noqa: E402
from fileio import atomic_write  # noqa: E402

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    import fla.ops.common.chunk_o as _fla_chunk_o
    # fla refuses its gated dq/dk backward under Triton < 3.7.1 on Hopper (a miscompile, fla #640);
    # the numbers can be wrong there but the work done is the same: lift the guard for timing only
    _fla_chunk_o.TRITON_ABOVE_3_7_1 = True
    import fla
    FLA_VERSION = getattr(fla, "__version__", "?")
except Exception as e:  # noqa: BLE001
    chunk_gated_delta_rule, FLA_VERSION = None, f"absent ({type(e).__name__}: {e})"

PACKED_ROWS, PACKED_T = 16, 2048   # packed bench: 16 x 2048 tokens as one row of documents


def make(B, T, H, K, V, L, dev="cuda", dtype=torch.bfloat16, gen=None):
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)
    q = F.normalize(r(B, T, H, K), dim=-1).to(dtype)
    k = F.normalize(r(B, T, H, K), dim=-1).to(dtype)
    v = r(B, T, H, V).to(dtype)
    g = F.logsigmoid(r(B, T, H)) / 16
    beta = torch.rand(B, T, H, device=dev, generator=gen).to(dtype)
    ke = F.normalize(r(B, T, H, L - 1, K), dim=-1).to(dtype) if L > 1 else None
    ve = (0.5 * r(B, T, H, L - 1, V)).to(dtype) if L > 1 else None
    xs = [q, k, v, g, beta, ke, ve]
    for x in xs:
        if x is not None:
            x.requires_grad_()
    return xs


def doc_lengths(total, seed=0, lo=16, hi=1984):
    """Random document lengths, uniform in [lo, hi] (mean ~1000, none longer than a 2048 row,
    so the packed sequential passes are no longer than the unpacked ones), summing to total."""
    gen = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    lens[-1] -= sum(lens) - total
    if lens[-1] <= 0:
        lens.pop()
        lens[-1] += total - sum(lens)
    return lens


def measure(fn, xs, do):
    """fn(xs) -> o. Returns fwd ms, fwd+bwd ms, activation MiB, peak MiB over the inputs."""
    leaves = [x for x in xs if x is not None]

    def fwd():
        with torch.no_grad():
            fn(xs)

    def fwdbwd():
        o = fn(xs)
        torch.autograd.grad(o, leaves, do)

    t_f = do_bench(fwd, warmup=10, rep=100, return_mode="median")
    t_fb = do_bench(fwdbwd, warmup=10, rep=100, return_mode="median")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = fn(xs)
    act = torch.cuda.memory_allocated() - base   # output + everything saved for backward
    torch.autograd.grad(o, leaves, do)
    del o
    peak = torch.cuda.max_memory_allocated() - base
    return t_f, t_fb, act / 2**20, peak / 2**20


def profile_kernels(fn, xs, do, steps=5):
    """GPU time from torch.profiler: (total us per fwd+bwd over every kernel, the 20 largest
    kernels as (name, us)). Unlike do_bench's wall time it leaves out host work, which a model
    hides behind other layers' GPU work (fla spends ~2 ms of Python per call)."""
    from torch.profiler import ProfilerActivity, profile
    leaves = [x for x in xs if x is not None]
    for _ in range(3):
        torch.autograd.grad(fn(xs), leaves, do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.autograd.grad(fn(xs), leaves, do)
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append((ev.key[:60], round(t / steps, 1)))
    rows.sort(key=lambda r: -r[1])
    return round(sum(t for _, t in rows), 1), rows[:20]


# ----------------------------------------------------------------------------------------------
# --warm: compile in parallel processes (Triton's disk cache keeps the results)

def warm_specs(shapes, Ls, configs):
    """(B, T, H, K, V, L, dtype, with states, packed sequences or 0, overrides) for every launch
    variant of the GPU tests and of this bench. B*H (N*H packed) matters: it sets the state BV."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_kernel import GPU_WARM
    specs = [s + ("",) for s in GPU_WARM]
    for B, _, H, K, V in shapes:
        specs += [(B, 100, H, K, V, L, "bfloat16", False, 0, c) for L in Ls for c in [""] + configs]
    n_docs = len(doc_lengths(PACKED_ROWS * PACKED_T))
    specs += [(PACKED_ROWS, 100, 6, 128, 128, L, "bfloat16", False, 0, "") for L in (1, 3)]
    specs += [(1, 100, 6, 128, 128, L, "bfloat16", False, min(n_docs, 100), "") for L in (1, 3)]
    return sorted(set(specs))


def _warm_one(spec):
    B, T, H, K, V, L, dtype, st, n_docs, overrides = spec
    prism_kernel.OVERRIDES.clear()   # pool workers are reused: each spec sets its own overrides
    prism_kernel.OVERRIDES.update({k: int(v) for k, v in (kv.split("=") for kv in overrides.split(",") if kv)})
    t0 = time.time()
    try:
        xs = make(B, T, H, K, V, L, dtype=getattr(torch, dtype))
        N = n_docs or B
        cu = None
        if n_docs:
            cu = torch.linspace(0, T, n_docs + 1, device="cuda").round().to(torch.int32)
        s0 = torch.zeros(N, H, K, V, device="cuda") if st else None
        o, ht = chunk_prism(*xs, initial_state=s0, output_final_state=st, cu_seqlens=cu)
        loss = o.float().sum() + (ht.sum() if st else 0)
        loss.backward()
        torch.cuda.synchronize()
        return f"{spec}: compiled in {time.time() - t0:.0f}s"
    except Exception as e:  # noqa: BLE001
        return f"{spec}: FAILED {type(e).__name__}: {str(e)[:300]}"


def warm(shapes, Ls, configs):
    import multiprocessing as mp
    specs = warm_specs(shapes, Ls, configs)
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(len(specs), os.cpu_count() or 4)) as pool:
        for line in pool.imap_unordered(_warm_one, specs):
            print("warm", line, flush=True)
    print(f"warm: {len(specs)} variants in {time.time() - t0:.0f}s")


# ----------------------------------------------------------------------------------------------

def row(impl, L, B, T, H, K, V, t_f, t_fb, act, peak, **extra):
    r = dict(impl=impl, L=L, B=B, T=T, H=H, K=K, V=V, fwd_ms=round(t_f, 4), fwdbwd_ms=round(t_fb, 4),
             Mtok_s_fwdbwd=round(B * T / t_fb / 1e3, 2), act_MiB=round(act, 1), peak_MiB=round(peak, 1), **extra)
    print(json.dumps(r), flush=True)
    return r


def load_kernel(path):
    """Time the prism_kernel.py at `path` (with its own prism_ops/) in place of the repo's, for
    this whole process."""
    global prism_kernel, chunk_prism
    from kernel_build import load_build
    prism_kernel = sys.modules["prism_kernel"] = load_build(path)
    chunk_prism = prism_kernel.chunk_prism


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["8,2048,6,128", "2,8192,6,128", "1,32768,6,128"],
                    help="B,T,H,K or B,T,H,K,V (V = K when left out)")
    ap.add_argument("--L", default="1,2,3,4")
    ap.add_argument("--bv", default="", help="state-pass value blocks to sweep, e.g. 16,32,64 "
                                             "(default: launch_config's choice only)")
    ap.add_argument("--configs", nargs="*", default=["local_bk=64"],
                    help="further launch_config overrides to time beside the default, e.g. 'bv=64' "
                         "'state_bv=16,stages=2' (default: local_bk=64, the local backward in key "
                         "blocks; pass --configs with nothing after it for none)")
    ap.add_argument("--no-packed", action="store_true", help="skip the packed-documents rows")
    ap.add_argument("--no-fla", action="store_true", help="skip the fla rows (a launch-config sweep "
                                                         "compares our own rows only)")
    ap.add_argument("--profile", action="store_true", help="per-kernel times for L=1, L=3 and fla at every shape")
    ap.add_argument("--warm", action="store_true", help="only compile the kernel variants, in parallel")
    ap.add_argument("--kernel", default="", help="a prism_kernel.py (with its prism_ops/ beside it) to time "
                                                 "instead of the repo's (an A/B of two builds: run once with each)")
    args = ap.parse_args()
    if args.kernel:
        load_kernel(args.kernel)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    shapes = [s if len(s) == 5 else s + (s[3],) for s in shapes]
    Ls = [int(x) for x in args.L.split(",")]
    if not torch.cuda.is_available():
        sys.exit("bench_kernel.py needs a CUDA GPU")
    if args.warm:
        return warm(shapes, Ls, args.configs)
    torch.manual_seed(0)
    dev_name = torch.cuda.get_device_name(0)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=dev_name, kernel=args.kernel or "prism_kernel.py", torch=torch.__version__, triton=triton.__version__, fla=FLA_VERSION,
                dtype="bfloat16", timing="triton.testing.do_bench median, warmup 10 ms, rep 100 ms",
                memory="act = allocated after forward minus before (output + saved); "
                       "peak = max allocated during fwd+bwd minus before; inputs excluded",
                packed=f"{PACKED_ROWS}x{PACKED_T} tokens as one row of documents, lengths uniform in "
                       f"[16, 1984], against the same tokens as {PACKED_ROWS} rows of {PACKED_T}")
    print(json.dumps(meta), flush=True)
    sweeps = [None] + [f"state_bv={x}" for x in args.bv.split(",") if x] + args.configs
    rows, profiles, failed = [], {}, []
    for B, T, H, K, V in shapes:
        do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
        if chunk_gated_delta_rule is not None and not args.no_fla:
            xs = make(B, T, H, K, V, 1)
            fn = lambda xs: chunk_gated_delta_rule(*xs[:5])[0]
            gpu_us, prof = profile_kernels(fn, xs, do)
            rows.append(row("fla", 1, B, T, H, K, V, *measure(fn, xs, do), gpu_us=gpu_us))
            if args.profile:
                profiles[f"fla {B}x{T}"] = prof
            del xs
        for sweep in sweeps:
            prism_kernel.OVERRIDES.clear()
            if sweep:
                prism_kernel.OVERRIDES.update({k: int(v) for k, v in (kv.split("=") for kv in sweep.split(","))})
            chosen = prism_kernel.launch_config(K, V, torch.bfloat16, 0, B * H)[2]["fwd_state"]["BV"]
            for L in Ls:
                xs = make(B, T, H, K, V, L)
                fn = lambda xs: chunk_prism(*xs)[0]
                name = f"prism L={L}" + ("" if sweep is None else f" {sweep}")
                try:
                    gpu_us, prof = profile_kernels(fn, xs, do)
                    rows.append(row(name, L, B, T, H, K, V, *measure(fn, xs, do), state_bv=chosen, gpu_us=gpu_us))
                except Exception as e:  # noqa: BLE001  (a swept launch that does not fit: a row saying so)
                    if sweep is None:
                        raise
                    failed.append(dict(impl=name, B=B, T=T, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    print(json.dumps(failed[-1]), flush=True)
                    continue
                if args.profile and L in (1, 3):
                    profiles[f"{name} {B}x{T}"] = prof
                del xs
        prism_kernel.OVERRIDES.clear()
        del do
        torch.cuda.empty_cache()
    if not args.no_packed:   # packed documents vs the same tokens as fixed rows, same values
        B, T, H, K = PACKED_ROWS, PACKED_T, 6, 128
        lens = doc_lengths(B * T)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        do = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
        for L in (1, 3):
            xs = make(B, T, H, K, K, L)
            packed = [None if x is None else x.detach().reshape(1, B * T, *x.shape[2:]).requires_grad_() for x in xs]
            rows.append(row(f"rows L={L}", L, B, T, H, K, K, *measure(lambda xs: chunk_prism(*xs)[0], xs, do)))
            rows.append(row(f"packed L={L}", L, 1, B * T, H, K, K,
                            *measure(lambda xs: chunk_prism(*xs, cu_seqlens=cu)[0], packed, do.reshape(1, B * T, H, K)),
                            docs=len(lens), mean_doc=round(B * T / len(lens), 1)))
            del xs, packed
        del do
        torch.cuda.empty_cache()

    # ratios in this run: to fla, to our own L=1 at the same shape and bv, packed to rows
    for r in rows:
        same = lambda x: (x["B"], x["T"]) == (r["B"], r["T"])
        ref = [x for x in rows if x["impl"] == "fla" and same(x)]
        if ref and r["impl"].startswith("prism"):
            r["fwd_vs_fla"] = round(r["fwd_ms"] / ref[0]["fwd_ms"], 3)
            r["fwdbwd_vs_fla"] = round(r["fwdbwd_ms"] / ref[0]["fwdbwd_ms"], 3)
            r["gpu_vs_fla"] = round(r["gpu_us"] / ref[0]["gpu_us"], 3)
        suffix = r["impl"].split(" ", 2)[2] if r["impl"].count(" ") >= 2 else None   # the sweep's overrides
        l1 = [x for x in rows if x["impl"] == "prism L=1" + ("" if suffix is None else f" {suffix}") and same(x)]
        if l1 and r["impl"].startswith("prism"):
            r["fwdbwd_vs_L1"] = round(r["fwdbwd_ms"] / l1[0]["fwdbwd_ms"], 3)
            r["gpu_vs_L1"] = round(r["gpu_us"] / l1[0]["gpu_us"], 3)
            r["act_vs_L1"] = round(r["act_MiB"] / l1[0]["act_MiB"], 3)
        if r["impl"].startswith("packed"):
            base = [x for x in rows if x["impl"] == r["impl"].replace("packed", "rows")]
            r["fwdbwd_vs_rows"] = round(r["fwdbwd_ms"] / base[0]["fwdbwd_ms"], 3)
    targets = []
    for r in rows:
        variant = r["impl"].split(" ", 2)[2] if r["impl"].count(" ") >= 2 else "default"
        if r["impl"].startswith("prism L=1") and "fwdbwd_vs_fla" in r:
            targets.append((f"L=1 <= 0.7x fla at {r['B']}x{r['T']} ({variant}), GPU time", r["gpu_vs_fla"], 0.7))
            targets.append((f"L=1 <= 0.7x fla at {r['B']}x{r['T']} ({variant}), wall time", r["fwdbwd_vs_fla"], 0.7))
        if r["impl"].startswith("prism L=3") and "fwdbwd_vs_L1" in r:
            targets.append((f"L=3 <= 1.3x L=1 at {r['B']}x{r['T']} ({variant}), GPU time", r["gpu_vs_L1"], 1.3))
            targets.append((f"L=3 <= 1.3x L=1 at {r['B']}x{r['T']} ({variant}), wall time", r["fwdbwd_vs_L1"], 1.3))
        if r["impl"].startswith("packed"):
            targets.append((f"{r['impl']} <= 1.1x rows", r["fwdbwd_vs_rows"], 1.1))
    out_dir = os.environ.get("RESULTS_DIR") or os.path.join(ROOT, "bench", "results")
    path = os.path.join(out_dir, "kernel_bench.json")
    atomic_write(path, json.dumps(dict(meta=meta, rows=rows, profiles=profiles, failed=failed,
                                       targets=[dict(target=t, ratio=v, bound=b, met=v <= b)
                                                for t, v, b in targets]), indent=1).encode())
    for name, prof in profiles.items():
        print(f"\nper-kernel us per fwd+bwd, {name}")
        for k, t in prof:
            print(f"  {t:9.1f}  {k}")
    if len(sweeps) > 1 and profiles:   # a launch-config sweep: one row per profile, one column per kernel
        kernels = list(dict.fromkeys(k for prof in profiles.values() for k, _ in prof))
        print("\nper-kernel us per fwd+bwd, every profiled row")
        print("| row | total | " + " | ".join(k[:14] for k in kernels) + " |")
        for name, prof in profiles.items():
            t = dict(prof)
            print(f"| {name[:90]} | {sum(t.values()):.0f} | " +
                  " | ".join(f"{t[k]:.0f}" if k in t else "-" for k in kernels) + " |")
    print(f"\n{dev_name}, bf16, fwd+bwd: wall time (do_bench median) and GPU time (sum of kernel "
          "durations, torch.profiler); ratios within this run")
    nan = float("nan")
    print(f"{'impl':<30} {'B x T':<10} {'fwd ms':>8} {'f+b ms':>8} {'f+b/fla':>8} {'f+b/L1':>7} "
          f"{'GPU us':>8} {'GPU/fla':>8} {'GPU/L1':>7} {'act MiB':>8} {'peak MiB':>9}")
    for r in rows:
        print(f"{r['impl']:<30} {str(r['B']) + 'x' + str(r['T']):<10} {r['fwd_ms']:>8.3f} {r['fwdbwd_ms']:>8.3f} "
              f"{r.get('fwdbwd_vs_fla', nan):>8.3f} {r.get('fwdbwd_vs_L1', r.get('fwdbwd_vs_rows', nan)):>7.3f} "
              f"{r.get('gpu_us', nan):>8.1f} {r.get('gpu_vs_fla', nan):>8.3f} {r.get('gpu_vs_L1', nan):>7.3f} "
              f"{r['act_MiB']:>8.1f} {r['peak_MiB']:>9.1f}")
    print("\ntargets:")
    for t, v, b in targets:
        print(f"  {'met   ' if v <= b else 'MISSED'} {t}: {v:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
