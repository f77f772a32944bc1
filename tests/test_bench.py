"""bench.py runs end to end on CPU and reports what it measured."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_single_config_reports_a_measurement():
    out = subprocess.run([sys.executable, "bench.py", "config/tiny_cpu.py", "--batch_size=2",
                          "--steps=2", "--warmup=1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["mixer"] == "prism" and row["B"] == 2 and row["T"] == 64
    assert row["ktok_s"] > 0 and row["step_ms"] > 0 and 0 < row["params_M"] < 5


def test_suite_rows_are_the_config_files():
    sys.path.insert(0, ROOT)
    import bench
    cfgs = {name: bench.suite_config(path, over) for name, path, over in bench.SUITE}
    assert cfgs["transformer"].mixer == "attention"
    assert cfgs["gdn"].mixer == "gdn"
    assert cfgs["prism L=2"].solver_steps == 2 and cfgs["prism L=3"].solver_steps == 3
    assert cfgs["hybrid (prism L=3 + attn 5,11)"].attn_layers == (5, 11)
    assert len({(c.n_embd, c.n_layer, c.vocab_size) for c in cfgs.values()}) == 1


def test_suite_filter_and_json(tmp_path):
    out = tmp_path / "suite.json"
    r = subprocess.run([sys.executable, "bench.py", "--suite", "--seqlens=16", "--tokens_per_step=16",
                        "--models=gdn", "--steps=1", "--warmup=0", f"--out={out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = json.load(open(out))["rows"]
    assert [(x["model"], x["T"], x["B"]) for x in rows] == [("gdn", 16, 1)]
    assert rows[0]["step_ms"] > 0 and rows[0]["params_M"] > 100
