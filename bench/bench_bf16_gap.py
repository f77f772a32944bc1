"""
Cached decoding against the full forward in bf16: how far the logits move, and which rounding
moves them (random-init 130M configs; CPU by default, model.py's PyTorch chunk backend).

    python bench/bench_bf16_gap.py                                   # -> bench/results/bf16_gap.json
    python bench/bench_bf16_gap.py --models gdn --tokens 32          # quicker
    python bench/bench_bf16_gap.py --device cuda --backend triton    # the GPU path (not the variants)

For each model, one batch of random tokens goes through the full forward and through the cache
(a prefill of the first half, then one token at a time), under bf16 autocast with float32
weights (sample.py's and the lm-eval adapter's setting), and in float32. Rows give the largest
logit difference (max_abs, and rel = max_abs / max|logit|), the mean difference and the
fraction of logits that differ, at how many positions the greedy token differs, and per block
the largest difference of the residual stream after it (where the difference first appears).

The variants put back, one at a time and all together, a rounding that the code avoids, to
show what each costs:
  recurrence_bf16   autocast reaching the PyTorch recurrence (model.float32_recurrence off):
                    its einsums and matmuls in bf16, the float32 state rounded at every product
  loop_out_float32  the token loop (delta_rule_naive, every decoding step) returning float32,
                    which the output norm then reads unrounded where the full forward rounds
  conv_bf16         the cached short conv (ShortConv.cached) rounding each tap's product to
                    bf16 before the sum, where F.conv1d sums in float32 and rounds once
and `reordered` is the full forward against itself with the chunk length 16 instead of 64:
the same float32 sums in another order, each result rounded to bf16 as before, which is the
difference left between cached decoding and the full forward. On CPU about 3 minutes a model
on 2 cores.
"""
import argparse
import contextlib
import functools
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import model as M  # noqa: E402
from fileio import write_json  # noqa: E402
from settings import model_args_of, parse_config  # noqa: E402

MODELS = ("gdn", "prism", "hybrid", "transformer")
VARIANTS = ("recurrence_bf16", "loop_out_float32", "conv_bf16")
SHIPPED = {"naive": M.delta_rule_naive, "chunk": M.delta_rule_chunk, "cached": M.ShortConv.cached}


def _conv_products_bf16(self, x, buf, reset):
    """ShortConv.cached with each tap's product rounded to x's dtype before the sum (without its
    segment resets: this comparison has no EOS in it)."""
    W = self.width
    xp = torch.cat([buf.to(x.dtype), x], 1)
    buf.copy_(xp[:, x.shape[1]:])
    return F.silu((xp.unfold(1, W, 1) * self.weight.to(x.dtype)).sum(-1))


@contextlib.contextmanager
def variant(names):
    """model.py with the roundings `names` (VARIANTS) put back, for the duration."""
    naive, chunk = SHIPPED["naive"], SHIPPED["chunk"]
    if "recurrence_bf16" in names:
        naive, chunk = naive.__wrapped__, chunk.__wrapped__
    if "loop_out_float32" in names:
        inner = naive

        @functools.wraps(inner)
        def naive(*a, **kw):
            o, s = inner(*a, **kw)
            return o.float(), s
    M.delta_rule_naive, M.delta_rule_chunk = naive, chunk
    if "conv_bf16" in names:
        M.ShortConv.cached = _conv_products_bf16
    try:
        yield
    finally:
        M.delta_rule_naive, M.delta_rule_chunk = SHIPPED["naive"], SHIPPED["chunk"]
        M.ShortConv.cached = SHIPPED["cached"]


def load(name, device, backend):
    cfg = M.ModelConfig(**model_args_of(parse_config([os.path.join(ROOT, "config", f"{name}_130m.py")])))
    torch.manual_seed(0)
    return M.Model(cfg, backend=backend).to(device).eval()


@torch.no_grad()
def forward_both(model, idx, prefill, bf16):
    """(full-forward logits, cached logits, per-block residual streams of each) of the positions
    after the prefill."""
    dev = idx.device.type
    streams = []
    hooks = [b.register_forward_hook(lambda m, i, o: streams.append(o.float())) for b in model.blocks]
    ctx = torch.autocast(dev, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    try:
        with ctx:
            full, _ = model(idx)
            n = len(model.blocks)
            full_streams, streams[:] = streams[:n], []
            cache = model.init_cache(idx.shape[0], idx.shape[1], dtype=torch.bfloat16 if bf16 else None)
            pieces = [model(idx[:, :prefill], cache=cache)[0]]
            for t in range(prefill, idx.shape[1]):
                pieces.append(model(idx[:, t:t + 1], cache=cache)[0])
    finally:
        for h in hooks:
            h.remove()
    cached = torch.cat(pieces, 1)
    per_block = []
    if len(streams) == n * (1 + idx.shape[1] - prefill):  # the PyTorch path (the Triton step has no block hooks)
        for b in range(n):
            c = torch.cat([streams[b]] + [streams[n * (1 + s) + b] for s in range(idx.shape[1] - prefill)], 1)
            per_block.append((c[:, prefill:] - full_streams[b][:, prefill:]).abs().max().item())
    return full[:, prefill:].float(), cached[:, prefill:].float(), per_block


def compare(a, b):
    d = (a - b).abs()
    scale = b.abs().max().item()
    return dict(max_abs=d.max().item(), rel=d.max().item() / scale, mean_abs=d.mean().item(),
                frac_differ=(d > 0).float().mean().item(), max_logit=scale,
                argmax_differ=int((a.argmax(-1) != b.argmax(-1)).sum()), positions=a.shape[0] * a.shape[1])


@torch.no_grad()
def reordered(model, idx, prefill):
    """The bf16 full forward at chunk length 16 against 64 (PyTorch chunk backend)."""
    dev = idx.device.type
    with torch.autocast(dev, dtype=torch.bfloat16):
        a, _ = model(idx)
        model.chunk_size = 16
        b, _ = model(idx)
        model.chunk_size = 64
    return compare(b[:, prefill:].float(), a[:, prefill:].float())


def rows_for(name, args):
    model = load(name, args.device, args.backend)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), generator=g).to(args.device)
    P = args.tokens // 2
    recurrent = any(b.mixer_name != "attention" for b in model.blocks)
    runs = [("float32", (), False), ("bf16", (), True)]
    if recurrent and args.backend == "chunk":
        runs += [(f"bf16 + {v}", (v,), True) for v in VARIANTS]
        runs += [("bf16 + " + " + ".join(VARIANTS), VARIANTS, True)]
    rows = []
    for label, names, bf16 in runs:
        t0 = time.perf_counter()
        with variant(names):
            full, cached, per_block = forward_both(model, idx, P, bf16)
        first = next((i for i, d in enumerate(per_block) if d > 0), None)
        rows.append(dict(model=name, run=label, **compare(cached, full), per_block_max_abs=per_block,
                         first_block_differing=first, s=round(time.perf_counter() - t0, 1)))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_block_max_abs"}), flush=True)
    if recurrent and args.backend == "chunk":
        rows.append(dict(model=name, run="bf16 full forward, chunk 16 against 64 (reordered)",
                         **reordered(model, idx, P)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "bf16_gap.json"), help="results JSON")
    p.add_argument("--models", default=",".join(MODELS), help="comma list of " + ",".join(MODELS))
    p.add_argument("--tokens", type=int, default=64, help="tokens per row: half prefilled, half decoded one by one")
    p.add_argument("--batch", type=int, default=2, help="rows")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--backend", default="chunk", choices=list(M.BACKENDS),
                   help="recurrence backend; the variants and the reordering run on chunk only")
    args = p.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    if any(m not in MODELS for m in names) or args.tokens < 4 or args.batch < 1:
        p.error(f"--models from {MODELS}, --tokens >= 4, --batch >= 1")
    if args.device == "cpu":
        torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    report = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=args.device,
                  cpu=platform.processor() or platform.machine(),
                  gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                  torch=torch.__version__, python=platform.python_version(), backend=args.backend,
                  command="python bench/bench_bf16_gap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  rows=[])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for name in names:
        report["rows"] += rows_for(name, args)
        write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
