"""Tests for bench/realtext_seeds.py: the pairing statistics on a hand-computed example, train.py's
data_seed (the seed changes the initial weights, not the data order), and the whole pipeline on
the CPU at tiny scale (pack -> prepare -> 4 models x 2 seeds in two lanes -> JSON, table, plot;
then a repeat that skips what finished). Offline: the corpus is generated here."""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import realtext_seeds as rs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pairing_math_by_hand():
    # per-seed losses: the seed moves both models alike (std 0.1 each), the gap is steadier
    prism = {0: 3.10, 1: 3.20, 2: 3.00}
    gdn = {0: 3.15, 1: 3.22, 2: 3.08}
    # differences -0.05, -0.02, -0.08: mean -0.05; deviations 0, +0.03, -0.03 -> std sqrt(0.0018/2) = 0.03
    d = rs.paired(prism, gdn)
    assert d["seeds"] == [0, 1, 2] and d["n"] == 3
    assert d["diffs"] == pytest.approx([-0.05, -0.02, -0.08])
    assert d["mean"] == pytest.approx(-0.05) and d["std"] == pytest.approx(0.03)
    m, sd, n = rs.mean_std(prism.values())
    assert (m, sd, n) == (pytest.approx(3.10), pytest.approx(0.1), 3)
    s = rs.verdict("prism", "gdn", d, "at 42M tokens")
    assert "larger than its seed spread" in s and "NOT" not in s and "lower in 3 of 3" in s
    # differences +0.01, -0.03, +0.02: mean 0, std sqrt((1 + 9 + 4) e-4 / 2) = 0.02646: not larger
    d2 = rs.paired({0: 3.01, 1: 2.97, 2: 3.02, 5: 1.0}, {0: 3.0, 1: 3.0, 2: 3.0})  # seed 5 unpaired
    assert d2["seeds"] == [0, 1, 2] and d2["mean"] == pytest.approx(0.0, abs=1e-12)
    assert d2["std"] == pytest.approx(math.sqrt(0.0007))
    assert "NOT larger than its seed spread" in rs.verdict("hybrid", "gdn", d2, "at 42M tokens")
    assert "one seed only" in rs.verdict("x", "y", rs.paired({0: 1.0}, {0: 2.0}), "here")

    rows = [{"model": m, "seed": s, "params": p, "tokens_per_s": 1000.0, "half_val_loss": h, "final_val_loss": f}
            for m, p, losses in (("gdn", 2e6, gdn), ("prism", 3e6, prism))
            for s, f in losses.items() for h in [f + 0.5]]
    per, diffs, table = rs.summarize(rows, ["gdn", "prism"], 21e6, 42e6)
    assert per["prism"]["final_val_loss"]["mean"] == pytest.approx(3.10)
    assert diffs["prism − gdn"]["final_val_loss"]["std"] == pytest.approx(0.03)
    assert "| prism | 3.0M | 1K | 3.600 ± 0.100 (3) | 3.100 ± 0.100 (3) | 22.20 |" in table
    assert "| prism − gdn | -0.0500 ± 0.0300 (3) | -0.0500 ± 0.0300 (3) |" in table
    assert table.count("larger than its seed spread") == 2  # half and full


def _bin(path, n, seed):
    rng = np.random.default_rng(seed)
    pattern = np.array([5, 900, 31, 4000, 77, 12000, 2], dtype=np.uint16)
    toks = np.resize(pattern, n)
    noise = rng.random(n) < 0.1
    toks[noise] = rng.integers(3, 32000, noise.sum())
    toks.astype(np.uint16).tofile(path)


def test_data_seed_fixes_the_order_not_the_init(tmp_path, monkeypatch):
    import train
    d = tmp_path / "data" / "tok"
    d.mkdir(parents=True)
    _bin(d / "train.bin", 4000, 0)
    _bin(d / "val.bin", 1000, 1)
    (d / "meta.json").write_text(json.dumps({"vocab_size": 32000, "eos_id": 2}))
    seen = []

    class Recorder(train.DataOrder):
        def __init__(self, n_tokens, block_size, seed):
            seen.append(seed)
            super().__init__(n_tokens, block_size, seed)
    monkeypatch.setattr(train, "DataOrder", Recorder)

    def run(name, *extra):
        out = tmp_path / name
        code = train.main(["config/tiny_cpu.py", f"--data_dir={tmp_path / 'data'}", "--dataset=tok",
                           f"--out_dir={out}", "--max_iters=1", "--eval_interval=1", "--eval_iters=1",
                           "--save_checkpoints=False", "--log_interval=1", *extra])
        assert code == 0
        return [json.loads(line) for line in open(out / "log.jsonl")]
    a = run("a", "--seed=3")
    b = run("b", "--seed=3", "--data_seed=9")
    c = run("c", "--seed=4", "--data_seed=9")
    assert seen == [3, 9, 9]  # -1 (the default) = seed; otherwise data_seed alone orders the data
    assert a[0]["val_loss"] == b[0]["val_loss"]  # same seed: same initial weights
    assert c[0]["val_loss"] != b[0]["val_loss"]  # another seed: other initial weights
    assert a[1]["loss"] != b[1]["loss"]          # same weights, other batch


WORDS = ("the system reads a file and writes its output to the terminal when the user asks for it "
         "each option changes how the program runs and what it prints on the screen").split()


def _corpus(n_docs):
    """Documents of English-like sentences, each tagged with its number."""
    rng = np.random.default_rng(0)
    docs = []
    for i in range(n_docs):
        sents = [" ".join(rng.choice(WORDS, rng.integers(6, 14))).capitalize() + "." for _ in range(6)]
        docs.append(("test", f"Document {i}. " + " ".join(sents)))
    return docs


@pytest.mark.slow
def test_pipeline_tiny(tmp_path):
    pytest.importorskip("zstandard")
    import realtext_corpus
    from tokenizer import load_tokenizer
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    try:
        load_tokenizer()
    except Exception as e:  # no tokenizer file without the network: nothing to tokenize with
        pytest.skip(f"no Mistral tokenizer offline ({e})")
    src, pack, data, runs, res = (tmp_path / x for x in ("src", "pack", "data", "runs", "res"))
    docs = _corpus(320)
    realtext_corpus.write_shards(docs, str(src), shard_chars=20_000)  # several shards
    dirs = [f"--src={src}", f"--pack={pack}", f"--data={data}", f"--runs={runs}", f"--results={res}", "--num_proc=1"]

    def run(*args):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "realtext_seeds.py"), "--tiny", *dirs, *args],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
        return p.stdout

    run("--phase=pack")
    manifest = json.loads((pack / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(f.name[:-4] + ".xz" for f in src.iterdir())
    assert (pack / "tokenizer.model").is_file() and manifest["prepared"]["val_documents"] == 320 // rs.VAL_EVERY
    record = json.loads((res / "realtext_seeds_corpus.json").read_text())
    assert record["prepared"]["train_tokens"] == manifest["prepared"]["train_tokens"]
    shutil.rmtree(data)  # what the GPU machine does: tokenize the pack again, check it is the same

    out = run("--lanes=2", "--seeds", "0", "1")
    meta = json.loads((data / "realtext_seeds" / "meta.json").read_text())
    assert meta["train_documents"] + meta["val_documents"] == 320 and meta["val_documents"] == 10
    # validation documents are whole documents that train.bin does not hold
    tok = load_tokenizer(str(pack / "tokenizer.model"))
    texts = {s: tok.decode(np.fromfile(data / "realtext_seeds" / f"{s}.bin", dtype=np.uint16))
             for s in ("train", "val")}
    val_ids = {int(t.split(".")[0].split()[-1]) for t in texts["val"].split("Document ")[1:]}
    train_ids = {int(t.split(".")[0].split()[-1]) for t in texts["train"].split("Document ")[1:]}
    assert len(val_ids) == 10 and not val_ids & train_ids and len(val_ids | train_ids) == 320

    res_json = json.loads((res / "realtext_seeds.json").read_text())
    assert res_json["complete"] and res_json["steps"] == 4 and res_json["tokens_per_step"] == 4 * 2 * 64
    rows = res_json["rows"]
    assert sorted((r["model"], r["seed"]) for r in rows) == sorted((m, s) for m in rs.MODELS for s in (0, 1))
    for r in rows:
        assert r["finished"] and r["train_tokens"] == 4 * 512, r
        assert [t for t, _ in r["val_curve"]] == [0, 512, 1024, 1536, 2048]
        assert r["final_val_loss"] == r["val_curve"][-1][1] and r["half_val_loss"] == r["val_curve"][2][1]
        assert r["val_curve"][-1][1] < r["val_curve"][0][1] and r["tokens_per_s"] > 0
        log = (runs / f"{r['model']}_s{r['seed']}" / "train.log").read_text()
        assert f"--seed={r['seed']}" in log and "--data_seed=1337" in log
    by = {(r["model"], r["seed"]): r for r in rows}
    # the seed changes the initial weights: another step-0 val loss
    assert by[("gdn", 0)]["val_curve"][0][1] != by[("gdn", 1)]["val_curve"][0][1]
    import torch
    from model import Model, ModelConfig
    from settings import model_args_of, parse_config
    cfg = parse_config(["config/tiny_cpu.py", "--mixer=attention"])
    with torch.device("meta"):
        assert by[("transformer", 0)]["params"] == Model(ModelConfig(**model_args_of(cfg))).num_params(False)
    # the table and its arithmetic: PRISM - GDN from the rows, paired by seed
    diffs = [by[("prism", s)]["final_val_loss"] - by[("gdn", s)]["final_val_loss"] for s in (0, 1)]
    d = res_json["differences"]["prism − gdn"]["final_val_loss"]
    assert d["mean"] == pytest.approx(np.mean(diffs)) and d["std"] == pytest.approx(np.std(diffs, ddof=1))
    assert f"| prism − gdn | " in out and f"{d['mean']:+.4f} ± {d['std']:.4f} (2) |" in out
    assert "| hybrid − gdn |" in out and out.count("seed spread") == 6  # 3 differences x 2 points
    assert (res / "realtext_seeds.png").stat().st_size > 10_000

    # again: everything finished is skipped; a run whose status is gone is redone alone
    out2 = run("--lanes=2", "--seeds", "0", "1")
    assert "8 runs (8 already finished)" in out2 and "start" not in out2
    os.remove(runs / "hybrid_s1" / "run.json")
    out3 = run("--lanes=2", "--seeds", "0", "1", "--phase=train")
    assert "8 runs (7 already finished)" in out3 and out3.count("start ") == 1 and "hybrid seed 1" in out3


@pytest.mark.slow
def test_deadline_stops_a_run_cleanly(tmp_path):
    """A run still going at --deadline_s gets SIGTERM, stops at the end of a step and is recorded as
    not finished (to be redone by the next call); the summary says how many finished."""
    d = tmp_path / "data" / "realtext_seeds"
    d.mkdir(parents=True)
    _bin(d / "train.bin", 20000, 0)
    _bin(d / "val.bin", 2000, 1)
    (d / "meta.json").write_text(json.dumps({"vocab_size": 32000, "eos_id": 2}))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "realtext_seeds.py"), "--tiny", "--lanes=1",
                        "--models", "gdn", "--seeds", "0", "--steps=2000", "--eval_interval=100",
                        "--deadline_s=25", f"--data={tmp_path / 'data'}", f"--runs={tmp_path / 'runs'}",
                        f"--pack={tmp_path / 'nopack'}"],
                       cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    st = json.loads((tmp_path / "runs" / "gdn_s0" / "run.json").read_text())
    assert not st["finished"] and st["stopped"] == "at --deadline_s" and 0 < st["iters"] < 2000, st
    assert st["exit_code"] == 0  # train.py stopped on its own at the end of a step
    assert "(0 of 1 runs finished)" in p.stdout
    res = json.loads((tmp_path / "runs" / "realtext_seeds.json").read_text())
    assert not res["complete"] and res["rows"][0]["final_val_loss"] is None


@pytest.mark.slow
def test_upcycle_tiny(tmp_path):
    """--upcycle: GDN to half the steps (on the full run's schedule, its checkpoint saved), then from
    that checkpoint the other half as GDN and as upcycled PRISM; the PRISM's first evaluation is the
    GDN's; the checkpoint goes once both continuations finished; a repeat skips all three."""
    d = tmp_path / "data" / "realtext_seeds"
    d.mkdir(parents=True)
    _bin(d / "train.bin", 20000, 0)
    _bin(d / "val.bin", 2000, 1)
    (d / "meta.json").write_text(json.dumps({"vocab_size": 32000, "eos_id": 2}))
    runs = tmp_path / "runs"

    def run():
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "realtext_seeds.py"), "--tiny", "--upcycle",
                            "--lanes=2", f"--data={tmp_path / 'data'}", f"--runs={runs}", f"--pack={tmp_path / 'nopack'}"],
                           cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stdout
    run()
    half_log = (runs / "gdn_half_s0" / "train.log").read_text()
    assert "--max_iters=2" in half_log and "--lr_decay_iters=4" in half_log and "--save_checkpoints=True" in half_log
    up_log = (runs / "prism_up_s0" / "train.log").read_text()
    assert "upcycling the GDN" in up_log and "continuing the run of" in up_log and "--init_continue=True" in up_log
    assert not list((runs / "gdn_half_s0").glob("ckpt*"))
    res = json.loads((runs / "realtext_upcycle.json").read_text())
    assert res["complete"] and res["steps"] == 4 and len(res["pairs"]) == 1
    pair = res["pairs"][0]
    assert abs(pair["start_gap"]) < 1e-5, pair
    by = {r["run"]: r for r in res["rows"]}
    assert [t for t, _ in by["gdn_half"]["val_curve"]] == [0, 512, 1024]
    for name in ("gdn_cont", "prism_up"):
        assert [t for t, _ in by[name]["val_curve"]] == [1024, 1536, 2048] and by[name]["finished"]
    assert pair["diff_final"] == by["prism_up"]["final_val_loss"] - by["gdn_cont"]["final_val_loss"]
    assert by["prism_up"]["params"] > by["gdn_cont"]["params"] == by["gdn_half"]["params"]
    assert (runs / "realtext_upcycle.png").stat().st_size > 10_000
    out = run()
    assert "1 runs (1 already finished)" in out and "2 runs (2 already finished)" in out and "start" not in out
