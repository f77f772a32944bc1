"""The repo as a new user meets it: --help on every script shows its defaults and says when it
needs a GPU; README's install and test commands are the ones CI runs; every file and link the
docs name exists in a clone; the test suite has one thread-limiting fixture; no module imports
itself back through others."""
import argparse
import ast
import importlib.util
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# script -> (its entry point, words its --help must contain)
SCRIPTS = {
    "sample.py": ("main", []),
    "plot.py": ("main", []),
    "eval/harness.py": ("main", ["CUDA GPU"]),
    "eval/compare.py": ("main", []),
    "eval/task_data.py": ("main", []),
    "eval/probes.py": ("main", ["CUDA GPU"]),
    "data/prepare_slimpajama.py": ("get_args", []),
    "bench/bench_eval.py": ("main", ["needs a CUDA GPU"]),
    "bench/bench_prepare.py": ("main", []),
    "bench/realtext_corpus.py": ("main", []),
    "bench/profile_model.py": ("main", ["Needs a CUDA GPU"]),
    "bench/bench_varlen.py": ("main", ["Needs a CUDA GPU"]),
    "bench/bench_decode.py": ("main", ["needs a CUDA GPU"]),
    "bench/bench_bf16_gap.py": ("main", []),
    "bench/realtext_seeds.py": ("main", ["Needs a CUDA GPU"]),
}


def _is_set(default):
    return default is not argparse.SUPPRESS and default is not False and default not in (None, "", [])


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_help_shows_every_default(script, capsys, monkeypatch):
    """--help exits 0, and every option whose default is set shows that default."""
    entry, words = SCRIPTS[script]
    parsers = []
    real_parse = argparse.ArgumentParser.parse_args

    def grab(self, *a, **kw):
        parsers.append(self)
        return real_parse(self, *a, **kw)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, os.path.dirname(script))] + sys.path)
    if script.startswith("eval/"):  # a package: one module object (lm-eval registers the adapter once)
        mod = importlib.import_module(script[:-3].replace("/", "."))
    else:
        spec = importlib.util.spec_from_file_location(f"_help_{script.replace('/', '_')[:-3]}",
                                                      os.path.join(ROOT, script))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as e:
        getattr(mod, entry)(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage:")
    for w in words:
        assert w in " ".join(text.split()), f"{script} --help does not say {w!r}"
    (p,) = parsers
    for action in p._actions:
        if not action.option_strings or not _is_set(action.default) or action.required:
            continue
        opt = action.option_strings[-1]
        block = re.search(rf"^  {re.escape(opt)}\b.*?(?=^  -|\Z)", text, re.M | re.S)
        assert block, f"{script}: {opt} is not in --help"
        shown = " ".join(block.group(0).split())
        assert "default" in shown, f"{script} --help: {opt} does not show its default"


def test_one_thread_fixture_is_defined_once():
    """conftest.py's one_thread is the only one: a test file's own copy would shadow it."""
    tests = os.path.join(ROOT, "tests")
    defined = []
    for f in sorted(os.listdir(tests)):
        if f.endswith(".py"):
            for node in ast.walk(ast.parse(open(os.path.join(tests, f)).read())):
                if isinstance(node, ast.FunctionDef) and node.name == "one_thread":
                    defined.append(f)
    assert defined == ["conftest.py"]


def test_pytest_ini_says_gpu_tests_are_deselected():
    ini = open(os.path.join(ROOT, "pytest.ini")).read()
    gpu = re.search(r"^\s*gpu:(.*)$", ini, re.M).group(1)
    assert "deselected on CPU" in gpu and "skipped" not in gpu
    assert re.search(r"^addopts\s*=.*-m \"not gpu\"", ini, re.M)


def _tracked_text_files():
    for dirpath, dirnames, files in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("out", "data", "__pycache__")
                       or d == ".ci"]
        for f in files:
            if f.endswith((".py", ".md", ".sh", ".ini", ".txt")) or f == "run":
                yield os.path.join(dirpath, f)


DOCS = ["README.md", "BENCHMARKS.md", "PRISM_SPEC.md", "bench/KERNEL_NOTES.md"]
CITING = ["README.md", "BENCHMARKS.md"]


def test_spec_sections_cited_in_the_code_exist():
    """`PRISM_SPEC.md §2.3` anywhere in the repo names a section the spec in the repo has."""
    spec = open(os.path.join(ROOT, "PRISM_SPEC.md")).read()
    sections = set(re.findall(r"^#+ (\d+(?:\.\d+)*)\.? ", spec, re.M))
    cited = {}
    for f in _tracked_text_files():
        for n in re.findall(r"PRISM_SPEC(?:\.md)?,? §(\d+(?:\.\d+)*)", open(f, errors="replace").read()):
            cited.setdefault(n, os.path.relpath(f, ROOT))
    assert cited and not {n: f for n, f in cited.items() if n not in sections}


@pytest.mark.parametrize("doc", DOCS)
def test_doc_links_and_paths_resolve_in_a_clone(doc):
    """Markdown links, and in README/BENCHMARKS the repo paths they name (`bench/results/x.json`),
    all exist inside the repo: nothing points outside it (../shared) or at a file that is gone."""
    text = open(os.path.join(ROOT, doc)).read()
    base = os.path.dirname(os.path.join(ROOT, doc))
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target):
            path = os.path.normpath(os.path.join(base, target))
            if not path.startswith(ROOT + os.sep) or not os.path.exists(path):
                missing.append(target)
    if doc in CITING:  # the result files a table cites, the scripts a command runs
        for path in re.findall(r"`((?:bench|config|data|eval|tests)/[\w./-]+\.(?:py|sh|json|jsonl|log|txt|png|md|diff))",
                               text):
            if "*" not in path and "<" not in path and not os.path.exists(os.path.join(ROOT, path)):
                missing.append(path)
    assert not missing, f"{doc} names what a clone does not have: {missing}"


def test_ci_runs_readme_install_and_test_commands():
    """README's first commands are install, demo, tests; .ci/run runs the install and the tests
    word for word, and both pin the torch that requirements.txt pins, with its Triton."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    install, demo, tests = [ln.split("#")[0].strip() for ln in block.splitlines() if ln.strip()]
    ci = [ln.strip() for ln in open(os.path.join(ROOT, ".ci", "run")).read().splitlines()]
    assert any(ln.startswith(install + " ") or ln == install for ln in ci), install
    assert any(ln.endswith(" " + tests) for ln in ci), tests
    torch_pin = re.search(r"torch==([\d.]+)", install).group(1)
    req = requirement_specs()
    assert req["torch"].contains(torch_pin), (torch_pin, req["torch"])
    assert req["triton"].contains("3.7.1")  # the Triton CUDA torch 2.13 pins, and CPU CI installs
    assert demo.startswith("python ")


def requirement_specs():
    """{name: SpecifierSet} of requirements.txt's lines."""
    from packaging.requirements import Requirement
    specs = {}
    for ln in open(os.path.join(ROOT, "requirements.txt")).read().splitlines():
        ln = ln.split("#")[0].strip()
        if ln:
            r = Requirement(ln)
            specs[r.name.lower()] = r.specifier
    return specs


RESULTS = os.path.join(ROOT, "bench", "results")


def result_versions():
    """{"torch": {...}, "triton": {...}}: the versions the committed GPU results name (in their
    meta, env or versions blocks), local labels (+cu130) dropped."""
    import json
    found = {"torch": set(), "triton": set()}

    def walk(node, depth):
        if isinstance(node, dict) and depth < 3:
            for k, v in node.items():
                if k in found and isinstance(v, str):
                    found[k].add(v.split("+")[0])
                else:
                    walk(v, depth + 1)

    for dirpath, _, files in os.walk(RESULTS):
        for f in files:
            if f.endswith(".json"):
                with open(os.path.join(dirpath, f)) as fh:
                    walk(json.load(fh), 0)
    return found


def test_gpu_results_stack_is_installable_from_readme():
    """Every torch that a committed GPU result ran on is admitted by requirements.txt and has its
    install line in README, and so is every Triton those results name: a GPU user can rebuild
    the stack the figures and GPU tests came from."""
    versions = result_versions()
    assert versions["torch"] and versions["triton"]
    req = requirement_specs()
    readme = open(os.path.join(ROOT, "README.md")).read()
    for v in sorted(versions["torch"]):
        assert req["torch"].contains(v), f"requirements.txt's torch range leaves out {v}, which results ran on"
        assert f"pip install torch=={v} && pip install -r requirements.txt" in readme, \
            f"README has no install line for torch {v}, which results ran on"
    for v in sorted(versions["triton"]):
        assert req["triton"].contains(v), f"requirements.txt's triton range leaves out {v}, which results ran on"


def _docs_and_code_text():
    """The text of every doc and code file outside bench/results."""
    for path in _tracked_text_files():
        if not os.path.relpath(path, ROOT).startswith(os.path.join("bench", "results")):
            yield open(path, errors="replace").read()


def uncited_result_files():
    """Files under bench/results that no doc and no code names: by path, by a glob
    (`bench/results/x_*`), by a folder under bench/results, or beside a named file of the same
    stem (a run's .log next to its .json)."""
    import fnmatch
    cited = set()
    for text in _docs_and_code_text():
        for m in re.findall(r"bench/results/[\w.*/-]*", text):
            m = m.rstrip(".,/")
            if m != "bench/results":
                cited.add(m)
    stems = {os.path.splitext(c)[0] for c in cited}
    uncited = []
    for dirpath, _, files in os.walk(RESULTS):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/")
            if any(rel == c or fnmatch.fnmatch(rel, c) or rel.startswith(c + "/") for c in cited):
                continue
            if os.path.splitext(rel)[0] not in stems:
                uncited.append(rel)
    return sorted(uncited)


def test_every_result_file_is_cited():
    """bench/results holds what the docs or the code cite, nothing superseded (git keeps history)."""
    assert not uncited_result_files(), "cited nowhere: " + ", ".join(uncited_result_files())


# phrases that date a figure by the repo's history instead of by its card, date and commit
HISTORY_WORDS = ["run before", "day before", "this build", "earlier build", "current build",
                 "build before", "last passed", "not yet met"]


@pytest.mark.parametrize("doc", CITING)
def test_docs_state_results_without_history_words(doc):
    text = " ".join(open(os.path.join(ROOT, doc)).read().lower().split())
    found = [w for w in HISTORY_WORDS if w in text]
    assert not found, f"{doc} says {found}: name the card, date or commit instead"


# the repo's own modules, and the folders of scripts that import their neighbours by bare name
# (the script's folder is sys.path[0] when it runs). tests/ imports everything: not part of the graph.
SCRIPT_DIRS = ["bench", "data"]


def _repo_files():
    """Every .py file of the graph: the top level, its packages (folders with an __init__.py: eval/,
    and any other), and the scripts of SCRIPT_DIRS."""
    files = []
    for name in sorted(os.listdir(ROOT)):
        path = os.path.join(ROOT, name)
        if name.endswith(".py"):
            files.append(name)
        elif os.path.isdir(path) and (name in SCRIPT_DIRS or os.path.isfile(os.path.join(path, "__init__.py"))):
            for dirpath, dirnames, fs in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
                files += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in sorted(fs) if f.endswith(".py")]
    return files


def _resolve(dotted, bases):
    """The repo file that `import <dotted>` loads, looked up from each base folder in turn, or None
    (a package outside the repo). For a.b.c: a/b/c.py, a/b/c/__init__.py, then a/b.py and so on:
    `from a.b import c` names a submodule or something that a/b.py defines."""
    parts = dotted.split(".")
    for base in bases:
        for k in range(len(parts), 0, -1):
            stem = os.path.join(base, *parts[:k])
            for path in (stem + ".py", os.path.join(stem, "__init__.py")):
                if os.path.isfile(path):
                    return os.path.relpath(path, ROOT)
    return None


def import_graph():
    """{file: {imported file: line}} over _repo_files(), from every import statement anywhere in a
    file: at the top, inside functions (lazy imports), under try/if."""
    graph = {}
    for f in _repo_files():
        here = os.path.dirname(os.path.join(ROOT, f))
        bases = [ROOT] + ([here] if here != ROOT else [])
        edges = graph.setdefault(f, {})
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, f)).read(), f)):
            if isinstance(node, ast.Import):
                targets = [(a.name, bases) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                where = bases
                if node.level:  # from . import x / from ..pkg import y: relative to this file's package
                    up = here
                    for _ in range(node.level - 1):
                        up = os.path.dirname(up)
                    where = [up]
                mod = node.module or ""
                targets = [(f"{mod}.{a.name}" if mod else a.name, where) for a in node.names]
            else:
                continue
            for dotted, where in targets:
                target = _resolve(dotted, where)
                if target and target != f:
                    edges.setdefault(target, node.lineno)
    return graph


def import_cycles(graph):
    """Each cycle a depth-first walk meets, as [a, b, ..., a]."""
    cycles, state, stack = [], {}, []  # state: 1 on the stack, 2 done

    def walk(f):
        state[f] = 1
        stack.append(f)
        for g in sorted(graph.get(f, ())):
            if state.get(g) == 1:
                cycles.append(stack[stack.index(g):] + [g])
            elif g not in state:
                walk(g)
        stack.pop()
        state[f] = 2

    for f in sorted(graph):
        if f not in state:
            walk(f)
    return cycles


def test_no_import_cycles():
    """No module imports one that imports it back, directly or through others, lazy imports
    included: a cycle makes what a module can use at import time depend on which one came first."""
    graph = import_graph()
    assert {"checkpoint.py", "eval/harness.py", "data/prepare_slimpajama.py", "bench/bench_prepare.py"} <= set(graph)
    assert {"bench/realtext_corpus.py", "tokenizer.py"} <= set(graph["bench/bench_prepare.py"])  # a neighbour
    assert "tokenizer.py" in graph["export_hf.py"]  # imported inside export()
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(
        "  " + " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}"
        for c in cycles)


def test_no_module_imports_train_py():
    """train.py is the script a fork edits: nothing else imports it. What other code needs of it
    lives in the modules it imports (settings.py, checkpoint.py, warm_start.py, train_env.py, ...)."""
    graph = import_graph()
    assert "train.py" in graph and "warm_start.py" in graph["train.py"]
    importers = sorted(f for f, edges in graph.items() if "train.py" in edges)
    assert not importers, f"import train.py: {importers}"


def test_kernels_import_only_their_own_package():
    """prism_kernel.py imports no repo module but prism_ops/, and prism_ops/ imports only itself,
    relatively, besides torch, triton and the standard library: `import prism_kernel` never
    loads model.py, and the copy export_hf.py writes (prism_kernel.py with prism_ops/ beside it,
    inside transformers' module cache) runs on its own."""
    graph = import_graph()
    ops = {f for f in graph if f.startswith("prism_ops" + os.sep)}
    stages = ("__init__", "tiles", "chunk_fwd", "chunk_bwd", "l2norm", "conv", "solver", "decode")
    assert {os.path.join("prism_ops", s + ".py") for s in stages} <= ops
    assert set(graph["prism_kernel.py"]) and set(graph["prism_kernel.py"]) <= ops
    for f in sorted(ops):
        assert set(graph[f]) <= ops, f"{f} imports {set(graph[f]) - ops}"
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, f)).read(), f)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [] if node.level else [node.module]
            else:
                continue
            outside = [n for n in names if n.split(".")[0] not in sys.stdlib_module_names | {"torch", "triton"}]
            assert not outside, f"{f} line {node.lineno} imports {outside} (the package imports itself relatively)"
