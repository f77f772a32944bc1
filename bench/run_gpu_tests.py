"""Run the GPU tests one pytest process per test, several at once, and say what each did.

    python bench/run_gpu_tests.py                      # every test marked gpu under tests/, 8 at once
    python bench/run_gpu_tests.py tests/test_kernel.py -j 16 --timeout 300 --log gpu_tests.txt

One process per test keeps a test's CUDA context, compiled kernels and memory out of the others
(the float64 references make the whole set take over 5 minutes even in parallel on one H200).
Tests marked `exclusive` need most of a GPU's memory (the million-token checks take ~70 GB
each): they run one at a time after the others, with no other test beside them, so that an
out-of-memory failure is the test's own and never a neighbour's.
A test counts as passed only if pytest says "passed": a skip (a missing package, no GPU) is
reported as skipped, and a file that fails to collect (an import error) is reported, not
silently left out. Exit status 0 only when every collected test passed and every file
collected. Needs a CUDA GPU for the gpu tests; `--marker` picks other tests (the CPU tests of
this script use it).
"""
import argparse
import concurrent.futures as cf
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pytest's last line, e.g. "1 passed in 3.2s", "1 skipped, 2 warnings in 0.1s", "1 failed ..."
OUTCOMES = ("failed", "error", "passed", "skipped", "xfailed", "xpassed")


def runnable(test_id, paths):
    """The id as a path this script's pytest calls (run from the repo root) can find: pytest
    prints ids relative to its rootdir, which for tests outside the repo is an ancestor of
    theirs (their own folder, or one shared with the repo, e.g. /tmp for /tmp/x and /tmp/repo)."""
    file, sep, rest = test_id.partition("::")
    bases = [ROOT]
    for p in paths:
        d = os.path.abspath(p if os.path.isdir(p) else os.path.dirname(p))
        while d not in bases:
            bases.append(d)
            d = os.path.dirname(d)
    for base in bases:
        path = os.path.join(base, file)
        if os.path.exists(path):
            return (os.path.relpath(path, ROOT) if base == ROOT else os.path.abspath(path)) + sep + rest
    return test_id


def collect(paths, marker):
    """Test ids and collection errors (pytest's 'ERROR <file>' lines) for the marker."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker,
                        "-o", "addopts=", "-p", "no:cacheprovider", *paths],
                       cwd=ROOT, capture_output=True, text=True)
    ids = [runnable(line.strip(), paths) for line in r.stdout.splitlines()
           if "::" in line and not line.startswith("ERROR")]
    errors = [line.strip() for line in r.stdout.splitlines() if line.startswith("ERROR")]
    if r.returncode not in (0, 5) and not errors:   # 5: nothing collected
        errors = [f"pytest --collect-only exited {r.returncode}: {r.stderr.strip()[-500:]}"]
    return ids, errors


def outcome(text):
    """The outcome pytest reports for one test from its final summary line."""
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    for word in OUTCOMES:
        if re.search(rf"\b\d+ {word}\b", tail):
            return word
    return "unknown"


def run_one(test_id, marker, timeout):
    """(test id, outcome, seconds, output); a test past its time is killed with every process
    it started (a torchrun test's workers too) and counts as "timeout"."""
    t0 = time.time()
    # -rfEs: pytest's summary names each failure's exception (an out-of-memory error, say)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rfEs", "-m", marker, "-o", "addopts=",
                             "-p", "no:cacheprovider", test_id], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        result = outcome(text)
        if proc.returncode != 0 and result in ("passed", "skipped"):
            result = "failed"   # a crash after the summary, e.g. at interpreter exit
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        result = "timeout"
    return test_id, result, time.time() - t0, text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", default=["tests"], help="test files or folders (default tests)")
    p.add_argument("-j", "--jobs", type=int, default=8, help="tests at once (default 8)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per test (default 300)")
    p.add_argument("--marker", default="gpu", help="pytest -m expression (default gpu)")
    p.add_argument("--log", default=None, help="write every test's outcome, and the output of those "
                   "that did not pass, to this file")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0:
        p.error("--jobs and --timeout must be positive")

    ids, errors = collect(args.paths, args.marker)
    alone = set(collect(args.paths, f"({args.marker}) and exclusive")[0]) if ids else set()
    shared = [i for i in ids if i not in alone]
    print(f"collected {len(ids)} tests (-m {args.marker!r}; {len(alone)} of them exclusive, run alone "
          f"after the others), {len(errors)} collection errors", flush=True)
    results, t0 = [], time.time()

    def report(test_id, result, secs, text):
        results.append((test_id, result, secs, text))
        n = len(results)
        rate = n / max(time.time() - t0, 1e-9)
        print(f"[{n}/{len(ids)}] {result:8s} {secs:6.1f}s  {test_id}  "
              f"(ETA {(len(ids) - n) / rate:.0f}s)", flush=True)

    with cf.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, i, args.marker, args.timeout) for i in shared]
        for fut in cf.as_completed(futures):
            report(*fut.result())
    for test_id in [i for i in ids if i in alone]:
        report(*run_one(test_id, args.marker, args.timeout))

    counts = {}
    for _, result, _, _ in results:
        counts[result] = counts.get(result, 0) + 1
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no tests"
    line = f"{counts.get('passed', 0)} of {len(ids)} passed ({summary}); {len(errors)} collection errors"
    print(line)
    for e in errors:
        print("  collection:", e)
    for test_id, result, _, _ in sorted(results):
        if result != "passed":
            print(f"  {result}: {test_id}")
    if args.log:
        with open(args.log, "w") as f:
            f.write(line + "\n")
            for e in errors:
                f.write(f"collection error: {e}\n")
            for test_id, result, secs, text in sorted(results):
                f.write(f"{result} {secs:.1f}s {test_id}\n")
                if result != "passed":
                    f.write("".join("    " + t + "\n" for t in text.strip().splitlines()[-40:]))
    ok = ids and not errors and counts.get("passed", 0) == len(ids)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
