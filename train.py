"""
Train a GDN / PRISM / attention language model. nanoGPT's loop, plus what a long run needs:
exact resume, atomic checkpoints, and a loop that survives preemption, NaNs and bad input.

One process (CPU or one GPU):
    python train.py config/tiny_cpu.py --max_iters=200
DDP on one node (8 GPUs; the global batch stays what the config says):
    torchrun --standalone --nproc_per_node=8 train.py config/prism_130m.py
Resume (picks the newest good checkpoint in out_dir):
    python train.py config/prism_130m.py --init_from=resume

Configuration = the defaults below, then each config file in order, then --key=value overrides.
Train keys are the names below; model keys are ModelConfig's fields (model.py).
"""
import ast
import dataclasses
import gc
import glob
import hashlib
import io
import json
import math
import os
import random
import re
import signal
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import Model, ModelConfig

# -----------------------------------------------------------------------------------------------
# defaults: train keys (nanoGPT's names)
TRAIN_DEFAULTS = dict(
    # I/O
    out_dir="out",
    dataset="slimpajama",            # reads <data_dir>/<dataset>/{train,val}.bin, meta.json
    data_dir="data",
    init_from="scratch",             # "scratch" | "resume" (newest good checkpoint in out_dir)
    eval_interval=250,               # val loss + checkpoint every this many iterations
    eval_iters=20,                   # val batches per evaluation
    log_interval=10,
    always_save_checkpoint=True,     # False: save only when val loss improves
    keep_checkpoints=3,              # keep the last K checkpoint files
    save_checkpoints=True,           # False: write none (benchmarks and throw-away runs)
    # batch: the GLOBAL batch is batch_size * gradient_accumulation_steps sequences of block_size;
    # each of N ranks does gradient_accumulation_steps / N micro-steps
    batch_size=16,
    gradient_accumulation_steps=16,
    # AdamW + warmup/cosine schedule
    learning_rate=3e-3,
    min_lr=3e-4,
    max_iters=3815,
    warmup_iters=100,
    lr_decay_iters=0,                # 0 = max_iters
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,                   # 0 = no clipping (the norm is still logged)
    # faults
    max_bad_steps=10,                # abort after this many consecutive non-finite steps
    debug_nan_iters=[],              # test hook: make the loss NaN at these iterations (1-based, as logged)
    # system
    seed=1337,
    data_seed=-1,                    # DataOrder's seed; -1 = seed. Fix it to vary only the init
    device="auto",                   # "auto" = cuda if available else cpu
    dtype="auto",                    # "auto" = bfloat16 autocast on CUDA, float32 on CPU
    compile=False,
    backend=None,                    # recurrence: "naive" | "chunk" | "triton"; None = triton on CUDA else chunk
    chunk_size=64,                   # the chunk backend's chunk length (the Triton kernels use 64)
    activation_checkpointing=False,  # recompute each block in the backward: less memory, ~1/3 more compute
    cpu_threads=0,                   # torch intra-op threads on CPU; 0 = torch's default
    # optional loggers, off by default (the JSONL log in out_dir is always written)
    wandb_log=False,
    wandb_project="prism",
    wandb_run_name="",
    tensorboard_log=False,
)
MODEL_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                  for f in dataclasses.fields(ModelConfig)}
TRAIN_SAMPLE = {**TRAIN_DEFAULTS, **MODEL_DEFAULTS}


class UserError(Exception):
    """Bad config, bad data, bad checkpoint: reported as one message, no traceback."""


# -----------------------------------------------------------------------------------------------
# config: defaults -> config files -> --key=value

def _coerce(key, value, default):
    """Check `value` against the type of the default; return it in that type."""
    want = type(default)
    if isinstance(default, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, (list, tuple)):
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        ok = isinstance(value, (list, tuple))
        value = want(value) if ok else value
    elif default is None:  # optional string (the backend key)
        ok = value is None or isinstance(value, str)
        want = "str or None"
    else:
        ok = isinstance(value, want)
    if not ok:
        name = want if isinstance(want, str) else want.__name__
        raise UserError(f"config key '{key}' expects {name}, got {value!r} ({type(value).__name__})")
    return value


def _parse_value(text):
    """--key=value: a Python literal if it parses as one, else the raw string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_config(argv):
    """Defaults, then config files and --key=value overrides in the order given. Returns a dict
    holding every train key and every model key."""
    cfg = dict(TRAIN_SAMPLE)
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq:
                raise UserError(f"expected --key=value, got '{arg}'")
            default = TRAIN_SAMPLE.get(key, 0)
            if isinstance(default, str) or (default is None and text != "None"):
                value = text  # strings stay as typed: --dataset=2024 is a name, not a number
            else:
                value = None if default is None else _parse_value(text)
            items, source = {key: value}, "command line"
        else:
            if not os.path.isfile(arg):
                raise UserError(f"config file '{arg}' not found")
            ns = {"__file__": arg}
            with open(arg) as f:
                exec(compile(f.read(), arg, "exec"), ns)  # nanoGPT style: plain Python assignments
            items = {k: v for k, v in ns.items() if not k.startswith("_")
                     and not callable(v) and type(v).__name__ != "module"}
            source = arg
        for key, value in items.items():
            if key not in TRAIN_SAMPLE:
                raise UserError(
                    f"unknown config key '{key}' (from {source}).\n"
                    f"  train keys: {', '.join(TRAIN_DEFAULTS)}\n"
                    f"  model keys: {', '.join(MODEL_DEFAULTS)}")
            cfg[key] = _coerce(key, value, TRAIN_SAMPLE[key])
    if cfg["init_from"] not in ("scratch", "resume"):
        raise UserError(f"init_from must be 'scratch' or 'resume', got {cfg['init_from']!r}")
    if cfg["dtype"] not in ("auto", "float32", "bfloat16"):
        raise UserError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {cfg['dtype']!r}")
    return cfg


def model_args_of(cfg):
    return {k: cfg[k] for k in MODEL_DEFAULTS}


# -----------------------------------------------------------------------------------------------
# data: uint16 memmaps, a deterministic and resumable order

def prepare_hint(data_dir, dataset):
    out = os.path.join(data_dir, dataset)
    if dataset == "slimpajama":
        return f"python data/prepare_slimpajama.py --out_dir={out}"
    return f"python data/prepare_slimpajama.py --data_files 'path/to/*.jsonl.zst' --out_dir={out}"


def open_data(cfg):
    """Check the dataset directory; return (paths, meta)."""
    d = os.path.join(cfg["data_dir"], cfg["dataset"])
    paths = {s: os.path.join(d, f"{s}.bin") for s in ("train", "val")}
    for split, p in paths.items():
        if not os.path.isfile(p):
            raise UserError(f"{split} data not found: {p}\nPrepare it with:\n  "
                            f"{prepare_hint(cfg['data_dir'], cfg['dataset'])}")
        n = os.path.getsize(p) // 2
        if n < cfg["block_size"] + 1:
            raise UserError(f"{p} holds {n} tokens, fewer than block_size+1 = {cfg['block_size'] + 1}")
    meta = {}
    meta_path = os.path.join(d, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    else:
        print(f"warning: {meta_path} missing; cannot check the tokenizer/vocab of the data")
    return paths, meta


def data_eos_id(meta, model_args):
    """reset_at_eos cuts at the data's EOS: meta.json's eos_id, unless the config names another."""
    eos, ours = meta.get("eos_id"), model_args["eos_id"]
    if not model_args["reset_at_eos"] or eos is None or eos == ours:
        return ours
    if ours != MODEL_DEFAULTS["eos_id"]:
        raise UserError(f"reset_at_eos: meta.json has eos_id {eos}, the config eos_id {ours}; "
                        f"drop --eos_id or set --eos_id={eos}")
    return eos


def check_data_meta(meta, model_args, ckpt_meta=None):
    """Refuse data whose vocab (or, on resume, tokenizer) differs from the model's."""
    problems = []
    if "vocab_size" in meta and meta["vocab_size"] != model_args["vocab_size"]:
        problems.append(f"vocab_size: meta.json has {meta['vocab_size']}, "
                        f"the model has {model_args['vocab_size']}")
    for key in ("vocab_size", "tokenizer", "tokenizer_sha256", "eos_id"):
        if ckpt_meta and key in ckpt_meta and key in meta and ckpt_meta[key] != meta[key]:
            problems.append(f"{key}: meta.json has {meta[key]!r}, "
                            f"the checkpoint was trained on {ckpt_meta[key]!r}")
    if problems:
        raise UserError("the data does not match the model:\n  " + "\n  ".join(problems))


class DataOrder:
    """Which training windows each rank reads, as a pure function of the data position.

    train.bin is cut into N non-overlapping windows of block_size+1 tokens (stride block_size).
    Sample k of the run (k counts from 0 over the whole run, globally) is window perm_e[k % N],
    e = k // N, with perm_e a permutation seeded by (seed, e): every window once per epoch.
    One iteration consumes the global batch, samples [pos, pos + batch_size * accum_global);
    rank r at micro-step m reads its slice (m * world + r) * batch_size + [0, batch_size), so
    ranks read disjoint samples and any world size sees the same global batch. The checkpoint
    stores pos: resuming continues the same order."""

    def __init__(self, n_tokens, block_size, seed):
        self.n = (n_tokens - 1) // block_size
        self.seed = seed
        self._perm = {}

    def window(self, k):
        e = k // self.n
        if e not in self._perm:
            self._perm = {e: np.random.default_rng([self.seed, e]).permutation(self.n)}
        return int(self._perm[e][k % self.n])

    def starts(self, pos, micro, rank, world, batch_size, block_size):
        first = pos + (micro * world + rank) * batch_size
        return [self.window(k) * block_size for k in range(first, first + batch_size)]


def val_starts(n_tokens, block_size, count):
    """Fixed, evenly spread val windows: the same every evaluation, comparable over the run."""
    last = n_tokens - block_size - 1
    return np.linspace(0, last, count).astype(np.int64).tolist()


def get_batch(path, starts, block_size, device):
    # a fresh memmap per batch avoids the memory growth nanoGPT notes
    data = np.memmap(path, dtype=np.uint16, mode="r")
    w = np.stack([data[s:s + block_size + 1] for s in starts]).astype(np.int64)
    x, y = torch.from_numpy(np.ascontiguousarray(w[:, :-1])), torch.from_numpy(np.ascontiguousarray(w[:, 1:]))
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


# -----------------------------------------------------------------------------------------------
# checkpoints: atomic writes, last K kept, corrupt ones detected and skipped

CKPT_RE = re.compile(r"ckpt_(\d+)\.pt$")


def _fsync_dir(d):
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def atomic_write(path, data):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def list_checkpoints(out_dir):
    """Checkpoint paths, newest first."""
    found = []
    for p in glob.glob(os.path.join(out_dir, "ckpt_*.pt")):
        m = CKPT_RE.search(os.path.basename(p))
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def save_checkpoint(out_dir, ckpt, keep):
    """ckpt_<iter>.pt (+ .sha256 beside it); ckpt.pt links to the newest; prune to the last K."""
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    data = buf.getvalue()
    path = os.path.join(out_dir, f"ckpt_{ckpt['iter_num']:07d}.pt")
    atomic_write(path, data)
    atomic_write(path + ".sha256", hashlib.sha256(data).hexdigest().encode())
    link = os.path.join(out_dir, "ckpt.pt")
    try:
        tmp = link + ".tmp"
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(os.path.basename(path), tmp)
        os.replace(tmp, link)
    except OSError:
        pass
    for old in list_checkpoints(out_dir)[max(keep, 1):]:
        for p in (old, old + ".sha256"):
            if os.path.exists(p):
                os.remove(p)
    return path


def load_checkpoint(path):
    """Load one checkpoint; raise ValueError saying why it is unusable."""
    with open(path, "rb") as f:
        data = f.read()
    digest_path = path + ".sha256"
    if os.path.isfile(digest_path):
        with open(digest_path) as f:
            want = f.read().strip()
        if hashlib.sha256(data).hexdigest() != want:
            raise ValueError("sha256 does not match the digest written with it (truncated or corrupt)")
    try:
        ckpt = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged zip
        raise ValueError(f"cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    missing = [k for k in ("model", "optimizer", "model_args", "iter_num", "data_pos") if k not in ckpt]
    if missing:
        raise ValueError(f"lacks keys {missing}")
    return ckpt


def load_latest_checkpoint(out_dir, log=print):
    """Newest checkpoint that loads; corrupt ones are reported and skipped."""
    paths = list_checkpoints(out_dir)
    if not paths:
        raise UserError(f"init_from='resume' but no checkpoint (ckpt_*.pt) in {out_dir}")
    for i, p in enumerate(paths):
        try:
            return p, load_checkpoint(p)
        except ValueError as e:
            nxt = paths[i + 1] if i + 1 < len(paths) else None
            log(f"warning: checkpoint {p} is unusable: {e}; "
                + (f"falling back to {nxt}" if nxt else "no older checkpoint left"))
    raise UserError(f"no usable checkpoint in {out_dir} (tried {len(paths)})")


def check_resume_model_args(ckpt_args, model_args):
    # a key the checkpoint lacks is newer than it: the checkpoint ran with its default
    ckpt_args = {**MODEL_DEFAULTS, **ckpt_args}
    diff = [f"{k} (checkpoint {ckpt_args.get(k)!r}, now {v!r})" for k, v in model_args.items()
            if _norm(ckpt_args.get(k)) != _norm(v)]
    if diff:
        raise UserError("cannot resume: the model config differs from the checkpoint's in "
                        + ", ".join(diff) + ". Use the checkpoint's values or a new out_dir.")


def _norm(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def rng_state(device):
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# -----------------------------------------------------------------------------------------------
# schedule, faults

def get_lr(it, cfg):
    """Linear warmup, cosine decay to min_lr at lr_decay_iters, then flat."""
    decay_iters = cfg["lr_decay_iters"] or cfg["max_iters"]
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    if it >= decay_iters:
        return cfg["min_lr"]
    ratio = (it - cfg["warmup_iters"]) / max(1, decay_iters - cfg["warmup_iters"])
    return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg["learning_rate"] - cfg["min_lr"])


def suggest_micro_batch(batch_size, fits):
    """Largest batch_size / 2^k (k >= 1) for which fits(b) is True, or None."""
    b = batch_size // 2
    while b >= 1:
        if fits(b):
            return b
        b //= 2
    return None


STOP = {"signal": None}


def _on_signal(signum, frame):
    if STOP["signal"] is not None and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: stop now
    STOP["signal"] = signal.Signals(signum).name


def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# -----------------------------------------------------------------------------------------------
# the run

def train(cfg):
    # --- processes and devices
    ddp = int(os.environ.get("RANK", -1)) != -1 and int(os.environ.get("WORLD_SIZE", 1)) > 1
    world = int(os.environ["WORLD_SIZE"]) if ddp else 1
    G = cfg["gradient_accumulation_steps"]
    if G % world:
        raise UserError(f"gradient_accumulation_steps={G} (global) is not divisible by the "
                        f"world size {world}; pick a multiple of {world}")
    if cfg["cpu_threads"] > 0:
        torch.set_num_threads(cfg["cpu_threads"])
    want_cuda = cfg["device"] == "cuda" or (cfg["device"] == "auto" and torch.cuda.is_available())
    if ddp:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        if want_cuda:
            device = torch.device(f"cuda:{local_rank}")
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend="nccl" if want_cuda else "gloo")
    else:
        rank = 0
        device = torch.device("cuda" if want_cuda else cfg["device"] if cfg["device"] != "auto" else "cpu")
    master = rank == 0
    log = print if master else (lambda *a, **k: None)

    accum = G // world
    B, T = cfg["batch_size"], cfg["block_size"]
    seqs_per_iter = B * G
    tokens_per_iter = seqs_per_iter * T
    dtype = cfg["dtype"] if cfg["dtype"] != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    autocast = (nullcontext() if dtype == "float32"
                else torch.autocast(device_type=device.type, dtype=torch.bfloat16))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # --- data
    model_args = model_args_of(cfg)
    try:
        ModelConfig(**model_args)
    except (ValueError, TypeError) as e:
        raise UserError(str(e))
    paths, meta = open_data(cfg)
    model_args["eos_id"] = data_eos_id(meta, model_args)
    n_train = os.path.getsize(paths["train"]) // 2
    n_val = os.path.getsize(paths["val"]) // 2
    check_data_meta(meta, model_args)
    for split in ("train", "val"):  # once, here: on CUDA a bad id is an unexplained device assert
        data = np.memmap(paths[split], dtype=np.uint16, mode="r")
        top = max(int(data[i:i + 2**26].max()) for i in range(0, len(data), 2**26))
        if top >= model_args["vocab_size"]:
            raise UserError(f"{paths[split]} holds token id {top} >= vocab_size {model_args['vocab_size']}")
    order = DataOrder(n_train, T, cfg["data_seed"] if cfg["data_seed"] >= 0 else cfg["seed"])

    # --- model, optimizer, state
    os.makedirs(cfg["out_dir"], exist_ok=True)
    log_path = os.path.join(cfg["out_dir"], "log.jsonl")
    iter_num, data_pos, best_val, skipped, bad_streak = 0, 0, float("inf"), 0, 0
    ckpt = None
    if cfg["init_from"] == "resume":
        ckpt_path, ckpt = load_latest_checkpoint(cfg["out_dir"], log)
        check_resume_model_args(ckpt["model_args"], model_args)
        check_data_meta(meta, model_args, ckpt.get("data_meta"))
        changed = [k for k in TRAIN_DEFAULTS if k in ckpt.get("config", {})
                   and _norm(ckpt["config"][k]) != _norm(cfg[k])]
        log(f"resuming from {ckpt_path} (iter {ckpt['iter_num']})"
            + (f"; train keys changed since: {', '.join(changed)}" if changed else ""))
    elif list_checkpoints(cfg["out_dir"]):
        raise UserError(f"{cfg['out_dir']} already holds checkpoints; use --init_from=resume "
                        f"or another --out_dir")

    torch.manual_seed(cfg["seed"])  # same initial weights on every rank
    try:
        model = Model(ModelConfig(**model_args), backend=cfg["backend"], chunk_size=cfg["chunk_size"])
    except ValueError as e:
        raise UserError(str(e))
    model = model.to(device)
    model.activation_checkpointing = cfg["activation_checkpointing"]
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"],
                                           (cfg["beta1"], cfg["beta2"]), device.type)
    random.seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"] + rank)  # per-rank streams (dropout)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        iter_num, data_pos = ckpt["iter_num"], ckpt["data_pos"]
        best_val = ckpt.get("best_val_loss", best_val)
        skipped, bad_streak = ckpt.get("skipped", 0), ckpt.get("bad_streak", 0)
        rngs = ckpt.get("rng") or []
        if len(rngs) == world:
            set_rng_state(rngs[rank], device)
        else:
            log(f"warning: checkpoint has RNG states for {len(rngs)} ranks, running {world}; reseeded")
        ckpt = None
        if master and os.path.isfile(log_path):  # drop log lines past the checkpoint (a killed run's)
            keep = []
            with open(log_path) as f:
                for line in f:
                    try:
                        if json.loads(line)["iter"] <= iter_num:
                            keep.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError, TypeError):
                        pass
            atomic_write(log_path, "".join(keep).encode())
    elif master:
        atomic_write(log_path, b"")
    resumed_at = iter_num if cfg["init_from"] == "resume" else None

    raw_model = model
    if cfg["compile"]:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    # --- loggers
    wandb = tb = None
    if master and cfg["wandb_log"]:
        try:
            import wandb
            wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"] or None, config=cfg)
        except Exception as e:  # missing package, offline, no login: keep training
            log(f"warning: wandb disabled ({type(e).__name__}: {e})")
            wandb = None
    if master and cfg["tensorboard_log"]:
        try:
            from torch.utils.tensorboard import SummaryWriter
            tb = SummaryWriter(os.path.join(cfg["out_dir"], "tb"))
        except Exception as e:
            log(f"warning: tensorboard disabled ({type(e).__name__}: {e})")

    def write_log(rec):
        if not master:
            return
        rec = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
        with open(log_path, "a") as f:  # strict JSON: NaN/Inf become null
            f.write(json.dumps(rec) + "\n")
        if wandb is not None:
            wandb.log({k: v for k, v in rec.items() if k != "iter"}, step=rec["iter"])
        if tb is not None:
            for k, v in rec.items():
                if k != "iter" and isinstance(v, (int, float)):
                    tb.add_scalar(k, v, rec["iter"])

    def all_sum(t):
        if ddp:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    @torch.no_grad()
    def evaluate():
        model.eval()
        starts = val_starts(n_val, T, cfg["eval_iters"] * B)
        total = torch.zeros(2, device=device)
        for i in range(rank, cfg["eval_iters"], world):  # ranks split the fixed val batches
            x, y = get_batch(paths["val"], starts[i * B:(i + 1) * B], T, device)
            with autocast:
                _, loss = raw_model(x, y)
            total += torch.stack([loss.float(), torch.ones((), device=device)])
        model.train()
        total = all_sum(total)
        return (total[0] / total[1]).item()

    def checkpoint():
        if not cfg["save_checkpoints"]:
            return "nothing (save_checkpoints=False)"
        rngs = [None] * world
        if ddp:
            dist.all_gather_object(rngs, rng_state(device))
        else:
            rngs = [rng_state(device)]
        path = None
        if master:
            path = save_checkpoint(cfg["out_dir"], {
                "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                "model_args": model_args, "iter_num": iter_num, "data_pos": data_pos,
                "best_val_loss": best_val, "config": cfg, "data_meta": meta, "rng": rngs,
                "world_size": world, "skipped": skipped, "bad_streak": bad_streak,
            }, cfg["keep_checkpoints"])
        if ddp:
            dist.barrier()
        return path

    def fits(b):  # OOM probe: can one fwd+bwd of b sequences run now?
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        try:
            x = torch.randint(0, model_args["vocab_size"], (b, T), device=device)
            with (model.no_sync() if ddp else nullcontext()), autocast:
                _, loss = model(x, x)
            loss.backward()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    # --- loop
    old_handlers = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    n_params = raw_model.num_params(non_embedding=False)
    log(f"model: {n_params / 1e6:.2f}M parameters ({model_args['mixer']}"
        f"{', attention at ' + str(list(model_args['attn_layers'])) if model_args['attn_layers'] else ''}), "
        f"backend {raw_model.backend}, device {device}, dtype {dtype}, world {world}")
    log(f"global batch: {B} seqs x {accum} micro-steps x {world} ranks x {T} tokens = "
        f"{tokens_per_iter:,} tokens/iter; {cfg['max_iters']} iters = {cfg['max_iters'] * tokens_per_iter / 1e9:.3f}B tokens")
    t_start, dt_avg, last_eval, oom = time.time(), None, None, False
    try:
        while True:
            final = iter_num >= cfg["max_iters"]
            if (iter_num % cfg["eval_interval"] == 0 or final) and iter_num != resumed_at and last_eval != iter_num:
                last_eval = iter_num
                val = evaluate()
                log(f"iter {iter_num}: val loss {val:.4f}")
                write_log({"iter": iter_num, "val_loss": val, "tokens": data_pos * T})
                improved = val < best_val
                best_val = min(best_val, val)
                if iter_num > 0 and (improved or cfg["always_save_checkpoint"] or final):
                    log(f"saved {checkpoint()}")
            if final:
                break

            t0 = time.time()
            lr = get_lr(iter_num, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro in range(accum):
                x, y = get_batch(paths["train"], order.starts(data_pos, micro, rank, world, B, T), T, device)
                # all-reduce gradients only on the last micro-step
                with (model.no_sync() if ddp and micro < accum - 1 else nullcontext()):
                    with autocast:
                        _, loss = model(x, y)
                    if iter_num + 1 in cfg["debug_nan_iters"]:
                        loss = loss * float("nan")
                    loss_sum += loss.detach().float()
                    (loss / accum).backward()
            clip = cfg["grad_clip"] if cfg["grad_clip"] > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip)
            bad = ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
            flags = all_sum(torch.stack([loss_sum / accum, bad.float(),
                                         torch.tensor(float(STOP["signal"] is not None), device=device)]))
            loss_val, bad, stop = (flags[0] / world).item(), flags[1].item() > 0, flags[2].item() > 0
            if bad:  # skip the update, keep the weights and optimizer state as they were
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                bad_streak += 1
                log(f"warning: iter {iter_num + 1}: non-finite loss or gradient; update skipped "
                    f"({bad_streak} in a row, {skipped} in total)")
                if bad_streak >= cfg["max_bad_steps"]:
                    good = list_checkpoints(cfg["out_dir"])
                    raise UserError(f"aborting at iter {iter_num + 1}: {bad_streak} consecutive non-finite "
                                    f"steps (max_bad_steps={cfg['max_bad_steps']}); last good checkpoint: "
                                    f"{good[0] if good else 'none'}. Lower learning_rate or check the data.")
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                bad_streak = 0
            iter_num += 1
            data_pos += seqs_per_iter

            dt = time.time() - t0
            dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
            if iter_num % cfg["log_interval"] == 0 or iter_num == cfg["max_iters"] or stop:
                mfu = raw_model.estimate_mfu(B * accum, dt)
                eta = dt_avg * (cfg["max_iters"] - iter_num)
                gn = grad_norm.item()
                log(f"iter {iter_num}: loss {loss_val:.4f}, lr {lr:.2e}, {tokens_per_iter / dt:,.0f} tok/s, "
                    f"mfu {mfu * 100:.1f}%, grad {gn:.3f}, eta {fmt_time(eta)}")
                write_log({"iter": iter_num, "loss": loss_val, "lr": lr, "tokens": data_pos * T,
                           "tok_s": tokens_per_iter / dt, "mfu": mfu, "grad_norm": gn,
                           "skipped": skipped, "dt": dt,
                           **({"mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}
                              if device.type == "cuda" else {})})
            if stop:
                log(f"received {STOP['signal'] or 'a stop signal on another rank'} at iter {iter_num}: "
                    f"saved {checkpoint()}; exiting")
                break
    except torch.OutOfMemoryError:
        if device.type != "cuda":
            raise
        oom = True  # probe below, once the traceback (and the activations it holds) is gone
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
        STOP["signal"] = None
        if tb is not None:
            tb.close()
        if wandb is not None:
            wandb.finish()
    if oom:
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        x = y = loss = None
        gc.collect()
        b = suggest_micro_batch(B, fits)
        hint = (f"batch_size={b} fits: rerun with --batch_size={b} --gradient_accumulation_steps="
                f"{G * B // b} (same global batch)" if b else "even batch_size=1 does not fit; "
                "shorten block_size or shrink the model")
        raise UserError(f"CUDA out of memory at iter {iter_num} with batch_size={B} x block_size={T} "
                        f"per GPU (peak {peak:.1f} of {total:.1f} GiB). {hint}")
    log(f"done at iter {iter_num} in {fmt_time(time.time() - t_start)}; best val loss {best_val:.4f}")
    return iter_num


def main(argv):
    try:
        train(parse_config(argv))
    except UserError as e:
        who = f" [rank {os.environ['RANK']}]" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
        print(f"train.py{who}: error: {e}", file=sys.stderr)
        code = 2
    else:
        code = 0
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
