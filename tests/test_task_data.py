"""eval/task_data.py: a local copy of the default tasks' data, and scoring from it offline.

No network: the "downloaded" datasets are DatasetDicts built here in each task's real schema, a
few rows each. Checked:
  * the writer puts every split the task reads into parquet, and the YAMLs it writes give lm-eval's
    own task configs with only the dataset fields replaced;
  * fetch asks load_dataset for the dataset each task's YAML names;
  * eval/harness.py --tasks_dir scores all ten tasks from the copy, every document of every task,
    with the hub off;
  * a copy lacking a task or a file, a broken file or another dataset is named with the command
    that fetches it, in seconds, before any lm-eval output; so is a missing dataset offline
    without a copy;
  * hub_reachable: offline settings, a port that refuses, a server that answers.
"""
import http.server
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from eval import task_data  # noqa: E402
from eval.harness import main as eval_main  # noqa: E402
from test_eval import ROOT, _mistral_tokenizer_path, _save_ckpt, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ARC_ROWS = [{"id": "q1", "question": "What melts ice?", "answerKey": "B",
             "choices": {"text": ["cold", "heat", "dark"], "label": ["A", "B", "C"]}},
            {"id": "q2", "question": "Which is a planet?", "answerKey": "1",
             "choices": {"text": ["Mars", "Moon"], "label": ["1", "2"]}}]
# two rows per task, in the fields its lm-eval YAML (and helper functions) read
ROWS = {
    "wikitext": [{"page": " = Valkyria = \n Senjo no Valkyria 3 is a game , released in 2011 . \n"},
                 {"page": " = Short = \n A tiny page . \n"}],
    "lambada_openai": [{"text": "the cat sat on the mat"}, {"text": "she opened the door and saw it"}],
    "piqa": [{"goal": "open a jar", "sol1": "twist the lid", "sol2": "eat the lid", "label": 0},
             {"goal": "dry hands", "sol1": "use water", "sol2": "use a towel", "label": 1}],
    "hellaswag": [{"activity_label": "Baking", "ctx_a": "She mixes flour.", "ctx_b": "then she",
                   "endings": ["bakes it.", "sings.", "runs [title] off.", "naps."], "label": "0"},
                  {"activity_label": "Swimming", "ctx_a": "He jumps in.", "ctx_b": "he",
                   "endings": ["swims.", "flies.", "reads.", "cooks."], "label": "1"}],
    "winogrande": [{"sentence": "The cup fell because _ was slippery.", "option1": "the cup",
                    "option2": "the table", "answer": "1"},
                   {"sentence": "Anna thanked Bea because _ was kind.", "option1": "Anna",
                    "option2": "Bea", "answer": "2"}],
    "arc_easy": ARC_ROWS,
    "arc_challenge": ARC_ROWS[::-1],
    "boolq": [{"question": "is the sky blue", "passage": "The sky is blue on clear days.", "idx": 0, "label": 1},
              {"question": "is ice hot", "passage": "Ice is frozen water.", "idx": 1, "label": 0}],
    "openbookqa": [{"id": "7-1", "question_stem": "The sun is", "answerKey": "A",
                    "choices": {"text": ["a star", "a moon", "a rock", "a lake"], "label": ["A", "B", "C", "D"]}},
                   {"id": "7-2", "question_stem": "Plants need", "answerKey": "C",
                    "choices": {"text": ["salt", "sand", "light", "oil"], "label": ["A", "B", "C", "D"]}}],
    "sciq": [{"question": "What do plants make?", "distractor1": "rock", "distractor2": "salt",
              "distractor3": "iron", "correct_answer": "sugar", "support": " Plants make sugar."},
             {"question": "What is H2O?", "distractor1": "air", "distractor2": "fire",
              "distractor3": "earth", "correct_answer": "water", "support": ""}],
}
TASKS = list(task_data.TASK_YAMLS)
assert sorted(ROWS) == sorted(TASKS)


def splits_of(task):
    return task_data.task_splits(task_data.read_task_yaml(
        os.path.join(task_data.lm_eval_tasks_dir(), task_data.TASK_YAMLS[task])))


def fake_download(task, splits=None):
    """What load_dataset would return for the task: a DatasetDict with its splits, the split's
    name in every row (to tell the splits apart)."""
    return datasets.DatasetDict({s: datasets.Dataset.from_list([dict(r, split_name=s) for r in ROWS[task]])
                                 for s in (splits or splits_of(task))})


@pytest.fixture(scope="module")
def copy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("copy")
    for task, rel in task_data.TASK_YAMLS.items():
        task_data.write_task(str(d), task, fake_download(task), rel)
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok_path = _mistral_tokenizer_path()
    if tok_path is None:
        pytest.skip("mistral-common not installed")
    from tokenizer import load_tokenizer
    ck = tmp_path_factory.mktemp("run") / "ckpt.pt"
    _save_ckpt(ck, tiny_model(vocab=load_tokenizer(tok_path).vocab_size, n_embd=16))
    return ck, tok_path


def _offline_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_DATASETS_CACHE", "HF_HUB_CACHE")}
    env.update(HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    return env


# ------------------------------------------------------------------ writing the copy
def test_writer_writes_every_split_and_yamls_that_only_swap_the_data(copy_dir, tmp_path):
    for task in TASKS:
        src = json.loads((copy_dir / task / "source.json").read_text())
        cfg = task_data.read_task_yaml(os.path.join(task_data.lm_eval_tasks_dir(), src["yaml"]))
        assert (src["dataset_path"], src["dataset_name"]) == (cfg["dataset_path"], cfg.get("dataset_name"))
        assert set(src["rows"]) == set(splits_of(task))
        for split in splits_of(task):  # the parquet file gives back the rows, in order
            got = datasets.Dataset.from_parquet(str(copy_dir / task / f"{split}.parquet"))
            assert got.to_list() == fake_download(task)[split].to_list()
            assert src["rows"][split] == len(ROWS[task])
    assert {"train", "validation", "test"} <= set(json.loads((copy_dir / "wikitext" / "source.json").read_text())["rows"])

    # lm-eval reads our YAMLs (those in the copy, and those written for --tasks_dir) as its own
    # tasks with only the dataset fields replaced: same prompts, metrics, splits, helper functions
    root = task_data.lm_eval_tasks_dir()
    theirs = TaskManager(include_path=sorted({os.path.join(root, os.path.dirname(r))
                                              for r in task_data.TASK_YAMLS.values()}), include_defaults=False)
    for yaml_dir in (str(copy_dir), task_data.copy_yamls(str(copy_dir), TASKS)):
        ours = TaskManager(include_path=yaml_dir, include_defaults=False)
        for task in TASKS:
            a, b = dict(ours.task_index[task].cfg), dict(theirs.task_index[task].cfg)
            assert a.pop("dataset_path") == "parquet" and a.pop("dataset_name") is None
            files = a.pop("dataset_kwargs")["data_files"]
            assert files == {s: str(copy_dir / task / f"{s}.parquet") for s in splits_of(task)}
            b.pop("dataset_path"), b.pop("dataset_name", None), b.pop("dataset_kwargs", None)
            assert a == b and "output_type" in a and "metric_list" in a, task


def test_writer_refuses_a_dataset_without_a_split_the_task_reads(tmp_path):
    with pytest.raises(ValueError, match=r"piqa: .*'baber/piqa'.*lacking \['train'\]"):
        task_data.write_task(str(tmp_path), "piqa", fake_download("piqa", ["validation"]), "piqa/piqa.yaml")
    assert not (tmp_path / "piqa" / "source.json").exists()


def test_fetch_loads_the_dataset_each_yaml_names(tmp_path, monkeypatch, capsys):
    calls = []

    def load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        task = next(t for t in TASKS if (path, name) == expected[t])
        return fake_download(task)

    root = task_data.lm_eval_tasks_dir()
    expected = {t: (c["dataset_path"], c.get("dataset_name"))
                for t, c in ((t, TaskManager(include_path=os.path.join(root, os.path.dirname(r)),
                                             include_defaults=False).task_index[t].cfg)
                             for t, r in task_data.TASK_YAMLS.items())}
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    task_data.main([str(tmp_path / "copy"), "--tasks", "piqa,arc_challenge"])
    assert calls == [(*expected["piqa"], {}), (*expected["arc_challenge"], {})]
    assert expected["arc_challenge"] == ("allenai/ai2_arc", "ARC-Challenge")  # from the include
    assert sorted(os.listdir(tmp_path / "copy")) == ["arc_challenge", "arc_challenge.yaml", "piqa", "piqa.yaml"]
    assert f"--tasks_dir {tmp_path / 'copy'}" in capsys.readouterr().out
    task_data.check_copy(str(tmp_path / "copy"), ["piqa", "arc_challenge"])

    def offline(path, name=None, **kwargs):
        raise ConnectionError(f"Couldn't reach {path!r} on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(SystemExit, match=r"^error: sciq: dataset 'allenai/sciq' is neither reachable "
                                         r"nor in the local datasets cache \(Couldn't reach"):
        task_data.main([str(tmp_path / "other"), "--tasks", "sciq"])
    assert not (tmp_path / "other").exists()


# ------------------------------------------------------------------ scoring from the copy
def test_scoring_from_the_copy_gives_every_tasks_numbers(copy_dir, ckpt, tmp_path, monkeypatch):
    from huggingface_hub import constants
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # restored afterwards, as the hub switch
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    ck, tok_path = ckpt
    out = tmp_path / "eval.json"
    rec = eval_main(["--ckpt", str(ck), "--tasks_dir", str(copy_dir), "--output", str(out),
                     "--tokenizer", tok_path, "--device", "cpu", "--batch_size", "8",
                     "--bootstrap_iters", "0", "--log_samples"])
    assert os.environ["HF_HUB_OFFLINE"] == "1" and datasets.config.HF_HUB_OFFLINE and constants.HF_HUB_OFFLINE
    res = json.loads(out.read_text())["results"]
    assert sorted(res) == sorted(TASKS)
    ppl = {("wikitext", "word_perplexity,none"), ("wikitext", "byte_perplexity,none"),
           ("lambada_openai", "perplexity,none")}
    for task in TASKS:
        metrics = {m: v for m, v in res[task].items() if "," in m and "stderr" not in m}
        assert metrics, task
        for m, v in metrics.items():
            assert isinstance(v, float) and math.isfinite(v), (task, m, v)
            assert v > 1 if (task, m) in ppl else 0 <= v <= 1 or m.startswith("bits_per_byte"), (task, m, v)
        # every document of the evaluation split was scored, and it came from the copy
        samples = rec["samples"][task]
        assert len(samples) == len(ROWS[task])
        eval_split = splits_of(task)[0]
        assert {s["doc"]["split_name"] for s in samples} == {eval_split}
    assert {s["doc"]["question"] for s in rec["samples"]["arc_challenge"]} == {r["question"] for r in ARC_ROWS}
    assert res["lambada_openai"]["perplexity,none"] > 1 and res["wikitext"]["bits_per_byte,none"] > 0


def test_a_lacking_copy_is_named_fast_with_the_fetch_command(copy_dir, ckpt, tmp_path):
    ck, tok_path = ckpt
    bad = tmp_path / "copy"
    shutil.copytree(copy_dir, bad)
    os.remove(bad / "hellaswag" / "validation.parquet")
    shutil.rmtree(bad / "boolq")
    env = _offline_env(tmp_path)
    env.pop("HF_HUB_OFFLINE", None), env.pop("HF_DATASETS_OFFLINE", None)  # the copy alone says where data is
    cmd = [sys.executable, os.path.join(ROOT, "eval", "harness.py"), "--ckpt", str(ck), "--tasks_dir", str(bad),
           "--tokenizer", tok_path, "--device", "cpu"]
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    wall = time.time() - t0
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.splitlines() == [
        f"error: the task copy in {bad} lacks data for 2 task(s):",
        f"  hellaswag: {bad / 'hellaswag' / 'validation.parquet'} is missing",
        f"  boolq: no copy of this task ({bad / 'boolq' / 'source.json'} is missing)",
        "Fetch them where the hub is reachable, then bring the folder here:",
        f"  python eval/task_data.py {bad} --tasks hellaswag,boolq"], p.stderr[-3000:]
    assert p.stdout == ""
    assert wall < 10, wall


def test_check_copy_names_broken_and_foreign_files(copy_dir, tmp_path):
    bad = tmp_path / "copy"
    shutil.copytree(copy_dir, bad)
    (bad / "piqa" / "train.parquet").write_bytes((copy_dir / "piqa" / "train.parquet").read_bytes()[:50])
    src = json.loads((bad / "sciq" / "source.json").read_text())
    (bad / "sciq" / "source.json").write_text(json.dumps(dict(src, dataset_path="someone/sciq")))
    src = json.loads((bad / "boolq" / "source.json").read_text())
    (bad / "boolq" / "source.json").write_text(json.dumps(dict(src, rows=dict(src["rows"], train=7))))
    (bad / "winogrande" / "source.json").write_text("{")
    with pytest.raises(task_data.TaskDataMissing) as e:
        task_data.check_copy(str(bad), TASKS)
    lines = str(e.value).splitlines()
    assert lines[0] == f"the task copy in {bad} lacks data for 4 task(s):"
    assert lines[1].startswith(f"  piqa: {bad / 'piqa' / 'train.parquet'} is not a readable parquet file")
    assert lines[2].startswith(f"  winogrande: {bad / 'winogrande' / 'source.json'} is malformed")
    assert lines[3] == f"  boolq: {bad / 'boolq' / 'train.parquet'} has 2 rows, {bad / 'boolq' / 'source.json'} says 7"
    assert lines[4] == "  sciq: the copy holds 'someone/sciq', this lm-eval's task reads 'allenai/sciq'"
    assert lines[-1] == f"  python eval/task_data.py {bad} --tasks piqa,winogrande,boolq,sciq"
    assert task_data.check_copy(str(bad), ["wikitext", "arc_easy"]).keys() == {"wikitext", "arc_easy"}


def test_offline_without_a_copy_names_every_missing_dataset_fast(ckpt, tmp_path):
    """The default tasks with the hub off and an empty cache: the message first (no lm-eval
    warnings, no retries), within seconds, one line per task and the fetch command."""
    ck, tok_path = ckpt
    env = _offline_env(tmp_path)
    env.update(HF_HUB_OFFLINE="1")
    t0 = time.time()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "eval", "harness.py"), "--ckpt", str(ck),
                        "--tokenizer", tok_path, "--device", "cpu"],
                       env=env, capture_output=True, text=True, timeout=120)
    wall = time.time() - t0
    lines = p.stderr.splitlines()
    assert p.returncode == 1 and lines[0].startswith("error: 10 task(s) have no data here"), p.stderr[-3000:]
    assert [ln.split(":")[0].strip() for ln in lines[1:11]] == TASKS
    assert lines[2] == "  lambada_openai: dataset 'EleutherAI/lambada_openai' (config 'default') is not in the cache"
    assert lines[11:] == ["Fetch a copy where the hub is reachable, bring the folder here and score from it:",
                          "  python eval/task_data.py DIR", "  python eval/harness.py --ckpt CKPT --tasks_dir DIR"]
    assert wall < 10, wall


def test_hub_reachable(monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    assert not task_data.hub_reachable()
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused
    assert not task_data.hub_reachable(timeout=2)

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.handle_request, daemon=True).start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    try:
        assert task_data.hub_reachable(timeout=5)  # an error status is still an answer
    finally:
        server.server_close()


def test_an_exported_directory_scores_from_the_copy(copy_dir, ckpt, tmp_path, monkeypatch):
    """--ckpt an export_hf.py directory: its own tokenizer, eval.json inside it, its name as label."""
    import export_hf
    monkeypatch.setattr(export_hf, "verify", lambda *a: 0.0)  # loading it through transformers: test_hf.py
    ck, tok_path = ckpt
    out, _ = export_hf.export(str(ck), str(tmp_path / "hf" / "tiny"), tokenizer=tok_path)
    rec = eval_main(["--ckpt", out, "--tasks_dir", str(copy_dir), "--tasks", "piqa,wikitext",
                     "--device", "cpu", "--bootstrap_iters", "0"])
    saved = json.loads((tmp_path / "hf" / "tiny" / "eval.json").read_text())
    assert saved["label"] == rec["label"] == "tiny" and saved["ckpt"] == out
    assert sorted(saved["results"]) == ["piqa", "wikitext"]
    assert not (tmp_path / "hf" / "eval.json").exists()
