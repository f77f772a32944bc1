"""
Train a GDN / PRISM / attention language model: nanoGPT's loop, plus exact resume, verified
checkpoints, and a loop that survives preemption, NaNs and bad input.

    python train.py config/tiny_cpu.py                       # CPU demo, data built on first use
    python train.py config/prism_130m.py                     # one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/prism_130m.py   # DDP, same global batch
    torchrun --standalone --nproc_per_node=8 train.py config/prism_1b3.py --fsdp=True
    python train.py config/prism_130m.py --init_from=resume  # the newest good checkpoint in out_dir
    python train.py --help                                   # every key, its default and meaning

train() comes first: setup, then the loop (evaluate and save, queue a step, read the one before).
What it calls follows in the order a run goes: data (memmaps and a resumable order), model and
optimizer (fresh or resumed), the step, evaluation, checkpoints. Beside it: train_env.py (the
process group, device and precision), warm_start.py (--init_from another run's weights, a
transformers or flash-linear-attention directory, upcycling GDN into PRISM) and train_aids.py
(the log, the stop signals, the data checks and the advice on faults).
"""
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import (CheckpointError, list_checkpoints, load_full_into_sharded, load_latest_checkpoint,
                        load_sharded, rng_state, save_checkpoint, save_sharded, set_rng_state)
from model import Model, ModelConfig
from settings import TRAIN_DEFAULTS, UserError, help_text, model_args_of, parse_config
from train_aids import (DEMO_DATASET, RunLog, StopNow, StopSignals, announce, changed_keys, check_cpu_speed,
                        check_data, check_data_meta, check_resume_model_args, data_eos_id, fmt_time,
                        fmt_tokens, log_step, oom_error, prepare_demo_data, report_bad_step)
from train_env import setup
from warm_start import carry_optimizer_state, init_weights_from, start_state


# -----------------------------------------------------------------------------------------------
# the run

def train(cfg):
    """Setup, then the loop: evaluate (and save) every eval_interval iterations, queue a step, read
    the one before it. The host reads each step's outcome one step late (StepResult), so the last
    one is read before anything that must know it: a save, the end."""
    env = setup(cfg)
    model_args = model_args_of(cfg)
    init = init_weights_from(cfg, env, model_args)
    data = load_data(cfg, env, model_args)
    model_args["eos_id"] = data_eos_id(data.meta, model_args)  # reset_at_eos cuts where the data does
    raw_model, optimizer = build_model(cfg, env, model_args, init)
    prog = start_or_resume(cfg, env, data, raw_model, optimizer, model_args)
    if init is not None and init.optimizer is not None:  # init_continue: the source run's position
        check_data_meta(data.meta, model_args, init.meta.get("data_meta"))
        prog = progress_of(init.meta)
        prog.best_val_loss = float("inf")  # another model from here on
    del init  # the model holds those weights now
    resumed_at = prog.iter_num if cfg["init_from"] == "resume" else None
    model = wrap_model(raw_model, cfg, env)
    runlog = RunLog(cfg, env, resumed_at)
    stop = StopSignals(announce=env.master, under_torchrun="TORCHELASTIC_RUN_ID" in os.environ)
    T = cfg["block_size"]
    t_start, last_eval, oom, dt_avg = time.time(), resumed_at, False, None

    def settle(res, force_log=False):
        """Take in a queued step's outcome: count a skipped step (aborting after max_bad_steps in a
        row), log it, and say whether some rank asked to stop."""
        nonlocal dt_avg
        loss, grad_norm, bad, stopping, dt = res.read()
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


# -----------------------------------------------------------------------------------------------
# data: uint16 memmaps, a deterministic and resumable order

@dataclass
class Data:
    paths: dict         # split -> .bin path
    meta: dict          # the dataset's meta.json (tokenizer, vocab, counts)
    n_train: int        # tokens
    n_val: int
    order: "DataOrder"


def load_data(cfg, env, model_args):
    """The dataset's bins and meta.json, checked against the model (train_aids.check_data); the
    demo dataset is built when it is missing."""
    d = os.path.join(cfg["data_dir"], cfg["dataset"])
    if cfg["dataset"] == DEMO_DATASET:
        ready = all(os.path.isfile(os.path.join(d, f)) for f in ("train.bin", "val.bin", "meta.json"))
        if env.master and not ready:
            prepare_demo_data(d)
        if env.ddp:
            dist.barrier()  # every rank, whatever it saw: the others wait for rank 0's files
    paths = {s: os.path.join(d, f"{s}.bin") for s in ("train", "val")}
    meta = check_data(paths, os.path.join(d, "meta.json"), cfg, model_args, env.log)
    n_train, n_val = (os.path.getsize(paths[s]) // 2 for s in ("train", "val"))
    order_seed = cfg["data_seed"] if cfg["data_seed"] >= 0 else cfg["seed"]
    return Data(paths, meta, n_train, n_val, DataOrder(n_train, cfg["block_size"], order_seed))


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


def progress_of(ckpt):
    """The Progress a checkpoint records (its keys; a key it lacks keeps its default)."""
    return Progress(**{k: ckpt[k] for k in asdict(Progress()) if k in ckpt})


def build_model(cfg, env, model_args, init=None):
    """The model (on its device, sharded under FSDP; `init`: a warm_start.Init, the weights to start
    from) and AdamW."""
    torch.manual_seed(cfg["seed"])  # same initial weights on every rank
    try:
        raw_model = Model(ModelConfig(**model_args), backend=cfg["backend"], chunk_size=cfg["chunk_size"])
    except (ValueError, TypeError) as e:
        raise UserError(str(e))
    # upcycling takes the fresh solver tensors, before the model moves or is sharded
    state = start_state(init, raw_model.state_dict(), env.log) if init is not None else None
    raw_model = raw_model.to(env.device)
    raw_model.activation_checkpointing = cfg["activation_checkpointing"]
    raw_model.recompute_solver = cfg["recompute_solver"]
    raw_model.fused_chain = cfg["fused_chain"]
    if env.fsdp:
        shard_model(raw_model, env)
    optimizer = raw_model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"],
                                               (cfg["beta1"], cfg["beta2"]))
    if init is not None:
        if env.fsdp:
            load_full_into_sharded(raw_model, None, {"model": state})
        else:
            raw_model.load_state_dict(state)
        if init.optimizer is not None:  # init_continue
            carry_optimizer_state(optimizer, raw_model, init, env.log)
    return raw_model, optimizer


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
    changed = changed_keys(ckpt.get("config", {}), cfg, TRAIN_DEFAULTS)
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
    return progress_of(ckpt)


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
    began = StepResult.clock(env.device)
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
    return StepResult(prog.iter_num, prog.data_pos, lr,
                      torch.stack([flags[0] / env.world, grad_norm.float(), flags[1], flags[2]]), began)


class StepResult:
    """One queued step's loss, grad norm, skipped? and stop? on their way to the host: copied into
    pinned memory behind the step's kernels and read (`read()`) once the next step is queued, so
    the GPU never waits for the host at a step boundary (with a sync per step it idles while the
    host queues the next step's first kernels). With them comes the step's own time, from its
    start to its end where it ran: tokens/s is the step's, whatever the host did between steps."""

    @staticmethod
    def clock(device):
        """A step's start: a CUDA event in the stream (it fires once the work before it is done),
        elsewhere the host's clock."""
        if device.type != "cuda":
            return time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def __init__(self, iter_num, data_pos, lr, stats, began):
        self.iter_num, self.data_pos, self.lr, self.began, self.done = iter_num, data_pos, lr, began, None
        if stats.is_cuda:
            self.stats = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            self.stats.copy_(stats, non_blocking=True)
            self.done = torch.cuda.Event(enable_timing=True)
            self.done.record()
        else:  # on the CPU the step has run by now (tolist waits for any other device)
            self.stats = stats.tolist()
            self.seconds = time.perf_counter() - began

    def read(self):
        """(loss, grad norm, skipped, stop requested on some rank, the step's seconds); waits for
        this step alone."""
        stats = self.stats
        if self.done is not None:
            self.done.synchronize()
            stats, self.seconds = stats.tolist(), self.began.elapsed_time(self.done) / 1e3
        loss, grad_norm, bad, stop = stats
        return loss, grad_norm, bad > 0, stop > 0, self.seconds


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
# the command line

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
