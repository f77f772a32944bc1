"""
Decoding speed of the 130M models (needs a CUDA GPU): tokens/s of Model.generate's step, and
how it changes with the context (the point of a constant-size state).

    python bench/bench_decode.py --out bench/results/decode.json
    python bench/bench_decode.py --models prism,transformer --contexts 1024,65536 --batches 1
    python bench/bench_decode.py --gemms --out bench/results/decode_gemms.json   # the step's GEMMs alone

GDN, PRISM, hybrid and transformer are the config files (config/*_130m.py), in bf16 weights,
each on its best cache path: Model.init_cache's static buffers, the prompt prefilled through
the cache, then the decoding step (Model.decode_step: the whole model plus greedy sampling on
the device) captured once in a CUDA graph and replayed. The transformer runs the same way, with
a static KV cache and flash-decoding attention over it. Timed with CUDA events around --steps
replays after warm-up; tok/s = batch * steps / time, cache_MiB = the Cache's buffers.

  short:   prompt 128, 128 new tokens, batch 1 and 64
  context: prompts of --contexts tokens (1K, 4K, 16K, 64K), batch 1 and 16

Writes --out (JSON: rows model, batch, context, new_tokens, tok_s, ms_per_token, cache_MiB,
prefill_s; date, GPU, versions) after every row, a plot next to it (.png, matplotlib), and
prints a table. About 3 minutes on one H200.
"""
import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from model import Model, ModelConfig, cuda_graph, sample_next  # noqa: E402
from fileio import write_figure, write_json  # noqa: E402
from settings import model_args_of, parse_config  # noqa: E402

MODELS = ("gdn", "prism", "hybrid", "transformer")


def load(name):
    cfg = ModelConfig(**model_args_of(parse_config([os.path.join(ROOT, "config", f"{name}_130m.py")])))
    torch.manual_seed(0)
    return Model(cfg).cuda().to(torch.bfloat16).eval()


PROFILE_STEPS = 16


def kernel_profile(step, n=PROFILE_STEPS):
    """GPU time of one decoding step from torch.profiler over n graph replays: kernels per step,
    the sum of their durations (the rest of the step is launch gaps) and the 25 largest."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.events():   # only GPU activities were recorded: kernels, copies, sets
        t = ev.device_time_total
        if t > 0:
            c, s = per.get(ev.name[:70], (0, 0.))
            per[ev.name[:70]] = (c + 1, s + t)
    top = sorted(per.items(), key=lambda kv: -kv[1][1])
    return dict(kernels_per_step=round(sum(c for c, _ in per.values()) / n, 1),
                gpu_us_per_step=round(sum(s for _, s in per.values()) / n, 1),
                top=[(k, round(c / n, 1), round(s / n, 1)) for k, (c, s) in top[:25]])


@torch.no_grad()
def measure(model, batch, context, steps, warmup=8, profile=False, state_dtype=None):
    """Prefill a random prompt of `context` tokens, then time `steps` graph replays of the
    decoding step (greedy); state_dtype as Model.init_cache takes it."""
    vocab = model.config.vocab_size
    # prompt, first token, eager warm-up, replays, profiled replays
    length = context + 1 + 2 + warmup + steps + (PROFILE_STEPS if profile else 0)
    cache = model.init_cache(batch, length, state_dtype=state_dtype)
    seq = torch.randint(3, vocab, (batch, length), device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    seq[:, context] = sample_next(model.prefill(seq[:, :context], cache), temperature=0)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    step = cuda_graph(model.decode_step(seq, cache, temperature=0), warmup=2)
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / steps
    row = dict(batch=batch, context=context, new_tokens=steps, tok_s=round(batch * 1e3 / ms),
               ms_per_token=round(ms, 4), cache_MiB=round(cache.nbytes() / 2**20, 1),
               prefill_s=round(prefill_s, 3))
    if profile:  # the kernels inside the graph replays
        row["profile"] = kernel_profile(step)
    del cache, seq, step
    torch.cuda.empty_cache()
    return row


def env():
    import triton
    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=torch.cuda.get_device_name(0),
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                python=platform.python_version(), dtype="bfloat16", sampling="greedy, on the device")


def table(rows):
    lines = ["| model | batch | context | tok/s | ms/token | cache MiB | prefill s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['batch']} | {r['context']} | {r['tok_s']:,} | {r['ms_per_token']:.3f} | "
              f"{r['cache_MiB']:,} | {r['prefill_s']} |" for r in rows]
    flat = []  # per-token time at the longest context over the shortest, per model and batch
    for (m, b) in sorted({(r["model"], r["batch"]) for r in rows if r["kind"] == "context"}):
        rs = sorted((r for r in rows if r["kind"] == "context" and r["model"] == m and r["batch"] == b),
                    key=lambda r: r["context"])
        if len(rs) > 1:
            flat.append(f"{m} batch {b}: {rs[-1]['ms_per_token'] / rs[0]['ms_per_token']:.3f}x "
                        f"({rs[0]['context']} -> {rs[-1]['context']})")
    return "\n".join(lines + ([""] + ["per-token time, longest over shortest context:"] + flat if flat else []))


def plot(rows, path, gpu):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r["batch"] for r in rows if r["kind"] == "context"})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for m in MODELS:
            rs = sorted((r for r in rows if r["kind"] == "context" and r["model"] == m and r["batch"] == b),
                        key=lambda r: r["context"])
            if rs:
                ax.plot([r["context"] for r in rs], [r["tok_s"] for r in rs], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {b}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"130M decoding, bf16, CUDA graphs ({gpu})")
    fig.tight_layout()
    write_figure(path, fig)


def decode_gemms(batches=(1, 64), reps=50, copies=16):
    """The decoding step's GEMMs alone (the weight shapes of GDN-130M's and PRISM-130M's step,
    bf16), each timed over `reps` CUDA-graph replays of `copies` calls on distinct weights:
    F.linear(x, w) with w [N, K] as the step calls it, against x @ w_t with the weight stored
    transposed, w_t [K, N]. Returns rows with
    microseconds per call and the weight bytes moved per microsecond (TB/s)."""
    import torch.nn.functional as F
    from model import stacked_weights
    shapes = {}
    for name in ("gdn", "prism"):
        m = load(name)
        layer, mlp = m.blocks[0].mixer, m.blocks[0].mlp
        parts = (layer.q_proj, layer.k_proj, layer.v_proj, layer.a_proj, layer.b_proj, layer.g_proj)
        shapes[f"{name} in-proj"] = stacked_weights(layer, "in", parts, torch.bfloat16)[0]
        if name == "prism":
            x = torch.zeros(1, 1, m.config.n_embd, device="cuda", dtype=torch.bfloat16)
            layer.solver_step(x, {"anchor": torch.zeros(1, 3, m.config.n_embd, device="cuda", dtype=torch.bfloat16)}, None)
            shapes["prism solver"] = layer._decode_memo[("solver", torch.bfloat16)][1]
            continue
        shapes["o_proj"] = layer.o_proj.weight
        shapes["mlp gate|up"] = stacked_weights(mlp, "gate_up", (mlp.w_gate, mlp.w_up), torch.bfloat16)[0]
        shapes["mlp down"] = mlp.w_down.weight
        shapes["lm_head"] = m.lm_head.weight
        del m
    rows = []
    for label, w in shapes.items():
        # one weight per layer, as in the step: together they exceed the L2 cache, so every call
        # reads its weight from HBM
        ws = [w.detach().to(torch.bfloat16).contiguous().clone() for _ in range(copies)]
        ws_t = [w.t().contiguous() for w in ws]
        for b in batches:
            x = torch.randn(b, w.shape[1], device="cuda", dtype=torch.bfloat16)
            row = dict(gemm=label, batch=b, N=w.shape[0], K=w.shape[1])
            for form, fn in (("linear", lambda: [F.linear(x, w) for w in ws]),
                             ("matmul_wt", lambda: [x @ w for w in ws_t])):
                g = cuda_graph(fn, 3)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(reps):
                    g()
                e.record(); torch.cuda.synchronize()
                us = s.elapsed_time(e) * 1e3 / reps / copies
                row[f"{form}_us"] = round(us, 2)
                row[f"{form}_TBs"] = round(w.numel() * 2 / us / 1e6, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "decode.json"), help="results JSON")
    p.add_argument("--models", default=",".join(MODELS), help="comma list of " + ",".join(MODELS))
    p.add_argument("--contexts", default="1024,4096,16384,65536", help="prompt lengths of the context curve")
    p.add_argument("--batches", default="1,16", help="batch sizes of the context curve")
    p.add_argument("--short_batches", default="1,64", help="batch sizes at prompt 128 + 128 new tokens")
    p.add_argument("--steps", type=int, default=64, help="timed decoding steps per context-curve row")
    p.add_argument("--profile", action="store_true",
                   help="also profile the short rows' step: kernels per step, their GPU time, the largest")
    p.add_argument("--state_dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype the GDN/PRISM states are kept in between steps (Model.init_cache)")
    p.add_argument("--gemms", action="store_true",
                   help="only the step's GEMMs, F.linear against a transposed weight (decode_gemms)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: bench_decode.py needs a CUDA GPU")
    if args.gemms:
        report = dict(env(), command="python bench/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                      rows=decode_gemms())
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_json(args.out, report)
        return 0
    names = [m for m in args.models.split(",") if m]
    bad = [m for m in names if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {MODELS}")
    ints = lambda s: [int(x) for x in s.split(",") if x]
    report = dict(env(), command="python bench/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  rows=[])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t_start = time.perf_counter()
    for name in names:
        model = load(name)
        plan = [("short", b, 128, 128) for b in ints(args.short_batches)]
        plan += [("context", b, c, args.steps) for b in ints(args.batches) for c in ints(args.contexts)]
        for kind, b, ctx, steps in plan:
            try:  # one row failing (memory, a kernel) must not lose the others
                row = dict(model=name, kind=kind, state_dtype=args.state_dtype,
                           **measure(model, b, ctx, steps, profile=args.profile and kind == "short",
                                     state_dtype=getattr(torch, args.state_dtype)))
            except Exception as e:
                row = dict(model=name, kind=kind, batch=b, context=ctx, error=f"{type(e).__name__}: {e}")
                torch.cuda.empty_cache()
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            write_json(args.out, report)
        del model
        torch.cuda.empty_cache()
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    ok = [r for r in report["rows"] if "error" not in r]
    report["table"] = table(ok)
    write_json(args.out, report)
    if any(r["kind"] == "context" for r in ok):
        plot(ok, os.path.splitext(args.out)[0] + ".png", report["gpu"])
    print(report["table"])
    failed = [r for r in report["rows"] if "error" in r]
    print(f"{len(ok)} rows, {len(failed)} failed, {report['total_s']} s -> {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
