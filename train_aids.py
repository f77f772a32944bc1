"""
What train.py's loop leans on but a reader of the loop can skip: the run's log (the console,
out_dir/log.jsonl, optional wandb / TensorBoard), the checks of the data it is given (and the
demo's data, built on first use), the stop signals, and the advice printed when something goes
wrong (non-finite steps, out of memory, a CPU too slow for the config).
"""
import gc
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch

from checkpoint import list_checkpoints
from fileio import atomic_write
from settings import MODEL_DEFAULTS, UserError

ROOT = os.path.dirname(os.path.abspath(__file__))


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
    """The step's line and record: tokens/s and MFU from dt, the step's own time (StepResult)."""
    T = cfg["block_size"]
    tokens_per_iter = cfg["batch_size"] * cfg["gradient_accumulation_steps"] * T
    # MFU against a GPU's peak means nothing on a CPU
    mfu = (raw_model.estimate_mfu(cfg["batch_size"] * cfg["gradient_accumulation_steps"] // env.world, dt)
           if env.device.type == "cuda" else None)
    eta = dt_avg * (cfg["max_iters"] - res.iter_num)
    env.log(f"iter {res.iter_num}: loss {loss:.4f}, lr {res.lr:.2e}, {tokens_per_iter / dt:,.0f} tok/s, "
            + (f"mfu {mfu * 100:.1f}%, " if mfu is not None else "")
            + f"grad {grad_norm:.3f}, eta {fmt_time(eta)}")
    runlog.write({"iter": res.iter_num, "loss": loss, "lr": res.lr, "tokens": res.data_pos * T,
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
# what a run is given, checked before the first step: its data (the demo's is built on first
# use) and the checkpoint it resumes

DEMO_DATASET = "pydoc"  # built on first use from the documentation inside every Python install


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


def check_data(paths, meta_path, cfg, model_args, log):
    """Refuse data a run cannot use, before the first step, saying which file, what is wrong and
    what to do: missing, odd-sized or too short bins, a meta.json that does not describe them, a
    vocab that differs from the model's, token ids beyond it. Returns meta.json ({} without one)."""
    again = f"Prepare the data again:\n  {prepare_hint(cfg['data_dir'], cfg['dataset'])}"
    for split, p in paths.items():
        if not os.path.isfile(p):
            raise UserError(f"{split} data not found: {p}\nPrepare it with:\n  "
                            f"{prepare_hint(cfg['data_dir'], cfg['dataset'])}")
        size = os.path.getsize(p)
        if size % 2:
            raise UserError(f"{p} is {size:,} bytes, not a whole number of 2-byte (uint16) tokens: cut "
                            f"short, or not written by data/prepare_slimpajama.py. {again}")
        if size // 2 < cfg["block_size"] + 1:
            raise UserError(f"{p} holds {size // 2} tokens, fewer than block_size+1 = {cfg['block_size'] + 1}; "
                            f"lower --block_size or prepare more data")
    meta = {}
    if os.path.isfile(meta_path):
        meta = read_meta(meta_path, paths, again)
    else:
        log(f"warning: {meta_path} missing; cannot check the tokenizer/vocab of the data")
    check_data_meta(meta, model_args)
    for split in ("train", "val"):  # once, here: on CUDA a bad id is an unexplained device assert
        data = np.memmap(paths[split], dtype=np.uint16, mode="r")
        top = max(int(data[i:i + 2**26].max()) for i in range(0, len(data), 2**26))
        if top >= model_args["vocab_size"]:
            raise UserError(f"{paths[split]} holds token id {top} >= vocab_size {model_args['vocab_size']}: "
                            f"data from another tokenizer? Prepare it with the model's, or set --vocab_size")
    return meta


def read_meta(path, paths, again):
    """meta.json as data/prepare_slimpajama.py writes it, checked against the bins beside it."""
    try:
        with open(path) as f:
            meta = json.load(f)
    except ValueError as e:  # not JSON, or not UTF-8
        raise UserError(f"{path} is not valid JSON ({e}). {again}")
    if not isinstance(meta, dict):
        raise UserError(f"{path} holds a JSON {type(meta).__name__}, not the object of keys that "
                        f"data/prepare_slimpajama.py writes. {again}")
    problems = [f"'{k}' is missing" for k in ("vocab_size",) if k not in meta]
    problems += [f"'{k}' is {meta[k]!r}, not a whole number" for k in ("vocab_size", "eos_id", "train_tokens",
                 "val_tokens") if k in meta and (not isinstance(meta[k], int) or isinstance(meta[k], bool))]
    if meta.get("dtype", "uint16") != "uint16":
        problems.append(f"'dtype' is {meta['dtype']!r}; train.py reads uint16 token ids")
    if not problems:
        for split, p in paths.items():
            n, said = os.path.getsize(p) // 2, meta.get(f"{split}_tokens")
            if said is not None and said != n:
                problems.append(f"'{split}_tokens' is {said:,}, but {p} holds {n:,} tokens "
                                f"(files from different preparations, or one cut short)")
        if meta.get("eos_id") is not None and not 0 <= meta["eos_id"] < meta["vocab_size"]:
            problems.append(f"'eos_id' {meta['eos_id']} is outside the vocab (vocab_size {meta['vocab_size']})")
    if problems:
        raise UserError(f"{path} does not describe this data:\n  " + "\n  ".join(problems) + f"\n{again}")
    return meta


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
        todo = ("Use the data the checkpoint was trained on, or a new out_dir" if ckpt_meta else
                f"Set --vocab_size={meta['vocab_size']} (the data's), or prepare the data with the model's tokenizer")
        raise UserError("the data does not match the model:\n  " + "\n  ".join(problems) + f"\n{todo}")


def data_eos_id(meta, model_args):
    """reset_at_eos cuts at the data's EOS: meta.json's eos_id, unless the config names another."""
    eos, ours = meta.get("eos_id"), model_args["eos_id"]
    if not model_args["reset_at_eos"] or eos is None or eos == ours:
        return ours
    if ours != MODEL_DEFAULTS["eos_id"]:
        raise UserError(f"reset_at_eos: meta.json has eos_id {eos}, the config eos_id {ours}; "
                        f"drop --eos_id or set --eos_id={eos}")
    return eos


def check_resume_model_args(ckpt_args, model_args):
    # a key the checkpoint lacks is newer than it: the checkpoint ran with its default
    ckpt_args = {**MODEL_DEFAULTS, **ckpt_args}
    diff = [f"{k} (checkpoint {ckpt_args[k]!r}, now {model_args[k]!r})"
            for k in changed_keys(ckpt_args, model_args, model_args)]
    if diff:
        raise UserError("cannot resume: the model config differs from the checkpoint's in "
                        + ", ".join(diff) + ". Use the checkpoint's values or a new out_dir.")


def changed_keys(old, new, keys):
    """Those of `keys` in both dicts whose values differ (a checkpoint holds a tuple as a list)."""
    norm = lambda v: list(v) if isinstance(v, (list, tuple)) else v  # noqa: E731
    return [k for k in keys if k in old and k in new and norm(old[k]) != norm(new[k])]


# -----------------------------------------------------------------------------------------------
# stop signals

class StopNow(BaseException):
    """A second stop signal: leave at once, saving nothing (BaseException: no `except Exception`
    on the way out may swallow it)."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGTERM / SIGINT. The first asks for a checkpoint after the current step (the loop reads
    `requested` once a step; under DDP the ranks agree through the next step's flags, one step
    later) and says so at once; a second, of either kind, stops at once without saving.
    Under torchrun alone, a repeat within ECHO_S seconds is the first one again: its agent passes
    every signal it gets on to the workers, so a job scheduler (SLURM) that signals the whole job
    reaches each worker twice, directly and through the agent."""
    ECHO_S = 1.0

    def __init__(self, announce, under_torchrun=False):
        self.name, self.at, self.announce, self.old = None, 0.0, announce, {}
        self.echo_s = self.ECHO_S if under_torchrun else 0.0

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
                            f"a second SIGINT or SIGTERM stops at once without saving\n".encode())
        elif time.monotonic() - self.at >= self.echo_s:
            raise StopNow(signum)


# -----------------------------------------------------------------------------------------------
# faults: non-finite steps, out of memory, a CPU too slow for the config

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
