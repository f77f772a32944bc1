"""
A fresh training run that starts from weights trained elsewhere (train.py --init_from=<source>):
a train.py checkpoint file, a directory written by export_hf.py, or a flash-linear-attention
GatedDeltaNetForCausalLM directory (fla_import.py), all read by checkpoint.load_model.

    init = init_weights_from(cfg, env, model_args)     # None for scratch / resume
    state = start_state(init, fresh_model.state_dict(), env.log)
    ... load state into the model, build AdamW ...
    carry_optimizer_state(optimizer, model, init, env.log)   # only with --init_continue=True

The source's architecture replaces the config's, except the keys that may change when
fine-tuning (FINETUNE_FREE_KEYS). A GDN source under a PRISM config is upcycled instead: the
config's PRISM keys (checkpoint.UPCYCLE_KEYS) stay, every GDN tensor is copied and the solver
starts with its gain at zero (checkpoint.upcycle_state), so the run starts at the GDN's loss.
--init_continue=True (a train.py checkpoint file only) also carries on the source run: its
iteration, data position and the AdamW state of every tensor it has.
"""
import os
from dataclasses import dataclass

from checkpoint import (UPCYCLE_KEYS, CheckpointError, check_upcycle_args, load_checkpoint, load_model,
                        upcycle_state)
from model import ModelConfig
from settings import MODEL_DEFAULTS, UserError
from train_aids import changed_keys

# architecture keys come from the weights; these may change when fine-tuning them
FINETUNE_FREE_KEYS = ("dropout", "block_size")


@dataclass
class Init:
    """Weights a fresh run starts from (--init_from=<checkpoint or directory>)."""
    state: dict       # model.py's state dict of the source
    source: str       # where it came from
    upcycle: bool     # GDN weights into a PRISM config (checkpoint.upcycle_state)
    meta: dict        # the source without its weights: iter_num, data_pos, data_meta, ... where it has them
    # init_continue: the source run's AdamW state and the parameter name of each index in that state
    optimizer: dict = None
    optimizer_names: list = None


def init_weights_from(cfg, env, model_args):
    """--init_from=<checkpoint file, export_hf.py directory or fla GatedDeltaNetForCausalLM directory>:
    start a fresh run (new optimizer, iteration 0) from those weights. Their architecture replaces
    the config's (updates model_args in place), except that a GDN source under a PRISM config is
    upcycled: the config's PRISM keys (UPCYCLE_KEYS) stay. Returns an Init, or None for scratch/resume."""
    src = cfg["init_from"]
    if src in ("scratch", "resume"):
        return None
    try:
        model, meta = load_model(src, "cpu", warn=env.log)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e))
    theirs = {**MODEL_DEFAULTS, **ModelConfig.from_dict(meta["model_args"]).__dict__}
    upcycle = theirs["mixer"] == "gdn" and model_args["mixer"] == "prism"
    keep = FINETUNE_FREE_KEYS + (UPCYCLE_KEYS if upcycle else ())
    changed = [f"{k}={theirs[k]!r} (config had {model_args[k]!r})"
               for k in changed_keys(theirs, model_args, model_args) if k not in keep]
    model_args.update({k: theirs[k] for k in model_args if k not in keep})
    if upcycle:
        try:
            check_upcycle_args(model_args)
        except ValueError as e:
            raise UserError(f"--init_from={src}: {e}")
    what = "upcycling the GDN" if upcycle else "initialising from"
    env.log(f"{what} {src}" + (f" (iter {meta['iter_num']})" if "iter_num" in meta else "")
            + (f" into PRISM (solver_steps={model_args['solver_steps']}, solver_rank={model_args['solver_rank']})"
               if upcycle else "")
            + (f"; its architecture replaces the config's: {', '.join(changed)}" if changed else ""))
    init = Init(model.state_dict(), src, upcycle, meta)
    if cfg["init_continue"]:
        continue_run_of(init, model, env)
    return init


def continue_run_of(init, model, env):
    """init_continue: fill in the source run's AdamW state (a train.py checkpoint file's), so that
    the run carries on from its iteration and data position (init.meta) with the moments of every
    tensor the source had."""
    src = init.source
    if env.fsdp:
        raise UserError("init_continue=True needs a run without FSDP (its AdamW state is carried by name)")
    if os.path.isdir(src) or any(k not in init.meta for k in ("iter_num", "data_pos")):
        raise UserError(f"init_continue=True: {src} is not a train.py checkpoint file (it records no "
                        f"iteration and data position to continue from)")
    try:
        ckpt = load_checkpoint(src, ("optimizer",), warn=env.log)
    except (FileNotFoundError, CheckpointError) as e:
        raise UserError(str(e))
    # the source's optimizer indexes its parameters in the order configure_optimizers groups them
    init.optimizer_names = param_names(model, model.configure_optimizers(0.0, 0.0, (0.9, 0.95)))
    init.optimizer = ckpt["optimizer"]


def start_state(init, fresh_state, log):
    """The state dict the new model loads: the source's weights, or, upcycling, those and the solver
    tensors of `fresh_state` (the new model as initialised, before it moves or is sharded)."""
    if not init.upcycle:
        return init.state
    try:
        state, new = upcycle_state(fresh_state, init.state, init.source)
    except ValueError as e:
        raise UserError(str(e))
    log(f"upcycled: {len(state) - len(new)} GDN tensors copied, {len(new)} solver tensors new; "
        f"gain_up = 0, so the solver writes are zero at step 0 (the GDN's logits) and learn from step 1")
    return state


def carry_optimizer_state(optimizer, raw_model, init, log):
    """The source's AdamW state (moments, step count) into `optimizer` for every parameter of the
    same name; the others (an upcycled PRISM's solver) start fresh."""
    order = param_names(raw_model, optimizer)
    theirs = {n: i for i, n in enumerate(init.optimizer_names)}
    src_state = init.optimizer["state"]
    state = {i: src_state[theirs[n]] for i, n in enumerate(order) if n in theirs and theirs[n] in src_state}
    sd = optimizer.state_dict()
    optimizer.load_state_dict({**sd, "state": state})
    log(f"continuing the run of {init.source} at iter {init.meta['iter_num']} (data position "
        f"{init.meta['data_pos']}); AdamW state carried for {len(state)} of {len(order)} tensors")


def param_names(model, optimizer):
    """The name of each parameter of `model` in `optimizer`'s index order (the order of its state)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
