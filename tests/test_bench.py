"""bench.py runs end to end on CPU and reports what it measured; the profiler's categories."""
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
    import bench
    cfgs = {name: bench.suite_config(path, over) for name, path, over, _ in bench.SUITE}
    assert cfgs["transformer"].mixer == "attention"
    assert cfgs["gdn"].mixer == "gdn"
    assert cfgs["prism L=2"].solver_steps == 2 and cfgs["prism L=3"].solver_steps == 3
    assert cfgs["hybrid (prism L=3 + attn 5,11)"].attn_layers == (5, 11)
    assert len({(c.n_embd, c.n_layer, c.vocab_size) for c in cfgs.values()}) == 1


def test_suite_filter_and_json(tmp_path):
    """Rows are filtered by name; a row that cannot run (here the peer: no GPU, maybe no fla)
    becomes an error row and the suite still finishes and writes its JSON."""
    out = tmp_path / "suite.json"
    r = subprocess.run([sys.executable, "bench.py", "--suite", "--seqlens=16", "--tokens_per_step=16",
                        "--models=gdn,fla", "--fla_modes=eager", "--steps=1", "--warmup=0",
                        f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.load(open(out))
    rows = result["rows"]
    assert [(x["model"], x["T"], x["B"]) for x in rows] == [("gdn", 16, 1), ("fla GatedDeltaNet", 16, 1)]
    assert rows[0]["step_ms"] > 0 and rows[0]["params_M"] > 100 and 0 <= rows[0]["mfu"] < 1
    assert "error" in rows[1] and "error" not in rows[0]
    assert {"date", "torch", "python"} <= set(result["env"])
    assert "| gdn | chunk |" in r.stdout  # the table


def test_help_and_bad_flags():
    r = subprocess.run([sys.executable, "bench.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--suite" in r.stdout and "--loss" in r.stdout
    assert "--batch_size" in r.stdout or "batch_size" in r.stdout  # how to time one config
    r = subprocess.run([sys.executable, "bench.py", "--suite", "--compile=maybe"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--compile" in r.stderr


def test_loss_mode_rows_are_measured_and_exact(tmp_path):
    out = tmp_path / "loss.json"
    r = subprocess.run([sys.executable, "bench.py", "--loss", "--loss_rows=100", "--loss_dim=8",
                        "--loss_vocab=50", "--loss_chunks=7,64", "--steps=1", "--warmup=0",
                        f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {x["impl"]: x for x in json.load(open(out))["rows"]}
    for name in ("plain: logits, float32 F.cross_entropy", "ours: linear_cross_entropy chunk=7",
                 "ours: linear_cross_entropy chunk=64"):
        assert rows[name]["ms"] > 0
        assert max(rows[name][k] for k in ("loss_err", "dh_err", "dw_err")) < 1e-5


def test_table_compares_with_the_fastest_peer_row():
    import bench
    rows = [dict(model="gdn", backend="triton", compile=True, ckpt=False, T=2048, B=16, step_ms=1,
                 ktok_s=300.0, mfu=0.3, peak_GiB=10.0),
            dict(model="fla GatedDeltaNet", backend="fla", compile=False, ckpt=False, T=2048, B=16,
                 step_ms=1, ktok_s=200.0, mfu=0.2, peak_GiB=20.0),
            dict(model="fla GatedDeltaNet", backend="fla", compile=True, ckpt=False, T=2048, B=16,
                 step_ms=1, ktok_s=250.0, mfu=0.25, peak_GiB=25.0),
            dict(model="prism L=3", backend="triton", compile=True, ckpt=False, T=2048, B=16,
                 error="out of memory")]
    lines = bench.table(rows).splitlines()
    assert "| 1.20 | 30.0% | 10.0 | 0.40 |" in lines[2]   # 300 / 250, 10 / 25
    assert "out of memory" in lines[5]


def test_kernel_categories():
    from profile_model import category
    assert category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", []) == "matmuls"
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", ["linear_cross_entropy"]) == "matmuls"
    assert category("triton_red_fused__to_copy_exp_sub_0", ["linear_cross_entropy"]) == "loss"
    assert category("_fwd_state", ["ChunkPrismFunction"]) == "recurrence kernels"
    assert category("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", []) == "recurrence kernels"
    assert category("_conv_bwd", ["CausalConvFunctionBackward"]) == "conv"
    # Inductor's fused kernels named after our ops' outputs are elementwise code
    assert category("triton_per_fused__fused_rms_norm__fused_rms_norm_backward__to_copy_chunk_bwd_4",
                    ["CompiledFunctionBackward"]) == "norms"
    assert category("triton_poi_fused_chunk_fwd_gelu_mul_sigmoid_5", []) == "other"
    # a torch op inside our custom ops is filed under the op that launched it
    assert category("reduce_kernel", ["aten::sum", "prism_kernel::conv_bwd"]) == "conv"
    assert category("elementwise_kernel", ["aten::copy_", "prism_kernel::chunk_bwd"]) == "recurrence kernels"
    # the recurrence's own helpers count as recurrence whatever the launcher stack looks like
    for name in ("_fwd_w", "_fwd_rows", "_l2norm_fwd", "_l2norm_bwd"):
        assert category(name, []) == "recurrence kernels", name
    assert category("triton_per_fused__to_copy_mean_mul_pow_rsqrt_3", []) == "norms"
    assert category("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", []) == "optimizer"
    assert category("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>",
                    ["aten::copy_"]) == "copies/casts"
    assert category("flash_fwd_kernel", []) == "attention"
    assert category("triton_poi_fused_mul_silu_4", []) == "other"


def test_gpu_test_runner_counts_only_passes(tmp_path):
    """bench/run_gpu_tests.py (one process per test): a skip, a failure, a test past its time
    and a file that does not import are each reported as such, and only all-passed exits 0."""
    (tmp_path / "test_mixed.py").write_text(
        "import time, pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "def test_pass(): assert True\n"
        "def test_fail(): assert False\n"
        "def test_skip(): pytest.skip('a missing package')\n"
        "def test_hangs(): time.sleep(600)\n")
    (tmp_path / "test_broken.py").write_text("import a_module_that_is_not_there\n")
    log = tmp_path / "log.txt"
    r = subprocess.run([sys.executable, "bench/run_gpu_tests.py", str(tmp_path), "-j", "4",
                        "--timeout", "20", "--log", str(log)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = log.read_text().splitlines()
    assert lines[0].startswith("1 of 4 passed") and "1 collection errors" in lines[0], lines[0]
    outcomes = {line.split()[2].rpartition("::")[2]: line.split()[0] for line in lines
                if "::" in line and not line.startswith(" ")}
    assert outcomes == {"test_pass": "passed", "test_fail": "failed", "test_skip": "skipped",
                        "test_hangs": "timeout"}, outcomes
    assert any("test_broken.py" in line for line in lines if line.startswith("collection error"))

    (tmp_path / "test_broken.py").unlink()
    (tmp_path / "test_mixed.py").write_text("import pytest\n@pytest.mark.gpu\ndef test_pass(): pass\n"
                                            "def test_not_marked(): assert False\n")
    r = subprocess.run([sys.executable, "bench/run_gpu_tests.py", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "1 of 1 passed" in r.stdout, r.stdout + r.stderr


def test_gpu_test_runner_runs_exclusive_tests_alone(tmp_path):
    """A test marked exclusive (most of the GPU's memory) runs after the others with none beside
    it; the rest still run several at once. Each test leaves a file while it runs."""
    (tmp_path / "running").mkdir()
    (tmp_path / "test_share.py").write_text(
        "import os, time, pytest\n"
        f"RUN = {str(tmp_path / 'running')!r}\n"
        "def hold(name, secs):\n"
        "    open(os.path.join(RUN, name), 'w').close()\n"
        "    others = set()\n"
        "    for _ in range(int(secs * 10)):\n"
        "        others |= set(os.listdir(RUN)) - {name}\n"
        "        time.sleep(0.1)\n"
        "    os.remove(os.path.join(RUN, name))\n"
        "    return others\n"
        "@pytest.mark.gpu\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "def test_shared(i): assert hold(f'shared{i}', 6)   # saw another test running\n"
        "@pytest.mark.gpu\n"
        "@pytest.mark.exclusive\n"
        "@pytest.mark.parametrize('i', range(2))\n"
        "def test_big(i):\n"
        "    others = hold(f'big{i}', 2)\n"
        "    assert not others, others\n")
    r = subprocess.run([sys.executable, "bench/run_gpu_tests.py", str(tmp_path), "-j", "4"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "5 of 5 passed" in r.stdout and "2 of them exclusive" in r.stdout, \
        r.stdout + r.stderr
    order = [line.split()[-3] for line in r.stdout.splitlines() if line.startswith("[")]
    assert [t.rpartition("::")[2].startswith("test_big") for t in order] == [False] * 3 + [True] * 2, order


def test_decode_front_ends_run_on_cpu_and_write_the_json(tmp_path):
    """bench/bench_decode.py --front_ends on CPU with tiny models: every front end (Model.generate,
    the export's generate() and transformers' loop over it, sample.py, the lm-eval adapter) runs
    on one checkpoint per model and lands in the JSON, against Model.generate."""
    out = tmp_path / "front_ends.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules")}
    r = subprocess.run([sys.executable, "bench/bench_decode.py", "--front_ends", "--device", "cpu", "--tiny",
                        "--models", "gdn,hybrid", "--prompt", "8", "--new_tokens", "6", "--reps", "1",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.load(open(out))
    assert report["device"] == "cpu" and report["tiny"] is True and "| front end |" in report["table"]
    ends = ["Model.generate", "export generate()", "export generate(), transformers' loop", "sample.py",
            "lm-eval generate_until"]
    assert [(x["model"], x["front_end"]) for x in report["rows"]] == [(m, e) for m in ("gdn", "hybrid") for e in ends]
    for row in report["rows"]:
        assert "error" not in row, row
        assert row["new_tokens"] == 6 and row["tok_s"] > 0 and row["vs_model_generate"] > 0
    assert [x["vs_model_generate"] for x in report["rows"] if x["front_end"] == "Model.generate"] == [1.0, 1.0]
