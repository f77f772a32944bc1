"""
Training configuration: the train keys and their defaults, the model keys (ModelConfig's fields),
and the parser that train.py, bench.py and bench/bench_eval.py share.

Configuration = the defaults below, then each config file in order (plain Python assignments,
nanoGPT style), then --key=value. The comment beside each default is its meaning in
`python train.py --help`: there is no second list to keep in sync.
"""
import ast
import dataclasses
import difflib
import inspect
import os
import re

from model import BACKENDS, ModelConfig

# defaults: train keys (nanoGPT's names). One line each: the comment is the --help text.
TRAIN_DEFAULTS = dict(
    # I/O
    out_dir="out",                   # checkpoints and log.jsonl are written here
    dataset="slimpajama",            # <data_dir>/<dataset>/{train,val}.bin + meta.json; "pydoc": built on first use
    data_dir="data",                 # the folder that holds the datasets
    init_from="scratch",             # "scratch" | "resume" (newest good checkpoint in out_dir) | a checkpoint file, export_hf.py or fla GatedDeltaNet directory to start from (GDN weights under a PRISM config: upcycled)
    init_continue=False,             # with init_from=<train.py checkpoint file>: carry on its run (iteration, data position, AdamW state of the tensors it has) instead of starting at iteration 0
    eval_interval=250,               # val loss + checkpoint every this many iterations
    eval_iters=20,                   # val batches per evaluation
    log_interval=10,                 # a log line and a log.jsonl record every this many iterations
    always_save_checkpoint=True,     # False: save only when val loss improves
    keep_checkpoints=3,              # keep the last K checkpoint files
    save_checkpoints=True,           # False: write none (benchmarks and throw-away runs)
    # batch: the GLOBAL batch is batch_size * gradient_accumulation_steps sequences of block_size;
    # each of N ranks does gradient_accumulation_steps / N micro-steps
    batch_size=16,                   # sequences per micro-step on each rank
    gradient_accumulation_steps=16,  # micro-steps per iteration, over all ranks together
    # AdamW + warmup/cosine schedule
    learning_rate=3e-3,              # peak learning rate, reached after warmup
    min_lr=3e-4,                     # learning rate at the end of the cosine decay
    max_iters=3815,                  # optimizer steps in the run
    warmup_iters=100,                # linear warmup steps
    lr_decay_iters=0,                # the cosine decay ends here; 0 = max_iters
    weight_decay=0.1,                # AdamW weight decay (matrices only, never norms or biases)
    beta1=0.9,                       # AdamW beta1
    beta2=0.95,                      # AdamW beta2
    grad_clip=1.0,                   # clip the gradient norm to this; 0 = no clipping (still logged)
    # faults
    max_bad_steps=10,                # abort after this many consecutive non-finite steps
    # system
    seed=1337,                       # initial weights, data order (unless data_seed), dropout
    data_seed=-1,                    # the data order's seed; -1 = seed. Fix it to vary only the init
    device="auto",                   # "auto" = cuda if available else cpu
    dtype="auto",                    # "auto" = bfloat16 autocast on CUDA, float32 on CPU
    compile=False,                   # torch.compile the model (about a minute at the start)
    fsdp=False,                      # FSDP2: shard weights, gradients and AdamW state over the ranks; sharded checkpoints
    backend=None,                    # "naive" | "chunk" | "triton" recurrence; None = triton on CUDA, else chunk
    chunk_size=64,                   # the chunk backend's chunk length (the Triton kernels use 64)
    activation_checkpointing=False,  # recompute each block in the backward: less memory, ~1/3 more compute
    recompute_solver=True,           # PRISM: rerun the solver write in the backward instead of saving it (less memory; BENCHMARKS.md)
    fused_chain=True,                # PRISM, Triton backend: the solver chain as one kernel each way; False = model.solver_chain's ops (a changed rule)
    cpu_threads=0,                   # torch intra-op threads on CPU; 0 = torch's default
    # optional loggers, off by default (the JSONL log in out_dir is always written)
    wandb_log=False,                 # log to Weights & Biases (a warning if wandb is missing or offline)
    wandb_project="prism",           # the wandb project
    wandb_run_name="",               # the wandb run name; "" = wandb's own
    tensorboard_log=False,           # TensorBoard events in out_dir/tb
)
MODEL_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                  for f in dataclasses.fields(ModelConfig)}
DEFAULTS = {**TRAIN_DEFAULTS, **MODEL_DEFAULTS}


class UserError(Exception):
    """Bad config, bad data, bad checkpoint: reported as one message, no traceback."""


def model_args_of(cfg):
    return {k: cfg[k] for k in MODEL_DEFAULTS}


# -----------------------------------------------------------------------------------------------
# parsing: defaults -> config files -> --key=value

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


def _unknown_key(key, source):
    close = difflib.get_close_matches(key, list(DEFAULTS), n=1, cutoff=0.7)
    if close:
        spelled = f"--{close[0]}" if source == "command line" else f"'{close[0]}'"
        return UserError(f"unknown config key '{key}' (from {source}); did you mean {spelled}? "
                         f"(python train.py --help lists every key)")
    return UserError(f"unknown config key '{key}' (from {source}).\n"
                     f"  train keys: {', '.join(TRAIN_DEFAULTS)}\n"
                     f"  model keys: {', '.join(MODEL_DEFAULTS)}\n"
                     f"python train.py --help says what each one means")


def parse_config(argv):
    """Defaults, then config files and --key=value overrides in the order given. Returns a dict
    holding every train key and every model key, each of its default's type and checked."""
    cfg = dict(DEFAULTS)
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq:
                raise UserError(f"expected --key=value, got '{arg}' (python train.py --help lists the keys)")
            default = DEFAULTS.get(key, 0)
            if isinstance(default, str) or (default is None and text != "None"):
                value = text  # strings stay as typed: --dataset=2024 is a name, not a number
            else:
                value = None if default is None else _parse_value(text)
            items, source = {key: value}, "command line"
        elif arg.startswith("-"):
            raise UserError(f"unknown option '{arg}': give config files and --key=value "
                            f"(python train.py --help)")
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
            if key not in DEFAULTS:
                raise _unknown_key(key, source)
            cfg[key] = _coerce(key, value, DEFAULTS[key])
    check_values(cfg)
    return cfg


def check_values(cfg):
    """Refuse values no run can use, all of them in one message, before anything starts."""
    c = cfg
    rules = [
        ("init_from", c["init_from"] in ("scratch", "resume") or os.path.exists(c["init_from"]),
         "must be 'scratch', 'resume', or an existing checkpoint file, exported or fla directory"),
        ("init_continue", not c["init_continue"] or c["init_from"] not in ("scratch", "resume"),
         "needs --init_from=<a train.py checkpoint file> (init_from=resume continues a run by itself)"),
        ("dtype", c["dtype"] in ("auto", "float32", "bfloat16"), "must be 'auto', 'float32' or 'bfloat16'"),
        ("device", re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", c["device"]) is not None,
         "must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
        ("backend", c["backend"] is None or c["backend"] in BACKENDS, f"must be None or one of {BACKENDS}"),
        *((k, c[k] >= 1, "must be >= 1") for k in ("max_iters", "batch_size", "gradient_accumulation_steps",
                                                    "eval_interval", "eval_iters", "log_interval",
                                                    "keep_checkpoints", "max_bad_steps", "chunk_size")),
        *((k, c[k] >= 0, "must be >= 0") for k in ("warmup_iters", "learning_rate", "min_lr", "weight_decay")),
        ("lr_decay_iters", c["lr_decay_iters"] >= 0, "must be >= 0 (0 = max_iters)"),
        *((k, 0 <= c[k] < 1, "must be in [0, 1)") for k in ("beta1", "beta2", "dropout")),
        ("grad_clip", c["grad_clip"] >= 0, "must be >= 0 (0 = no clipping)"),
        ("cpu_threads", c["cpu_threads"] >= 0, "must be >= 0 (0 = torch's default)"),
        ("data_seed", c["data_seed"] >= -1, "must be >= 0, or -1 (= seed)"),
    ]
    bad = [f"{key}={c[key]!r}: {why}" for key, ok, why in rules if not ok]
    try:
        ModelConfig(**model_args_of(c))
    except ValueError as e:
        bad.append(str(e))
    if bad:
        raise UserError("invalid config:\n  " + "\n  ".join(bad))


# -----------------------------------------------------------------------------------------------
# --help: every key with its value and the comment beside its default

_KEY_COMMENT = re.compile(r"^\s+(\w+)\s*(?::[^=#]*)?=[^#]*#\s*(.*\S)")


def meanings(source, keys):
    """{key: comment} from lines like `key=value,  # comment` or `key: type = value  # comment`."""
    out = {}
    for line in source.splitlines():
        m = _KEY_COMMENT.match(line)
        if m and m.group(1) in keys and m.group(1) not in out:
            out[m.group(1)] = m.group(2)
    return out


def _show(v):
    if isinstance(v, (list, tuple)):
        return repr(v).replace(" ", "")
    return '""' if v == "" else str(v)


def help_text(cfg=None, sources=()):
    """Usage, then the train keys and the model keys with their values and meanings. `cfg` (from
    parse_config) shows the values after the config files in `sources`; default: the defaults."""
    cfg = cfg or DEFAULTS
    with open(__file__) as f:
        train_help = meanings(f.read(), TRAIN_DEFAULTS)
    model_help = meanings(inspect.getsource(ModelConfig), MODEL_DEFAULTS)
    after = f" (after {', '.join(sources)})" if sources else " (defaults)"
    lines = [
        "usage: python train.py [CONFIG.py ...] [--key=value ...]",
        "       torchrun --standalone --nproc_per_node=N train.py [CONFIG.py ...] [--key=value ...]",
        "",
        "Train a GDN / PRISM / attention language model. Configuration = the defaults below, then",
        "each config file in order (plain Python assignments, see config/), then --key=value.",
        "CPU demo, data prepared on first use: python train.py config/tiny_cpu.py",
    ]
    width = max(len(f"--{k}={_show(cfg[k])}") for k in DEFAULTS) + 2
    width = min(width, 40)
    for title, keys, text in ((f"train keys{after}:", TRAIN_DEFAULTS, train_help),
                              (f"model keys{after}, ModelConfig in model.py:", MODEL_DEFAULTS, model_help)):
        lines += ["", title]
        for k in keys:
            flag = f"--{k}={_show(cfg[k])}"
            lines.append(f"  {flag:<{width}} {text.get(k, '')}".rstrip() if len(flag) < width
                         else f"  {flag}\n  {'':<{width}} {text.get(k, '')}".rstrip())
    return "\n".join(lines) + "\n"
