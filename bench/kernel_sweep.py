"""The kernel's random-shape sweep (tests/test_kernel.py: sweep_case, run_sweep_case) in parallel
processes, every case's errors written down, not only pass/fail. Needs a CUDA GPU.

    python bench/kernel_sweep.py                       # every case, 12 processes
    python bench/kernel_sweep.py --cases 0,1 --kernel /tmp/old/prism_kernel.py   # another build

Each case runs chunk_prism (bf16/fp16/float32) and the float64 chunk form on the same rounded
inputs, and measures the rounding floor: the float64 result on the float32 inputs against the
float64 result on the same inputs rounded to the case's dtype. Per output and gradient it
records the whole-tensor and the worst 64-token chunk's relative error, the floor and their
ratio. The JSON (bench/results/kernel_sweep_<date>.json) is what tests/test_kernel.py's
ROUNDING_RATIO is derived from: the worst ratio of a healthy build, with a margin.
"""
import argparse
import concurrent.futures as cf
import datetime
import json
import multiprocessing as mp
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def init(kernel):
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    if kernel:   # this build is prism_kernel for the whole process (model.py and the tests alike)
        from kernel_build import load_build
        sys.modules["prism_kernel"] = load_build(kernel)


def run(case):
    import test_kernel
    # every element read back was written (POISON sits beside the allocator: prism_ops/tiles.py,
    # or in prism_kernel.py itself for a build in one file)
    pk = test_kernel.prism_kernel
    getattr(pk, "tiles", pk).POISON = True
    try:
        return test_kernel.run_sweep_case(case)
    except Exception as e:   # a launch failure is a result too
        B, T, H, K, V, L, dtype, h0, packed = test_kernel.sweep_case(case)
        return dict(case=case, B=B, T=T, H=H, K=K, V=V, L=L, dtype=dtype, h0=h0, packed=packed, ok=False,
                    error=f"{type(e).__name__}: {e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="", help="comma-separated case numbers (default: all)")
    ap.add_argument("-j", type=int, default=12, help="processes at once (default 12)")
    ap.add_argument("--kernel", default="", help="a prism_kernel.py (with its prism_ops/ beside it) to test "
                                                 "instead of the repo's")
    ap.add_argument("--out", default="", help="JSON path (default bench/results/kernel_sweep_<date>.json)")
    a = ap.parse_args()
    init(a.kernel)
    import torch
    import triton
    import test_kernel
    from fileio import atomic_write
    if not torch.cuda.is_available():
        sys.exit("kernel_sweep.py: needs a CUDA GPU")
    cases = [int(c) for c in a.cases.split(",") if c] or test_kernel.SWEEP_CASES
    date = datetime.datetime.now(datetime.timezone.utc)
    out = a.out or os.path.join(ROOT, "bench", "results", f"kernel_sweep_{date:%Y-%m-%d_%H%M}.json")
    t0, recs = time.time(), []
    with cf.ProcessPoolExecutor(a.j, mp.get_context("spawn"), initializer=init, initargs=(a.kernel,)) as ex:
        futs = [ex.submit(run, c) for c in cases]
        for n, f in enumerate(cf.as_completed(futs), 1):
            r = f.result()
            recs.append(r)
            if "errors" in r:
                key = r.get("ratio", r["errors"])
                worst = max(key, key=lambda name: max(key[name]))
                tag = f"worst {worst} err {r['errors'][worst][0]:.1e}/{r['errors'][worst][1]:.1e}" + (
                    f" ratio {key[worst][0]:.1f}/{key[worst][1]:.1f}" if "ratio" in r else "")
            else:
                tag = r["error"][:200]
            shape = test_kernel.sweep_case(r["case"])
            print(f"[{n}/{len(cases)} {time.time() - t0:.0f}s] case {r['case']} {shape}: "
                  f"{'ok' if r['ok'] else 'BAD ' + str(r.get('bad', ''))} {tag}", flush=True)
    recs.sort(key=lambda r: r["case"])
    summary = {}
    for r in recs:
        for name, ratio in r.get("ratio", {}).items():
            s = summary.setdefault(r["dtype"], {}).setdefault(name, [0.0, 0.0])
            if r["ok"]:
                s[0], s[1] = max(s[0], ratio[0]), max(s[1], ratio[1])
    doc = dict(date_utc=date.strftime("%Y-%m-%dT%H:%M:%SZ"), command=" ".join(["python"] + sys.argv),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(), kernel=a.kernel or "prism_kernel.py",
               ratio_bound=test_kernel.ROUNDING_RATIO, f32_bounds=test_kernel.SWEEP_F32_TOL,
               worst_healthy_ratio=summary, passed=sum(r["ok"] for r in recs), cases=len(recs),
               seconds=round(time.time() - t0, 1), records=recs)
    atomic_write(out, json.dumps(doc, indent=1))
    print(f"{doc['passed']}/{len(recs)} cases within bounds in {doc['seconds']}s; worst ratio over the "
          f"rounding floor of the passing cases (whole, per chunk):")
    for dt, per in summary.items():
        print(f"  {dt}: " + " ".join(f"{n}={w:.1f}/{c:.1f}" for n, (w, c) in per.items()))
    print(f"wrote {out}")
    sys.exit(0 if doc["passed"] == len(recs) else 1)


if __name__ == "__main__":
    main()
