"""
Benchmark the short causal conv (+ SiLU) of prism_kernel.causal_conv against
flash-linear-attention's causal_conv1d (its Triton backend, activation='silu') in the same run:
forward and backward time (do_bench median) and the bandwidth that implies (the bytes a
kernel must move at least: x and y forward; x, dy and dx backward).

    python bench/bench_conv.py                                  # the model's shapes, bf16
    python bench/bench_conv.py --configs conv_br=8 conv_bd=64,conv_warps=8   # launch overrides
    python bench/bench_conv.py --compare /tmp/old/prism_kernel.py   # another version beside it
                                                  # (e.g. git worktree add /tmp/old HEAD~1)

Needs a CUDA GPU; fla is optional. Writes $RESULTS_DIR/conv_bench.json (or
bench/results/conv_bench.json) with the date, GPU and versions.
"""
import argparse
import datetime
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import prism_kernel  # noqa: E402
from fileio import atomic_write  # noqa: E402

try:
    from fla.modules.causal_conv1d import causal_conv1d
    import fla
    FLA_VERSION = getattr(fla, "__version__", "?")
except Exception as e:  # noqa: BLE001
    causal_conv1d, FLA_VERSION = None, f"absent ({type(e).__name__}: {e})"


def load_module(path):
    from kernel_build import load_build   # the build's own prism_ops/ beside it, not the repo's
    return load_build(path)


def measure(fn, x, w, dy):
    """(forward ms, backward ms, dx, dw) of y = fn(x, w)."""
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(xr, wr)
    dx, dw = torch.autograd.grad(y, (xr, wr), dy, retain_graph=True)
    fwd = do_bench(lambda: fn(x, w))
    bwd = do_bench(lambda: torch.autograd.grad(y, (xr, wr), dy, retain_graph=True))
    return fwd, bwd, y.detach(), dx, dw


def save(path, meta, rows):   # after every row: a run cut short keeps what it measured
    atomic_write(path, json.dumps(dict(meta=meta, rows=rows), indent=1).encode())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["16,2048,3072", "16,2048,768", "2,16384,3072"],
                    help="B,T,C (3072 = GDN-130M's q|k|v channels, 768 = PRISM's anchor)")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--configs", nargs="*", default=[], help="launch overrides to time beside the default")
    ap.add_argument("--compare", nargs="*", default=[], help="other prism_kernel.py files (each with its prism_ops/ beside it) to time beside this one")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_conv.py needs a CUDA GPU")
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                fla=FLA_VERSION, dtype="bfloat16", width=args.width,
                timing="triton.testing.do_bench median; backward = autograd.grad of dx and dw",
                bandwidth="forward reads x and writes y, backward reads x and dy and writes dx: "
                          "those bytes over the time")
    print(json.dumps(meta), flush=True)
    out_dir = os.environ.get("RESULTS_DIR") or os.path.join(ROOT, "bench", "results")
    path = os.path.join(out_dir, "conv_bench.json")
    impls = [("ours", prism_kernel, None)] + [(f"ours {c}", prism_kernel, c) for c in args.configs]
    impls += [(f"compare {p}", load_module(p), None) for p in args.compare]
    rows = []
    for shape in args.shapes:
        B, T, C = (int(s) for s in shape.split(","))
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(B, T, C, device="cuda", generator=gen).bfloat16()
        w = torch.randn(C, args.width, device="cuda", generator=gen) / args.width ** 0.5
        dy = torch.randn(B, T, C, device="cuda", generator=gen).bfloat16()
        n = B * T * C * x.element_size()
        ref = None
        runs = [(name, (lambda m: lambda x, w: m.causal_conv(x, w))(mod), cfg) for name, mod, cfg in impls]
        if causal_conv1d is not None:
            runs.append(("fla", lambda x, w: causal_conv1d(x, w, activation="silu")[0], None))
        for name, fn, cfg in runs:
            prism_kernel.OVERRIDES.clear()
            if cfg:
                prism_kernel.OVERRIDES.update({k: int(v) for k, v in (kv.split("=") for kv in cfg.split(","))})
            fwd, bwd, y, dx, dw = measure(fn, x, w, dy)
            if ref is None:
                ref = (y.float(), dx.float(), dw.float())
            err = [((a.float() - b).norm() / b.norm()).item() for a, b in zip((y, dx, dw), ref)]
            r = dict(impl=name, B=B, T=T, C=C, fwd_us=round(fwd * 1e3, 1), bwd_us=round(bwd * 1e3, 1),
                     fwd_TBps=round(2 * n / fwd / 1e9, 2), bwd_TBps=round(3 * n / bwd / 1e9, 2),
                     rel_err_vs_ours=[float(f"{e:.2e}") for e in err])
            rows.append(r)
            print(json.dumps(r), flush=True)
            save(path, meta, rows)
            del y, dx, dw
        prism_kernel.OVERRIDES.clear()
        del x, w, dy, ref
        torch.cuda.empty_cache()
    for r in rows:
        peer = [x for x in rows if x["impl"] == "fla" and (x["B"], x["T"], x["C"]) == (r["B"], r["T"], r["C"])]
        if peer and r["impl"] != "fla":
            r["fwd_vs_fla"] = round(r["fwd_us"] / peer[0]["fwd_us"], 3)
            r["bwd_vs_fla"] = round(r["bwd_us"] / peer[0]["bwd_us"], 3)
    save(path, meta, rows)
    nan = float("nan")
    print(f"\n{'impl':<40} {'B,T,C':<14} {'fwd us':>8} {'TB/s':>6} {'bwd us':>8} {'TB/s':>6} {'fwd/fla':>8} {'bwd/fla':>8}")
    for r in rows:
        shape = f"{r['B']},{r['T']},{r['C']}"
        print(f"{r['impl'][:40]:<40} {shape:<14} {r['fwd_us']:>8.1f} {r['fwd_TBps']:>6.2f} "
              f"{r['bwd_us']:>8.1f} {r['bwd_TBps']:>6.2f} {r.get('fwd_vs_fla', nan):>8.3f} {r.get('bwd_vs_fla', nan):>8.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
