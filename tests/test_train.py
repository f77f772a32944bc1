"""train.py: config parsing, data checks, learning, exact resume, faults (CPU, float32, tiny).
The tiny model is a 2-layer hybrid (PRISM layer 0, attention layer 1): both paths, and fast."""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train  # noqa: E402
from model import Model, ModelConfig  # noqa: E402

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
    with pytest.raises(train.UserError, match="unknown config key 'bogus'") as e:
        train.parse_config(["--bogus=1"])
    assert "batch_size" in str(e.value) and "solver_steps" in str(e.value)
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("import math\nlearning_rate = math.sqrt(1e-6)\nn_layers = 3\n")
    with pytest.raises(train.UserError, match="unknown config key 'n_layers'.*c.py"):
        train.parse_config([str(cfg_file)])
    with pytest.raises(train.UserError, match="not found"):
        train.parse_config([str(tmp_path / "missing.py")])


def test_bad_types_rejected_and_good_ones_coerced():
    with pytest.raises(train.UserError, match="'batch_size' expects int"):
        train.parse_config(["--batch_size=abc"])
    with pytest.raises(train.UserError, match="'compile' expects bool"):
        train.parse_config(["--compile=1"])
    with pytest.raises(train.UserError, match="'learning_rate' expects float"):
        train.parse_config(["--learning_rate=fast"])
    with pytest.raises(train.UserError, match="init_from"):
        train.parse_config(["--init_from=latest"])
    cfg = train.parse_config(["--learning_rate=1", "--attn_layers=5,11", "--compile=True",
                              "--backend=naive", "--dataset=2024"])
    assert cfg["dataset"] == "2024" and train.parse_config(["--backend=None"])["backend"] is None
    assert cfg["learning_rate"] == 1.0 and isinstance(cfg["learning_rate"], float)
    assert cfg["attn_layers"] == (5, 11) and cfg["compile"] is True and cfg["backend"] == "naive"


def test_config_files_build_the_stated_models():
    counts = {}
    for f in sorted((ROOT / "config").glob("*.py")):
        cfg = train.parse_config([str(f)])
        with torch.device("meta"):
            counts[f.stem] = Model(ModelConfig(**train.model_args_of(cfg))).num_params(non_embedding=False)
        if f.stem.endswith("130m"):
            assert (cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"], cfg["block_size"]) == (768, 12, 32000, 2048)
            tokens = cfg["batch_size"] * cfg["gradient_accumulation_steps"] * cfg["block_size"]
            assert tokens == 524288 and abs(tokens * cfg["max_iters"] - 2e9) < tokens
    assert abs(counts["gdn_130m"] - 130e6) <= 10e6
    assert counts["gdn_130m"] < counts["prism_130m"] <= 1.1 * counts["gdn_130m"]
    assert train.parse_config([str(ROOT / "config/hybrid_130m.py")])["attn_layers"] == (5, 11)
    assert train.parse_config([str(ROOT / "config/transformer_130m.py")])["mixer"] == "attention"
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
    assert "vocab_size: meta.json has 64, the model has 128" in err
    # no meta.json: token ids beyond the vocab are still caught
    d = make_dataset(tmp_path / "nometa", meta=False)
    assert run(args(d, tmp_path / "o2", "--vocab_size=32", "--max_iters=1")) == 2
    assert "token id" in capsys.readouterr().err


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
    assert train.list_checkpoints(out)
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
    assert "received SIGTERM" in text
    losses, _ = read_log(out)
    stopped = max(losses)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == stopped and ckpt["data_pos"] == stopped * 8
    assert run(args(data, out, f"--max_iters={stopped + 2}", "--init_from=resume")) == 0
    assert sorted(read_log(out)[0]) == list(range(1, stopped + 3))


def test_corrupt_latest_checkpoint_falls_back(reference, data, tmp_path, capsys):
    ref_dir, ref = reference
    out = tmp_path / "corrupt"
    shutil.copytree(ref_dir, out, symlinks=True)
    latest = out / "ckpt_0000010.pt"
    raw = latest.read_bytes()
    latest.write_bytes(raw[: len(raw) // 2])  # truncated
    path, ckpt = train.load_latest_checkpoint(out)
    assert path.endswith("ckpt_0000009.pt") and ckpt["iter_num"] == 9
    assert "ckpt_0000010.pt is unusable" in capsys.readouterr().out
    # same size, flipped bytes: caught by the sha256 written beside it
    flipped = bytearray(raw)
    flipped[len(raw) // 2: len(raw) // 2 + 8] = bytes(8)
    latest.write_bytes(bytes(flipped))
    assert train.load_latest_checkpoint(out)[0].endswith("ckpt_0000009.pt")
    # no digest file: torch's own zip check still refuses the truncated file
    latest.write_bytes(raw[: len(raw) // 2])
    os.remove(str(latest) + ".sha256")
    assert train.load_latest_checkpoint(out)[0].endswith("ckpt_0000009.pt")
    # end to end: resume falls back to iter 9 and recomputes iter 10 exactly
    assert run(args(data, out, "--max_iters=10", "--eval_interval=3", "--init_from=resume")) == 0
    assert "falling back to" in capsys.readouterr().out
    assert read_log(out)[0][10]["loss"] == ref[10]


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

def test_nan_step_skipped_then_abort(data, tmp_path, capsys):
    out = tmp_path / "nan"
    # optional loggers on: without their packages (or network) they only warn
    loggers = [f"--{k}=True" for k in ("wandb_log", "tensorboard_log")
               if importlib.util.find_spec(k.split("_")[0]) is None]
    assert run(args(data, out, "--max_iters=6", "--eval_interval=100", "--debug_nan_iters=[2]", *loggers)) == 0
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
    assert run(args(data, out2, "--max_iters=20", "--eval_interval=3", "--max_bad_steps=3",
                    "--debug_nan_iters=[4,5,6,7]")) == 2
    err = capsys.readouterr().err
    assert "aborting at iter 6: 3 consecutive non-finite steps" in err and "ckpt_0000003.pt" in err
    assert train.list_checkpoints(out2)[0].endswith("ckpt_0000003.pt")


def test_oom_suggestion_halves_until_it_fits():
    tried = []

    def fits(b):
        tried.append(b)
        return b <= 5

    assert train.suggest_micro_batch(16, fits) == 4 and tried == [8, 4]
    assert train.suggest_micro_batch(4, lambda b: False) is None


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
