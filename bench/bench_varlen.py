"""
What reset_at_eos costs a training step: forward + backward of the 130M models on one packed
batch with the switch off and on (same weights, same tokens, bf16 autocast). Needs a CUDA GPU
and the Triton kernels.

    python bench/bench_varlen.py [--models=gdn,prism,hybrid] [--batch_size=16] [--block_size=2048]
        [--compile] [--data=data/slimpajama/train.bin] [--out=bench/results/varlen_bench.json]

Documents: with --data, windows of a prepared train.bin (its EOS where its documents start);
else document lengths drawn from a log-normal, median 400 tokens and sigma 1.3 (mean ~930, a
long tail: web text as in SlimPajama, with a few long books and code files), an EOS starting
each. The target is on / off <= 1.1. The optimizer step, the same either way, is left out.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import Model, ModelConfig  # noqa: E402
from cli import HelpFormatter  # noqa: E402
from fileio import atomic_write  # noqa: E402
from settings import model_args_of, parse_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"gdn": "config/gdn_130m.py", "prism": "config/prism_130m.py", "hybrid": "config/hybrid_130m.py"}


def packed_batch(B, T, vocab, eos, rng, data=None):
    if data is not None:
        tokens = np.memmap(data, dtype=np.uint16, mode="r")
        starts = rng.integers(0, len(tokens) - T, B)
        return torch.from_numpy(np.stack([tokens[s:s + T] for s in starts]).astype(np.int64))
    idx = torch.from_numpy(rng.integers(eos + 1, vocab, (B, T)))
    for b in range(B):
        t = -int(rng.integers(0, 400))                      # the window starts inside a document
        while t < T:
            if t >= 0:
                idx[b, t] = eos
            t += max(1, int(rng.lognormal(np.log(400), 1.3)))
    return idx


def time_ms(fn, steps, warmup=3):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--models", default="gdn,prism", help="comma list of " + ", ".join(MODELS))
    ap.add_argument("--batch_size", type=int, default=16, help="sequences per step")
    ap.add_argument("--block_size", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="off/on alternations (medians of medians)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the models")
    ap.add_argument("--data", default=None, help="a train.bin to take the windows from (default: synthetic documents)")
    ap.add_argument("--out", default="bench/results/varlen_bench.json", help="results JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_varlen.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    B, T, dev = args.batch_size, args.block_size, torch.device("cuda")
    rows = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        cfg = ModelConfig(**{**model_args_of(parse_config([os.path.join(ROOT, MODELS[name])])),
                             "block_size": T})
        model = Model(cfg, backend="triton").to(dev).train()
        fwd = torch.compile(model) if args.compile else model
        x = packed_batch(B, T + 1, cfg.vocab_size, cfg.eos_id, np.random.default_rng(0), args.data).to(dev)
        inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        n_docs = int((inp == cfg.eos_id).sum()) + int((inp[:, 0] != cfg.eos_id).sum())

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = fwd(inp, tgt)
            loss.backward()
            model.zero_grad(set_to_none=True)

        ms = {False: [], True: []}
        peak = {}
        for _ in range(args.rounds):
            for reset in (False, True):
                model.config.reset_at_eos = reset
                torch.cuda.reset_peak_memory_stats()
                ms[reset].append(time_ms(step, args.steps))
                peak[reset] = torch.cuda.max_memory_allocated() / 2**30
        off, on = (sorted(ms[r])[len(ms[r]) // 2] for r in (False, True))
        row = dict(model=name, batch_size=B, block_size=T, segments_per_row=n_docs / B,
                   compile=args.compile, data=args.data or "log-normal lengths", ms_off=off, ms_on=on,
                   ratio=on / off, peak_gib_off=peak[False], peak_gib_on=peak[True])
        rows.append(row)
        print(f"{name:7s} B={B} T={T} {n_docs / B:.1f} docs/row  off {off:8.2f} ms  on {on:8.2f} ms  "
              f"on/off {on / off:.3f}  peak GiB {peak[False]:.1f} / {peak[True]:.1f}", flush=True)
        del model, fwd
        torch.cuda.empty_cache()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__,
                command="python bench/bench_varlen.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    atomic_write(args.out, json.dumps(dict(meta=meta, rows=rows), indent=1).encode())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
