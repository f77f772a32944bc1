"""train.py: config parsing, data checks, learning, exact resume, faults (CPU, float32, tiny).
The tiny model is a 2-layer hybrid (PRISM layer 0, attention layer 1): both paths, and fast."""
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
import settings
import train
import train_aids
import train_env
from model import Model, ModelConfig

ROOT = Path(__file__).resolve().parent.parent

VOCAB = 64
TINY = ["--vocab_size=64", "--n_layer=2", "--n_embd=32", "--n_head=2", "--head_dim=16",
        "--block_size=32", "--chunk_size=16", "--solver_rank=8", "--attn_layers=[1]", "--batch_size=4",
        "--gradient_accumulation_steps=2", "--eval_iters=2", "--log_interval=1",
        "--warmup_iters=2", "--learning_rate=1e-2", "--min_lr=1e-3", "--lr_decay_iters=10",
        "--device=cpu", "--dtype=float32", "--seed=7"]


def make_dataset(root, name="pat", vocab=VOCAB, n=20000, meta=True):
    """A noisy repeating pattern: learnable, but not instantly."""
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, vocab, size=29)
    data = np.tile(pattern, n // 29 + 1)[:n]
    noise = rng.random(n) < 0.05
    data[noise] = rng.integers(0, vocab, size=noise.sum())
    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    data[: n * 9 // 10].astype(np.uint16).tofile(d / "train.bin")
    data[n * 9 // 10:].astype(np.uint16).tofile(d / "val.bin")
    if meta:
        (d / "meta.json").write_text(json.dumps({"vocab_size": vocab, "tokenizer": "pattern",
                                                 "tokenizer_sha256": "0" * 64, "eos_id": 0}))
    return str(root)


def args(data_dir, out_dir, *extra):
    return TINY + [f"--data_dir={data_dir}", "--dataset=pat", f"--out_dir={out_dir}", *extra]


def run(argv):
    """train.py in this process; returns its exit code."""
    return train.main(argv)


def spawn(argv):
    # one thread, like this process (see one_thread): same float results, no oversubscription
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def read_log(out_dir):
    recs = [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]
    return {r["iter"]: r for r in recs if "loss" in r}, recs


def wait_for_iter(out_dir, it, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, proc.stdout.read()
        try:
            lines = open(Path(out_dir) / "log.jsonl").read().splitlines()
            done = [json.loads(x)["iter"] for x in lines[:-1] if '"loss"' in x]
            if done and max(done) >= it:
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"run did not reach iter {it}")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """An uninterrupted 10-iteration run, checkpoints at 3, 6, 9, 10 (last 3 kept)."""
    out = tmp_path_factory.mktemp("ref")
    assert run(args(data, out, "--max_iters=10", "--eval_interval=3")) == 0
    losses, _ = read_log(out)
    assert sorted(losses) == list(range(1, 11))
    return out, {i: r["loss"] for i, r in losses.items()}


# ------------------------------------------------------------------------------ config

def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(settings.UserError, match="unknown config key 'bogus'") as e:
        settings.parse_config(["--bogus=1"])
    assert "batch_size" in str(e.value) and "solver_steps" in str(e.value)
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("import math\nlearning_rate = math.sqrt(1e-6)\nn_layers = 3\n")
    with pytest.raises(settings.UserError, match="unknown config key 'n_layers'.*c.py"):
        settings.parse_config([str(cfg_file)])
    with pytest.raises(settings.UserError, match="not found"):
        settings.parse_config([str(tmp_path / "missing.py")])


def test_bad_types_rejected_and_good_ones_coerced():
    with pytest.raises(settings.UserError, match="'batch_size' expects int"):
        settings.parse_config(["--batch_size=abc"])
    with pytest.raises(settings.UserError, match="'compile' expects bool"):
        settings.parse_config(["--compile=1"])
    with pytest.raises(settings.UserError, match="'learning_rate' expects float"):
        settings.parse_config(["--learning_rate=fast"])
    with pytest.raises(settings.UserError, match="init_from"):
        settings.parse_config(["--init_from=latest"])
    cfg = settings.parse_config(["--learning_rate=1", "--attn_layers=5,11", "--compile=True",
                              "--backend=naive", "--dataset=2024"])
    assert cfg["dataset"] == "2024" and settings.parse_config(["--backend=None"])["backend"] is None
    assert cfg["learning_rate"] == 1.0 and isinstance(cfg["learning_rate"], float)
    assert cfg["attn_layers"] == (5, 11) and cfg["compile"] is True and cfg["backend"] == "naive"


def test_help_lists_every_key_with_its_default_and_meaning(capsys):
    for flag in ("--help", "-h"):
        assert run([flag]) == 0
        text = capsys.readouterr().out
        assert text.startswith("usage: python train.py")
        lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith("  --")}
        for key, default in settings.DEFAULTS.items():
            line = lines[f"--{key}={settings._show(default)}"]
            assert len(line.split(None, 1)) == 2, f"{key} has no meaning in --help"
        assert "peak learning rate" in lines["--learning_rate=0.003"]
        assert "1 = GDN exactly" in lines["--solver_steps=3"]
    # with a config file: the values it sets
    assert run([str(ROOT / "config/tiny_cpu.py"), "--help"]) == 0
    text = capsys.readouterr().out
    assert "--n_layer=2 " in text and "after " in text and "tiny_cpu.py" in text


def test_near_miss_key_says_did_you_mean(tmp_path, capsys):
    with pytest.raises(settings.UserError, match="did you mean --learning_rate"):
        settings.parse_config(["--lerning_rate=1e-3"])
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("n_layers = 3\n")
    with pytest.raises(settings.UserError, match="did you mean 'n_layer'"):
        settings.parse_config([str(cfg_file)])
    assert run(["--gradient_acumulation_steps=4"]) == 2
    assert "did you mean --gradient_accumulation_steps?" in capsys.readouterr().err
    with pytest.raises(settings.UserError, match="unknown option '-x'"):
        settings.parse_config(["-x"])


@pytest.mark.parametrize("flag, why", [
    ("--max_iters=-5", "max_iters=-5: must be >= 1"),
    ("--max_iters=0", "max_iters=0: must be >= 1"),
    ("--batch_size=0", "batch_size=0: must be >= 1"),
    ("--gradient_accumulation_steps=0", "gradient_accumulation_steps=0: must be >= 1"),
    ("--eval_interval=0", "eval_interval=0: must be >= 1"),
    ("--learning_rate=-0.001", "learning_rate=-0.001: must be >= 0"),
    ("--beta2=1.5", "beta2=1.5: must be in [0, 1)"),
    ("--keep_checkpoints=0", "keep_checkpoints=0: must be >= 1"),
])
def test_invalid_values_refused_at_start_up(data, tmp_path, capsys, flag, why):
    out = tmp_path / "o"
    assert run(args(data, out, "--max_iters=2", flag)) == 2
    assert why in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written


def test_invalid_values_reported_together():
    with pytest.raises(settings.UserError) as e:
        settings.parse_config(["--max_iters=-5", "--batch_size=0", "--min_lr=-1"])
    assert all(w in str(e.value) for w in ("max_iters=-5", "batch_size=0", "min_lr=-1.0"))


def test_config_files_build_the_stated_models():
    counts = {}
    for f in sorted((ROOT / "config").glob("*.py")):
        cfg = settings.parse_config([str(f)])
        with torch.device("meta"):
            counts[f.stem] = Model(ModelConfig(**settings.model_args_of(cfg))).num_params(non_embedding=False)
        if f.stem.endswith("130m"):
            assert (cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"], cfg["block_size"]) == (768, 12, 32000, 2048)
            tokens = cfg["batch_size"] * cfg["gradient_accumulation_steps"] * cfg["block_size"]
            assert tokens == 524288 and abs(tokens * cfg["max_iters"] - 2e9) < tokens
    assert abs(counts["gdn_130m"] - 130e6) <= 10e6
    assert counts["gdn_130m"] < counts["prism_130m"] <= 1.1 * counts["gdn_130m"]
    assert settings.parse_config([str(ROOT / "config/hybrid_130m.py")])["attn_layers"] == (5, 11)
    assert settings.parse_config([str(ROOT / "config/transformer_130m.py")])["mixer"] == "attention"
    assert counts["tiny_cpu"] < 5e6


def test_lr_schedule():
    cfg = dict(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200)
    lrs = [train.get_lr(i, cfg) for i in range(200)]
    assert lrs[0] < lrs[5] < lrs[9] < 1.0 and lrs[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:111]))
    assert lrs[60] == pytest.approx(0.55) and lrs[150] == 0.1


# ------------------------------------------------------------------------------ data

def test_missing_data_prints_prepare_command(tmp_path, capsys):
    assert run(args(tmp_path, tmp_path / "out", "--max_iters=1")) == 2
    err = capsys.readouterr().err
    assert "train data not found" in err and "python data/prepare_slimpajama.py" in err
    assert f"--out_dir={tmp_path / 'pat'}" in err


def test_vocab_mismatch_refused(data, tmp_path, capsys):
    assert run(args(data, tmp_path / "o", "--vocab_size=128", "--max_iters=1")) == 2
    err = capsys.readouterr().err
    assert "vocab_size: meta.json has 64, the model has 128" in err and "--vocab_size=64" in err
    # no meta.json: token ids beyond the vocab are still caught
    d = make_dataset(tmp_path / "nometa", meta=False)
    assert run(args(d, tmp_path / "o2", "--vocab_size=32", "--max_iters=1")) == 2
    assert "token id" in capsys.readouterr().err


BAD_DATA = {  # what is wrong -> (the file it is in, how to break a good dataset, what the error says)
    "odd-sized bin": ("train.bin", lambda d: open(d / "train.bin", "ab").write(b"\0"),
                      "is 36,001 bytes, not a whole number of 2-byte (uint16) tokens"),
    "meta.json not JSON": ("meta.json", lambda d: (d / "meta.json").write_text('{"vocab_size": 64,'),
                           "is not valid JSON"),
    "meta.json not an object": ("meta.json", lambda d: (d / "meta.json").write_text("[64]"),
                                "holds a JSON list"),
    "meta.json lacks vocab_size": ("meta.json", lambda d: (d / "meta.json").write_text('{"eos_id": 0}'),
                                   "'vocab_size' is missing"),
    "meta.json vocab_size a string": ("meta.json", lambda d: (d / "meta.json").write_text('{"vocab_size": "64"}'),
                                      "'vocab_size' is '64', not a whole number"),
    "meta.json of other bins": ("meta.json", lambda d: (d / "meta.json").write_text(
        '{"vocab_size": 64, "train_tokens": 99, "val_tokens": 2000}'), "'train_tokens' is 99, but"),
    "meta.json eos_id outside the vocab": ("meta.json", lambda d: (d / "meta.json").write_text(
        '{"vocab_size": 64, "eos_id": 64}'), "'eos_id' 64 is outside the vocab"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_is_a_clear_error(tmp_path, capsys, case):
    """Not a traceback: the file, what is wrong with it, and the command that prepares it again."""
    name, spoil, why = BAD_DATA[case]
    d = Path(make_dataset(tmp_path / "d"))
    spoil(d / "pat")
    assert run(args(d, tmp_path / "o", "--max_iters=1")) == 2
    err = capsys.readouterr().err
    assert str(d / "pat" / name) in err and why in err, err
    assert "python data/prepare_slimpajama.py" in err and f"--out_dir={d / 'pat'}" in err
    assert not (tmp_path / "o").exists()


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    """The demo needs the Mistral tokenizer to prepare its data: offline and without
    mistral-common's copy, the error says so and what to install, with no traceback."""
    fake = tmp_path / "site" / "mistral_common"  # found by name, but without the tokenizer file
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path / "site"), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub")}
    r = subprocess.run([sys.executable, "train.py", "config/tiny_cpu.py", f"--data_dir={tmp_path / 'data'}",
                        f"--out_dir={tmp_path / 'out'}", "--max_iters=1"], cwd=ROOT, capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: no tokenizer found" in r.stderr and "pip install mistral-common" in r.stderr, r.stderr
    assert "preparing the demo data" in r.stderr and "Traceback" not in r.stdout + r.stderr


def test_data_order_disjoint_ranks_same_global_batch():
    order = train.DataOrder(n_tokens=10 * 8 + 1, block_size=8, seed=3)  # 10 windows
    B, G = 2, 4
    single = [s for m in range(G) for s in order.starts(0, m, 0, 1, B, 8)]
    per_rank = {r: [s for m in range(G // 2) for s in order.starts(0, m, r, 2, B, 8)] for r in range(2)}
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(single)
    epoch = [order.window(k) for k in range(10)]
    assert sorted(epoch) == list(range(10))                       # each window once per epoch
    assert [order.window(k) for k in range(10, 20)] != epoch       # reshuffled next epoch
    assert train.DataOrder(81, 8, 3).window(13) == order.window(13)  # a pure function of k


# ------------------------------------------------------------------------------ learning, resume

def test_tiny_model_learns(reference, data, tmp_path):
    out = tmp_path / "learn"
    assert run(args(data, out, "--max_iters=40", "--eval_interval=40", "--lr_decay_iters=40")) == 0
    losses, recs = read_log(out)
    first, last = losses[1]["loss"], losses[40]["loss"]
    assert first > 3.5 and last < 0.5 * first, (first, last)
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert vals[-1] < 0.5 * vals[0]
    r = losses[40]
    assert r["tokens"] == 40 * 4 * 2 * 32 and r["tok_s"] > 0 and r["grad_norm"] > 0 and r["skipped"] == 0


def test_resume_reproduces_uninterrupted_run(reference, data, tmp_path):
    ref_dir, ref = reference
    out = tmp_path / "resumed"
    assert run(args(data, out, "--max_iters=5", "--eval_interval=3")) == 0
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 5 and ckpt["data_pos"] == 5 * 8 and len(ckpt["rng"]) == 1
    assert {"model", "optimizer", "model_args", "config", "best_val_loss"} <= set(ckpt)
    assert run(args(data, out, "--max_iters=10", "--eval_interval=3", "--init_from=resume")) == 0
    losses, _ = read_log(out)
    assert sorted(losses) == list(range(1, 11))            # one line per iteration, none twice
    assert {i: losses[i]["loss"] for i in losses} == ref   # float32 CPU: identical
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == [
        "ckpt_0000006.pt", "ckpt_0000009.pt", "ckpt_0000010.pt"]


def test_kill9_then_resume_matches(reference, data, tmp_path):
    _, ref = reference
    out = tmp_path / "killed"
    proc = spawn(args(data, out, "--max_iters=100000", "--eval_interval=3"))
    wait_for_iter(out, 7, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert checkpoint.list_checkpoints(out)
    assert run(args(data, out, "--max_iters=10", "--eval_interval=3", "--init_from=resume")) == 0
    losses, _ = read_log(out)
    assert sorted(losses) == list(range(1, 11))
    assert {i: losses[i]["loss"] for i in losses} == ref


def test_sigterm_saves_and_exits_zero(data, tmp_path):
    out = tmp_path / "term"
    proc = spawn(args(data, out, "--max_iters=100000", "--eval_interval=1000"))
    wait_for_iter(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, text
    assert "received SIGTERM: will save a checkpoint after the current step" in text  # said at once
    assert "received SIGTERM at iter" in text                                          # then done
    losses, _ = read_log(out)
    stopped = max(losses)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == stopped and ckpt["data_pos"] == stopped * 8
    assert run(args(data, out, f"--max_iters={stopped + 2}", "--init_from=resume")) == 0
    assert sorted(read_log(out)[0]) == list(range(1, stopped + 3))


def spawn_slow(argv, seconds, env=()):
    """train.py in a subprocess whose every micro-step takes `seconds` longer (a hook the test
    injects by wrapping train.forward_loss), so that signals land mid-step."""
    code = ("import sys, time, train\n"
            "real = train.forward_loss\n"
            f"train.forward_loss = lambda *a: (time.sleep({seconds}), real(*a))[1]\n"
            "sys.exit(train.main(sys.argv[1:]))\n")
    return subprocess.Popen([sys.executable, "-u", "-c", code, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **dict(env)})


def read_until(proc, text, timeout=120):
    seen, t0 = [], time.time()
    while time.time() - t0 < timeout:
        line = proc.stdout.readline()
        seen.append(line)
        if text in line:
            return "".join(seen)
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"never printed {text!r}:\n{''.join(seen)}")


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)])
def test_second_signal_stops_at_once_without_saving(data, tmp_path, first, second):
    """Any second stop signal, however soon after the first (the first is already acted on)."""
    out = tmp_path / "term2"
    proc = spawn_slow(args(data, out, "--max_iters=1000", "--eval_interval=1000"), seconds=3)
    read_until(proc, "global batch")
    time.sleep(0.5)  # inside the first step (6 s long)
    t0 = time.time()
    proc.send_signal(first)
    read_until(proc, "will save a checkpoint after the current step")
    proc.send_signal(second)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + second, text
    assert f"stopped at once by a second {second.name}; nothing saved since the last checkpoint" in text
    assert time.time() - t0 < 5.5  # did not wait for the step to end
    assert not list(out.glob("ckpt*"))


def test_two_signals_at_once_stop_at_once(data, tmp_path):
    """Two stop signals sent back to back are two requests: the second stops the run at once."""
    out = tmp_path / "term3"
    proc = spawn_slow(args(data, out, "--max_iters=1000", "--eval_interval=1000"), seconds=3)
    read_until(proc, "global batch")
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=60)
    # either may be handled first: the other one stops the run
    assert proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), text
    assert re.search(r"stopped at once by a second SIG(INT|TERM)", text), text
    assert time.time() - t0 < 5.5 and not list(out.glob("ckpt*"))


def test_under_torchrun_a_repeat_within_a_second_is_one_request(data, tmp_path):
    """torchrun's agent passes each signal it gets on to its workers, and SLURM signals both: under
    torchrun one stop can arrive twice, and must still save."""
    out = tmp_path / "term4"
    proc = spawn_slow(args(data, out, "--max_iters=1000", "--eval_interval=1000"), seconds=1,
                      env={"TORCHELASTIC_RUN_ID": "test"})
    read_until(proc, "global batch")
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, text
    # the two arrive together: either may be handled first, and the other must not stop at once
    assert re.search(r"received SIG(INT|TERM) at iter 1: saved", text), text
    assert "stopped at once" not in text, text
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 1


RESUME = train.RESUME_KEYS


def test_corrupt_latest_checkpoint_falls_back_and_is_moved_aside(reference, data, tmp_path, capsys):
    ref_dir, ref = reference
    out = tmp_path / "corrupt"
    shutil.copytree(ref_dir, out, symlinks=True)
    latest = out / "ckpt_0000010.pt"
    raw = latest.read_bytes()
    latest.write_bytes(raw[: len(raw) // 2])  # truncated
    path, ckpt = checkpoint.load_latest_checkpoint(out, RESUME, log=print)
    assert path.endswith("ckpt_0000009.pt") and ckpt["iter_num"] == 9
    assert "ckpt_0000010.pt is unusable (sha256 does not match" in capsys.readouterr().out
    # moved aside with its digest: never listed, resumed from or rotated again
    assert (out / "ckpt_0000010.pt.corrupt").read_bytes() == raw[: len(raw) // 2]
    assert (out / "ckpt_0000010.pt.sha256.corrupt").exists() and not latest.exists()
    assert checkpoint.list_checkpoints(out)[0].endswith("ckpt_0000009.pt")
    assert os.path.realpath(out / "ckpt.pt") == str(out / "ckpt_0000009.pt")  # the link follows
    # same size, flipped bytes: caught by the sha256 written beside it
    flipped = bytearray(raw)
    flipped[len(raw) // 2: len(raw) // 2 + 8] = bytes(8)
    latest.write_bytes(bytes(flipped))
    os.replace(str(latest) + ".sha256.corrupt", str(latest) + ".sha256")
    assert checkpoint.load_latest_checkpoint(out, RESUME)[0].endswith("ckpt_0000009.pt")
    assert not latest.exists()
    # no digest file: torch's own zip check still refuses the truncated file
    latest.write_bytes(raw[: len(raw) // 2])
    assert checkpoint.load_latest_checkpoint(out, RESUME)[0].endswith("ckpt_0000009.pt")
    # end to end: resume falls back to iter 9 and recomputes iter 10 exactly
    latest.write_bytes(raw[: len(raw) // 2])
    shutil.copy(out / "ckpt_0000009.pt.sha256", str(latest) + ".sha256")  # a digest that does not match
    assert run(args(data, out, "--max_iters=10", "--eval_interval=3", "--init_from=resume")) == 0
    assert "falling back to" in capsys.readouterr().out
    assert read_log(out)[0][10]["loss"] == ref[10]
    assert checkpoint.verify(str(latest))  # iter 10 written again, whole


def test_rotation_keeps_the_good_checkpoint(reference, data, tmp_path):
    """keep_checkpoints=2 with a truncated newest: resuming falls back to the one before it, and
    the next rotation must delete neither that good one nor count the corrupt one."""
    ref_dir, ref = reference
    out = tmp_path / "rot"
    assert run(args(data, out, "--max_iters=10", "--eval_interval=3", "--keep_checkpoints=2")) == 0
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(out)] == ["ckpt_0000010.pt", "ckpt_0000009.pt"]
    latest = out / "ckpt_0000010.pt"
    latest.write_bytes(latest.read_bytes()[:-100])
    assert run(args(data, out, "--max_iters=12", "--eval_interval=3", "--keep_checkpoints=2",
                    "--init_from=resume")) == 0
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(out)]
    assert names == ["ckpt_0000012.pt", "ckpt_0000009.pt"], names
    assert (out / "ckpt_0000010.pt.corrupt").exists()
    assert read_log(out)[0][10]["loss"] == ref[10]


def test_rotation_deletes_only_what_is_older_than_the_newest_verified(tmp_path):
    out = str(tmp_path)
    for it in (1, 2):
        checkpoint.save_checkpoint(out, {"iter_num": it, "w": torch.zeros(3)}, keep=1)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(out)] == ["ckpt_0000002.pt"]
    # a newer checkpoint with no digest (copied in, or from an older version) is not verified:
    # keep=1 must not delete the verified one behind it
    torch.save({"iter_num": 3}, tmp_path / "ckpt_0000003.pt")
    checkpoint.rotate(out, keep=1)
    assert len(checkpoint.list_checkpoints(out)) == 2
    # a newer one whose digest does not match is moved aside and not counted
    checkpoint.save_checkpoint(out, {"iter_num": 4, "w": torch.ones(3)}, keep=3)
    (tmp_path / "ckpt_0000004.pt").write_bytes(b"junk")
    checkpoint.rotate(out, keep=1)
    assert (tmp_path / "ckpt_0000004.pt.corrupt").exists()
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(out)] == ["ckpt_0000003.pt", "ckpt_0000002.pt"]
    # once the newest is verified, keep=1 leaves it alone
    checkpoint.save_checkpoint(out, {"iter_num": 5, "w": torch.ones(3)}, keep=1)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(out)] == ["ckpt_0000005.pt"]
    assert sorted(os.listdir(out)) == ["ckpt.pt", "ckpt_0000004.pt.corrupt", "ckpt_0000004.pt.sha256.corrupt",
                                       "ckpt_0000005.pt", "ckpt_0000005.pt.sha256"]


def test_checkpoint_without_digest_loads_with_a_warning(reference, tmp_path, capsys):
    ref_dir, _ = reference
    src = ref_dir / "ckpt_0000010.pt"
    p = tmp_path / "ckpt_0000010.pt"
    raw = bytearray(src.read_bytes())
    i = raw.index(b"data/0") + 200  # inside the first tensor's bytes: torch's zip reader does not notice
    raw[i:i + 4] = b"\xff\xff\xff\x7f"
    p.write_bytes(bytes(raw))
    ckpt = checkpoint.load_checkpoint(str(p), RESUME)
    assert ckpt["iter_num"] == 10
    err = capsys.readouterr().err
    assert f"warning: {p} has no sha256 beside it" in err and "loaded without verification" in err
    # with the digest of the original beside it, the same bytes are refused
    shutil.copy(str(src) + ".sha256", str(p) + ".sha256")
    with pytest.raises(checkpoint.CheckpointError, match="sha256 does not match"):
        checkpoint.load_checkpoint(str(p), RESUME)
    # ckpt.pt (a link) is checked against the digest of the file it points to
    assert checkpoint.load_checkpoint(str(ref_dir / "ckpt.pt"), RESUME)["iter_num"] == 10
    assert "without verification" not in capsys.readouterr().err


def test_resume_refuses_changed_model_or_tokenizer(reference, data, tmp_path, capsys):
    ref_dir, _ = reference
    out = tmp_path / "changed"
    shutil.copytree(ref_dir, out, symlinks=True)
    assert run(args(data, out, "--n_layer=3", "--solver_steps=2", "--max_iters=12",
                    "--init_from=resume")) == 2
    err = capsys.readouterr().err
    assert "n_layer (checkpoint 2, now 3)" in err and "solver_steps (checkpoint 3, now 2)" in err
    d2 = Path(make_dataset(tmp_path / "d2"))
    meta = json.loads((d2 / "pat/meta.json").read_text())
    (d2 / "pat/meta.json").write_text(json.dumps({**meta, "tokenizer": "other"}))
    assert run(args(d2, out, "--max_iters=12", "--init_from=resume")) == 2
    assert "tokenizer: meta.json has 'other', the checkpoint was trained on 'pattern'" in capsys.readouterr().err
    # starting from scratch over existing checkpoints is refused too
    assert run(args(data, out, "--max_iters=12")) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


# ------------------------------------------------------------------------------ faults

def poison(monkeypatch, iters, accum=2):
    """Make the loss (and so the gradient) NaN at these iterations (1-based, as logged) of a fresh
    run with `accum` micro-steps, by wrapping train.forward_loss: a hook the test injects, not a
    config key."""
    calls = []

    def forward_loss(model, x, y):
        calls.append(1)
        loss = real(model, x, y)
        return loss * float("nan") if (len(calls) - 1) // accum + 1 in iters else loss
    real = train.forward_loss
    monkeypatch.setattr(train, "forward_loss", forward_loss)


def test_nan_step_skipped_then_abort(data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "nan"
    # optional loggers on: without their packages (or network) they only warn
    loggers = [f"--{k}=True" for k in ("wandb_log", "tensorboard_log")
               if importlib.util.find_spec(k.split("_")[0]) is None]
    poison(monkeypatch, {2})
    assert run(args(data, out, "--max_iters=6", "--eval_interval=100", *loggers)) == 0
    losses, _ = read_log(out)
    assert losses[1]["skipped"] == 0 and losses[2]["skipped"] == 1 and losses[6]["skipped"] == 1
    assert all(np.isfinite(losses[i]["loss"]) for i in (1, 3, 4, 5, 6)) and losses[2]["loss"] is None
    assert losses[2]["grad_norm"] is None
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["skipped"] == 1
    assert all(int(s["step"]) == 5 for s in ckpt["optimizer"]["state"].values())  # 6 iters, 1 skipped
    printed = capsys.readouterr().out
    assert "iter 2: non-finite loss" in printed
    for flag in loggers:
        assert f"{flag[2:].split('_')[0]} disabled" in printed

    out2 = tmp_path / "nan2"
    poison(monkeypatch, {4, 5, 6, 7})
    assert run(args(data, out2, "--max_iters=20", "--eval_interval=3", "--max_bad_steps=3")) == 2
    err = capsys.readouterr().err
    assert "aborting at iter 6: 3 consecutive non-finite steps" in err and "ckpt_0000003.pt" in err
    assert checkpoint.list_checkpoints(out2)[0].endswith("ckpt_0000003.pt")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_train_step_never_waits_for_the_gpu(data, tmp_path, monkeypatch, compiled):
    """Queuing a step (data, forward, backward, clip, the skip of a non-finite step, AdamW) makes
    no host-device sync: torch's sync debug mode turns any into an error. The first step is left
    out (lazy initialisation: compilation, the optimizer's state)."""
    calls = []
    real = train.train_step

    def checked(*a, **k):
        calls.append(1)
        torch.cuda.set_sync_debug_mode("error" if len(calls) > 1 else 0)
        try:
            return real(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    monkeypatch.setattr(train, "train_step", checked)
    poison(monkeypatch, {3})
    out = tmp_path / f"nosync{compiled}"
    assert run(args(data, out, "--device=cuda", "--dtype=bfloat16", f"--compile={compiled}", "--head_dim=64",
                    "--max_iters=6", "--eval_interval=100")) == 0
    assert len(calls) == 6
    losses, _ = read_log(out)
    assert losses[3]["loss"] is None and losses[2]["skipped"] == 0 and losses[6]["skipped"] == 1
    assert all(np.isfinite(losses[i]["loss"]) for i in (1, 2, 4, 5, 6))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert all(int(s["step"]) == 5 for s in ckpt["optimizer"]["state"].values())  # skipped on the device


def test_no_test_hook_in_the_config():
    assert "debug_nan_iters" not in settings.DEFAULTS
    with pytest.raises(settings.UserError, match="unknown config key 'debug_nan_iters'"):
        settings.parse_config(["--debug_nan_iters=[2]"])


def test_gpu_sized_config_on_cpu_warns_before_the_first_step(data, tmp_path, capsys, monkeypatch):
    # the 130M config on this CPU: estimated from its FLOPs per token (model on the meta device)
    cfg = settings.parse_config([str(ROOT / "config/prism_130m.py")])
    env = train_env.Env(ddp=False, rank=0, world=1, device=torch.device("cpu"), dtype="float32")
    with torch.device("meta"):
        big = Model(ModelConfig(**settings.model_args_of(cfg)))
    train_aids.check_cpu_speed(big, cfg, env)
    text = capsys.readouterr().out
    assert "warning: this config is sized for a GPU" in text and "524,288 tokens" in text
    assert "python train.py config/tiny_cpu.py" in text
    # the tiny test config: no warning on this CPU ...
    assert run(args(data, tmp_path / "a", "--max_iters=1")) == 0
    assert "sized for a GPU" not in capsys.readouterr().out
    # ... but on a CPU a million times slower, a warning before the first step
    monkeypatch.setattr(train_aids, "cpu_flops", lambda: 1e5)
    assert run(args(data, tmp_path / "b", "--max_iters=1")) == 0
    text = capsys.readouterr().out
    assert "sized for a GPU" in text and text.index("sized for a GPU") < text.index("iter 1: loss")


def test_token_counts_and_no_mfu_on_cpu(data, tmp_path, capsys):
    assert [train_aids.fmt_tokens(n) for n in (2560, 12_345_678, 999_999_999, 2_000_000_000)] == [
        "2,560", "12.3M", "1.00B", "2.00B"]
    assert run(args(data, tmp_path / "o", "--max_iters=10", "--eval_interval=10")) == 0
    text = capsys.readouterr().out
    assert "10 iters = 2,560 tokens" in text and "0.000B" not in text
    steps = [ln for ln in text.splitlines() if ln.startswith("iter") and "loss" in ln]
    assert len(steps) == 12 and not [ln for ln in steps if "mfu" in ln]  # a GPU's peak means nothing on a CPU
    assert all("mfu" not in r for r in read_log(tmp_path / "o")[1])


def test_tokens_per_second_is_the_steps_own(data, tmp_path, capsys, monkeypatch):
    """Every log line's tok/s and dt are its step's, also on the iterations that evaluate and save
    (there the step is read with no step queued behind it) and on the step after them: never
    faster than the step's slowed micro-steps allow, never slowed by the evaluation or the save."""
    real_fwd, real_eval, real_save = train.forward_loss, train.evaluate, train.save
    monkeypatch.setattr(train, "forward_loss", lambda *a: (time.sleep(0.15), real_fwd(*a))[1])
    monkeypatch.setattr(train, "evaluate", lambda *a: (time.sleep(0.6), real_eval(*a))[1])
    monkeypatch.setattr(train, "save", lambda *a: (time.sleep(0.6), real_save(*a))[1])
    out = tmp_path / "rate"
    assert run(args(data, out, "--max_iters=7", "--eval_interval=3")) == 0
    printed = {int(m[1]): float(m[2].replace(",", "")) for m in
               re.finditer(r"^iter (\d+): loss [^,]+, lr [^,]+, ([\d,]+) tok/s", capsys.readouterr().out, re.M)}
    steps, _ = read_log(out)
    assert sorted(steps) == sorted(printed) == list(range(1, 8))
    for i, r in steps.items():
        assert 0.3 <= r["dt"] < 0.6, (i, r["dt"])  # 2 micro-steps of 0.15 s; an eval or a save is 0.6 s
        assert r["tok_s"] == pytest.approx(4 * 2 * 32 / r["dt"])
        assert printed[i] == pytest.approx(r["tok_s"], abs=1)


def test_demo_config_prepares_its_own_data(tmp_path):
    """python train.py config/tiny_cpu.py on a machine with nothing prepared: the data is built
    from pydoc_data under data_dir/pydoc, nothing lands in the repo root, a second run reuses it."""
    before = sorted(os.listdir(ROOT))
    cmd = [sys.executable, "train.py", "config/tiny_cpu.py", f"--data_dir={tmp_path / 'data'}",
           f"--out_dir={tmp_path / 'out'}", "--max_iters=2", "--eval_interval=2", "--eval_iters=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # tokenizer from mistral-common
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "preparing it from Python's documentation" in r.stdout
    d = tmp_path / "data" / "pydoc"
    meta = json.loads((d / "meta.json").read_text())
    assert meta["vocab_size"] == 32000 and meta["val_tokens"] > 1000 and meta["train_tokens"] > 20 * meta["val_tokens"]
    assert sorted(os.listdir(d)) == ["meta.json", "pydoc.txt", "train.bin", "val.bin"]
    assert sorted(os.listdir(ROOT)) == before
    r = subprocess.run(cmd[:-3] + ["--max_iters=3", "--init_from=resume", "--eval_iters=1"], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "preparing" not in r.stdout, r.stdout + r.stderr


def test_oom_suggestion_halves_until_it_fits():
    tried = []

    def fits(b):
        tried.append(b)
        return b <= 5

    assert train_aids.suggest_micro_batch(16, fits) == 4 and tried == [8, 4]
    assert train_aids.suggest_micro_batch(4, lambda b: False) is None


def test_plot_writes_png(reference, tmp_path):
    pytest.importorskip("matplotlib")
    ref_dir, _ = reference
    png = tmp_path / "loss.png"
    r = subprocess.run([sys.executable, str(ROOT / "plot.py"), str(ref_dir / "log.jsonl"),
                        str(ref_dir / "log.jsonl"), f"--out={png}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = subprocess.run([sys.executable, str(ROOT / "plot.py"), str(tmp_path / "nope.jsonl")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "nope.jsonl" in r.stderr


def test_init_from_weights_starts_a_fresh_run_from_them(reference, data, tmp_path, capsys):
    """--init_from=<checkpoint file>: iteration 0, a new optimizer, the source's weights and its
    architecture (a config that disagrees is overridden and told so)."""
    ref_dir, ref = reference
    src = ref_dir / "ckpt.pt"
    out = tmp_path / "ft"
    assert run(args(data, out, "--max_iters=2", "--eval_interval=2", f"--init_from={src}",
                    "--solver_rank=4")) == 0
    assert "its architecture replaces the config's: solver_rank=8" in capsys.readouterr().out
    losses, recs = read_log(out)
    assert sorted(losses) == [1, 2]
    # the first step already sees trained weights: far below a fresh model's first loss
    assert losses[1]["loss"] < 0.8 * ref[1], (losses[1]["loss"], ref[1])
    assert run(args(data, tmp_path / "x", f"--init_from={tmp_path / 'missing.pt'}")) == 2
