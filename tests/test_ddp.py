"""DDP through torchrun on CPU (gloo): 2 ranks with the same global batch follow the
single-process loss trajectory; rank 0 alone logs and saves; resume under DDP stays exact."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoint
import train
from test_train import TINY, make_dataset, read_log

ROOT = Path(__file__).resolve().parent.parent


def torchrun(argv, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train.py"), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def single(argv):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_ddp_matches_single_process_and_resumes(tmp_path):
    data = make_dataset(tmp_path / "data")
    common = TINY + [f"--data_dir={data}", "--dataset=pat", "--gradient_accumulation_steps=4",
                     "--eval_interval=3", "--eval_iters=3"]
    single(common + [f"--out_dir={tmp_path / 'one'}", "--max_iters=6"])
    one, one_recs = read_log(tmp_path / "one")

    # 2 ranks x 2 micro-steps (no all-reduce on the first) = the same 4 x 4 sequences per step
    r = torchrun(common + [f"--out_dir={tmp_path / 'two'}", "--max_iters=3"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 seqs x 2 micro-steps x 2 ranks" in r.stdout
    assert r.stdout.count("saved ") == 1  # rank 0 alone logs and saves
    r = torchrun(common + [f"--out_dir={tmp_path / 'two'}", "--max_iters=6", "--init_from=resume"])
    assert r.returncode == 0, r.stdout + r.stderr
    two, two_recs = read_log(tmp_path / "two")

    assert sorted(two) == sorted(one) == list(range(1, 7))
    for i in one:
        assert two[i]["loss"] == pytest.approx(one[i]["loss"], rel=1e-5, abs=1e-6), i
        assert two[i]["tokens"] == one[i]["tokens"]
    vals1 = [x["val_loss"] for x in one_recs if "val_loss" in x]
    vals2 = [x["val_loss"] for x in two_recs if "val_loss" in x]
    assert len(vals2) == len(vals1) == 3 and vals2 == pytest.approx(vals1, rel=1e-5)
    ckpt = torch.load(tmp_path / "two" / "ckpt.pt", weights_only=True)
    assert ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2 and ckpt["data_pos"] == 6 * 16
    assert len(checkpoint.list_checkpoints(tmp_path / "two")) == 2  # 3, 6


def test_ddp_rejects_accumulation_not_divisible_by_world(tmp_path, monkeypatch, capsys):
    # checked before any process group starts, so the environment torchrun sets is enough
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    data = make_dataset(tmp_path / "data")
    assert train.main(TINY + [f"--data_dir={data}", "--dataset=pat", f"--out_dir={tmp_path / 'o'}",
                              "--gradient_accumulation_steps=3", "--max_iters=2"]) == 2
    assert "gradient_accumulation_steps=3 (global) is not divisible by the world size 2" in capsys.readouterr().err


def children(pid):
    """Child process ids of pid (Linux /proc): torchrun starts its workers in process groups of their own."""
    kids = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:  # the field after the name is the state, then ppid
                    kids.append(int(d))
        except (OSError, IndexError, ValueError):
            pass  # gone since the listing
    return kids


def test_preempted_ddp_run_saves(tmp_path):
    """SLURM-style preemption: SIGTERM to every process of the job, torchrun and its workers. Each
    worker gets it twice (once directly, once forwarded by torchrun a moment later), which must
    count as one request: the step finishes and rank 0 saves. Micro-steps are slowed (a hook this
    test injects) so that the workers sit in a sleep, where each signal runs its handler at once
    instead of coalescing with the next."""
    import signal
    from test_train import wait_for_iter
    data = make_dataset(tmp_path / "data")
    out = tmp_path / "pre"
    script = tmp_path / "slow_train.py"
    script.write_text(f"import sys, time\nsys.path.insert(0, {str(ROOT)!r})\nimport train\n"
                      "real = train.forward_loss\n"
                      "train.forward_loss = lambda *a: (time.sleep(0.5), real(*a))[1]\n"
                      "sys.exit(train.main(sys.argv[1:]))\n")
    argv = TINY + [f"--data_dir={data}", "--dataset=pat", f"--out_dir={out}", "--max_iters=100000",
                   "--eval_interval=100000"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), *argv]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        wait_for_iter(out, 2, proc, timeout=240)
        workers = children(proc.pid)
        assert len(workers) == 2
        for pid in [proc.pid, *workers]:
            os.kill(pid, signal.SIGTERM)
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "received SIGTERM at iter" in text, text
    assert "stopped at once" not in text, text
    stopped = max(read_log(out)[0])
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == stopped and ckpt["world_size"] == 2
