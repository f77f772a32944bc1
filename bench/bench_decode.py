"""
Decoding speed of the 130M models (needs a CUDA GPU): tokens/s of Model.generate's step, and
how it changes with the context (the point of a constant-size state).

    python bench/bench_decode.py --out bench/results/decode.json
    python bench/bench_decode.py --models prism,transformer --contexts 1024,65536 --batches 1
    python bench/bench_decode.py --gemms --out bench/results/decode_gemms.json   # the step's GEMMs alone
    python bench/bench_decode.py --front_ends       # one checkpoint through every front end

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

--front_ends times, in one run, greedy decoding of one random prompt (batch 1, --prompt tokens,
--new_tokens new ones, --reps timed calls after a warm-up call, wall clock per call: prefill,
graph capture and every step) of one random-init checkpoint per model through every front end:
Model.generate on bf16 weights; the directory export_hf.py writes for that checkpoint, loaded by
transformers (AutoModelForCausalLM, bf16), its generate() and, for comparison, transformers' own
decoding loop over it (fast_generate = False); sample.py's path (its checkpoint loading, autocast
and Model.generate call); and the lm-eval adapter's generate_until (eval/harness.py, PrismLM).
Rows: model, front_end, new_tokens, s_per_call, tok_s, vs_model_generate (tok/s over
Model.generate's in the same run) -> --out (default bench/results/decode_front_ends.json).
`--front_ends --device cpu --tiny` runs it without a GPU on 2-layer models: a check that every
path runs, not a timing.
"""
import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
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


def env(device="cuda"):
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = device == "cuda"
    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                gpu=torch.cuda.get_device_name(0) if cuda else None, device=device,
                torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
                python=platform.python_version(), dtype="bfloat16" if cuda else "float32",
                sampling="greedy, on the device")


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


# ---------------------------------------------------------------------------------------------
# --front_ends: one checkpoint's greedy decoding through every way the repo offers to decode

TINY = dict(vocab_size=32000, block_size=64, n_layer=2, n_head=2, n_embd=32, head_dim=16, mlp_hidden=64,
            solver_rank=8)
TINY_MIXERS = {"gdn": dict(mixer="gdn"), "prism": dict(mixer="prism"),
               "hybrid": dict(mixer="prism", attn_layers=(1,)), "transformer": dict(mixer="attention")}


def front_end_checkpoint(name, tiny, out_dir, tokenizer=None):
    """A random-init checkpoint of model `name` (its 130M config, or a 2-layer width-32 one) in
    out_dir, with the data metadata of the tokenizer (file; default tokenizer.py's Mistral), as
    train.py writes it. Returns (its path, the model, the tokenizer)."""
    from checkpoint import save_checkpoint
    from tokenizer import load_tokenizer
    tok = load_tokenizer(tokenizer)
    if tiny:
        cfg = ModelConfig(**TINY, **TINY_MIXERS[name])
    else:
        cfg = ModelConfig(**model_args_of(parse_config([os.path.join(ROOT, "config", f"{name}_130m.py")])))
    torch.manual_seed(0)
    model = Model(cfg).eval()
    meta = {"tokenizer": tok.name, "tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id}
    path = save_checkpoint(out_dir, {"model": model.state_dict(), "model_args": dataclasses.asdict(cfg),
                                     "iter_num": 0, "data_meta": meta}, keep=1)
    return path, model, tok


def timed(fn, device, reps):
    """(median wall seconds of fn() over `reps` calls after one warm-up call, what the last returned)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


@torch.no_grad()
def front_ends(name, device, tiny, prompt, new_tokens, reps, workdir, tokenizer=None):
    """Rows of greedy tokens/s of one random-init checkpoint of `name` through each front end
    (batch 1, the same random prompt; each front end's own new-token count)."""
    import sample
    from checkpoint import load_model
    from export_hf import export
    from transformers import AutoModelForCausalLM
    ckpt, model, tok = front_end_checkpoint(name, tiny, os.path.join(workdir, name), tokenizer)
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, tok.vocab_size, (1, prompt), generator=g)
    ids[:, 0] = tok.eos_id  # a document start, as every front end's prompt has
    ids = ids.to(device)
    rows = []

    def run(front_end, fn, how):
        try:  # one front end failing (a missing package, memory) must not lose the others
            s, n = timed(fn, device, reps)
            row = dict(model=name, front_end=front_end, batch=1, prompt=prompt, new_tokens=n,
                       s_per_call=round(s, 5), tok_s=round(n / s, 1), how=how)
        except Exception as e:
            row = dict(model=name, front_end=front_end, error=f"{type(e).__name__}: {e}")
        rows.append(row)
        print(json.dumps(row), flush=True)

    weights = "bf16 weights" if cuda else "float32 weights"
    m = model.to(device, dtype)
    run("Model.generate", lambda: m.generate(ids, new_tokens, temperature=0).shape[1] - prompt,
        f"model.py, {weights}, temperature=0")
    del m, model
    path, _ = export(ckpt, os.path.join(workdir, f"hf_{name}"), tokenizer=tok.path,
                     dtype="bfloat16" if cuda else "float32")
    hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=dtype).to(device).eval()
    hf_call = lambda: hf.generate(ids, max_new_tokens=new_tokens, do_sample=False).shape[1] - prompt
    run("export generate()", hf_call, f"transformers AutoModelForCausalLM, {weights}, do_sample=False")
    hf.fast_generate = False
    run("export generate(), transformers' loop", hf_call, "the same call with fast_generate = False")
    del hf
    args = sample.parse_args(["--ckpt", ckpt, "--temperature", "0", "--max_new_tokens", str(new_tokens),
                              "--device", device, "--tokenizer", tok.path])
    sm, _ = load_model(ckpt, device)

    def sample_py():
        with sample.decoding_context(args):
            return sample.draw(sm, ids, args, tok.eos_id).shape[1] - prompt
    run("sample.py", sample_py, "sample.py's load_model, decoding_context and draw: float32 weights"
        + (", bf16 autocast" if cuda else ""))
    del sm

    def lm_eval_adapter():
        from eval.harness import PrismLM
        from lm_eval.api.instance import Instance
        lm = PrismLM(ckpt=ckpt, device=device, batch_size=1, max_gen_toks=new_tokens, tokenizer_path=tok.path)
        inner, drawn = lm.model.generate, []

        def counted(x, n, **kw):  # generate_until returns text: count its new tokens here
            y = inner(x, n, **kw)
            drawn.append(y.shape[1] - x.shape[1])
            return y
        lm.model.generate = counted
        return lm, drawn, Instance

    def adapter_call(lm, drawn, Instance):
        context = tok.decode(ids[0, 1:].tolist())  # the adapter puts the document start in front
        req = [Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": new_tokens}), 0)]
        lm.generate_until(req, disable_tqdm=True)
        return drawn[-1]
    try:
        state = lm_eval_adapter()
    except Exception as e:
        rows.append(dict(model=name, front_end="lm-eval generate_until", error=f"{type(e).__name__}: {e}"))
        print(json.dumps(rows[-1]), flush=True)
    else:
        run("lm-eval generate_until", lambda: adapter_call(*state),
            "eval/harness.py PrismLM on the checkpoint: float32 weights" + (", bf16 autocast" if cuda else ""))
    base = next((r["tok_s"] for r in rows if r["front_end"] == "Model.generate" and "tok_s" in r), None)
    for r in rows:
        if base and "tok_s" in r:
            r["vs_model_generate"] = round(r["tok_s"] / base, 3)
    return rows


def front_end_table(rows):
    lines = ["| model | front end | new tokens | tok/s | vs Model.generate |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['front_end']} | {r['new_tokens']} | {r['tok_s']:,} | "
              f"{r.get('vs_model_generate', '—')} |" for r in rows if "tok_s" in r]
    return "\n".join(lines)


def run_front_ends(args, out, argv):
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: bench_decode.py --front_ends needs a CUDA GPU, or --device cpu")
    if min(args.prompt, args.new_tokens, args.reps) < 1:
        sys.exit("error: --prompt, --new_tokens and --reps must be >= 1")
    names = [m for m in args.models.split(",") if m]
    bad = [m for m in names if m not in MODELS]
    if bad:
        sys.exit(f"error: unknown model(s) {bad}; choose from {MODELS}")
    report = dict(env(args.device), command="python bench/bench_decode.py " +
                  " ".join(argv if argv is not None else sys.argv[1:]), tiny=args.tiny, rows=[])
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="front_ends_") as work:
        for name in names:
            report["rows"] += front_ends(name, args.device, args.tiny, args.prompt, args.new_tokens,
                                         args.reps, work, args.tokenizer)
            write_json(out, report)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    report["table"] = front_end_table(report["rows"])
    write_json(out, report)
    print(report["table"])
    failed = [r for r in report["rows"] if "error" in r]
    print(f"{len(report['rows']) - len(failed)} rows, {len(failed)} failed, {report['total_s']} s -> {out}")
    return 1 if failed else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "decode.json"),
                   help="results JSON (--front_ends: bench/results/decode_front_ends.json unless given)")
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
    p.add_argument("--front_ends", action="store_true",
                   help="only greedy tokens/s of Model.generate, the export's generate(), sample.py and "
                        "the lm-eval adapter on one checkpoint per --models (this file's docstring)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="--front_ends: cpu runs the paths without a GPU (a check, not a timing)")
    p.add_argument("--tiny", action="store_true", help="--front_ends: 2-layer width-32 models, not the 130M configs")
    p.add_argument("--prompt", type=int, default=128, help="--front_ends: prompt tokens")
    p.add_argument("--new_tokens", type=int, default=128, help="--front_ends: new tokens per call")
    p.add_argument("--reps", type=int, default=3, help="--front_ends: timed calls per front end (the median)")
    p.add_argument("--tokenizer", default=None, help="--front_ends: tokenizer file; none: tokenizer.py's Mistral")
    args = p.parse_args(argv)
    if args.front_ends:
        out = args.out if args.out != p.get_default("out") else \
            os.path.join(ROOT, "bench", "results", "decode_front_ends.json")
        return run_front_ends(args, out, argv)
    if not torch.cuda.is_available() or args.device != "cuda":
        sys.exit("error: bench_decode.py needs a CUDA GPU (only --front_ends runs on --device cpu)")
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
