"""
Train a GDN / PRISM / attention language model. nanoGPT's loop, plus what a long run needs:
exact resume, verified checkpoints, and a loop that survives preemption, NaNs and bad input.

CPU demo (prepares its data from Python's own documentation on first use):
    python train.py config/tiny_cpu.py
One GPU:
    python train.py config/prism_130m.py
DDP on one node (8 GPUs; the global batch stays what the config says):
    torchrun --standalone --nproc_per_node=8 train.py config/prism_130m.py
FSDP (weights, gradients and AdamW state sharded over the GPUs; sharded checkpoints):
    torchrun --standalone --nproc_per_node=8 train.py config/prism_1b3.py --fsdp=True
Resume (picks the newest good checkpoint in out_dir):
    python train.py config/prism_130m.py --init_from=resume
Every key, its default and its meaning (settings.py holds them):
    python train.py --help

The file reads in the order a run goes: setup (processes, device, precision), data (memmaps and a
resumable order), model and optimizer (fresh or resumed), the step, evaluation, checkpoints,
logging, faults (signals, NaN steps, out of memory, a CPU too slow for the config), then
train(), the loop that strings them together.
"""
import gc
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import (CheckpointError, atomic_write, list_checkpoints, load_full_into_sharded,
                        load_latest_checkpoint, load_model, load_sharded, rng_state, save_checkpoint,
                        save_sharded, set_rng_state)
from model import Model, ModelConfig
from settings import MODEL_DEFAULTS, TRAIN_DEFAULTS, UserError, help_text, model_args_of, parse_config

ROOT = os.path.dirname(os.path.abspath(__file__))


# -----------------------------------------------------------------------------------------------
# setup: processes, device, precision

@dataclass
class Env:
    """Where this process runs: its rank among `world` ranks, its device and its precision."""
    ddp: bool   # in a process group (DDP, or FSDP on any number of ranks)
    rank: int
    world: int
    device: torch.device
    dtype: str  # "float32" | "bfloat16" (autocast)
    fsdp: bool = False  # weights, gradients and optimizer state sharded over the ranks

    @property
    def master(self):
        return self.rank == 0

    def log(self, *args, **kw):
        if self.master:  # rank 0 alone prints
            print(*args, **kw, flush=True)

    def autocast(self):
        if self.dtype == "float32":
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def all_sum(self, t):
        if self.ddp:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t


def setup(cfg):
    """Join the process group (under torchrun), pick the device and the precision."""
    fsdp = cfg["fsdp"]
    torchrun = int(os.environ.get("RANK", -1)) != -1
    ddp = torchrun and (int(os.environ.get("WORLD_SIZE", 1)) > 1 or fsdp)
    world = int(os.environ["WORLD_SIZE"]) if ddp else 1
    G = cfg["gradient_accumulation_steps"]
    if G % world:
        raise UserError(f"gradient_accumulation_steps={G} (global) is not divisible by the "
                        f"world size {world}; pick a multiple of {world}")
    if cfg["cpu_threads"] > 0:
        torch.set_num_threads(cfg["cpu_threads"])
    want_cuda = cfg["device"].startswith("cuda") or (cfg["device"] == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise UserError(f"device={cfg['device']!r} but this torch ({torch.__version__}) sees no CUDA GPU; "
                        f"use --device=cpu (and a small config, e.g. config/tiny_cpu.py)")
    rank = 0
    if ddp:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        device = torch.device(f"cuda:{local_rank}" if want_cuda else "cpu")
        if want_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if want_cuda else "gloo")
    elif fsdp:  # `python train.py --fsdp=True`: FSDP over a process group of one
        ddp = True
        device = torch.device(("cuda" if want_cuda else "cpu") if cfg["device"] == "auto" else cfg["device"])
        if device.type == "cuda":
            device = torch.device("cuda", device.index or 0)
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    else:
        device = torch.device("cuda" if cfg["device"] == "auto" and want_cuda else
                              "cpu" if cfg["device"] == "auto" else cfg["device"])
    dtype = cfg["dtype"] if cfg["dtype"] != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Env(ddp, rank, world, device, dtype, fsdp)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -----------------------------------------------------------------------------------------------
# data: uint16 memmaps, a deterministic and resumable order

DEMO_DATASET = "pydoc"  # built on first use from the documentation inside every Python install


@dataclass
class Data:
    paths: dict         # split -> .bin path
    meta: dict          # the dataset's meta.json (tokenizer, vocab, counts)
    n_train: int        # tokens
    n_val: int
    order: "DataOrder"


def prepare_hint(data_dir, dataset):
    out = os.path.join(data_dir, dataset)
    if dataset == "slimpajama":
        return f"python data/prepare_slimpajama.py --out_dir={out}"
    return f"python data/prepare_slimpajama.py --data_files 'path/to/*.jsonl.zst' --out_dir={out}"


def prepare_demo_data(d):
    """The CPU demo's corpus: Python's own documentation (pydoc_data, ~0.5 MB of English, no
    download), one document per paragraph, 5% of them held out, tokenized into d by
    data/prepare_slimpajama.py. Everything it writes stays in d."""
    from pydoc_data.topics import topics
    src = os.path.join(d, "pydoc.txt")
    atomic_write(src, "\n\n".join(topics.values()))
    args = ["--data_files", src, "--tokens", "all", "--val_tokens", "all", "--val_fraction", "0.05",
            "--num_proc", "1", "--overwrite", "--out_dir", d]
    script = os.path.join(ROOT, "data", "prepare_slimpajama.py")
    print(f"{d}: no data yet; preparing it from Python's documentation (pydoc_data):\n"
          f"  {shlex.join(['python', os.path.relpath(script), *args])}", flush=True)
    r = subprocess.run([sys.executable, script, *args])
    if r.returncode != 0:
        raise UserError(f"preparing the demo data in {d} failed (exit code {r.returncode}, "
                        f"its error is above)")


def load_data(cfg, env, model_args):
    """Check the dataset directory (building the demo dataset when it is missing); refuse data
    whose vocab or token ids do not fit the model."""
    d = os.path.join(cfg["data_dir"], cfg["dataset"])
    if cfg["dataset"] == DEMO_DATASET:
        ready = all(os.path.isfile(os.path.join(d, f)) for f in ("train.bin", "val.bin", "meta.json"))
        if env.master and not ready:
            prepare_demo_data(d)
        if env.ddp:
            dist.barrier()  # every rank, whatever it saw: the others wait for rank 0's files
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
        env.log(f"warning: {meta_path} missing; cannot check the tokenizer/vocab of the data")
    check_data_meta(meta, model_args)
    for split in ("train", "val"):  # once, here: on CUDA a bad id is an unexplained device assert
        data = np.memmap(paths[split], dtype=np.uint16, mode="r")
        top = max(int(data[i:i + 2**26].max()) for i in range(0, len(data), 2**26))
        if top >= model_args["vocab_size"]:
            raise UserError(f"{paths[split]} holds token id {top} >= vocab_size {model_args['vocab_size']}")
    n_train, n_val = (os.path.getsize(paths[s]) // 2 for s in ("train", "val"))
    order_seed = cfg["data_seed"] if cfg["data_seed"] >= 0 else cfg["seed"]
    return Data(paths, meta, n_train, n_val, DataOrder(n_train, cfg["block_size"], order_seed))


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
# model, optimizer, and where the run stands (fresh or resumed)

RESUME_KEYS = ("model", "optimizer", "model_args", "iter_num", "data_pos")


@dataclass
class Progress:
    """Where the run stands: saved in every checkpoint under these names, restored on resume."""
    iter_num: int = 0                   # optimizer steps taken (skipped ones included)
    data_pos: int = 0                   # training samples consumed, globally: DataOrder's position
    best_val_loss: float = float("inf")
    skipped: int = 0                    # non-finite steps whose update was skipped, in total
    bad_streak: int = 0                 # ... in a row, up to now


def build_model(cfg, env, model_args):
    torch.manual_seed(cfg["seed"])  # same initial weights on every rank
    try:
        raw_model = Model(ModelConfig(**model_args), backend=cfg["backend"], chunk_size=cfg["chunk_size"])
    except (ValueError, TypeError) as e:
        raise UserError(str(e))
    raw_model = raw_model.to(env.device)
    raw_model.activation_checkpointing = cfg["activation_checkpointing"]
    raw_model.recompute_solver = cfg["recompute_solver"]
    raw_model.fused_chain = cfg["fused_chain"]
    if env.fsdp:
        shard_model(raw_model, env)
    optimizer = raw_model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"],
                                               (cfg["beta1"], cfg["beta2"]))
    return raw_model, optimizer


# architecture keys come from the weights; these may change when fine-tuning them
FINETUNE_FREE_KEYS = ("dropout", "block_size")


def init_weights_from(cfg, env, model_args):
    """--init_from=<checkpoint file or export_hf.py directory>: start a fresh run (new optimizer,
    iteration 0) from those weights. Their architecture replaces the config's (updates
    model_args in place); returns the state dict, or None for scratch/resume."""
    src = cfg["init_from"]
    if src in ("scratch", "resume"):
        return None
    try:
        model, meta = load_model(src, "cpu", warn=env.log)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e))
    theirs = {**MODEL_DEFAULTS, **ModelConfig.from_dict(meta["model_args"]).__dict__}
    changed = [f"{k}={theirs[k]!r} (config had {model_args[k]!r})" for k in model_args
               if k not in FINETUNE_FREE_KEYS and _norm(theirs[k]) != _norm(model_args[k])]
    model_args.update({k: theirs[k] for k in model_args if k not in FINETUNE_FREE_KEYS})
    env.log(f"initialising from {src}" + (f"; its architecture replaces the config's: {', '.join(changed)}"
                                           if changed else ""))
    return model.state_dict()


def shard_model(raw_model, env):
    """FSDP2 in place: each block is one unit that is all-gathered for its forward and backward and
    whose gradients are reduce-scattered; the root unit holds the rest (the embedding, the final
    norm and the head: a tied head shares the embedding's weight, so they must be one unit).
    Under bf16 the gathered weights are bf16 and gradients are reduced in float32; the sharded
    weights the optimizer updates stay float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if env.dtype == "bfloat16" else MixedPrecisionPolicy())
    for block in raw_model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(raw_model, mp_policy=mp)


def wrap_model(raw_model, cfg, env):
    """The module the step runs: compiled and/or DDP-wrapped. raw_model keeps the weights that are
    evaluated and saved. Under FSDP, raw_model is already sharded (in place) and is compiled whole,
    as without FSDP; the kernels stay outside the graph either way."""
    model = torch.compile(raw_model) if cfg["compile"] else raw_model
    if env.ddp and not env.fsdp:
        model = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    return model


def start_or_resume(cfg, env, data, raw_model, optimizer, model_args):
    """Seed every rank's random streams; on resume, load the newest checkpoint that verifies
    (refusing a changed model or tokenizer) and restore weights, optimizer, position and RNG."""
    out_dir = cfg["out_dir"]
    os.makedirs(out_dir, exist_ok=True)
    random.seed(cfg["seed"] + env.rank)
    np.random.seed(cfg["seed"] + env.rank)
    torch.manual_seed(cfg["seed"] + env.rank)  # per-rank streams (dropout)
    if cfg["init_from"] != "resume":  # scratch, or fine-tuning given weights
        if list_checkpoints(out_dir):
            raise UserError(f"{out_dir} already holds checkpoints; use --init_from=resume "
                            f"or another --out_dir")
        return Progress()
    if not list_checkpoints(out_dir):
        raise UserError(f"init_from='resume' but no checkpoint (ckpt_*.pt) in {out_dir}")
    try:
        path, ckpt = load_latest_checkpoint(out_dir, RESUME_KEYS, env.log, move=env.master)
    except CheckpointError as e:
        raise UserError(str(e))
    check_resume_model_args(ckpt["model_args"], model_args)
    check_data_meta(data.meta, model_args, ckpt.get("data_meta"))
    changed = [k for k in TRAIN_DEFAULTS if k in ckpt.get("config", {})
               and _norm(ckpt["config"][k]) != _norm(cfg[k])]
    env.log(f"resuming from {path} (iter {ckpt['iter_num']})"
            + (f"; train keys changed since: {', '.join(changed)}" if changed else ""))
    if os.path.isdir(path):  # sharded (written with FSDP, on any number of ranks)
        load_sharded(path, raw_model, optimizer)
    elif env.fsdp:
        load_full_into_sharded(raw_model, optimizer, ckpt)
    else:
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    rngs = ckpt.get("rng") or []
    if len(rngs) == env.world:
        set_rng_state(rngs[env.rank], env.device)
    else:
        env.log(f"warning: checkpoint has RNG states for {len(rngs)} ranks, running {env.world}; reseeded")
    return Progress(**{k: ckpt[k] for k in asdict(Progress()) if k in ckpt})


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


# -----------------------------------------------------------------------------------------------
# the step

def get_lr(it, cfg):
    """Linear warmup, cosine decay to min_lr at lr_decay_iters, then flat."""
    decay_iters = cfg["lr_decay_iters"] or cfg["max_iters"]
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    if it >= decay_iters:
        return cfg["min_lr"]
    ratio = (it - cfg["warmup_iters"]) / max(1, decay_iters - cfg["warmup_iters"])
    return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg["learning_rate"] - cfg["min_lr"])


def forward_loss(model, x, y):
    """The loss of one micro-batch (a seam of its own: the tests wrap it to inject faults)."""
    _, loss = model(x, y)
    return loss


def train_step(model, raw_model, optimizer, data, cfg, env, prog, stop_requested):
    """Queue one optimizer step over the global batch; nothing here waits for the GPU. Gradients
    accumulate over this rank's micro-steps (DDP: all-reduced on the last one only; FSDP:
    reduce-scattered after each, so that no rank ever holds the whole model's gradient) and are
    clipped. A step whose loss or gradient is not finite on any rank is skipped on the device:
    fused AdamW's found_inf leaves weights, moments and step count as they were. The same
    all-reduce tells every rank whether any of them was asked to stop.
    Advances `prog`'s position; returns the step's StepResult, which the host reads later."""
    B, T = cfg["batch_size"], cfg["block_size"]
    accum = cfg["gradient_accumulation_steps"] // env.world
    lr = get_lr(prog.iter_num, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=env.device)
    for micro in range(accum):
        starts = data.order.starts(prog.data_pos, micro, env.rank, env.world, B, T)
        x, y = get_batch(data.paths["train"], starts, T, env.device)
        with (model.no_sync() if env.ddp and not env.fsdp and micro < accum - 1 else nullcontext()):
            with env.autocast():
                loss = forward_loss(model, x, y)
            loss_sum += loss.detach().float()
            (loss / accum).backward()
    clip = cfg["grad_clip"] if cfg["grad_clip"] > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip)
    if env.fsdp:
        grad_norm = grad_norm.full_tensor()  # a DTensor: the norm over all the ranks' shards
    bad = ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
    # torch.full, not torch.tensor: a copy from pageable host memory would wait for the GPU
    flags = env.all_sum(torch.stack([loss_sum / accum, bad.float(),
                                     torch.full((), float(stop_requested), device=env.device)]))
    optimizer.found_inf = (flags[1] > 0).float()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    prog.iter_num += 1
    prog.data_pos += B * cfg["gradient_accumulation_steps"]
    return StepResult(prog.iter_num, prog.data_pos,
                      torch.stack([flags[0] / env.world, grad_norm.float(), flags[1], flags[2]]))


class StepResult:
    """One queued step's loss, grad norm, skipped? and stop? on their way to the host: copied into
    pinned memory behind the step's kernels and read (`read()`) once the next step is queued, so
    the GPU never waits for the host at a step boundary (with a sync per step it idles while the
    host queues the next step's first kernels)."""

    def __init__(self, iter_num, data_pos, stats):
        self.iter_num, self.data_pos, self.done = iter_num, data_pos, None
        if stats.is_cuda:
            self.stats = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            self.stats.copy_(stats, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.stats = stats

    def read(self):
        """(loss, grad norm, skipped, stop requested on some rank); waits for this step alone."""
        if self.done is not None:
            self.done.synchronize()
        loss, grad_norm, bad, stop = self.stats.tolist()
        return loss, grad_norm, bad > 0, stop > 0


# -----------------------------------------------------------------------------------------------
# evaluation

@torch.no_grad()
def evaluate(raw_model, data, cfg, env):
    """Mean loss over the fixed val windows; the ranks split them. Under FSDP every forward gathers
    weights from all ranks, so each rank runs as many as the busiest one; the extras count nothing."""
    B, T, n = cfg["batch_size"], cfg["block_size"], cfg["eval_iters"]
    raw_model.eval()
    starts = val_starts(data.n_val, T, n * B)
    total = torch.zeros(2, device=env.device)
    for i in range(env.rank, -(-n // env.world) * env.world if env.fsdp else n, env.world):
        x, y = get_batch(data.paths["val"], starts[i % n * B:(i % n + 1) * B], T, env.device)
        with env.autocast():
            _, loss = raw_model(x, y)
        if i < n:
            total += torch.stack([loss.float(), torch.ones((), device=env.device)])
    raw_model.train()
    total = env.all_sum(total)
    return (total[0] / total[1]).item()


# -----------------------------------------------------------------------------------------------
# checkpoints (written, verified and rotated by checkpoint.py)

def save(cfg, env, raw_model, optimizer, prog, data, model_args):
    """Every rank's RNG state goes to rank 0, which writes the checkpoint; the others wait. Under
    FSDP every rank writes its shards into one directory (checkpoint.save_sharded)."""
    if not cfg["save_checkpoints"]:
        return "nothing (save_checkpoints=False)"
    rngs = [None] * env.world
    if env.ddp:
        dist.all_gather_object(rngs, rng_state(env.device))
    else:
        rngs = [rng_state(env.device)]
    if env.fsdp:
        return save_sharded(cfg["out_dir"], raw_model, optimizer, {
            **asdict(prog), "model_args": model_args, "config": cfg, "data_meta": data.meta,
            "rng": rngs, "world_size": env.world}, cfg["keep_checkpoints"], env.log)
    path = None
    if env.master:
        path = save_checkpoint(cfg["out_dir"], {
            "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), **asdict(prog),
            "model_args": model_args, "config": cfg, "data_meta": data.meta, "rng": rngs,
            "world_size": env.world,
        }, cfg["keep_checkpoints"], env.log)
    if env.ddp:
        dist.barrier()
    return path


# -----------------------------------------------------------------------------------------------
# logging: the console, out_dir/log.jsonl, optional wandb / TensorBoard

class RunLog:
    """log.jsonl (every logged step, strict JSON) plus wandb / TensorBoard when asked for; rank 0
    only. A fresh run starts the file empty; a resumed one drops the lines past its checkpoint
    (what a killed run logged after its last save)."""

    def __init__(self, cfg, env, resumed_at=None):
        self.on = env.master
        self.path = os.path.join(cfg["out_dir"], "log.jsonl")
        self.wandb = self.tb = None
        if not self.on:
            return
        keep = []
        if resumed_at is not None and os.path.isfile(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        if json.loads(line)["iter"] <= resumed_at:
                            keep.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError, TypeError):
                        pass
        atomic_write(self.path, "".join(keep))
        if cfg["wandb_log"]:
            try:
                import wandb
                wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"] or None, config=cfg)
                self.wandb = wandb
            except Exception as e:  # missing package, offline, no login: keep training
                env.log(f"warning: wandb disabled ({type(e).__name__}: {e})")
        if cfg["tensorboard_log"]:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(cfg["out_dir"], "tb"))
            except Exception as e:
                env.log(f"warning: tensorboard disabled ({type(e).__name__}: {e})")

    def write(self, rec):
        if not self.on:
            return
        rec = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
        with open(self.path, "a") as f:  # strict JSON: NaN/Inf become null
            f.write(json.dumps(rec) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in rec.items() if k != "iter"}, step=rec["iter"])
        if self.tb is not None:
            for k, v in rec.items():
                if k != "iter" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, rec["iter"])

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def log_step(runlog, env, raw_model, cfg, prog, res, loss, grad_norm, dt, dt_avg):
    T = cfg["block_size"]
    tokens_per_iter = cfg["batch_size"] * cfg["gradient_accumulation_steps"] * T
    lr = get_lr(res.iter_num - 1, cfg)
    # MFU against a GPU's peak means nothing on a CPU
    mfu = (raw_model.estimate_mfu(cfg["batch_size"] * cfg["gradient_accumulation_steps"] // env.world, dt)
           if env.device.type == "cuda" else None)
    eta = dt_avg * (cfg["max_iters"] - res.iter_num)
    env.log(f"iter {res.iter_num}: loss {loss:.4f}, lr {lr:.2e}, {tokens_per_iter / dt:,.0f} tok/s, "
            + (f"mfu {mfu * 100:.1f}%, " if mfu is not None else "")
            + f"grad {grad_norm:.3f}, eta {fmt_time(eta)}")
    runlog.write({"iter": res.iter_num, "loss": loss, "lr": lr, "tokens": res.data_pos * T,
                  "tok_s": tokens_per_iter / dt, **({"mfu": mfu} if mfu is not None else {}),
                  "grad_norm": grad_norm, "skipped": prog.skipped, "dt": dt,
                  **({"mem_gib": torch.cuda.max_memory_allocated(env.device) / 2**30}
                     if env.device.type == "cuda" else {})})


def fmt_time(s):
    s = int(s)
    if s >= 2 * 86400:
        return f"{s / 86400:,.0f} days"
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def fmt_tokens(n):
    """12,345 / 12.3M / 2.00B: exact below a million, then in M below a billion, then in B."""
    if n < 1e6:
        return f"{n:,}"
    return f"{n / 1e6:.1f}M" if round(n / 1e6, 1) < 1000 else f"{n / 1e9:.2f}B"


def announce(cfg, env, raw_model):
    B, T, G = cfg["batch_size"], cfg["block_size"], cfg["gradient_accumulation_steps"]
    a = raw_model.config
    env.log(f"model: {raw_model.num_params(non_embedding=False) / 1e6:.2f}M parameters ({a.mixer}"
            f"{', attention at ' + str(list(a.attn_layers)) if a.attn_layers else ''}), "
            f"backend {raw_model.backend}, device {env.device}, dtype {env.dtype}, world {env.world}"
            + (" (FSDP)" if env.fsdp else ""))
    env.log(f"global batch: {B} seqs x {G // env.world} micro-steps x {env.world} ranks x {T} tokens = "
            f"{B * G * T:,} tokens/iter; {cfg['max_iters']} iters = "
            f"{fmt_tokens(cfg['max_iters'] * B * G * T)} tokens")


# -----------------------------------------------------------------------------------------------
# faults: stop signals, non-finite steps, out of memory, a CPU too slow for the config

class StopNow(BaseException):
    """A second stop signal: leave at once, saving nothing (BaseException: no `except Exception`
    on the way out may swallow it)."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGTERM / SIGINT. The first asks for a checkpoint after the current step (the loop reads
    `requested` once a step; under DDP the ranks agree through the next step's flags, one step
    later) and says so at once; a second stops at once
    without saving. A repeat within REPEAT_S seconds is the same request delivered twice
    (launchers such as torchrun and SLURM signal the workers as well as themselves): ignored."""
    REPEAT_S = 1.0

    def __init__(self, announce):
        self.name, self.at, self.announce, self.old = None, 0.0, announce, {}

    @property
    def requested(self):
        return self.name is not None

    def install(self):
        self.old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore(self):
        for s, h in self.old.items():
            signal.signal(s, h)

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.name is None:
            self.name, self.at = name, time.monotonic()
            if self.announce:  # os.write: print() from a signal handler can hit a half-done write
                os.write(2, f"\nreceived {name}: will save a checkpoint after the current step, then exit; "
                            f"send it again to stop at once without saving\n".encode())
        elif time.monotonic() - self.at > self.REPEAT_S:
            raise StopNow(signum)


def report_bad_step(prog, cfg, env, iter_num):
    env.log(f"warning: iter {iter_num}: non-finite loss or gradient; update skipped "
            f"({prog.bad_streak} in a row, {prog.skipped} in total)")
    if prog.bad_streak >= cfg["max_bad_steps"]:
        good = list_checkpoints(cfg["out_dir"])
        raise UserError(f"aborting at iter {iter_num}: {prog.bad_streak} consecutive non-finite "
                        f"steps (max_bad_steps={cfg['max_bad_steps']}); last good checkpoint: "
                        f"{good[0] if good else 'none'}. Lower learning_rate or check the data.")


def suggest_micro_batch(batch_size, fits):
    """Largest batch_size / 2^k (k >= 1) for which fits(b) is True, or None."""
    b = batch_size // 2
    while b >= 1:
        if fits(b):
            return b
        b //= 2
    return None


def oom_error(model, optimizer, cfg, env, iter_num):
    """Called once the out-of-memory traceback (and the activations it held) is gone: find a
    micro-batch that fits and say how to rerun with the same global batch."""
    B, T, G = cfg["batch_size"], cfg["block_size"], cfg["gradient_accumulation_steps"]
    peak = torch.cuda.max_memory_allocated(env.device) / 2**30
    total = torch.cuda.get_device_properties(env.device).total_memory / 2**30
    gc.collect()

    def fits(b):  # can one forward + backward of b sequences run now?
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        try:
            x = torch.randint(0, cfg["vocab_size"], (b, T), device=env.device)
            with (model.no_sync() if env.ddp and not env.fsdp else nullcontext()), env.autocast():
                _, loss = model(x, x)
            loss.backward()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    b = suggest_micro_batch(B, fits)
    hint = (f"batch_size={b} fits: rerun with --batch_size={b} --gradient_accumulation_steps="
            f"{G * B // b} (same global batch)" if b else "even batch_size=1 does not fit; "
            "shorten block_size or shrink the model")
    return UserError(f"CUDA out of memory at iter {iter_num} with batch_size={B} x block_size={T} "
                     f"per GPU (peak {peak:.1f} of {total:.1f} GiB). {hint}")


CPU_WARN_STEP_S = 10.0  # warn when one step on a CPU is estimated to take longer than this


def cpu_flops(n=512, reps=3):
    """A rough float32 matmul FLOP/s of this CPU at torch's thread count: an upper bound on what
    a training step gets."""
    a = torch.randn(n, n)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def check_cpu_speed(raw_model, cfg, env):
    """On a CPU, warn before the first step when the config is sized for a GPU."""
    if env.device.type != "cpu":
        return
    tokens = cfg["batch_size"] * cfg["gradient_accumulation_steps"] // env.world * cfg["block_size"]
    flops = raw_model.flops_per_token(cfg["block_size"]) * tokens
    rate = cpu_flops()
    step_s = flops / rate
    if step_s < CPU_WARN_STEP_S:
        return
    env.log(f"warning: this config is sized for a GPU. On this CPU one step ({tokens:,} tokens x "
            f"{raw_model.flops_per_token(cfg['block_size']) / 1e9:.2f} GFLOP) takes at least "
            f"{fmt_time(step_s)} at the {rate / 1e9:.0f} GFLOP/s its matmuls reach, "
            f"the run ({cfg['max_iters']} steps) {fmt_time(step_s * cfg['max_iters'])}.\n"
            f"  For a CPU run pick a tiny config: python train.py config/tiny_cpu.py\n"
            f"  or shrink this one, e.g. --n_layer=2 --n_embd=64 --n_head=2 --head_dim=32 "
            f"--block_size=64 --batch_size=4 --gradient_accumulation_steps=2")


# -----------------------------------------------------------------------------------------------
# the run

def train(cfg):
    env = setup(cfg)
    model_args = model_args_of(cfg)
    init = init_weights_from(cfg, env, model_args)
    data = load_data(cfg, env, model_args)
    model_args["eos_id"] = data_eos_id(data.meta, model_args)  # reset_at_eos cuts where the data does
    raw_model, optimizer = build_model(cfg, env, model_args)
    if init is not None:
        if env.fsdp:
            load_full_into_sharded(raw_model, None, {"model": init})
        else:
            raw_model.load_state_dict(init)
        init = None
    prog = start_or_resume(cfg, env, data, raw_model, optimizer, model_args)
    resumed_at = prog.iter_num if cfg["init_from"] == "resume" else None
    model = wrap_model(raw_model, cfg, env)
    runlog = RunLog(cfg, env, resumed_at)
    stop = StopSignals(announce=env.master)
    T = cfg["block_size"]
    t_start, last_eval, oom = time.time(), resumed_at, False
    t_mark, dt_avg = time.time(), None

    def settle(res, force_log=False):
        """Take in a queued step's outcome: count a skipped step (aborting after max_bad_steps in a
        row), log it, and say whether some rank asked to stop."""
        nonlocal t_mark, dt_avg
        loss, grad_norm, bad, stopping = res.read()
        now = time.time()
        dt, t_mark = now - t_mark, now   # read to read: the step's time once steps queue back to back
        dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
        if bad:
            prog.skipped += 1
            prog.bad_streak += 1
            report_bad_step(prog, cfg, env, res.iter_num)  # raises after max_bad_steps in a row
        else:
            prog.bad_streak = 0
        if (res.iter_num % cfg["log_interval"] == 0 or res.iter_num == cfg["max_iters"]
                or stopping or force_log):
            log_step(runlog, env, raw_model, cfg, prog, res, loss, grad_norm, dt, dt_avg)
        return stopping

    stop.install()
    try:
        announce(cfg, env, raw_model)
        check_cpu_speed(raw_model, cfg, env)
        pending, stopping = None, False   # the step queued last: read once the next one is queued
        while True:
            final = prog.iter_num >= cfg["max_iters"]
            evaluating = (prog.iter_num % cfg["eval_interval"] == 0 or final) and prog.iter_num != last_eval
            # a save or the end must know every step's outcome first
            if pending is not None and (evaluating or stopping or final):
                stopping, pending = settle(pending, force_log=stopping) or stopping, None
            if stopping:
                env.log(f"received {stop.name or 'a stop signal on another rank'} at iter {prog.iter_num}: "
                        f"saved {save(cfg, env, raw_model, optimizer, prog, data, model_args)}; exiting")
                break
            if evaluating:
                last_eval = prog.iter_num
                val = evaluate(raw_model, data, cfg, env)
                env.log(f"iter {prog.iter_num}: val loss {val:.4f}")
                runlog.write({"iter": prog.iter_num, "val_loss": val, "tokens": prog.data_pos * T})
                improved = val < prog.best_val_loss
                prog.best_val_loss = min(prog.best_val_loss, val)
                if prog.iter_num > 0 and (improved or cfg["always_save_checkpoint"] or final):
                    env.log(f"saved {save(cfg, env, raw_model, optimizer, prog, data, model_args)}")
                t_mark = time.time()
            if final:
                break
            queued = train_step(model, raw_model, optimizer, data, cfg, env, prog, stop.requested)
            if pending is not None:  # the GPU holds the queued step while the host reads this one
                stopping = settle(pending)
            # one process needs no word from other ranks: stop after the step it was asked during
            stopping = stopping or (not env.ddp and stop.requested)
            pending = queued
    except torch.OutOfMemoryError:
        if env.device.type != "cuda":
            raise
        oom = True  # handled below, once the traceback (and the activations it holds) is gone
    finally:
        stop.restore()
        runlog.close()
    if oom:
        raise oom_error(model, optimizer, cfg, env, prog.iter_num)
    env.log(f"done at iter {prog.iter_num} ({fmt_tokens(prog.data_pos * T)} tokens) in "
            f"{fmt_time(time.time() - t_start)}; best val loss {prog.best_val_loss:.4f}")
    return prog.iter_num


def main(argv):
    if "-h" in argv or "--help" in argv:
        rest = [a for a in argv if a not in ("-h", "--help")]
        try:
            cfg = parse_config(rest)
        except UserError as e:
            print(f"train.py: error: {e}", file=sys.stderr)
            cfg, rest = None, []
        print(help_text(cfg, [a for a in rest if not a.startswith("-")]), end="")
        return 0
    who = f" [rank {os.environ['RANK']}]" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    try:
        train(parse_config(argv))
        code = 0
    except UserError as e:
        print(f"train.py{who}: error: {e}", file=sys.stderr)
        code = 2
    except StopNow as e:
        print(f"train.py{who}: stopped at once by a second {e}; nothing saved since the last checkpoint",
              file=sys.stderr)
        code = 128 + e.signum
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
