"""
Evaluation speed: the lm-eval adapter's scoring throughput and recurrent decoding speed.

    python bench/bench_eval.py                 # 130M GDN / PRISM / transformer / hybrid: needs a CUDA GPU
    python bench/bench_eval.py --tiny          # tiny models, a CPU smoke test (~1 min)
    python bench/bench_eval.py --models prism --batch_size 128 --scale 0.25

1. Adapter: synthetic requests shaped like each default task (request count, context and
   continuation lengths in Mistral tokens, measured on the real tasks and rounded; wikitext as
   rolling windows of block_size) go through PrismLM's scoring path, sorted and batched exactly
   as in a real run. A --scale fraction of each task is timed; the full-run time is estimated
   from the measured rate per task. "cont tok/s" counts scored continuation tokens, "fwd tok/s"
   every token through the model.
2. Decoding: a 128-token prompt is prefilled, then `--new_tokens` single-token steps run
   through the cache (what model.generate does), at batch 1 and 64. tok/s = batch * steps / time.

Writes --out (default $RESULTS_DIR/bench_eval_<date>.json, RESULTS_DIR defaulting to bench/results) with date,
device and versions, and prints markdown tables.
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from eval.harness import PrismLM  # noqa: E402
from model import Model, ModelConfig  # noqa: E402
from cli import HelpFormatter  # noqa: E402
from fileio import atomic_write  # noqa: E402
from settings import model_args_of, parse_config  # noqa: E402

BASE_TINY = dict(n_layer=2, n_embd=64, n_head=2, head_dim=16, expand_v=2.0, vocab_size=512,
                 block_size=256, solver_rank=16)
# the 130M models are the config files; --tiny shrinks them to BASE_TINY with these mixers
CONFIGS = {name: os.path.join(ROOT, "config", f"{name}_130m.py")
           for name in ("transformer", "gdn", "prism", "hybrid")}
MODELS = {
    "transformer": dict(mixer="attention"),
    "gdn": dict(mixer="gdn"),
    "prism": dict(mixer="prism", solver_steps=3),
    "hybrid": dict(mixer="prism", solver_steps=3, attn_layers=(5, 11)),
}
# task: (requests in the full task, context tokens (lo, hi), continuation tokens (lo, hi)).
# Multiple-choice tasks count one request per choice. wikitext: 62 test documents, ~330k tokens.
TASKS = {
    "lambada_openai": (5153, (40, 160), (1, 4)),
    "piqa": (1838 * 2, (8, 40), (5, 60)),
    "hellaswag": (10042 * 4, (30, 110), (15, 50)),
    "winogrande": (1267 * 2, (5, 35), (5, 20)),
    "arc_easy": (2376 * 4, (12, 60), (1, 15)),
    "arc_challenge": (1172 * 4, (15, 80), (1, 20)),
    "boolq": (3270 * 2, (60, 300), (1, 1)),
    "openbookqa": (500 * 4, (8, 30), (2, 12)),
    "sciq": (1000 * 4, (40, 250), (1, 6)),
}
WIKITEXT_DOCS, WIKITEXT_TOKENS = 62, 330_000


class NullTokenizer:
    """The adapter's tokenizer slot; synthetic requests are already token ids."""
    name = "synthetic"
    eos_id, bos_id = 2, 1

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def synthetic_requests(task, n, vocab, rng):
    _, (clo, chi), (nlo, nhi) = TASKS[task]
    reqs = []
    for _ in range(n):
        ctx = [rng.randrange(3, vocab) for _ in range(rng.randint(clo, chi))]
        cont = [rng.randrange(3, vocab) for _ in range(rng.randint(nlo, nhi))]
        reqs.append((None, [2] + ctx, cont))
    return reqs


def wikitext_windows(n_docs, n_tokens, block, vocab, rng):
    """Disjoint rolling windows of lm-eval's loglikelihood_rolling over documents of random
    lengths summing to n_tokens."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    cuts = sorted(rng.sample(range(1, n_tokens), n_docs - 1))
    lens = [b - a for a, b in zip([0] + cuts, cuts + [n_tokens])]
    reqs = []
    for L in lens:
        toks = [rng.randrange(3, vocab) for _ in range(L)]
        for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(toks, 2, block, 1)):
            reqs.append((None, ctx, cont))
    return reqs


def bench_adapter(lm, name, reqs, full_requests, device):
    lm._loglikelihood_tokens(reqs[:lm.batch_size], disable_tqdm=True)  # warm-up (kernels, autotune)
    sync(device)
    tok0, t0 = lm.tokens_scored, time.perf_counter()
    lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    sync(device)
    dt = time.perf_counter() - t0
    cont = lm.tokens_scored - tok0
    fwd = sum(min(len(c) + len(x), lm.max_length + 1) - 1 for _, c, x in reqs)
    return {"task": name, "requests": len(reqs), "cont_tokens": cont, "fwd_tokens": fwd,
            "seconds": round(dt, 4), "cont_tok_s": round(cont / dt), "fwd_tok_s": round(fwd / dt),
            "est_full_task_s": round(dt * full_requests / len(reqs), 2)}


@torch.no_grad()
def bench_decode(model, batch, prompt_len, new_tokens, device, autocast):
    vocab = model.config.vocab_size
    x = torch.randint(3, vocab, (batch, prompt_len), device=device)
    for rep in range(2):  # first pass warms up kernels and the allocator
        cache = model.init_cache(batch, prompt_len + new_tokens)
        sync(device)
        t0 = time.perf_counter()
        with autocast():
            logits = model(x, cache=cache)[0][:, -1]
        sync(device)
        t1 = time.perf_counter()
        with autocast():
            for _ in range(new_tokens if rep else 4):
                nxt = logits.float().argmax(-1, keepdim=True)
                logits = model(nxt, cache=cache)[0][:, -1]
        sync(device)
        t2 = time.perf_counter()
    cache_bytes = sum(t.numel() * t.element_size() for layer in cache for t in layer.values()
                      if torch.is_tensor(t))
    return {"batch": batch, "prompt": prompt_len, "new_tokens": new_tokens,
            "prefill_s": round(t1 - t0, 4), "step_ms": round(1e3 * (t2 - t1) / new_tokens, 3),
            "tok_s": round(batch * new_tokens / (t2 - t1)), "cache_MiB": round(cache_bytes / 2**20, 2)}


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None



def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny models, few requests (CPU smoke test)")
    p.add_argument("--models", default="gdn,prism,transformer,hybrid", help="comma list of " + ", ".join(MODELS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--batch_size", type=int, default=64, help="adapter batch (requests)")
    p.add_argument("--scale", type=float, default=None,
                   help="fraction of each task's requests to time (default: 0.05; tiny: 0.01)")
    p.add_argument("--new_tokens", type=int, default=None, help="decode steps (default: 128; tiny: 16)")
    p.add_argument("--decode_batches", default="1,64", help="comma list of decoding batch sizes")
    p.add_argument("--backend", default=None, choices=["naive", "chunk", "triton"],
                   help="recurrence backend (default: triton on CUDA, else chunk)")
    p.add_argument("--no_adapter", action="store_true", help="skip the adapter's scoring benchmark")
    p.add_argument("--no_decode", action="store_true", help="skip the decoding benchmark")
    p.add_argument("--out", default=None, help="JSON path (default: $RESULTS_DIR/bench_eval_<date>.json)")
    args = p.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {list(MODELS)}")
    device = torch.device(args.device)
    scale = args.scale if args.scale is not None else (0.01 if args.tiny else 0.05)
    new_tokens = args.new_tokens or (16 if args.tiny else 128)
    rng = random.Random(0)
    torch.manual_seed(0)

    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "triton": _version("triton"), "lm_eval": _version("lm_eval"),
              "tiny": args.tiny, "scale": scale,
              "adapter_batch_size": args.batch_size, "dtype": "bfloat16" if device.type == "cuda" else "float32",
              "models": {}, "adapter": [], "decode": []}
    t_start = time.perf_counter()
    for name in names:
        if args.tiny:
            kw = dict(BASE_TINY, **MODELS[name])
            if "attn_layers" in kw:
                kw["attn_layers"] = (1,)
        else:
            kw = model_args_of(parse_config([CONFIGS[name]]))
        model = Model(ModelConfig(**kw), backend=args.backend).to(device).eval()
        report["models"][name] = {"model_args": {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()},
                                  "params": model.num_params(non_embedding=False), "backend": model.backend}
        lm = PrismLM(model=model, tokenizer=NullTokenizer(kw["vocab_size"]), device=str(device),
                     batch_size=args.batch_size)
        print(f"== {name}: {report['models'][name]['params'] / 1e6:.1f}M params, backend {model.backend}",
              flush=True)
        try:  # one model failing (a kernel, memory) must not lose the others' numbers
            if not args.no_adapter:
                total = 0.0
                for task, (full, _, _) in TASKS.items():
                    n = max(lm.batch_size, int(full * scale))
                    r = bench_adapter(lm, task, synthetic_requests(task, n, kw["vocab_size"], rng), full, device)
                    r["model"] = name
                    report["adapter"].append(r)
                    total += r["est_full_task_s"]
                    print(f"  {task:15s} {r['cont_tok_s']:>12,} cont tok/s {r['fwd_tok_s']:>12,} fwd tok/s"
                          f"  full task ~{r['est_full_task_s']:.1f} s", flush=True)
                wt = int(WIKITEXT_TOKENS * (scale if args.tiny else 1.0))
                wins = wikitext_windows(WIKITEXT_DOCS, max(wt, 4 * WIKITEXT_DOCS), lm.max_length,
                                        kw["vocab_size"], rng)
                r = bench_adapter(lm, "wikitext", wins, len(wins), device)
                r["model"] = name
                report["adapter"].append(r)
                total += r["est_full_task_s"]
                print(f"  {'wikitext':15s} {r['cont_tok_s']:>12,} cont tok/s {r['fwd_tok_s']:>12,} fwd tok/s"
                      f"  full task ~{r['est_full_task_s']:.1f} s", flush=True)
                report["models"][name]["est_all_default_tasks_s"] = round(total, 1)
                print(f"  all default tasks: ~{total:.0f} s of scoring", flush=True)
            if not args.no_decode:
                for b in [int(x) for x in args.decode_batches.split(",")]:
                    r = bench_decode(model, b, 128, new_tokens, device, lm._autocast)
                    r["model"] = name
                    report["decode"].append(r)
                    print(f"  decode batch {b:3d}: {r['tok_s']:>10,} tok/s  ({r['step_ms']:.2f} ms/step, "
                          f"cache {r['cache_MiB']} MiB)", flush=True)
        except Exception as e:
            import traceback
            traceback.print_exc()
            report["models"][name]["error"] = f"{type(e).__name__}: {e}"
        del lm, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["total_s"] = round(time.perf_counter() - t_start, 1)

    lines = []
    if report["adapter"]:
        lines += ["| model | est. all default tasks (s) | " + " | ".join(list(TASKS) + ["wikitext"]) + " |",
                  "|---|---|" + "---|" * (len(TASKS) + 1)]
        for name in names:
            rows = {r["task"]: r for r in report["adapter"] if r["model"] == name}
            est = report["models"][name].get("est_all_default_tasks_s", "failed")
            lines.append(f"| {name} | {est} | " + " | ".join(
                f"{rows[t]['fwd_tok_s']:,}" if t in rows else "-" for t in list(TASKS) + ["wikitext"]) + " |")
        lines.append("(cells: forward tokens/s through the adapter)\n")
    if report["decode"]:
        lines += ["| model | batch | decode tok/s | ms/step | cache MiB |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['batch']} | {r['tok_s']:,} | {r['step_ms']} | {r['cache_MiB']} |"
                  for r in report["decode"]]
    report["table"] = "\n".join(lines) + "\n"
    print(report["table"])
    out = args.out or os.path.join(os.environ.get("RESULTS_DIR") or os.path.join(ROOT, "bench", "results"),
                                   f"bench_eval_{report['date'][:10]}{'_tiny' if args.tiny else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    atomic_write(out, json.dumps(report, indent=2).encode())
    print(f"wrote {out} ({report['total_s']} s)")
    return report


if __name__ == "__main__":
    main()
