"""
A transformers model directory (as save_pretrained writes it) read without transformers: its
config.json, the model_type that names, and its safetensors weights. The readers of the two kinds
of directory this repo takes in use it: checkpoint.read_exported (export_hf.py's) and
fla_import.read_fla (flash-linear-attention's). Needs json, and safetensors for the weights; it
imports nothing of this repo, so any module may import it.

read_config(path, missing)   (config.json's path, its content); errors name the file
config_model_type(path)      config.json's model_type, or None where there is no readable one
read_weights(path, what)     each weights file as (its path, {name: tensor}): model.safetensors,
                             or the shards model.safetensors.index.json names
"""
import json
import os


def read_config(path, missing):
    """(config.json's path, its parsed content) of directory `path`. Raises FileNotFoundError
    ("<file> not found: <missing>") or ValueError naming the file and why it is unreadable."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            return cfg_path, json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{cfg_path} not found: {missing}")
    except (OSError, ValueError) as e:
        raise ValueError(f"{cfg_path}: cannot be read as JSON ({e})")


def config_model_type(path):
    """The model_type that `path`'s config.json names; None when there is no such file, it is not
    JSON, or it names none."""
    try:
        cfg = read_config(path, "")[1]
    except (OSError, ValueError):
        return None
    return cfg.get("model_type") if isinstance(cfg, dict) else None


def read_weights(path, what):
    """Each safetensors file of directory `path` as (its path, {name: tensor}), in file-name order:
    model.safetensors, or the shards save_pretrained(max_shard_size=...) lists in its index. `what`
    names the directory in the error for a missing file ("the <what> in <path> is incomplete"),
    which says what to do where the weights are a pytorch_model.bin instead.
    Raises FileNotFoundError, or ValueError for a file that is not readable safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for name in files:
        wpath = os.path.join(path, name)
        if not os.path.isfile(wpath):
            hint = f" ({what}s saved as pytorch_model.bin: load and save_pretrained them once with " \
                   "safe_serialization=True)" if os.path.isfile(os.path.join(path, "pytorch_model.bin")) else ""
            raise FileNotFoundError(f"{wpath} not found: the {what} in {path} is incomplete{hint}")
        try:
            tensors = load_file(wpath)
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{wpath}: cannot be read as safetensors ({e}); is the file corrupt or truncated?")
        yield wpath, tensors
