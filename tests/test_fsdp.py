"""FSDP2 (train.py --fsdp=True) on CPU with gloo, float32: 2 sharded ranks follow the
single-process loss trajectory for the same global batch; sharded (DCP) checkpoints resume
exactly, on 2 ranks and on 1 (resharded); they verify, fall back and rotate like the files; and
one command makes a single-file checkpoint of them that loads and resumes without FSDP."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoint
from test_ddp import torchrun
from test_train import TINY, make_dataset, read_log

ROOT = Path(__file__).resolve().parent.parent

TOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    """One process without FSDP and 2 FSDP ranks, 6 iterations each with checkpoints at 3 and 6
    (the tiny model is a hybrid with tied embeddings: PRISM layer 0, attention layer 1)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    data = make_dataset(tmp / "data")
    common = TINY + [f"--data_dir={data}", "--dataset=pat", "--gradient_accumulation_steps=4",
                     "--eval_interval=3", "--eval_iters=3", "--max_iters=6"]
    assert train_main(common + [f"--out_dir={tmp / 'one'}"]) == 0
    r = torchrun(common + [f"--out_dir={tmp / 'two'}", "--fsdp=True"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 seqs x 2 micro-steps x 2 ranks" in r.stdout and "world 2 (FSDP)" in r.stdout
    return tmp, common


def train_main(argv):
    import train
    return train.main(argv)


def resume_copy(tmp, name, drop="ckpt_0000006"):
    """A copy of the 2-rank run's out_dir with its last checkpoint removed: resuming it redoes 4-6."""
    dst = tmp / name
    shutil.copytree(tmp / "two", dst)
    shutil.rmtree(dst / drop)
    return dst


def assert_close(got, ref, iters, tol=TOL):
    for i in iters:
        assert abs(got[i]["loss"] - ref[i]["loss"]) <= tol, (i, got[i]["loss"], ref[i]["loss"])
        assert got[i]["tokens"] == ref[i]["tokens"]


def test_two_ranks_follow_one_process(runs):
    tmp, _ = runs
    one, one_recs = read_log(tmp / "one")
    two, two_recs = read_log(tmp / "two")
    assert sorted(two) == sorted(one) == list(range(1, 7))
    assert_close(two, one, range(1, 7))
    for i in one:
        assert two[i]["grad_norm"] == pytest.approx(one[i]["grad_norm"], abs=TOL)
    vals = lambda recs: [x["val_loss"] for x in recs if "val_loss" in x]
    assert len(vals(two_recs)) == 3 and vals(two_recs) == pytest.approx(vals(one_recs), abs=TOL)
    # sharded: one directory per checkpoint, a shard file per rank, no single file anywhere
    ckpts = checkpoint.list_checkpoints(tmp / "two")
    assert [os.path.basename(p) for p in ckpts] == ["ckpt_0000006", "ckpt_0000003"]
    files = sorted(os.listdir(ckpts[0]))
    assert sum(f.endswith(".distcp") for f in files) == 2 and "sha256" in files and ".metadata" in files
    assert not list((tmp / "two").glob("*.pt"))
    state = checkpoint.load_sharded_state(ckpts[0], ("model_args", "iter_num", "data_pos"))
    assert state["iter_num"] == 6 and state["data_pos"] == 6 * 16 and state["world_size"] == 2
    assert len(state["rng"]) == 2


def test_resume_on_two_ranks_is_exact(runs):
    tmp, common = runs
    out = resume_copy(tmp, "two_resumed")
    r = torchrun(common + [f"--out_dir={out}", "--fsdp=True", "--init_from=resume"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming from" in r.stdout and "ckpt_0000003" in r.stdout
    got, _ = read_log(out)
    ref, _ = read_log(tmp / "two")
    assert sorted(got) == list(range(1, 7))
    for i in range(4, 7):  # the same ranks, the same reductions: the same numbers
        assert got[i]["loss"] == ref[i]["loss"], i


def test_resume_on_one_rank_reshards(runs, capsys):
    tmp, common = runs
    out = resume_copy(tmp, "one_resumed")
    # one process, FSDP over a group of one: DCP reads each tensor whole from the 2 ranks' shards
    assert train_main(common + [f"--out_dir={out}", "--fsdp=True", "--init_from=resume"]) == 0
    log = capsys.readouterr().out
    assert "world 1 (FSDP)" in log and "RNG states for 2 ranks, running 1" in log
    got, _ = read_log(out)
    one, _ = read_log(tmp / "one")
    assert_close(got, one, range(4, 7))
    assert checkpoint.load_sharded_state(out / "ckpt_0000006")["world_size"] == 1


def test_fsdp_resumes_from_a_single_file_checkpoint(runs):
    tmp, common = runs
    out = tmp / "from_file"
    shutil.copytree(tmp / "one", out)
    for f in out.glob("ckpt_0000006.pt*"):
        f.unlink()
    # a run started without FSDP continues sharded: the file's tensors are cut into this rank's shards
    assert train_main(common + [f"--out_dir={out}", "--fsdp=True", "--init_from=resume"]) == 0
    got, _ = read_log(out)
    one, _ = read_log(tmp / "one")
    assert_close(got, one, range(4, 7))
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(out)] == [
        "ckpt_0000006", "ckpt_0000003.pt"]


def test_fsdp_fine_tunes_from_given_weights(runs):
    tmp, common = runs
    out = tmp / "finetune"
    src = tmp / "one" / "ckpt_0000003.pt"
    assert train_main(common + [f"--out_dir={out}", "--fsdp=True", f"--init_from={src}", "--max_iters=1"]) == 0
    _, recs = read_log(out)
    _, one_recs = read_log(tmp / "one")
    first = next(r["val_loss"] for r in recs if "val_loss" in r)  # iter 0: the given weights, sharded
    assert first == pytest.approx(next(r["val_loss"] for r in one_recs if r.get("iter") == 3 and "val_loss" in r),
                                  abs=TOL)


def test_consolidated_checkpoint_loads_and_resumes_without_fsdp(runs, capsys):
    tmp, common = runs
    src = tmp / "two" / "ckpt_0000003"
    out = tmp / "consolidated"
    out.mkdir()
    dst = out / "ckpt_0000003.pt"
    assert checkpoint.main(["consolidate", str(src), str(dst)]) == 0
    assert checkpoint.verify(str(dst)) is True
    model, meta = checkpoint.load_model(str(dst))  # what sample.py / eval / the HF export call
    assert meta["iter_num"] == 3 and meta["world_size"] == 2
    one = torch.load(tmp / "one" / "ckpt_0000003.pt", weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.allclose(v, one["model"][k], atol=TOL), k
    ckpt = torch.load(dst, weights_only=True)
    assert set(ckpt["optimizer"]["state"]) == set(one["optimizer"]["state"])  # indexed as the file format
    for i, s in one["optimizer"]["state"].items():
        assert torch.allclose(ckpt["optimizer"]["state"][i]["exp_avg"], s["exp_avg"], atol=TOL), i
    # a run without FSDP resumes from it and follows the uninterrupted one
    assert train_main(common + [f"--out_dir={out}", "--init_from=resume"]) == 0
    got, _ = read_log(out)
    ref, _ = read_log(tmp / "one")
    assert_close(got, ref, range(4, 7))
    # a sharded directory handed to what reads files says how to consolidate it
    with pytest.raises(checkpoint.CheckpointError, match="consolidate"):
        checkpoint.load_model(str(src))
    assert checkpoint.main(["consolidate", str(tmp / "one" / "ckpt_0000003.pt"), str(out / "x.pt")]) == 2
    assert "is not a sharded checkpoint" in capsys.readouterr().err


def test_corrupt_shard_is_moved_aside_and_the_older_checkpoint_used(runs):
    tmp, _ = runs
    out = tmp / "corrupt"
    shutil.copytree(tmp / "two", out)
    shard = out / "ckpt_0000006" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    warnings = []
    path, state = checkpoint.load_latest_checkpoint(out, ("model", "optimizer", "model_args", "iter_num"),
                                                    log=warnings.append)
    assert path.endswith("ckpt_0000003") and state["iter_num"] == 3
    assert "does not match the manifest" in warnings[0] and (out / "ckpt_0000006.corrupt").is_dir()
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(out)] == ["ckpt_0000003"]
    # an unfinished save (no manifest yet) is neither listed nor resumed from
    shutil.copytree(out / "ckpt_0000003", out / "ckpt_0000009.tmp")
    (out / "ckpt_0000009.tmp" / "sha256").unlink()
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(out)] == ["ckpt_0000003"]
    # rotation deletes whole directories, keeping the newest ones
    for it in (12, 15):
        shutil.copytree(out / "ckpt_0000003", out / f"ckpt_{it:07d}")
    checkpoint.rotate(out, keep=2)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(out)] == ["ckpt_0000015", "ckpt_0000012"]


@pytest.mark.gpu
def test_fsdp_bf16_compiled_on_one_gpu(tmp_path):
    """needs a CUDA GPU: FSDP over one rank with bf16 weights, float32 reduction, the Triton
    kernels and torch.compile trains, saves sharded and resumes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    data = make_dataset(tmp_path / "data")
    common = [a for a in TINY if not a.startswith(("--device", "--dtype"))] + [
        f"--data_dir={data}", "--dataset=pat", "--gradient_accumulation_steps=2", "--eval_interval=4",
        "--eval_iters=2", "--max_iters=4", "--fsdp=True", "--compile=True", "--device=cuda", "--dtype=bfloat16",
        f"--out_dir={tmp_path / 'o'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *common], cwd=ROOT, capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend triton" in r.stdout and "(FSDP)" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *common, "--max_iters=6", "--init_from=resume"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    got, _ = read_log(tmp_path / "o")
    assert sorted(got) == list(range(1, 7)) and all(torch.isfinite(torch.tensor(got[i]["loss"])) for i in got)
