"""
Benchmark prism_kernel.chunk_prism (L = 1..4) against flash-linear-attention's
chunk_gated_delta_rule in the same run: forward and forward+backward time (do_bench median),
activation memory (held between forward and backward) and peak memory of forward+backward.

    python bench/bench_kernel.py [--shapes 8,2048,6,128 2,8192,6,128 ...] [--profile]
    python bench/bench_kernel.py --warm   # compile every kernel variant the GPU tests and this
                                          # bench use, in parallel processes (Triton disk cache)

Needs a CUDA GPU. fla is optional (carry its wheels; see bench/KERNEL_NOTES.md). Writes
$OUT/kernel_bench.json (or bench/results/kernel_bench.json when OUT is unset) and prints a table.
"""
import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prism_kernel import chunk_prism  # noqa: E402
from checkpoint import atomic_write  # noqa: E402

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


def make(B, T, H, K, V, L, dev="cuda", dtype=torch.bfloat16):
    q = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device=dev).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, H, device=dev)) / 16
    beta = torch.rand(B, T, H, device=dev).to(dtype)
    ke = F.normalize(torch.randn(B, T, H, L - 1, K, device=dev), dim=-1).to(dtype) if L > 1 else None
    ve = (0.5 * torch.randn(B, T, H, L - 1, V, device=dev)).to(dtype) if L > 1 else None
    xs = [q, k, v, g, beta, ke, ve]
    for x in xs:
        if x is not None:
            x.requires_grad_()
    return xs


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
    """Per-kernel CUDA time (us per fwd+bwd) from torch.profiler."""
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
    return rows[:20]


# (dtype, K, V, L, with initial/final state): what tests/test_kernel.py -m gpu and main() launch
WARM = ([("bfloat16", 128, 128, L, st) for L in (1, 2, 3, 4) for st in (True, False)]
        + [("float32", 64, 64, L, True) for L in (1, 2, 3, 4)]
        + [("bfloat16", 128, 256, 3, True), ("bfloat16", 256, 256, 3, True)])


def _warm_one(spec):
    import time
    dtype, K, V, L, st = spec
    t0 = time.time()
    try:
        xs = make(1, 100, 1, K, V, L, dtype=getattr(torch, dtype))
        s0 = torch.zeros(1, 1, K, V, device="cuda") if st else None
        o, ht = chunk_prism(*xs, initial_state=s0, output_final_state=st)
        loss = o.float().sum() + (ht.sum() if st else 0)
        loss.backward()
        torch.cuda.synchronize()
        return f"{spec}: compiled in {time.time() - t0:.0f}s"
    except Exception as e:  # noqa: BLE001
        return f"{spec}: FAILED {type(e).__name__}: {str(e)[:300]}"


def warm():
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(min(len(WARM), os.cpu_count() or 4)) as pool:
        for line in pool.imap_unordered(_warm_one, WARM):
            print("warm", line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["8,2048,6,128", "2,8192,6,128", "1,32768,6,128"])
    ap.add_argument("--L", default="1,2,3,4")
    ap.add_argument("--profile", action="store_true", help="per-kernel times for L=1, L=3 and fla")
    ap.add_argument("--warm", action="store_true", help="only compile the kernel variants, in parallel")
    args = ap.parse_args()
    if args.warm:
        return warm()
    if not torch.cuda.is_available():
        sys.exit("bench_kernel.py needs a CUDA GPU")
    torch.manual_seed(0)
    dev_name = torch.cuda.get_device_name(0)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=dev_name, torch=torch.__version__, triton=triton.__version__, fla=FLA_VERSION,
                dtype="bfloat16", timing="triton.testing.do_bench median, warmup 10 ms, rep 100 ms",
                memory="act = allocated after forward minus before (output + saved); "
                       "peak = max allocated during fwd+bwd minus before; inputs excluded")
    print(json.dumps(meta), flush=True)
    rows, profiles = [], {}
    for shape in args.shapes:
        B, T, H, K = (int(x) for x in shape.split(","))
        V = K
        impls = []
        if chunk_gated_delta_rule is not None:
            impls.append(("fla", 1, lambda xs: chunk_gated_delta_rule(*xs[:5])[0]))
        for L in (int(x) for x in args.L.split(",")):
            impls.append((f"prism L={L}", L, lambda xs: chunk_prism(*xs)[0]))
        for name, L, fn in impls:
            xs = make(B, T, H, K, V, L)
            do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
            t_f, t_fb, act, peak = measure(fn, xs, do)
            r = dict(impl=name, L=L, B=B, T=T, H=H, K=K, V=V, fwd_ms=round(t_f, 4),
                     fwdbwd_ms=round(t_fb, 4), Mtok_s_fwdbwd=round(B * T / t_fb / 1e3, 2),
                     act_MiB=round(act, 1), peak_MiB=round(peak, 1))
            rows.append(r)
            print(json.dumps(r), flush=True)
            if args.profile and shape == args.shapes[0] and name in ("fla", "prism L=1", "prism L=3"):
                profiles[name] = profile_kernels(fn, xs, do)
            del xs, do
            torch.cuda.empty_cache()
    # ratios to fla in the same run
    for r in rows:
        ref = [x for x in rows if x["impl"] == "fla" and (x["B"], x["T"]) == (r["B"], r["T"])]
        if ref:
            r["fwd_vs_fla"] = round(r["fwd_ms"] / ref[0]["fwd_ms"], 3)
            r["fwdbwd_vs_fla"] = round(r["fwdbwd_ms"] / ref[0]["fwdbwd_ms"], 3)
        l1 = [x for x in rows if x["impl"] == "prism L=1" and (x["B"], x["T"]) == (r["B"], r["T"])]
        if l1 and r["impl"] != "fla":
            r["act_vs_L1"] = round(r["act_MiB"] / l1[0]["act_MiB"], 3)
            r["peak_vs_L1"] = round(r["peak_MiB"] / l1[0]["peak_MiB"], 3)
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    path = os.path.join(out_dir, "kernel_bench.json")
    atomic_write(path, json.dumps(dict(meta=meta, rows=rows, profiles=profiles), indent=1).encode())
    for name, prof in profiles.items():
        print(f"\nper-kernel us per fwd+bwd, {name}, shape {args.shapes[0]}")
        for k, t in prof:
            print(f"  {t:9.1f}  {k}")
    print(f"\n{dev_name}, bf16, do_bench median; ratios to fla in this run")
    hdr = f"{'impl':<11} {'B,T,H,K':<14} {'fwd ms':>8} {'f+b ms':>8} {'Mtok/s':>7} {'fwd/fla':>7} {'f+b/fla':>7} {'act MiB':>8} {'peak MiB':>9} {'act/L1':>6}"
    print(hdr)
    for r in rows:
        print(f"{r['impl']:<11} {r['B']},{r['T']},{r['H']},{r['K']:<5} {r['fwd_ms']:>8.3f} {r['fwdbwd_ms']:>8.3f} "
              f"{r['Mtok_s_fwdbwd']:>7.2f} {r.get('fwd_vs_fla', float('nan')):>7.3f} "
              f"{r.get('fwdbwd_vs_fla', float('nan')):>7.3f} {r['act_MiB']:>8.1f} {r['peak_MiB']:>9.1f} "
              f"{r.get('act_vs_L1', float('nan')):>6.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
