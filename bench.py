"""
Training throughput: tokens/s, MFU and peak memory of full training steps (forward, backward,
AdamW) after warm-up, nanoGPT's bench.py grown into a side-by-side table.

One configuration (same config files and --key=value overrides as train.py):
    python bench.py config/prism_130m.py --batch_size=16 --block_size=2048 --compile=True
The comparison table (every row measured in the same process, same GPU):
    python bench.py --suite --out=bench/results/train_bench.json [--seqlens=2048,8192,16384]
        [--tokens_per_step=32768] [--steps=10] [--compile] [--backends=triton,chunk] [--models=gdn,fla]
Rows: transformer, GDN, PRISM L=2 and L=3, hybrid, and flash-linear-attention's
GatedDeltaNetForCausalLM of the same shape (when `fla` is importable) as the peer.
"""
import argparse
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from model import Model, ModelConfig
from checkpoint import atomic_write
from settings import UserError, model_args_of, parse_config

# the table's rows: the 130M config files themselves, plus an override where a row differs
SUITE = [
    ("transformer", "config/transformer_130m.py", {}),
    ("gdn", "config/gdn_130m.py", {}),
    ("prism L=2", "config/prism_130m.py", dict(solver_steps=2)),
    ("prism L=3", "config/prism_130m.py", {}),
    ("hybrid (prism L=3 + attn 5,11)", "config/hybrid_130m.py", {}),
]


def suite_config(path, over, **kw):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    return ModelConfig(**{**model_args_of(parse_config([path])), **over, **kw})


def time_steps(step, warmup, steps, device):
    """Median seconds of one call of step() after warm-up."""
    for _ in range(warmup):
        step()
    ts = []
    for _ in range(steps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); step(); e.record(); torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def bench_model(model, B, T, vocab, device, steps=10, warmup=3, compile=False, ours=True):
    """Tokens/s, step time and peak memory of AdamW training steps on random tokens."""
    model = model.to(device).train()
    opt = (model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device.type) if ours else
           torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda"))
    fwd = torch.compile(model) if compile else model
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, vocab, (B, T + 1), device=device, generator=gen)
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
           else torch.autocast("cpu", enabled=False))

    def step():
        with amp:
            if ours:
                _, loss = fwd(inp, tgt)
            else:
                logits = fwd(input_ids=inp).logits
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    dt = time_steps(step, warmup, steps, device)
    row = dict(B=B, T=T, step_ms=round(dt * 1e3, 2), ktok_s=round(B * T / dt / 1e3, 1),
               params_M=round(sum(p.numel() for p in model.parameters()) / 1e6, 1))
    if ours:
        row["mfu"] = round(model.flops_per_token(T) * B * T / dt / 989e12, 4)  # H200 dense bf16
    if device.type == "cuda":
        row["peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row


def fla_peer(cfg):
    """flash-linear-attention's GDN model with our shape (same widths, MLP, tied embeddings)."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    # fla refuses its gated dq/dk backward under Triton 3.4-3.7.0 on Hopper (a miscompile,
    # ANCHORS.md); its speed is unaffected, so lift the guard for timing the peer only.
    try:
        import fla.ops.common.chunk_o as _co
        _co.TRITON_ABOVE_3_7_1 = True
    except Exception:
        pass
    c = GatedDeltaNetConfig(hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer,
                            num_heads=cfg.n_head, head_dim=cfg.head_dim, expand_v=cfg.expand_v,
                            vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings,
                            fuse_cross_entropy=False)
    return GatedDeltaNetForCausalLM(c)


def env_info(device):
    info = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                python=platform.python_version(), device=str(device))
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        pass
    return info


def run_suite(args, device):
    rows = []
    def emit(r):  # the JSON is rewritten after every row: a run cut short keeps what it measured
        rows.append(r)
        print(json.dumps(r), flush=True)
        if args.out:
            result = dict(env=env_info(device), tokens_per_step=args.tokens_per_step, rows=rows)
            atomic_write(args.out, json.dumps(result, indent=1).encode())

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    wanted = lambda name: args.models is None or any(name.startswith(m) for m in args.models)

    for T in args.seqlens:
        B = max(1, args.tokens_per_step // T)
        jobs = [(name, path, over, be) for name, path, over in SUITE for be in args.backends
                if wanted(name) and not ("transformer" in path and be != args.backends[0])]
        for name, path, over, backend in jobs:
            cfg = suite_config(path, over, block_size=T)
            attn = cfg.mixer == "attention"
            try:
                torch.manual_seed(0)
                r = bench_model(Model(cfg, backend=backend), B, T, cfg.vocab_size, device, args.steps, args.warmup,
                                args.compile)
                emit(dict(model=name, backend="sdpa" if attn else backend,
                          compile=args.compile, **r))
            except torch.cuda.OutOfMemoryError:
                emit(dict(model=name, backend=backend, B=B, T=T, error="out of memory"))
            torch.cuda.empty_cache() if device.type == "cuda" else None
        if not wanted("fla"):
            continue
        try:
            cfg = suite_config("config/gdn_130m.py", {}, block_size=T)
            r = bench_model(fla_peer(cfg), B, T, cfg.vocab_size, device, args.steps, args.warmup,
                            args.compile, ours=False)
            emit(dict(model="fla GatedDeltaNet (peer)", backend="fla", compile=args.compile, **r))
        except ImportError as e:
            print(f"fla peer skipped: {e}", file=sys.stderr)
        except torch.cuda.OutOfMemoryError:
            emit(dict(model="fla GatedDeltaNet (peer)", B=B, T=T, error="out of memory"))
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def table(rows):
    lines = ["| model | backend | T | B | step ms | ktok/s | x fla | MFU | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    peer = {r["T"]: r["ktok_s"] for r in rows if r.get("backend") == "fla" and "ktok_s" in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r.get('backend', '')} | {r['T']} | {r['B']} | {r['error']} ||||")
            continue
        ratio = f"{r['ktok_s'] / peer[r['T']]:.2f}" if r["T"] in peer else "-"
        lines.append(f"| {r['model']} | {r['backend']} | {r['T']} | {r['B']} | {r['step_ms']} | "
                     f"{r['ktok_s']} | {ratio} | {r.get('mfu', '-')} | {r.get('peak_GiB', '-')} |")
    return "\n".join(lines)


def main(argv):
    if "--suite" in argv:
        p = argparse.ArgumentParser()
        p.add_argument("--suite", action="store_true")
        p.add_argument("--seqlens", default="2048,8192,16384")
        p.add_argument("--tokens_per_step", type=int, default=32768)
        p.add_argument("--backends", default=None, help="comma list; default triton on CUDA")
        p.add_argument("--steps", type=int, default=10)
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--compile", action="store_true")
        p.add_argument("--models", default=None,
                       help="comma list of row-name prefixes, e.g. 'gdn,prism L=3,fla'; default all")
        p.add_argument("--out", default=None)
        args = p.parse_args(argv)
        args.models = args.models.split(",") if args.models else None
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args.seqlens = [int(s) for s in args.seqlens.split(",")]
        args.backends = (args.backends.split(",") if args.backends else
                         ["triton" if device.type == "cuda" else "chunk"])
        rows = run_suite(args, device)
        print(table(rows))
        return
    extra = [a for a in argv if a.startswith(("--steps=", "--warmup="))]
    opts = {a[2:].split("=")[0]: int(a.split("=")[1]) for a in extra}
    cfg = parse_config([a for a in argv if a not in extra])
    device = torch.device(cfg["device"] if cfg["device"] != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    mcfg = ModelConfig(**model_args_of(cfg))
    torch.manual_seed(cfg["seed"])
    r = bench_model(Model(mcfg, backend=cfg["backend"]), cfg["batch_size"], mcfg.block_size, mcfg.vocab_size, device,
                    opts.get("steps", 10), opts.get("warmup", 3), cfg["compile"])
    print(json.dumps(dict(env=env_info(device), mixer=mcfg.mixer, backend=cfg["backend"], **r)))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
