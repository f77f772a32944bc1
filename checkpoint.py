"""
Files that must survive a crash, and checkpoints: the one place that writes, verifies and reads them.

atomic_write(path, data)       temporary file in the same directory, fsync, rename over the target,
                               fsync the directory: a crash leaves the old file or the new one
save_checkpoint(out_dir, ...)  out_dir/ckpt_<iter>.pt with its sha256 in ckpt_<iter>.pt.sha256,
                               ckpt.pt -> the newest, older ones rotated away
load_checkpoint(path)          the dict, checked against the sha256 beside it
load_latest_checkpoint(dir)    the newest checkpoint that loads; the ones that do not are moved aside
load_model(path)               an eval-mode Model from a checkpoint or an export_hf.py directory
rng_state / set_rng_state      every random stream a training step draws from

A checkpoint that fails verification is renamed to *.corrupt (its digest to *.sha256.corrupt): it is
never resumed from again and never counted as one of the kept checkpoints. Rotation deletes only
checkpoints older than the newest verified one, so a good checkpoint is always left.

torch is imported inside the functions that need it: data preparation's spawned workers import
this module, and they must not pay for torch.
"""
import glob
import hashlib
import io
import os
import random
import re
import sys

CKPT_RE = re.compile(r"ckpt_(\d+)\.pt$")
LINK = "ckpt.pt"  # -> the newest checkpoint in out_dir


class CheckpointError(ValueError):
    """A checkpoint that cannot be used. The message names the file and says why."""

    def __init__(self, path, why):
        super().__init__(f"checkpoint {path}: {why}")
        self.path, self.why = path, why


def _stderr(msg):
    print(msg, file=sys.stderr)


# -----------------------------------------------------------------------------------------------
# atomic files

def fsync_dir(d):
    """Make a rename in directory d durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(d or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, data):
    """Write bytes (or str, as UTF-8) to path so that a crash leaves either the old file or the new
    one. The temporary file sits beside the target (a rename across filesystems is not atomic)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, or a second Ctrl-C mid-write: leave no temp file behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(d)


# -----------------------------------------------------------------------------------------------
# digests

def digest_path(path):
    """Where the sha256 of a checkpoint lives (for ckpt.pt: beside the file it links to)."""
    return os.path.realpath(path) + ".sha256"


def sha256_file(path, chunk=1 << 24):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify(path):
    """True if the sha256 beside path matches the file, None if there is no digest to check.
    Raises CheckpointError if it does not match."""
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
    """ckpt_<iter>.pt paths in out_dir, newest first (moved-aside *.corrupt files are not listed)."""
    found = []
    for p in glob.glob(os.path.join(glob.escape(str(out_dir)), "ckpt_*.pt")):
        m = CKPT_RE.search(os.path.basename(p))
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def _link_latest(out_dir, path):
    """out_dir/ckpt.pt -> path (a relative symlink, replaced atomically); skipped where the
    filesystem has no symlinks."""
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
            try:
                if verify(p):
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
        for f in (p, digest_path(p)):
            if os.path.exists(f):
                os.remove(f)


def load_checkpoint(path, keys=("model", "model_args"), warn=_stderr):
    """A checkpoint dict, read with torch.load(weights_only=True) (tensors and plain Python values:
    nothing needs arbitrary unpickling). Checked against the sha256 beside it; a file with no
    digest loads with a warning that it was not verified. Raises FileNotFoundError or
    CheckpointError (a ValueError) saying why the file is unusable."""
    import torch
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
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
            ckpt = load_checkpoint(p, keys, warn=log)
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
    'model' and 'model_args'), or from a directory written by export_hf.py. Strips the
    '_orig_mod.' (torch.compile) and 'module.' (DDP) prefixes, checks names, shapes and that every
    float tensor is finite. `backend` picks the recurrence backend (None: Triton on CUDA, else
    chunk). Returns (model, meta): meta is the checkpoint without the weights and the optimizer
    state."""
    import torch
    from model import Model, ModelConfig
    if os.path.isdir(path):  # a transformers directory written by export_hf.py
        from export_hf import read_exported
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
