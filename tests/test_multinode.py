"""README's multi-node launch, shaped as two nodes on one host: two torchrun processes with
--nnodes=2 and their own --node_rank, meeting through c10d rendezvous on localhost (gloo on
CPU). They must train exactly as one process with the same global batch."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from test_train import TINY, make_dataset, read_log

ROOT = Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_launch_matches_one_process(tmp_path):
    data = make_dataset(tmp_path / "data")
    common = TINY + [f"--data_dir={data}", "--dataset=pat", "--gradient_accumulation_steps=4",
                     "--eval_interval=2", "--eval_iters=2", "--max_iters=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, str(ROOT / "train.py"), *common, f"--out_dir={tmp_path / 'one'}"],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stdout + one.stderr

    port = free_port()
    nodes = []
    for rank in (0, 1):  # the README command, with localhost as $MASTER and 1 process per node
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               f"--node_rank={rank}", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}",
               "--rdzv_id=prism_test", str(ROOT / "train.py"), *common, f"--out_dir={tmp_path / 'two'}"]
        nodes.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env))
    outs = []
    for p in nodes:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            raise
    for p, out in zip(nodes, outs):
        assert p.returncode == 0, out
    assert "2 ranks" in outs[0]

    ref, _ = read_log(tmp_path / "one")
    got, _ = read_log(tmp_path / "two")
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    for i in ref:
        assert got[i]["loss"] == pytest.approx(ref[i]["loss"], rel=1e-5, abs=1e-6), i
