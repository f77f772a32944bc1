"""
Where lm-eval tasks' data comes from: the Hugging Face hub, its local cache, or a copy in a folder.

    python eval/task_data.py data/eval_tasks                     # where the hub is reachable: the
                                                                 # ten tasks eval/harness.py runs
    python eval/task_data.py data/eval_tasks --tasks piqa,sciq   # some of them, or other lm-eval tasks
    python eval/harness.py --ckpt out/prism_130m/ckpt.pt --tasks_dir data/eval_tasks   # anywhere, offline

The folder holds, for each task, every split its lm-eval YAML names (training, validation, test,
few-shot) as DIR/<task>/<split>.parquet, the dataset exactly as datasets.load_dataset returns it
(rows in order, features kept), and DIR/<task>/source.json (the dataset it came from, rows per
split, versions). DIR/<task>.yaml is a task YAML that includes lm-eval's own YAML of the task and
replaces only where its data is read from, so prompts, metrics and splits stay lm-eval's:
`lm_eval --include_path DIR` reads it on the machine that wrote it. eval/harness.py --tasks_dir
writes the same YAMLs afresh into a temporary folder (the copy may have moved, lm-eval may live
elsewhere), checks every file first and turns the hub off, so nothing waits on network retries.

Without a copy, eval/harness.py asks whether the hub answers (3 s at most); when it does not, the
built-in tasks' datasets are looked up in the local datasets cache before lm-eval starts, and the
ones missing are named with the command above.
"""
import argparse
import datetime
import io
import json
import os
import sys
import tempfile
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import yaml  # noqa: E402

from cli import HelpFormatter  # noqa: E402
from fileio import atomic_write, write_json  # noqa: E402

FETCH = "python eval/task_data.py"

# The YAML of each task eval/harness.py runs by default, under lm_eval/tasks/: found without
# lm-eval's ~15 s scan of all its tasks. Other tasks are looked up through that scan.
TASK_YAMLS = {
    "wikitext": "wikitext/wikitext.yaml",
    "lambada_openai": "lambada/lambada_openai.yaml",
    "piqa": "piqa/piqa.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "winogrande": "winogrande/default.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "sciq": "sciq/sciq.yaml",
}


class TaskDataMissing(Exception):
    """Some tasks have no data here: the message names each task, what is missing, and the command
    that fetches it."""


def lm_eval_tasks_dir():
    import lm_eval
    return os.path.join(os.path.dirname(os.path.abspath(lm_eval.__file__)), "tasks")


def task_yaml(task, tm=None):
    """(path of the task's YAML, that path relative to lm_eval/tasks/ or None if outside it).
    tm: the TaskManager whose index decides (it may hold --include_path tasks); None: TASK_YAMLS,
    or for other tasks a TaskManager built here (lm-eval's slow scan)."""
    root = lm_eval_tasks_dir()
    if task in TASK_YAMLS and tm is None:
        return os.path.join(root, TASK_YAMLS[task]), TASK_YAMLS[task]
    if tm is None:
        from lm_eval.tasks import TaskManager
        tm = TaskManager()
    entry = tm.task_index.get(task)  # an Entry; in older lm-eval a dict (-1: no YAML)
    found = entry.get("yaml_path") if isinstance(entry, dict) else getattr(entry, "yaml_path", None)
    if not isinstance(found, (str, os.PathLike)):
        raise ValueError(f"{task}: not an lm-eval task defined by a YAML file")
    path = os.path.abspath(found)
    rel = os.path.relpath(path, root)
    return path, (None if rel.startswith("..") else rel)


class _YamlLoader(yaml.SafeLoader):
    """lm-eval's task YAML dialect: `!function module.name` is kept as text (only the dataset
    fields are read here)."""


_YamlLoader.add_constructor("!function", lambda loader, node: "!function " + loader.construct_scalar(node))


def read_task_yaml(path):
    """A task YAML as a dict, its `include`s merged in first (its own keys win), as lm-eval does."""
    with open(path) as f:
        cfg = yaml.load(f, _YamlLoader)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a task YAML (a mapping)")
    includes = cfg.pop("include", [])
    merged = {}
    for inc in [includes] if isinstance(includes, str) else includes:
        merged.update(read_task_yaml(os.path.join(os.path.dirname(path), inc)))
    merged.update(cfg)
    return merged


def dataset_of(task, cfg):
    """(dataset path, config name or None, other load_dataset kwargs) of a task's YAML config."""
    if "class" in cfg or "custom_dataset" in cfg or not cfg.get("dataset_path"):
        raise ValueError(f"{task}: its YAML names no hub dataset (dataset_path); it cannot be copied")
    return cfg["dataset_path"], cfg.get("dataset_name"), dict(cfg.get("dataset_kwargs") or {})


def task_splits(cfg):
    """The splits lm-eval reads for a task: evaluation, training (few-shot examples, built when
    the task is) and an explicit few-shot split, in that order, once each."""
    fewshot = cfg.get("fewshot_config") or {}
    names = [cfg.get("test_split"), cfg.get("validation_split"), cfg.get("training_split"),
             cfg.get("fewshot_split"), fewshot.get("split") if isinstance(fewshot, dict) else None]
    return list(dict.fromkeys(n for n in names if n))


def fetch_command(out_dir, tasks):
    """The command that writes these tasks' copy into out_dir (run where the hub is reachable)."""
    tasks = list(dict.fromkeys(tasks))
    return f"{FETCH} {out_dir}" + ("" if tasks == list(TASK_YAMLS) else f" --tasks {','.join(tasks)}")


def describe(path, name):
    return repr(path) + (f" (config {name!r})" if name is not None else "")


# ---- writing a copy
def write_task(out_dir, task, ds, yaml_rel):
    """Write one task's copy into out_dir from ds, the DatasetDict load_dataset gave for it:
    <task>/<split>.parquet for every split the task reads, <task>/source.json, <task>.yaml."""
    cfg = read_task_yaml(os.path.join(lm_eval_tasks_dir(), yaml_rel))
    path, name, kwargs = dataset_of(task, cfg)
    splits = task_splits(cfg)
    lacking = [s for s in splits if s not in ds]
    if lacking:
        raise ValueError(f"{task}: dataset {describe(path, name)} has splits {sorted(ds)}, "
                         f"the task reads {splits} (lacking {lacking})")
    import datasets
    import lm_eval
    rows = {}
    bars = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one bar per split for a write that takes milliseconds
    try:
        for split in splits:
            buf = io.BytesIO()
            ds[split].to_parquet(buf)
            atomic_write(os.path.join(out_dir, task, f"{split}.parquet"), buf.getvalue())
            rows[split] = len(ds[split])
    finally:
        if bars:
            datasets.enable_progress_bars()
    write_json(os.path.join(out_dir, task, "source.json"), {  # written last: the copy is whole
        "task": task, "yaml": yaml_rel, "dataset_path": path, "dataset_name": name,
        "dataset_kwargs": kwargs, "rows": rows, "lm_eval": lm_eval.__version__,
        "datasets": datasets.__version__,
        "fetched": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    write_task_yaml(out_dir, task, out_dir, yaml_rel, splits)


def write_task_yaml(data_dir, task, yaml_dir, yaml_rel, splits):
    """yaml_dir/<task>.yaml: lm-eval's own YAML of the task (by absolute path: the include), its
    dataset replaced by the parquet files of the copy in data_dir."""
    files = {s: os.path.abspath(os.path.join(data_dir, task, f"{s}.parquet")) for s in splits}
    cfg = {"include": os.path.join(lm_eval_tasks_dir(), yaml_rel), "task": task,
           "dataset_path": "parquet", "dataset_name": None, "dataset_kwargs": {"data_files": files}}
    atomic_write(os.path.join(yaml_dir, f"{task}.yaml"),
                 f"# lm-eval's {yaml_rel}, its data read from the copy written by eval/task_data.py\n"
                 + yaml.safe_dump(cfg, sort_keys=False))


def fetch(out_dir, tasks, tm=None):
    """Download each task's dataset from the hub (datasets.load_dataset, as lm-eval calls it) and
    write its copy into out_dir."""
    import datasets
    for task in tasks:
        path, rel = task_yaml(task, tm)
        if rel is None:
            raise ValueError(f"{task}: {path} is not one of lm-eval's own tasks; copy its data by hand")
        ds_path, name, kwargs = dataset_of(task, read_task_yaml(path))
        print(f"{task}: {describe(ds_path, name)}", flush=True)
        try:
            ds = datasets.load_dataset(ds_path, name, **kwargs)
        except (ConnectionError, FileNotFoundError) as e:  # no hub, and not in the cache
            raise TaskDataMissing(f"{task}: dataset {describe(ds_path, name)} is neither reachable "
                                  f"nor in the local datasets cache ({e})") from e
        write_task(out_dir, task, ds, rel)
    print(f"wrote {len(tasks)} task(s) into {out_dir}; score with: python eval/harness.py "
          f"--ckpt CKPT --tasks_dir {out_dir}")


# ---- reading a copy
def check_copy(data_dir, tasks):
    """{task: (its YAML path relative to lm_eval/tasks/, its splits)} for a copy in data_dir that
    this lm-eval can read; TaskDataMissing naming every task whose copy is absent, incomplete or
    of another dataset than this lm-eval's YAML reads."""
    import pyarrow.parquet as pq
    found, problems = {}, []
    for task in tasks:
        src_file = os.path.join(data_dir, task, "source.json")
        if not os.path.isfile(src_file):
            problems.append((task, f"no copy of this task ({src_file} is missing)"))
            continue
        try:
            with open(src_file) as f:
                src = json.load(f)
            yaml_rel, rows = src["yaml"], src["rows"]
        except (ValueError, KeyError, TypeError) as e:
            problems.append((task, f"{src_file} is malformed ({e!r})"))
            continue
        yaml_path = os.path.join(lm_eval_tasks_dir(), yaml_rel)
        if not os.path.isfile(yaml_path):
            problems.append((task, f"this lm-eval has no {yaml_rel} (the copy was written by "
                                   f"lm-eval {src.get('lm_eval')})"))
            continue
        cfg = read_task_yaml(yaml_path)
        path, name, _ = dataset_of(task, cfg)
        if (path, name) != (src.get("dataset_path"), src.get("dataset_name")):
            problems.append((task, f"the copy holds {describe(src.get('dataset_path'), src.get('dataset_name'))}, "
                                   f"this lm-eval's task reads {describe(path, name)}"))
            continue
        splits = task_splits(cfg)
        for split in splits:
            f = os.path.join(data_dir, task, f"{split}.parquet")
            if not os.path.isfile(f):
                problems.append((task, f"{f} is missing"))
                continue
            try:
                n = pq.read_metadata(f).num_rows
            except Exception as e:  # pyarrow says ArrowInvalid, OSError, ... for a broken file
                problems.append((task, f"{f} is not a readable parquet file ({e})"))
                continue
            if n != rows.get(split):
                problems.append((task, f"{f} has {n} rows, {src_file} says {rows.get(split)}"))
        if not any(t == task for t, _ in problems):
            found[task] = (yaml_rel, splits)
    if problems:
        raise TaskDataMissing("\n".join(
            [f"the task copy in {data_dir} lacks data for {len(set(t for t, _ in problems))} task(s):"]
            + [f"  {t}: {what}" for t, what in problems]
            + ["Fetch them where the hub is reachable, then bring the folder here:",
               "  " + fetch_command(data_dir, [t for t, _ in problems])]))
    return found


def copy_yamls(data_dir, tasks):
    """Check the copy (check_copy), write its task YAMLs for this machine into a temporary folder
    (removed at exit) and return that folder, for TaskManager's include_path."""
    found = check_copy(data_dir, tasks)
    yaml_dir = tempfile.mkdtemp(prefix="prism_tasks_")
    import atexit
    import shutil
    atexit.register(shutil.rmtree, yaml_dir, True)
    for task, (yaml_rel, splits) in found.items():
        write_task_yaml(data_dir, task, yaml_dir, yaml_rel, splits)
    return yaml_dir


# ---- the hub and the local cache
def hub_reachable(timeout=3.0):
    """False when HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set or the hub's endpoint does not
    answer within timeout seconds (any HTTP answer counts: the network works)."""
    import datasets
    if datasets.config.HF_HUB_OFFLINE:
        return False
    from huggingface_hub import constants
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        pass
    except (OSError, ValueError):  # no route, no name, refused, timed out; a malformed HF_ENDPOINT
        return False
    return True


def go_offline():
    """Hub off for this process and its children: datasets reads the local cache or local files
    at once instead of retrying the network."""
    import datasets
    from huggingface_hub import constants
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    constants.HF_HUB_OFFLINE = True


def check_cache(tasks, tm=None):
    """With the hub off: TaskDataMissing naming every task whose dataset the local datasets cache
    lacks (load_dataset_builder, the first step of the task's own load_dataset, fails). Tasks
    without a YAML of their own (groups, Python tasks) are left to lm-eval."""
    import datasets
    missing = []
    for task in tasks:
        try:
            path, name, kwargs = dataset_of(task, read_task_yaml(task_yaml(task, tm)[0]))
        except ValueError:
            continue
        try:
            datasets.load_dataset_builder(path, name, **kwargs)
        except (ConnectionError, FileNotFoundError) as e:  # offline: "Couldn't reach ... on the Hub"
            missing.append((task, path, name, e))
    if missing:
        from huggingface_hub import constants
        raise TaskDataMissing("\n".join(
            [f"{len(missing)} task(s) have no data here: the hub is out of reach (or HF_HUB_OFFLINE / "
             f"HF_DATASETS_OFFLINE is set) and the local datasets cache ({constants.HF_HOME}) lacks them:"]
            + [f"  {t}: dataset {describe(p, n)} is not in the cache" for t, p, n, _ in missing]
            + ["Fetch a copy where the hub is reachable, bring the folder here and score from it:",
               "  " + fetch_command("DIR", [t for t, *_ in missing]),
               "  python eval/harness.py --ckpt CKPT --tasks_dir DIR"]))


def main(argv=None):
    p = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]) + "\n\nNeeds the hub (or "
                                "a datasets cache holding the tasks' datasets); no GPU.",
                                formatter_class=HelpFormatter)
    p.add_argument("out_dir", help="folder to write the copy into (created; tasks already there are replaced)")
    p.add_argument("--tasks", default=",".join(TASK_YAMLS), help="comma list of lm-eval tasks")
    args = p.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        p.error("--tasks is empty")
    tm = None
    if any(t not in TASK_YAMLS for t in tasks):
        from lm_eval.tasks import TaskManager
        tm = TaskManager()
        unknown = [t for t in tasks if t not in tm.all_tasks]
        if unknown:
            p.error(f"unknown lm-eval task(s) {unknown}")
    if not hub_reachable():  # what the local datasets cache holds can still be copied
        print("the hub is out of reach: copying from the local datasets cache", flush=True)
        go_offline()
    try:
        fetch(args.out_dir, tasks, tm)
    except (TaskDataMissing, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
