"""
Training throughput: tokens/s, MFU and peak memory of full training steps (forward, backward,
grad clip, AdamW) after warm-up; nanoGPT's bench.py grown into a side-by-side table.

One configuration (config files and --key=value overrides as for train.py):
    python bench.py config/prism_130m.py --batch_size=16 --block_size=2048 --compile=True
The comparison table, every row measured in one process on one GPU:
    python bench.py --suite --compile --seqlens=2048,8192,16384 --out=bench/results/train_bench.json
The loss alone, B*T=32768 rows, D=768, V=32000, bf16 autocast: our chunked linear cross-entropy
at several chunk sizes against the plain float32-logits path, fla's FusedLinearCrossEntropyLoss,
fla's FusedCrossEntropyLoss (its model's default) and Liger-Kernel's, where importable:
    python bench.py --loss --out=bench/results/loss_bench.json

Suite rows: the 130M config files (transformer with FlashAttention when importable, else SDPA;
GDN; PRISM L=2 and L=3, and L=3 with recompute_solver=False or fused_chain=False; hybrid; --models picks rows by
name or name prefix) and flash-linear-attention's GatedDeltaNetForCausalLM of the same
shape, run as its users run it: its own defaults (fused norm, SwiGLU and cross-entropy), labels
passed so it computes its loss, eager and compiled. A row that fails (out of memory, a compile
error) becomes an error row and the suite goes on. Every row's MFU is model.training_flops_per_token
(6 N per token with N the row's own parameter count, plus the token-mixing matmuls) times
tokens/s over 989 TFLOP/s. Peak memory is torch.cuda.max_memory_allocated over the timed steps.
The JSON (--out) is rewritten after every row, so a run cut short keeps what it measured.
"""
import argparse
import functools
import gc
import json
import os
import platform
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from fileio import atomic_write
from model import PEAK_FLOPS, Model, ModelConfig, linear_cross_entropy, training_flops_per_token
from settings import UserError, model_args_of, parse_config

# the table's rows: the 130M config files themselves, plus an override where a row differs
# (config keys, then Model attributes: run-time choices that compute the same function)
SUITE = [
    ("transformer", "config/transformer_130m.py", {}, {}),
    ("gdn", "config/gdn_130m.py", {}, {}),
    ("prism L=2", "config/prism_130m.py", dict(solver_steps=2), {}),
    ("prism L=3", "config/prism_130m.py", {}, {}),
    ("prism L=3 (solver saved)", "config/prism_130m.py", {}, dict(recompute_solver=False)),
    ("prism L=3 (chain in PyTorch)", "config/prism_130m.py", {}, dict(fused_chain=False)),
    ("hybrid (prism L=3 + attn 5,11)", "config/hybrid_130m.py", {}, {}),
]
FLA = "fla GatedDeltaNet"  # the peer's row name (select it with --models=fla)


def suite_config(path, over, **kw):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    return ModelConfig(**{**model_args_of(parse_config([path])), **over, **kw})


def time_steps(step, warmup, steps, device):
    """Mean seconds per call of step() over `steps` calls queued back to back after warm-up, the
    way train.py runs them (it reads each step's loss one step late, so the GPU never waits for
    the host at a step boundary). The peak-memory counter is reset after warm-up, so it holds the
    timed steps' peak (weights, grads and optimizer included)."""
    for _ in range(warmup):
        step()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) / steps
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(steps):
        step()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / steps


def autocast(device):
    return (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
            else torch.autocast("cpu", enabled=False))


def bench_model(model, B, T, vocab, device, flops_per_token, steps=10, warmup=3, compile=False,
                ours=True):
    """Tokens/s, step time, MFU and peak memory of AdamW training steps on random tokens.
    ours: model(idx, targets) -> (_, loss); else a Hugging Face causal LM given labels."""
    model = model.to(device).train()
    opt = (model.configure_optimizers(0.1, 1e-4, (0.9, 0.95)) if ours else
           torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                             fused=device.type == "cuda"))
    fwd = torch.compile(model) if compile else model
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, vocab, (B, T + 1), device=device, generator=gen)
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step():
        with autocast(device):
            # the peer shifts its labels itself (the last position is ignored): same B*T logits
            loss = fwd(inp, tgt)[1] if ours else fwd(input_ids=inp, labels=inp).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    dt = time_steps(step, warmup, steps, device)
    row = dict(B=B, T=T, step_ms=round(dt * 1e3, 2), ktok_s=float(f"{B * T / dt / 1e3:.4g}"),
               params_M=round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
               mfu=round(flops_per_token * B * T / dt / PEAK_FLOPS, 4))
    if device.type == "cuda":
        row["peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row


def fla_peer(cfg):
    """flash-linear-attention's GDN model with our shape (widths, heads, layers, vocab, tied
    embeddings; its MLP is the same SwiGLU width) and its own defaults for everything else."""
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
                            vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings)
    return GatedDeltaNetForCausalLM(c)


def peer_params(model):
    """The peer's parameters as the FLOPs formula counts them: all (a tied head once), less an
    untied input table (a lookup does no multiply-adds)."""
    n = sum(p.numel() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        n -= model.get_input_embeddings().weight.numel()
    return n


def version(pkg):
    try:
        from importlib.metadata import version as v
        return v(pkg)
    except Exception:
        return None


def env_info(device):
    info = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                python=platform.python_version(), device=str(device))
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    for key, pkg in [("triton", "triton"), ("fla", "flash-linear-attention"),
                     ("fla_core", "fla-core"), ("liger_kernel", "liger-kernel"),
                     ("flash_attn", "flash-attn")]:
        if version(pkg):
            info[key] = version(pkg)
    return info


class Results:
    """Rows printed as they come and the JSON rewritten after each one."""

    def __init__(self, path, device, **meta):
        self.path, self.rows = path, []
        self.head = dict(env=env_info(device), **meta)
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def add(self, row):
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if self.path:
            atomic_write(self.path, json.dumps(dict(self.head, rows=self.rows), indent=1).encode())


def error_text(e):
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "out of memory"
    if isinstance(e, ImportError):
        return f"not importable: {e}"
    traceback.print_exc()
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}"


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_row(results, device, fields, build):
    """build() -> row dict; an exception becomes an error row and the suite goes on."""
    try:
        row = build()
    except Exception as e:
        row = dict(error=error_text(e))
    results.add({**fields, **row})
    torch._dynamo.reset() if fields.get("compile") else None  # compiled graphs of this model go
    free(device)


def run_suite(args, device):
    res = Results(args.out, device, tokens_per_step=args.tokens_per_step, steps=args.steps,
                  warmup=args.warmup, activation_checkpointing=args.activation_checkpointing)
    names = {r[0] for r in SUITE} | {"fla"}
    # a name selects the row it names, else every row it begins
    wanted = lambda name: args.models is None or any(name == m or (m not in names and name.startswith(m))
                                                     for m in args.models)
    from model import _flash_attn
    for T in args.seqlens:
        B = max(1, args.tokens_per_step // T)
        for name, path, over, attrs in SUITE:
            if not wanted(name):
                continue
            attn = "transformer" in name
            for backend in args.backends[:1] if attn else args.backends:
                fields = dict(model=name, backend=("flash" if _flash_attn else "sdpa") if attn else backend,
                              compile=args.compile, ckpt=args.activation_checkpointing, B=B, T=T)

                def build(path=path, over=over, attrs=attrs, backend=backend):
                    cfg = suite_config(path, over, block_size=T)
                    torch.manual_seed(0)
                    m = Model(cfg, backend=backend)
                    for key, value in attrs.items():
                        setattr(m, key, value)
                    m.activation_checkpointing = args.activation_checkpointing
                    m.fused_loss = args.fused_loss
                    return bench_model(m, B, T, cfg.vocab_size, device, m.flops_per_token(T),
                                       args.steps, args.warmup, args.compile)
                run_row(res, device, fields, build)
        if not wanted("fla"):
            continue
        for mode in args.fla_modes:
            fields = dict(model=FLA, backend="fla", compile=mode == "compile", ckpt=False, B=B, T=T)

            def build(mode=mode):
                cfg = suite_config("config/gdn_130m.py", {}, block_size=T)
                torch.manual_seed(0)
                m = fla_peer(cfg)
                fpt = training_flops_per_token(cfg, T, peer_params(m))
                return bench_model(m, B, T, cfg.vocab_size, device, fpt, args.steps, args.warmup,
                                   mode == "compile", ours=False)
            run_row(res, device, fields, build)
    return res.rows


def table(rows):
    """Markdown table; x fla and mem/fla are against the fastest fla row at the same T."""
    lines = ["| model | backend | compile | ckpt | T | B | step ms | ktok/s | x fla | MFU | peak GiB | mem / fla |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    peer = {}
    for r in rows:
        if r.get("backend") == "fla" and "ktok_s" in r and r["ktok_s"] > peer.get(r["T"], {}).get("ktok_s", 0):
            peer[r["T"]] = r
    for r in rows:
        head = f"| {r['model']} | {r.get('backend', '')} | {r.get('compile', '')} | {r.get('ckpt', '')} | {r['T']} | {r['B']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} |||||||")
            continue
        p = peer.get(r["T"])
        speed = f"{r['ktok_s'] / p['ktok_s']:.2f}" if p else "-"
        mem = (f"{r['peak_GiB'] / p['peak_GiB']:.2f}" if p and "peak_GiB" in r and "peak_GiB" in p
               else "-")
        lines.append(f"{head} {r['step_ms']} | {r['ktok_s']} | {speed} | {100 * r['mfu']:.1f}% | "
                     f"{r.get('peak_GiB', '-')} | {mem} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the loss alone

def loss_candidates(chunks, ignore_index=-1):
    """(name, fn(h, w, t) -> loss) for every implementation that imports; (name, error) if not."""
    out = [("plain: logits, float32 F.cross_entropy",
            lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t, ignore_index=ignore_index))]
    out += [(f"ours: linear_cross_entropy chunk={c}", functools.partial(linear_cross_entropy, chunk=c))
            for c in chunks]
    try:
        from fla.modules import FusedCrossEntropyLoss, FusedLinearCrossEntropyLoss
        flce = FusedLinearCrossEntropyLoss(ignore_index=ignore_index)
        fce = FusedCrossEntropyLoss(ignore_index=ignore_index, inplace_backward=True)
        out += [("fla FusedLinearCrossEntropyLoss", lambda h, w, t: flce(h, t, w)),
                ("fla FusedCrossEntropyLoss on bf16 logits (its model's default)",
                 lambda h, w, t: fce(F.linear(h, w), t))]
    except Exception as e:
        out.append(("fla", e))
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, accum_dtype=torch.float32)
        # Liger wants input and weight in one dtype: the bf16 copies autocast would make
        out.append(("liger LigerFusedLinearCrossEntropyLoss",
                    lambda h, w, t: liger(w.to(torch.bfloat16), h.to(torch.bfloat16), t)))
    except Exception as e:
        out.append(("liger", e))
    return out


def run_loss(args, device):
    """Every implementation on the same h [N,D] (float32, as the model's final norm gives it),
    tied-head weight [V,D] (float32 master) and targets (1 in 8 ignored), under bf16 autocast:
    forward+backward ms, peak memory above the inputs, and errors against float32 math."""
    N, D, V = args.loss_rows, args.loss_dim, args.loss_vocab
    res = Results(args.out, device, N=N, D=D, V=V, steps=args.steps, warmup=args.warmup)
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(N, D, device=device, generator=gen).requires_grad_()
    w = (torch.randn(V, D, device=device, generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, V, (N,), device=device, generator=gen)
    t[::8] = -1
    # reference: float32 logits from float32 inputs, no autocast, no TF32
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_loss = F.cross_entropy(h @ w.t(), t, ignore_index=-1)
    ref = [ref_loss.detach(), *torch.autograd.grad(ref_loss, (h, w))]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    del ref_loss
    free(device)
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()

    for name, fn in loss_candidates(args.loss_chunks):
        fields = dict(impl=name, N=N, D=D, V=V)
        if isinstance(fn, Exception):
            res.add({**fields, "error": error_text(fn)})
            continue

        def step(fn=fn):
            h.grad = w.grad = None
            with autocast(device):
                loss = fn(h, w, t)
            loss.backward()
            return loss

        def build():
            base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            dt = time_steps(step, args.warmup, args.steps, device)
            loss = step()
            row = dict(ms=round(dt * 1e3, 3), loss_err=rel(loss.detach(), ref[0]),
                       dh_err=rel(h.grad, ref[1]), dw_err=rel(w.grad, ref[2]))
            if device.type == "cuda":  # peak above the inputs, grads of h and w included
                row["peak_GiB"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
            return row
        try:
            row = build()
        except Exception as e:
            row = dict(error=error_text(e))
        h.grad = w.grad = None
        res.add({**fields, **row})
        free(device)
    return res.rows


def loss_table(rows):
    lines = ["| implementation | ms fwd+bwd | peak GiB | loss err | dh err | dW err |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['error']} |||||")
        else:
            lines.append(f"| {r['impl']} | {r['ms']} | {r.get('peak_GiB', '-')} | {r['loss_err']:.1e} | "
                         f"{r['dh_err']:.1e} | {r['dw_err']:.1e} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------

def flag(text):
    """--x, --x=True, --x=False"""
    if isinstance(text, bool):
        return text
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def checkpointing(text):
    return "mlp" if text.lower() == "mlp" else flag(text)


def optional_flag(text):
    return None if text.lower() in ("none", "auto") else flag(text)


def ints(text):
    try:
        return [int(s) for s in text.split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def arg_parser():
    p = argparse.ArgumentParser(
        prog="bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --backend (a train key) must not be taken for --backends
        usage="bench.py [config files] [--key=value ...] | --suite [options] | --loss [options]",
        epilog="Without --suite/--loss, the config files and --key=value overrides (train.py's keys: "
               "batch_size, block_size, backend, ...) describe the one model to time.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--suite", action="store_true", help="the comparison table (rows above)")
    mode.add_argument("--loss", action="store_true", help="the loss implementations alone")
    p.add_argument("--steps", type=int, default=10, metavar="N", help="timed steps, queued back to back (mean reported); default 10")
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed steps first (compilation, autotune); default 3")
    p.add_argument("--out", default=None, metavar="FILE", help="JSON file, rewritten after every row; default "
                   "bench/results/train_bench.json (--suite), bench/results/loss_bench.json (--loss), "
                   "none for one configuration")
    p.add_argument("--compile", type=flag, nargs="?", const=True, default=None, metavar="BOOL",
                   help="torch.compile our models (suite); one configuration: overrides its compile key")
    p.add_argument("--activation_checkpointing", type=checkpointing, nargs="?", const=True,
                   default=None, metavar="True|mlp",
                   help="our rows: recompute each block (True) or each MLP (mlp) in the backward")
    p.add_argument("--fused_loss", type=optional_flag, default=None, metavar="BOOL",
                   help="True/False: force the chunked loss on or off (our rows); default: on CUDA")
    s = p.add_argument_group("--suite")
    s.add_argument("--seqlens", type=ints, default=[2048, 8192, 16384], metavar="T,..", help="default 2048,8192,16384")
    s.add_argument("--tokens_per_step", type=int, default=32768, metavar="N", help="B = this // T; default 32768")
    s.add_argument("--backends", default=None, metavar="B,..", help="comma list for the recurrent rows; default triton on CUDA, else chunk")
    s.add_argument("--models", default=None, metavar="NAMES",
                   help="comma list of row names or name prefixes, e.g. 'gdn,prism L=3,fla'; default all")
    s.add_argument("--fla_modes", default="eager,compile", metavar="MODES", help="the peer's rows; default eager,compile")
    lo = p.add_argument_group("--loss")
    lo.add_argument("--loss_rows", metavar="N", type=int, default=32768, help="N = B*T; default 32768")
    lo.add_argument("--loss_dim", metavar="N", type=int, default=768, help="D; default 768")
    lo.add_argument("--loss_vocab", metavar="N", type=int, default=32000, help="V; default 32000")
    lo.add_argument("--loss_chunks", type=ints, default=[1024, 2048, 4096, 8192], metavar="C,..",
                    help="our chunk sizes to time; default 1024,2048,4096,8192")
    return p


def main(argv):
    args, rest = arg_parser().parse_known_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.suite or args.loss:
        if rest:
            raise UserError(f"--suite/--loss take no config files or train keys, got {rest}")
        args.activation_checkpointing = args.activation_checkpointing or False
        if args.loss:
            args.out = args.out or "bench/results/loss_bench.json"
            print(loss_table(run_loss(args, device)))
            return
        args.out = args.out or "bench/results/train_bench.json"
        args.compile = bool(args.compile)
        args.models = args.models.split(",") if args.models else None
        args.backends = (args.backends.split(",") if args.backends else
                         ["triton" if device.type == "cuda" else "chunk"])
        args.fla_modes = [m for m in args.fla_modes.split(",") if m]
        bad = [m for m in args.fla_modes if m not in ("eager", "compile")]
        if bad:
            raise UserError(f"--fla_modes takes eager and/or compile, got {bad}")
        print(table(run_suite(args, device)))
        return
    cfg = parse_config(rest)
    for key in ("compile", "activation_checkpointing"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if cfg["device"] != "auto":
        device = torch.device(cfg["device"])
    try:
        mcfg = ModelConfig(**model_args_of(cfg))
    except ValueError as e:
        raise UserError(str(e))
    torch.manual_seed(cfg["seed"])
    m = Model(mcfg, backend=cfg["backend"], chunk_size=cfg["chunk_size"])
    m.activation_checkpointing = cfg["activation_checkpointing"]
    m.fused_loss = args.fused_loss
    T = mcfg.block_size
    r = bench_model(m, cfg["batch_size"], T, mcfg.vocab_size, device, m.flops_per_token(T),
                    args.steps, args.warmup, cfg["compile"])
    row = dict(env=env_info(device), mixer=mcfg.mixer, backend=m.backend, compile=cfg["compile"],
               ckpt=cfg["activation_checkpointing"], **r)
    print(json.dumps(row))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        atomic_write(args.out, json.dumps(row, indent=1).encode())


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
