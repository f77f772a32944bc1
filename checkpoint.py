"""
Checkpoints: the one place that writes, verifies and reads them (written atomically through
fileio.py: a crash leaves the old file or the new one).

save_checkpoint(out_dir, ...)  out_dir/ckpt_<iter>.pt with its sha256 in ckpt_<iter>.pt.sha256,
                               ckpt.pt -> the newest, older ones rotated away
load_checkpoint(path)          the dict, checked against the sha256 beside it
load_latest_checkpoint(dir)    the newest checkpoint that loads; the ones that do not are moved aside
load_model(path)               an eval-mode Model from a checkpoint, an export_hf.py directory or an
                               fla GatedDeltaNetForCausalLM directory (fla_import.py)
read_exported(path)            an export_hf.py directory as a checkpoint dict (what load_model reads)
rng_state / set_rng_state      every random stream a training step draws from

Sharded checkpoints (train.py --fsdp=True) are directories, written by every rank at once through
torch.distributed.checkpoint (DCP), never gathered on one:
save_sharded(out_dir, ...)     out_dir/ckpt_<iter>/: each rank's shards, DCP's .metadata,
                               train_state.pt (everything but the tensors) and a sha256 manifest;
                               written as ckpt_<iter>.tmp/ and renamed when complete
load_sharded(path, model, opt) weights and optimizer state into a model of any world size (DCP
                               reshards), sharded or not
consolidate(path, out)         one single-file checkpoint, as save_checkpoint writes, from a
                               sharded one:  python checkpoint.py consolidate out/x/ckpt_0000500 out/x/ckpt.pt
They are listed, verified, rotated and moved aside like the files.

A checkpoint that fails verification is renamed to *.corrupt (its digest to *.sha256.corrupt): it is
never resumed from again and never counted as one of the kept checkpoints. Rotation deletes only
checkpoints older than the newest verified one, so a good checkpoint is always left.

torch is imported inside the functions that need it: listing, verifying and rotating checkpoints
need only the standard library.
"""
import dataclasses
import glob
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys

from fileio import atomic_write, fsync_dir, sha256_file

CKPT_RE = re.compile(r"ckpt_(\d+)\.pt$")
SHARDED_RE = re.compile(r"ckpt_(\d+)$")  # a directory: a sharded checkpoint
MANIFEST = "sha256"                      # in a sharded checkpoint: "<hex>  <file>" lines (sha256sum -c)
TRAIN_STATE = "train_state.pt"           # in a sharded checkpoint: the dict without the tensors
LINK = "ckpt.pt"  # -> the newest checkpoint in out_dir


class CheckpointError(ValueError):
    """A checkpoint that cannot be used. The message names the file and says why."""

    def __init__(self, path, why):
        super().__init__(f"checkpoint {path}: {why}")
        self.path, self.why = path, why


def _stderr(msg):
    print(msg, file=sys.stderr)


# -----------------------------------------------------------------------------------------------
# digests

def digest_path(path):
    """Where the sha256 of a checkpoint lives (for ckpt.pt: beside the file it links to)."""
    return os.path.realpath(path) + ".sha256"


def verify(path, full=True):
    """True if the sha256 beside path matches the file, None if there is no digest to check.
    Raises CheckpointError if it does not match. A sharded checkpoint (a directory) is checked
    against its manifest (full=False: only that every file it lists is there)."""
    if os.path.isdir(path):
        return verify_sharded(path, full)
    dp = digest_path(path)
    if not os.path.isfile(dp):
        return None
    with open(dp) as f:
        want = (f.read().split() or [""])[0]  # sha256sum's format ("<hex>  <name>") reads too
    if sha256_file(path) != want:
        raise CheckpointError(path, "sha256 does not match the digest written with it (truncated or corrupt)")
    return True


# -----------------------------------------------------------------------------------------------
# the checkpoints of a run

def checkpoint_path(out_dir, iter_num):
    return os.path.join(out_dir, f"ckpt_{iter_num:07d}.pt")


def list_checkpoints(out_dir):
    """ckpt_<iter>.pt files and ckpt_<iter>/ sharded directories in out_dir, newest first
    (moved-aside *.corrupt ones and unfinished *.tmp directories are not listed)."""
    found = []
    for p in glob.glob(os.path.join(glob.escape(str(out_dir)), "ckpt_*")):
        name = os.path.basename(p)
        m = CKPT_RE.search(name) if os.path.isfile(p) else SHARDED_RE.fullmatch(name) if os.path.isdir(p) else None
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def _link_latest(out_dir, path):
    """out_dir/ckpt.pt -> path (a relative symlink, replaced atomically); skipped where the
    filesystem has no symlinks, and for a sharded checkpoint (readers of ckpt.pt want one file)."""
    if os.path.isdir(path):
        return
    link = os.path.join(out_dir, LINK)
    tmp = link + ".tmp"
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(os.path.basename(path), tmp)
        os.replace(tmp, link)
    except OSError:
        pass


def move_aside(path):
    """Rename an unusable checkpoint (and its digest) to *.corrupt, out of every later listing.
    Returns the new path."""
    dest = path + ".corrupt"
    dp = digest_path(path)
    os.replace(path, dest)
    if os.path.exists(dp):
        os.replace(dp, dp + ".corrupt")
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return dest


def save_checkpoint(out_dir, ckpt, keep, log=_stderr):
    """Write ckpt_<iter>.pt and its .sha256 atomically, point ckpt.pt at it, then rotate: keep the
    newest `keep` checkpoints, deleting only ones older than the newest verified checkpoint.
    Returns the path written."""
    import torch
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    data = buf.getbuffer()
    path = checkpoint_path(out_dir, ckpt["iter_num"])
    atomic_write(path, data)
    atomic_write(path + ".sha256", hashlib.sha256(data).hexdigest() + "\n")
    del data, buf
    _link_latest(out_dir, path)
    rotate(out_dir, keep, log)
    return path


def rotate(out_dir, keep, log=_stderr):
    """Delete all but the newest `keep` checkpoints, never the newest verified one or anything
    newer. Checkpoints newer than it that fail verification are moved aside (not counted); newer
    ones without a digest are kept and counted. The file just written is read back to verify it."""
    listed, good, moved = [], None, False  # good: index in `listed` of the newest verified one
    for p in list_checkpoints(out_dir):
        if good is None:
            try:  # a sharded checkpoint was read back and hashed by every rank as it was saved
                if verify(p, full=False):
                    good = len(listed)
            except CheckpointError as e:
                log(f"warning: {e}; moved it to {move_aside(p)}")
                moved = True
                continue
        listed.append(p)
    if good is None:
        return  # nothing verified: delete nothing
    if moved:
        _link_latest(out_dir, listed[0])  # ckpt.pt may have pointed at a moved file
    for p in listed[max(keep, 1, good + 1):]:
        if os.path.isdir(p):
            shutil.rmtree(p)
            continue
        for f in (p, digest_path(p)):
            if os.path.exists(f):
                os.remove(f)


def load_checkpoint(path, keys=("model", "model_args"), warn=_stderr):
    """A checkpoint dict, read with torch.load(weights_only=True) (tensors and plain Python values:
    nothing needs arbitrary unpickling). Checked against the sha256 beside it; a file with no
    digest loads with a warning that it was not verified. Raises FileNotFoundError or
    CheckpointError (a ValueError) saying why the file is unusable."""
    import torch
    if is_sharded(path):
        raise CheckpointError(path, "is a sharded checkpoint (train.py --fsdp=True); make one file of it with\n"
                                    f"  python checkpoint.py consolidate {path} {path}.pt")
    if not os.path.isfile(path):
        sharded = [p for p in list_checkpoints(os.path.dirname(path) or ".") if os.path.isdir(p)]
        hint = (f"; {os.path.dirname(path) or '.'} holds sharded checkpoints: make one file of the newest with\n"
                f"  python checkpoint.py consolidate {sharded[0]} {path}") if sharded else ""
        raise FileNotFoundError(f"checkpoint not found: {path}{hint}")
    if verify(path) is None:
        warn(f"warning: {path} has no sha256 beside it ({digest_path(path)}): loaded without verification")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, wrong file, or a type weights_only refuses
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise CheckpointError(path, f"cannot be read as a torch checkpoint ({type(e).__name__}: {first}); "
                                    "is the file corrupt or truncated?")
    if not isinstance(ckpt, dict) or any(k not in ckpt for k in keys):
        have = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(path, f"expected a dict with keys {list(keys)}, got {have}")
    return ckpt


def load_latest_checkpoint(out_dir, keys=("model", "model_args"), log=_stderr, move=True):
    """(path, ckpt) of the newest checkpoint in out_dir that loads. Each one that does not is
    reported and, with move=True, moved aside (in DDP only rank 0 moves files; the other ranks
    read the same files and skip the same ones). Raises CheckpointError if none loads."""
    paths = list_checkpoints(out_dir)
    moved = False  # then ckpt.pt may point at a moved file: point it at the one that loads
    for i, p in enumerate(paths):
        try:
            ckpt = load_sharded_state(p, keys) if os.path.isdir(p) else load_checkpoint(p, keys, warn=log)
        except FileNotFoundError:
            continue  # moved aside by rank 0 since we listed it
        except CheckpointError as e:
            nxt = paths[i + 1] if i + 1 < len(paths) else None
            where = f"; moved it to {move_aside(p)}" if move else ""
            moved |= move
            log(f"warning: checkpoint {p} is unusable ({e.why}){where}; "
                + (f"falling back to {nxt}" if nxt else "no older checkpoint left"))
            continue
        if moved:
            _link_latest(out_dir, p)
        return p, ckpt
    raise CheckpointError(out_dir, f"no usable checkpoint (ckpt_*.pt) among {len(paths)}")


# -----------------------------------------------------------------------------------------------
# sharded checkpoints (FSDP): one directory, written and read by every rank through DCP

def sharded_path(out_dir, iter_num):
    return os.path.join(out_dir, f"ckpt_{iter_num:07d}")


def is_sharded(path):
    return os.path.isfile(os.path.join(path, TRAIN_STATE))


def _dist():
    """(rank, world) of the process group, or (0, 1) without one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj):
    """obj from every rank (a list), without a process group [obj]."""
    import torch.distributed as dist
    rank, world = _dist()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _barrier():
    import torch.distributed as dist
    if _dist()[1] > 1:
        dist.barrier()


def _hash_files(d, names):
    """sha256 of names, the ranks splitting the reading; every rank gets all of them."""
    rank, world = _dist()
    mine = {n: sha256_file(os.path.join(d, n)) for n in names[rank::world]}
    return {n: h for part in _gather(mine) for n, h in part.items()}


def save_sharded(out_dir, model, optimizer, state, keep, log=_stderr):
    """Every rank calls this. Writes out_dir/ckpt_<iter>/ through DCP (each rank its own shards of
    the weights and AdamW state), rank 0 adds `state` (the checkpoint dict without model and
    optimizer: iteration, data position, config, every rank's RNG state) and a manifest of sha256
    digests that the ranks compute by reading the files back. The directory is written as
    ckpt_<iter>.tmp/ and renamed once complete, then rotated as save_checkpoint's files are.
    Returns the path."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    rank, _ = _dist()
    path = sharded_path(out_dir, state["iter_num"])
    tmp = path + ".tmp"
    if rank == 0:
        for old in glob.glob(os.path.join(glob.escape(str(out_dir)), "ckpt_*.tmp")):
            shutil.rmtree(old, ignore_errors=True)  # what a save killed midway left
    _barrier()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp)  # rank 0 writes DCP's .metadata
    if rank == 0:
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write(os.path.join(tmp, TRAIN_STATE), buf.getbuffer())
    _barrier()
    names = sorted(os.listdir(tmp))
    digests = _hash_files(tmp, names)
    if rank == 0:
        atomic_write(os.path.join(tmp, MANIFEST), "".join(f"{digests[n]}  {n}\n" for n in names))
        if os.path.isdir(path):
            shutil.rmtree(path)  # a second save at the same iteration replaces the first
        os.replace(tmp, path)
        fsync_dir(out_dir)
        rotate(out_dir, keep, log)
    _barrier()
    return path


def verify_sharded(path, full=True):
    """True if every file the manifest of a sharded checkpoint lists is there and (full=True) has
    its digest; with a process group the ranks split the reading. Raises CheckpointError."""
    mf = os.path.join(path, MANIFEST)
    if not os.path.isfile(mf):
        raise CheckpointError(path, f"has no {MANIFEST} manifest (not a complete sharded checkpoint)")
    with open(mf) as f:
        want = {name: digest for digest, name in (line.split(None, 1) for line in f.read().splitlines() if line.strip())}
    missing = sorted(n for n in {*want, TRAIN_STATE, ".metadata"} if not os.path.isfile(os.path.join(path, n)))
    if missing:
        raise CheckpointError(path, f"lacks {missing[:3]} (truncated or damaged)")
    if full:
        bad = [n for n, h in _hash_files(path, sorted(want)).items() if h != want[n]]
        if bad:
            raise CheckpointError(path, f"sha256 of {bad[:3]} does not match the manifest written with it (corrupt)")
    return True


def load_sharded_state(path, keys=("model_args",)):
    """The checkpoint dict of a sharded checkpoint without its tensors, after checking every file
    against the manifest. `keys`: what it must hold ('model' and 'optimizer' are in the shards)."""
    import torch
    verify_sharded(path)
    try:
        state = torch.load(os.path.join(path, TRAIN_STATE), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(path, f"{TRAIN_STATE} cannot be read ({type(e).__name__}: {str(e)[:200]})")
    missing = [k for k in keys if k not in state and k not in ("model", "optimizer")]
    if missing:
        raise CheckpointError(path, f"{TRAIN_STATE} lacks keys {missing}")
    return state


def load_sharded(path, model, optimizer):
    """Weights and AdamW state of a sharded checkpoint into `model` and its optimizer. The model
    may be sharded with fully_shard over any number of ranks (DCP reads what each rank's shards
    need: resharding) or be a plain module; every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optimizer)
    sd = {"model": msd, "optimizer": osd}
    import warnings
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*load in a single process")
        dcp.load(sd, checkpoint_id=path, no_dist=not _in_process_group())
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])


def load_full_into_sharded(model, optimizer, ckpt):
    """A single-file checkpoint (save_checkpoint's) into a model sharded with fully_shard: each
    rank keeps its shards of the full tensors. The optimizer state, keyed by parameter index in
    the file, is re-keyed by parameter name, which is how DCP's state-dict functions address it.
    optimizer=None: the weights alone."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict
    if optimizer is None:
        set_model_state_dict(model, ckpt["model"], options=StateDictOptions(full_state_dict=True))
        return
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    osd = ckpt["optimizer"]
    by_name = {"state": {order[i]: s for i, s in osd["state"].items()},
               "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=by_name,
                   options=StateDictOptions(full_state_dict=True))


def _in_process_group():
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def consolidate(src, dst, log=_stderr):
    """A sharded checkpoint as one file in save_checkpoint's format (weights, AdamW state, iteration,
    config, RNG): what sample.py, eval/ and the HF export read, and what a run without FSDP resumes
    from. Reads every shard into this one process (16 bytes per weight of CPU memory). Written
    atomically with its sha256 beside it. Returns dst."""
    import torch
    from model import Model, ModelConfig
    if not is_sharded(src):
        raise CheckpointError(src, "is not a sharded checkpoint (a ckpt_<iter>/ directory that train.py "
                                   "--fsdp=True wrote)")
    state = load_sharded_state(src, ("model_args", "config", "iter_num"))
    try:
        model = Model(ModelConfig.from_dict(dict(state["model_args"])))
    except (TypeError, ValueError) as e:
        raise CheckpointError(src, f"model_args do not fit this model.py: {e}")
    c = state["config"]
    optimizer = model.configure_optimizers(c["weight_decay"], c["learning_rate"], (c["beta1"], c["beta2"]))
    load_sharded(src, model, optimizer)
    buf = io.BytesIO()
    torch.save({**state, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
    data = buf.getbuffer()
    if os.path.islink(dst):
        os.remove(dst)  # e.g. ckpt.pt -> the newest file of an earlier run: replace the link, not its target
    atomic_write(dst, data)
    atomic_write(digest_path(dst), hashlib.sha256(data).hexdigest() + "\n")
    log(f"{src} (iter {state['iter_num']}, {model.num_params(non_embedding=False) / 1e6:.2f}M weights) -> {dst}")
    return dst


# -----------------------------------------------------------------------------------------------
# random state

def rng_state(device):
    """Python, NumPy, torch (and CUDA on a CUDA device) generator states, as checkpointable values."""
    import numpy as np
    import torch
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    import numpy as np
    import torch
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# -----------------------------------------------------------------------------------------------
# a model from a checkpoint

def load_model(path, device="cpu", backend=None, warn=_stderr):
    """An eval-mode Model on `device` from a checkpoint written by train.py (or any dict with
    'model' and 'model_args'), from a directory written by export_hf.py, or from one of
    flash-linear-attention's GatedDeltaNetForCausalLM directories (fla_import.py). Strips the
    '_orig_mod.' (torch.compile) and 'module.' (DDP) prefixes, checks names, shapes and that every
    float tensor is finite. `backend` picks the recurrence backend (None: Triton on CUDA, else
    chunk). Returns (model, meta): meta is the checkpoint without the weights and the optimizer
    state."""
    import torch
    from model import Model, ModelConfig
    from fla_import import is_fla_dir, read_fla
    if os.path.isdir(path) and is_fla_dir(path):  # flash-linear-attention's GatedDeltaNetForCausalLM
        ckpt = read_fla(path)
    elif os.path.isdir(path) and not is_sharded(path):  # a transformers directory written by export_hf.py
        ckpt = read_exported(path)
    else:
        ckpt = load_checkpoint(path, ("model", "model_args"), warn)
    try:
        config = ModelConfig.from_dict(dict(ckpt["model_args"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(path, f"model_args do not fit this model.py: {e}")

    state = {}
    for k, v in ckpt["model"].items():
        for prefix in ("_orig_mod.", "module."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        state[k] = v
    model = Model(config, backend=backend)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        more = lambda ks: f"{ks[:5]}{'...' if len(ks) > 5 else ''}"
        raise CheckpointError(path, f"weights do not match model_args: missing {more(missing)}, "
                                    f"unexpected {more(unexpected)}")
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise CheckpointError(path, f"tensor {k} has shape {tuple(v.shape)}, "
                                        f"model_args imply {tuple(expected[k].shape)}")
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise CheckpointError(path, f"tensor {k} contains NaN or Inf")
    model.load_state_dict(state)
    model.eval().to(device)
    meta = {k: v for k, v in ckpt.items() if k not in ("model", "optimizer")}
    return model, meta


# the PRISM config keys an upcycled run takes from its own config; every other key is the GDN's
UPCYCLE_KEYS = ("mixer", "solver_steps", "solver_rank", "solver_nonlinear", "solver_anchor", "solver_gain",
                "solver_keys", "solver_mode", "anchor_conv_size")


def check_upcycle_args(args):
    """Raise ValueError unless a PRISM of these model args can start exactly where its GDN is.
    Algorithm 1's step is delta = GELU(p * r) with the gain p = gain_up(.): gain_up = 0 makes
    every extra write zero (GELU(0) = 0) while its gradient, GELU'(0) r = r / 2 times the write's
    gradient, is not. With solver_gain=False (p = 1) or the linear mode (sigmoid(p) r) no
    parameter turns the write off and still learns."""
    problems = [f"{k}={args[k]!r} (upcycling needs {want!r})" for k, want in
                (("mixer", "prism"), ("solver_gain", True), ("solver_mode", "gelu")) if args[k] != want]
    if args["solver_steps"] < 2:
        problems.append(f"solver_steps={args['solver_steps']} (PRISM with L = 1 is GDN: nothing to add; use >= 2)")
    if problems:
        raise ValueError("cannot upcycle GDN into this PRISM config: " + "; ".join(problems))


def upcycle_state(prism_state, gdn_state, where="the GDN checkpoint"):
    """The state dict that starts a PRISM model where a GDN model is: every GDN tensor copied, the
    solver's new tensors as `prism_state` (a freshly initialised PRISM of the same architecture)
    has them, except gain_up, zeroed (check_upcycle_args says why). Returns (state, new): `new` names
    the solver tensors. Raises ValueError naming the tensors that do not fit."""
    import torch
    extra = sorted(set(gdn_state) - set(prism_state))
    if extra:
        raise ValueError(f"{where}: tensors {extra[:5]} have no place in the PRISM model (not a GDN checkpoint?)")
    state, new = {}, []
    for k, v in prism_state.items():
        if k in gdn_state:
            if gdn_state[k].shape != v.shape:
                raise ValueError(f"{where}: tensor {k} has shape {tuple(gdn_state[k].shape)}, the PRISM "
                                 f"model needs {tuple(v.shape)}")
            state[k] = gdn_state[k]
            continue
        if ".mixer." not in k:
            raise ValueError(f"{where}: lacks tensor {k}, which is not one of PRISM's solver tensors")
        new.append(k)
        state[k] = torch.zeros_like(v) if ".gain_up." in k else v
    if not any(".gain_up." in k for k in new):
        raise ValueError(f"{where}: the PRISM model has no gain_up tensors to zero (solver_gain=False?)")
    return state, new


# = hf_modeling.MODEL_TYPE (that file imports transformers; this one need not)
MODEL_TYPE = "prism_lm"


def read_exported(path):
    """An exported directory as a checkpoint dict ({"model": state dict in model.py's names,
    "model_args", "data_meta"}), for load_model. Needs safetensors, not transformers. Raises
    FileNotFoundError, or ValueError naming the file and saying why it is unusable."""
    from model import ModelConfig
    from pretrained_dir import read_config, read_weights

    cfg_path, cfg = read_config(path, f"{path} is not a directory written by export_hf.py")
    if not isinstance(cfg, dict) or cfg.get("model_type") != MODEL_TYPE:
        got = cfg.get("model_type") if isinstance(cfg, dict) else type(cfg).__name__
        raise ValueError(f"{cfg_path}: model_type is {got!r}, expected {MODEL_TYPE!r} "
                         "(a directory written by export_hf.py)")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    args = {k: v for k, v in cfg.items() if k in names}
    try:
        args = dataclasses.asdict(ModelConfig.from_dict(args))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cfg_path}: does not describe a model.py model: {e}")

    state = {}
    for wpath, shard in read_weights(path, "export"):
        for k, v in shard.items():
            if not k.startswith("model."):
                raise ValueError(f"{wpath}: tensor {k!r} is not one of PrismForCausalLM's (model.*)")
            state[k[len("model."):]] = v
    if args["tie_embeddings"] and "lm_head.weight" not in state and "wte.weight" in state:
        state["lm_head.weight"] = state["wte.weight"]  # stored once

    tok_json = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tok_json):
        with open(tok_json, encoding="utf-8") as f:
            t = json.load(f)
        ids = list(t.get("model", {}).get("vocab", {}).values()) + [a["id"] for a in t.get("added_tokens", [])]
        if ids and max(ids) >= args["vocab_size"]:
            raise ValueError(f"{tok_json}: token id {max(ids)} does not fit the model's vocab_size "
                             f"{args['vocab_size']}")
    prov = cfg.get("prism_export") or {}
    data_meta = {k: prov[k] for k in ("tokenizer", "tokenizer_sha256", "vocab_size", "eos_id") if k in prov}
    return {"model": state, "model_args": args, "data_meta": data_meta, "exported_from": prov}


USAGE = """usage: python checkpoint.py consolidate SHARDED_DIR OUT_FILE
  SHARDED_DIR  a sharded checkpoint written by train.py --fsdp=True, e.g. out/prism_1b3/ckpt_0005000
  OUT_FILE     the single-file checkpoint to write, e.g. out/prism_1b3/ckpt.pt (what sample.py,
               eval/ and the HF export read, and what a run without FSDP resumes from)"""


def main(argv):
    if len(argv) != 3 or argv[0] != "consolidate":
        print(USAGE, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        consolidate(argv[1], argv[2], log=print)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
