"""
Evidence with error bars: GDN-130M, PRISM-130M (L=3), hybrid-130M and transformer-130M, three
seeds each, every run on the same 41.9M tokens of real English in the same order. Needs a CUDA
GPU (any number: one run per GPU at a time); --tiny runs the whole pipeline on a CPU.

    python bench/realtext_seeds.py                    # prepare the data, train the 12 runs, summarise
    python bench/realtext_seeds.py --deadline_s 540   # start no run that would end after 540 s; run
                                                      # it again (same runs folder) to do the rest
    python bench/realtext_seeds.py --phase summary    # only the table, JSON and plot of what finished
    python bench/realtext_seeds.py --tiny --lanes 2   # tiny models, a few steps, on the CPU

Data. Debian-packaged English (bench/realtext_corpus.py with every source: the default corpus
plus MANUALS and info_more), 24,756 documents, 176M characters, 53.4M tokens. What travels to
the GPU machine is data/realtext_pack/: the text as .jsonl.xz shards (41.9 MiB; xz because Python
reads it without extra packages), Mistral-7B's tokenizer.model (0.5 MB) and manifest.json, 42.3
MiB in all. The GPU machine tokenizes it (data/prepare_slimpajama.py, seconds on 16 cores) into
data/realtext_seeds/ and checks that its train.bin and val.bin are byte for byte the ones
recorded at packing. Every 32nd document (in the corpus's md5 order) is held out whole: val.bin,
1,566,789 tokens (773 documents), never trained on; train.bin holds the other 51,856,893 tokens
(23,983 documents). Built once, on a Debian machine, on its CPU:

    apt-get install -y --no-install-recommends $(python bench/realtext_seeds.py --packages)
    python bench/realtext_corpus.py --sources $(python bench/realtext_seeds.py --sources) \\
        --out data/realtext_seeds_src --record bench/results/realtext_seeds_corpus.json
    python bench/realtext_seeds.py --phase pack       # -> data/realtext_pack/, and the record

Runs. Each model is its config/<model>_130m.py with one recipe, the same for all four:
65,536 tokens a step (16 sequences x 2048 tokens x 2 micro-steps), 640 steps = 41,943,040
tokens (0.81 of an epoch of train.bin: no window is seen twice), AdamW (0.9, 0.95, weight decay
0.1, clip 1.0), peak lr 1.5e-3 after 32 warm-up steps, cosine to 1.5e-4 at step 640; bf16
autocast, torch.compile, the default (Triton) kernels. This is the recipe of bench/realtext.sh
(16.8M tokens, one seed) with the schedule stretched to the longer run. The models have 138M
(GDN), 146M (PRISM), 140M (hybrid) and 110M (transformer) parameters: equal tokens, not size. The seed (0, 1, 2) sets
the initial weights only: train.py's data_seed is fixed at 1337, so every run reads the same
windows in the same order. Validation: every 32 steps (21 points, the 11th exactly at half the
tokens) on the same 20 x 16 fixed windows of val.bin (655K tokens). The half-way point is read
from the same runs: their learning rate is then mid-decay, not annealed, so it shows how the gaps
develop with tokens rather than what a run planned for 21M tokens would reach.

Lanes. One lane per visible GPU (--gpus), each running one train.py at a time from a queue, the
longest runs first; each run has a time limit (--run_timeout). A run's folder
(--runs/<model>_s<seed>/) holds its train.log (stdout and stderr), train.py's log.jsonl and
run.json (exit code, wall time, whether it finished, the fingerprint of its command and data).
A finished run with the same fingerprint is skipped, so the command can be repeated until all
are done (the runs folder defaults to bench/results/realtext_seeds/, committed: each finished run's
run.json, log.jsonl and train.log, no checkpoints); an unfinished one starts again from scratch (no checkpoints are written: a 130M save is
1.75 GB). With --deadline_s (counted from the start, data preparation included), a run is started only
if its estimated time (a finished run's measured time, else the speeds below) ends before the
deadline, and runs still going at the deadline are stopped (and redone next time).

Results: bench/results/realtext_seeds.json (one row per run: model, seed, train_tokens, params,
final_val_loss, half_val_loss, tokens_per_s, val_curve [tokens, val loss], wall time; the recipe,
data, date, GPU and versions), bench/results/realtext_seeds.png (val loss against tokens, mean
and spread per model; each seed's loss at half and all tokens) and a markdown table on stdout:
mean +- std (over seeds) per model, and PRISM - GDN, hybrid - GDN paired by seed (mean and std
of the per-seed differences), each with a sentence saying whether it is larger than that spread.

Upcycling (--upcycle, seed 0 unless --seeds): GDN-130M trained for the first half of the steps
(320, 21.0M tokens) on the full run's schedule (lr_decay_iters = 640), its checkpoint saved; then
from that checkpoint the other half twice, with train.py --init_continue=True (same iteration,
data position and AdamW state for the GDN tensors): as GDN (config/gdn_130m.py) and as PRISM L=3
upcycled from it (config/prism_130m.py: the solver's gain_up starts at zero, so its first evaluation
is the GDN's). Runs gdn_half_s<seed>, gdn_cont_s<seed>, prism_up_s<seed> in
bench/results/realtext_upcycle/; the 1.7 GB checkpoint is deleted once both continuations finished
(--keep_checkpoint keeps it). Results: bench/results/realtext_upcycle.json (the three val curves,
upcycled PRISM - GDN continued per seed and along the curve, the upcycled model's first evaluation
minus the GDN's, and the seed spread of the evidence runs above, read from realtext_seeds.json, for
scale) and realtext_upcycle.png. About 2.3 + 2.3 + 3 minutes on one H100/H200, the two
continuations side by side on two GPUs:

    python bench/realtext_seeds.py --upcycle          # prepare the data if needed, train, summarise
    python bench/realtext_seeds.py --upcycle --tiny   # the same on a CPU, tiny models, 4 steps

GPU time on one H200, estimated from bench/results/train_bench_compile_all.json (compiled, 16 x
2048 tokens a micro-step: PRISM 140K tok/s, hybrid 156K, GDN 234K, transformer 390-436K), +10%
for evaluation (21 x 655K tokens, forward only), + ~60 s to start and compile a run: PRISM 390 s,
hybrid 355 s, GDN 257 s, transformer 172 s, 1,175 s a seed: ~59 minutes for the twelve runs, + ~1
minute to prepare the data. With lanes: 8 GPUs ~9 minutes (the longest lane runs hybrid then
transformer), 4 GPUs ~15 minutes, 2 GPUs ~30 minutes.
"""
import argparse
import glob
import hashlib
import json
import lzma
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from fileio import atomic_write, sha256_file, write_figure, write_json  # noqa: E402
from cli import HelpFormatter  # noqa: E402

MODELS = ["gdn", "prism", "hybrid", "transformer"]
CONFIGS = {m: [f"config/{m}_130m.py"] for m in MODELS}
TINY_CONFIGS = {"gdn": ["config/tiny_gdn.py"], "prism": ["config/tiny_cpu.py"],
                "hybrid": ["config/tiny_hybrid.py"], "transformer": ["config/tiny_cpu.py", "--mixer=attention"]}
BASELINE = "gdn"  # the differences are model - BASELINE
# The one recipe (train.py keys), on top of each model's config. batch_size x accumulation x
# block_size = 65,536 tokens a step; lr_decay_iters = 0 is max_iters.
RECIPE = dict(batch_size=16, gradient_accumulation_steps=2, block_size=2048, learning_rate=1.5e-3,
              min_lr=1.5e-4, warmup_iters=32, lr_decay_iters=0, weight_decay=0.1, beta1=0.9, beta2=0.95,
              grad_clip=1.0, eval_iters=20, log_interval=8, compile=True, data_seed=1337,
              save_checkpoints=False)
STEPS = 640
TINY_RECIPE = dict(RECIPE, batch_size=4, block_size=64, learning_rate=3e-3, min_lr=3e-4, warmup_iters=1,
                   eval_iters=2, log_interval=1, compile=False, cpu_threads=1)
TINY_STEPS = 4
# planning speeds (tokens/s on one H200, compiled; bench/results/train_bench_compile_all.json),
# used only to decide whether a run fits before --deadline_s when none of its model finished yet
PLAN_TOK_S = {"prism": 140e3, "hybrid": 156e3, "gdn": 234e3, "transformer": 390e3}
PLAN_START_S = 60
VAL_EVERY = 32  # hold out every 32nd document
START = time.time()  # --deadline_s counts from here


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)  # so that the runs started get stopped


def die(msg):
    sys.exit(f"realtext_seeds.py: error: {msg}")


def read_json(path, default=None):
    if not os.path.isfile(path):
        return default
    with open(path) as f:
        return json.load(f)


# -----------------------------------------------------------------------------------------------
# data: pack (CPU, once) -> prepare (on the GPU machine) -> data/realtext_seeds/{train,val}.bin

def run_prepare(text_glob, tokenizer, out_dir, num_proc):
    """data/prepare_slimpajama.py on local .jsonl: all the text, every VAL_EVERY-th document to val."""
    rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731  (the command is recorded in meta.json)
    cmd = [sys.executable, os.path.join("data", "prepare_slimpajama.py"), "--data_files", rel(text_glob),
           "--tokens", "all", "--val_tokens", "all", "--val_fraction", str(1 / VAL_EVERY),
           "--tokenizer", rel(tokenizer), "--num_proc", str(num_proc), "--out_dir", rel(out_dir), "--overwrite"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        die(f"data/prepare_slimpajama.py failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")


def pack(a):
    """data/realtext_seeds_src/*.jsonl.zst -> a.pack: .jsonl.xz shards, tokenizer.model, manifest.json
    (sizes and sha256s, and the train/val token counts and .bin sha256s that tokenizing gives)."""
    import realtext_corpus
    import zstandard
    from tokenizer import load_tokenizer
    shards = sorted(glob.glob(os.path.join(a.src, "*.jsonl.zst")))
    if not shards:
        die(f"no .jsonl.zst shards in {a.src}; build them with bench/realtext_corpus.py (see --help)")
    os.makedirs(a.pack, exist_ok=True)
    for old in glob.glob(os.path.join(a.pack, "*.jsonl.xz")):
        os.remove(old)
    files = {}
    for src in shards:
        name = os.path.basename(src)[:-len(".zst")] + ".xz"
        with open(src, "rb") as f:
            raw = zstandard.ZstdDecompressor().stream_reader(f).read()
        path = os.path.join(a.pack, name)
        atomic_write(path, lzma.compress(raw, preset=9))
        files[name] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path), "text_bytes": len(raw)}
        print(f"{name}: {len(raw) / 1e6:.1f} MB of JSONL -> {files[name]['bytes'] / 1e6:.1f} MB", flush=True)
    tok = load_tokenizer()
    shutil.copyfile(tok.path, os.path.join(a.pack, "tokenizer.model"))
    manifest = {"files": files, "tokenizer": tok.name, "tokenizer_sha256": tok.sha256, "val_every": VAL_EVERY,
                "pack_bytes": sum(f["bytes"] for f in files.values())
                + os.path.getsize(os.path.join(a.pack, "tokenizer.model"))}
    write_json(os.path.join(a.pack, "manifest.json"), manifest)  # prepare() below reads it
    prepared = prepare(a, check=False)
    manifest["prepared"] = prepared
    write_json(os.path.join(a.pack, "manifest.json"), manifest)
    rec = os.path.join(a.results, "realtext_seeds_corpus.json")
    realtext_corpus.update_record(rec, {"pack": {k: v for k, v in manifest.items() if k != "prepared"},
                                        "prepared": prepared})
    print(f"{a.pack}: {manifest['pack_bytes'] / 2**20:.1f} MiB; train {prepared['train_tokens']:,} tokens "
          f"({prepared['train_documents']:,} documents), val {prepared['val_tokens']:,} tokens "
          f"({prepared['val_documents']:,} documents); recorded in {rec}")


def prepare(a, check=True):
    """a.pack -> a.data/realtext_seeds (skipped if already made from this pack). With check, the
    .bin files must equal the ones recorded at packing. Returns the prepared record."""
    import realtext_corpus
    manifest = read_json(os.path.join(a.pack, "manifest.json"))
    out = os.path.join(a.data, a.dataset)
    if manifest is None:
        if os.path.isfile(os.path.join(out, "train.bin")):
            print(f"no {a.pack}/manifest.json: using the data in {out} as it is")
            return None
        die(f"{a.pack}/manifest.json not found: bring data/realtext_pack (made by --phase pack)")
    stamp = os.path.join(out, "prepared.json")
    pack_id = hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()
    done = read_json(stamp, {})
    have = all(os.path.isfile(os.path.join(out, f"{s}.bin")) for s in ("train", "val"))
    if done.get("pack_id") == pack_id and have:
        return done["record"]
    t0 = time.time()
    text = out + ".text"
    shutil.rmtree(text, ignore_errors=True)
    os.makedirs(text)
    for name, info in sorted(manifest["files"].items()):
        path = os.path.join(a.pack, name)
        if not os.path.isfile(path) or sha256_file(path) != info["sha256"]:
            die(f"{path} is missing or differs from {a.pack}/manifest.json")
        with lzma.open(path) as f, open(os.path.join(text, name[:-len(".xz")]), "wb") as g:
            shutil.copyfileobj(f, g, 1 << 24)
    tok = os.path.join(a.pack, "tokenizer.model")
    if sha256_file(tok) != manifest["tokenizer_sha256"]:
        die(f"{tok} differs from the tokenizer recorded in the manifest")
    run_prepare(os.path.join(text, "*.jsonl"), tok, out, a.num_proc)
    shutil.rmtree(text)
    rec = realtext_corpus.prepared_record(out)
    want = manifest.get("prepared")
    if check and want:  # every run here reads the same files either way: a warning, not an error
        diff = [k for k in ("train_tokens", "val_tokens", "train_bin_sha256", "val_bin_sha256")
                if rec.get(k) != want.get(k)]
        rec["matches_pack"] = not diff
        if diff:
            print(f"warning: tokenizing the pack here gave other data than at packing ({', '.join(diff)} "
                  f"differ; another sentencepiece?): here {rec}, packed {want}", flush=True)
    write_json(stamp, {"pack_id": pack_id, "record": rec})
    print(f"prepared {out}: train {rec['train_tokens']:,} tokens, val {rec['val_tokens']:,} tokens "
          f"in {time.time() - t0:.0f}s", flush=True)
    return rec


# -----------------------------------------------------------------------------------------------
# runs

def run_argv(a, model, recipe, seed, name, extra=()):
    """train.py's argv for one run: the model's config, the recipe, --train_args, then the seed,
    the data and the run folder (a.runs/<name>_s<seed>)."""
    configs = TINY_CONFIGS if a.tiny else CONFIGS
    argv = list(configs[model]) + [f"--{k}={v}" for k, v in recipe.items()] + a.train_args.split() + list(extra) + [
        f"--seed={seed}", f"--data_dir={a.data}", f"--dataset={a.dataset}",
        f"--out_dir={os.path.join(a.runs, f'{name}_s{seed}')}"]
    return argv + (["--device=cpu"] if a.tiny else [])


def plan(a):
    """[(model, seed, train.py argv)], plus the recipe as run."""
    recipe = dict(TINY_RECIPE if a.tiny else RECIPE, max_iters=a.steps, eval_interval=a.eval_interval)
    return [(m, s, run_argv(a, m, recipe, s, m)) for m in a.models for s in a.seeds], recipe


# --upcycle: GDN for the first half of the steps (the full run's schedule, its checkpoint kept), then
# from that checkpoint the second half twice, as GDN and as PRISM upcycled from it (train.py
# --init_continue: same iteration, data position and AdamW state for the GDN tensors)
UPCYCLE_RUNS = {"gdn_half": "gdn", "gdn_cont": "gdn", "prism_up": "prism"}


def upcycle_plan(a, stage):
    """stage "half": the GDN runs to the half-way checkpoint; "continue": the two continuations."""
    recipe = dict(TINY_RECIPE if a.tiny else RECIPE, eval_interval=a.eval_interval, lr_decay_iters=a.steps)
    runs = []
    for s in a.seeds:
        if stage == "half":
            half = dict(recipe, max_iters=a.steps // 2, save_checkpoints=True, keep_checkpoints=1,
                        always_save_checkpoint=False)
            runs.append(("gdn_half", s, run_argv(a, "gdn", half, s, "gdn_half")))
            continue
        start = [f"--init_from={os.path.join(a.runs, f'gdn_half_s{s}', 'ckpt.pt')}", "--init_continue=True"]
        for name in ("gdn_cont", "prism_up"):
            runs.append((name, s, run_argv(a, UPCYCLE_RUNS[name], dict(recipe, max_iters=a.steps), s, name, start)))
    return runs, recipe


def max_iters_of(argv):
    return int([x for x in argv if x.startswith("--max_iters=")][-1].split("=", 1)[1])


def fingerprint(argv, data_rec):
    """What makes a finished run reusable: its command and the data it read (not where the two
    lay: run folders copied to another machine stay valid there)."""
    args = [x if not x.startswith("--init_from=") else "--init_from=" + "/".join(x.split(os.sep)[-2:])
            for x in argv if not x.startswith(("--data_dir=", "--out_dir="))]  # init_from: the run it continues
    key = json.dumps([args, data_rec.get("train_bin_sha256"), data_rec.get("val_bin_sha256")])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def data_record(a, required=True):
    """Counts and sha256 of the prepared data. Without it (a summary elsewhere, of runs copied
    there), the record the runs stored; else an error."""
    d = os.path.join(a.data, a.dataset)
    done = read_json(os.path.join(d, "prepared.json"))
    if done:
        return done["record"]
    if not required and not os.path.isfile(os.path.join(d, "train.bin")):
        for st_path in sorted(glob.glob(os.path.join(a.runs, "*", "run.json"))):
            if read_json(st_path).get("data"):
                return read_json(st_path)["data"]
    meta = read_json(os.path.join(d, "meta.json"), {})  # data made some other way (the test's)
    rec = {k: meta.get(k) for k in ("train_tokens", "val_tokens", "train_documents", "val_documents",
                                    "tokenizer", "tokenizer_sha256") if k in meta}
    for s in ("train", "val"):
        p = os.path.join(d, f"{s}.bin")
        if not os.path.isfile(p):
            die(f"{p} not found: run --phase prepare (or all) first")
        rec[f"{s}_bin_sha256"] = sha256_file(p)
        rec.setdefault(f"{s}_tokens", os.path.getsize(p) // 2)
    return rec


def parse_run(argv):
    """train.py's config of a run. Without its --init_from: a continuation's architecture is its
    config's (the same as the checkpoint's), and the checkpoint may be gone by the summary."""
    from settings import parse_config
    return parse_config([x for x in argv if not x.startswith(("--init_from=", "--init_continue="))])


def tokens_per_step(argv):
    cfg = parse_run(argv)
    return cfg["batch_size"] * cfg["gradient_accumulation_steps"] * cfg["block_size"]


def estimate_s(model, a, steps, runs_done):
    """Seconds a run of `model` (a name of MODELS or UPCYCLE_RUNS) doing `steps` steps is expected
    to take: a finished one's wall time, else PLAN_TOK_S."""
    walls = [r["wall_s"] for r in runs_done if r["model"] == model and r.get("finished")]
    if walls:
        return max(walls)
    if a.tiny:
        return 0.0
    return 1.1 * steps * a.step_tokens / PLAN_TOK_S[UPCYCLE_RUNS.get(model, model)] + PLAN_START_S


def lanes_of(a):
    """CUDA_VISIBLE_DEVICES value of each lane ("" on the CPU)."""
    if a.tiny:
        return [""] * a.lanes
    if a.gpus:
        return a.gpus.split(",")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g for g in visible.split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    n = sum(line.startswith("GPU ") for line in out.splitlines())
    if n == 0:
        die("no CUDA GPU found (nvidia-smi -L lists none); this needs a CUDA GPU, or --tiny for the CPU")
    return [str(i) for i in range(n)]


def train_all(a, data_rec, runs=None):
    runs = runs or plan(a)[0]
    a.step_tokens = tokens_per_step(runs[0][2])
    lanes = lanes_of(a)
    todo, finished = [], []
    for m, s, argv in runs:
        d = os.path.join(a.runs, f"{m}_s{s}")
        st = read_json(os.path.join(d, "run.json"), {})
        if st.get("finished") and st.get("fingerprint") == fingerprint(argv, data_rec):
            finished.append(st)
        else:
            todo.append((m, s, argv))
    print(f"{len(runs)} runs ({len(finished)} already finished), {len(lanes)} lane(s) "
          f"{'on the CPU' if a.tiny else 'on GPUs ' + ','.join(lanes)}", flush=True)
    if not todo:
        return
    todo.sort(key=lambda r: (-estimate_s(r[0], a, max_iters_of(r[2]), finished), r[1]))  # longest first
    names, where = gpu_names(), {"versions": versions(), "host": platform.node()}
    t0 = time.time()
    deadline = START + a.deadline_s if a.deadline_s else None
    busy = {}  # lane index -> (model, seed, argv, Popen, start time, log file)

    def start(lane, m, s, argv):
        d = os.path.join(a.runs, f"{m}_s{s}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        log = open(os.path.join(d, "train.log"), "w")
        log.write(f"$ python train.py {' '.join(argv)}\n")
        log.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES=lanes[lane])
        if a.tiny:
            env["OMP_NUM_THREADS"] = "1"
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *argv], cwd=ROOT, env=env,
                             stdout=log, stderr=subprocess.STDOUT)
        busy[lane] = (m, s, argv, p, time.time(), log)
        print(f"  start {m} seed {s} on {'cpu lane ' + str(lane) if a.tiny else 'GPU ' + lanes[lane]}", flush=True)

    def finish(lane, why=None):
        m, s, argv, p, t_start, log = busy.pop(lane)
        log.close()
        g = lanes[lane]
        d = os.path.join(a.runs, f"{m}_s{s}")
        recs = read_log(os.path.join(d, "log.jsonl"))[0]
        done_iters = recs[-1]["iter"] if recs else 0
        st = {"model": m, "seed": s, "exit_code": p.returncode, "wall_s": round(time.time() - t_start, 1),
              "iters": done_iters, "finished": p.returncode == 0 and done_iters >= max_iters_of(argv) and why is None,
              "stopped": why, "gpu": g or "cpu", **where, "fingerprint": fingerprint(argv, data_rec),
              "gpu_name": names[int(g)] if g.isdigit() and int(g) < len(names) else None,
              "data": data_rec,
              "ended_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        write_json(os.path.join(d, "run.json"), st)
        finished.append(st)
        tail = ""
        if not st["finished"]:
            with open(os.path.join(d, "train.log"), errors="replace") as f:
                tail = "\n    " + "\n    ".join(f.read().splitlines()[-5:])
        print(f"  {'done ' if st['finished'] else 'stopped' if why else 'FAILED'} {m} seed {s}: exit {p.returncode}, "
              f"{done_iters}/{max_iters_of(argv)} steps, {st['wall_s']:.0f}s{' (' + why + ')' if why else ''}{tail}", flush=True)

    def stop(lane, why):
        p, t_stop = busy[lane][3], time.time()
        p.send_signal(signal.SIGTERM)  # train.py stops at the end of the step
        while p.poll() is None and time.time() - t_stop < 30:
            time.sleep(0.5)
        if p.poll() is None:
            p.kill()
            p.wait()
        finish(lane, why)

    try:
        while todo or busy:
            for lane in range(len(lanes)):
                if lane in busy or not todo:
                    continue
                left = (deadline - time.time()) if deadline else math.inf
                pick = next((r for r in todo if estimate_s(r[0], a, max_iters_of(r[2]), finished) <= left), None)
                if pick is None:
                    continue
                todo.remove(pick)
                start(lane, *pick)
            if not busy:
                if todo:
                    print(f"deadline: {len(todo)} run(s) would not finish in time and were not started: "
                          + ", ".join(f"{m} seed {s}" for m, s, _ in todo) + "; run again to do them", flush=True)
                break
            time.sleep(0.2 if a.tiny else 2)
            for lane in list(busy):
                p, t_start = busy[lane][3], busy[lane][4]
                if p.poll() is not None:
                    finish(lane)
                elif time.time() - t_start > a.run_timeout:
                    stop(lane, f"over --run_timeout {a.run_timeout:.0f}s")
                elif deadline and time.time() > deadline:
                    stop(lane, "at --deadline_s")
    finally:  # interrupted: stop the runs this process started
        for lane in list(busy):
            stop(lane, "interrupted")
    print(f"training: {time.time() - t0:.0f}s", flush=True)


# -----------------------------------------------------------------------------------------------
# statistics (pure functions, unit-tested)

def mean_std(xs):
    """(mean, sample std with n-1, n); std is None for fewer than two values."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None, 0
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None), len(xs)


def paired(a, b):
    """a, b: {seed: loss}. The per-seed differences a - b over the seeds both have, their mean and
    std (n-1): the spread of the difference itself, free of what the seed does to both alike."""
    seeds = sorted(s for s in a if s in b and a[s] is not None and b[s] is not None)
    diffs = [a[s] - b[s] for s in seeds]
    m, sd, n = mean_std(diffs)
    return {"seeds": seeds, "diffs": diffs, "mean": m, "std": sd, "n": n}


def verdict(a, b, d, where):
    """A plain sentence: is the mean of the per-seed differences a - b larger than their std?"""
    name = f"{a} − {b} {where}"
    if d["n"] == 0:
        return f"{name}: no seed has both runs finished."
    if d["n"] == 1:
        return f"{name}: {d['mean']:+.4f} nats from one seed only: no spread to compare it with."
    lower = sum(x < 0 for x in d["diffs"])
    sign = (f"{a} is lower in {lower} of {d['n']} seeds" if lower * 2 >= d["n"]
            else f"{a} is higher in {d['n'] - lower} of {d['n']} seeds")
    if abs(d["mean"]) > d["std"]:
        return (f"{name}: {d['mean']:+.4f} ± {d['std']:.4f} nats ({d['n']} seeds), larger than its seed "
                f"spread (|{d['mean']:.4f}| > {d['std']:.4f}); {sign}.")
    return (f"{name}: {d['mean']:+.4f} ± {d['std']:.4f} nats ({d['n']} seeds), NOT larger than its seed "
            f"spread (|{d['mean']:.4f}| <= {d['std']:.4f}): no difference shown; {sign}.")


def fmt_tokens(n):
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else f"{n:.0f}"


def fmt(m, sd, n, digits=3, signed=False):
    """'mean ± std (n)' for a table cell."""
    if m is None:
        return "–"
    mean = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    return f"{mean} ± {sd:.{digits}f} ({n})" if sd is not None else f"{mean} ({n})"


def summarize(rows, models, half_tokens, full_tokens):
    """Per model mean/std at half and all tokens, the paired differences to BASELINE, the
    markdown table and the sentences."""
    per = {}
    for m in models:
        mine = [r for r in rows if r["model"] == m]
        per[m] = {}
        for key in ("half_val_loss", "final_val_loss"):
            mean, sd, n = mean_std([r[key] for r in mine])
            per[m][key] = {"mean": mean, "std": sd, "n": n, "by_seed": {r["seed"]: r[key] for r in mine}}
        tps = mean_std([r["tokens_per_s"] for r in mine])[0]
        per[m]["tokens_per_s"] = round(tps) if tps else None
        per[m]["params"] = mine[0]["params"] if mine else None
    diffs, sentences = {}, []
    for m in models:
        if m == BASELINE or BASELINE not in per:
            continue
        name = f"{m} − {BASELINE}"
        diffs[name] = {}
        for key, where in (("half_val_loss", f"at {fmt_tokens(half_tokens)} tokens"),
                           ("final_val_loss", f"at {fmt_tokens(full_tokens)} tokens")):
            d = paired(per[m][key]["by_seed"], per[BASELINE][key]["by_seed"])
            diffs[name][key] = d
            sentences.append(verdict(m, BASELINE, d, where))
    h, f = fmt_tokens(half_tokens), fmt_tokens(full_tokens)
    lines = [f"| model | params | tokens/s | val loss @ {h} tokens | val loss @ {f} tokens | ppl @ {f} |",
             "|---|---|---|---|---|---|"]
    for m in models:
        p, half, full = per[m], per[m]["half_val_loss"], per[m]["final_val_loss"]
        lines.append(f"| {m} | " + (f"{p['params'] / 1e6:.1f}M" if p["params"] else "–")
                     + " | " + (f"{p['tokens_per_s'] / 1e3:.0f}K" if p["tokens_per_s"] else "–")
                     + f" | {fmt(half['mean'], half['std'], half['n'])}"
                     + f" | {fmt(full['mean'], full['std'], full['n'])} | "
                     + (f"{math.exp(full['mean']):.2f}" if full["mean"] is not None else "–") + " |")
    lines += ["", f"| difference, paired by seed (nats) | @ {h} tokens | @ {f} tokens |", "|---|---|---|"]
    for name, d in diffs.items():
        cells = [fmt(d[k]["mean"], d[k]["std"], d[k]["n"], 4, signed=True)
                 for k in ("half_val_loss", "final_val_loss")]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    table = "\n".join(lines) + "\n\n" + "\n".join(f"- {s}" for s in sentences)
    return per, diffs, table


# -----------------------------------------------------------------------------------------------
# summary: JSON, plot, table

def read_log(path):
    from plot import read_log as plot_read_log
    return plot_read_log(path) if os.path.isfile(path) else ([], [])


def count_params(argv):
    """Exact parameter count of a run's model, built on the meta device (no memory, no time)."""
    import torch
    from model import Model, ModelConfig
    from settings import model_args_of
    cfg = parse_run(argv)
    with torch.device("meta"):
        return Model(ModelConfig(**model_args_of(cfg))).num_params(non_embedding=False)


def versions():
    v = {"python": platform.python_version()}
    for name in ("torch", "triton", "sentencepiece", "numpy"):
        try:
            from importlib.metadata import version
            v[name] = version(name)
        except Exception:  # not installed as a distribution
            v[name] = None
    try:
        import torch
        v["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return v


def gpu_names():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def summary(a, data_rec):
    runs, recipe = plan(a)
    step_tokens = tokens_per_step(runs[0][2])
    full_tokens, half_tokens = a.steps * step_tokens, a.steps // 2 * step_tokens
    rows, params, trained_with = [], {}, None
    for m, s, argv in runs:
        d = os.path.join(a.runs, f"{m}_s{s}")
        st = read_json(os.path.join(d, "run.json"))
        if st is None:
            continue
        train_recs, val_recs = read_log(os.path.join(d, "log.jsonl"))
        val = {r["iter"]: r for r in val_recs}
        if m not in params:
            params[m] = count_params(argv)
        tok_s = [r["tok_s"] for r in train_recs if r["iter"] > a.steps // 5]  # past compilation and warm-up
        ok = st["finished"] and st["fingerprint"] == fingerprint(argv, data_rec)
        rows.append({
            "model": m, "seed": s, "finished": ok,
            "train_tokens": train_recs[-1]["tokens"] if train_recs else 0,
            "params": params[m],
            "final_val_loss": val[a.steps]["val_loss"] if ok and a.steps in val else None,
            "half_val_loss": val[a.steps // 2]["val_loss"] if a.steps // 2 in val else None,
            "tokens_per_s": round(statistics.median(tok_s)) if tok_s else None,
            "card": (st.get("gpu_name") or "").split(",")[0] or None,  # tokens/s compare within one card
            "val_curve": [[r["tokens"], r["val_loss"]] for r in val_recs],
            "final_train_loss": train_recs[-1]["loss"] if train_recs else None,
            "peak_mem_gib": max((r.get("mem_gib", 0) for r in train_recs), default=None),
            "wall_s": st["wall_s"], "exit_code": st["exit_code"], "stopped": st.get("stopped"),
            "gpu": st.get("gpu"), "gpu_name": st.get("gpu_name"), "host": st.get("host"),
        })
        trained_with = trained_with or st.get("versions")
    per, diffs, table = summarize([r for r in rows if r["finished"]], a.models, half_tokens, full_tokens)
    title = (f"{'tiny ' if a.tiny else '130M: '}{', '.join(a.models)}; {fmt_tokens(full_tokens)} tokens of "
             f"Debian English, seeds {' '.join(map(str, a.seeds))}")
    out = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/realtext_seeds.py " + " ".join(sys.argv[1:]),
        "git_commit": git_commit(), "tiny": a.tiny,
        # where the runs trained (the summary may be made elsewhere, from their folders)
        "gpus": sorted({r["gpu_name"] for r in rows if r["gpu_name"]}) or gpu_names(),
        "versions": trained_with or versions(),
        "complete": len(rows) == len(runs) and all(r["finished"] for r in rows),
        "models": {m: (TINY_CONFIGS if a.tiny else CONFIGS)[m] for m in a.models}, "seeds": a.seeds,
        "recipe": recipe, "train_args": a.train_args, "steps": a.steps, "tokens_per_step": step_tokens,
        "train_tokens": full_tokens, "half_tokens": half_tokens,
        "data": data_rec,
        "epochs": round(full_tokens / data_rec["train_tokens"], 3) if data_rec.get("train_tokens") else None,
        "val_tokens_per_eval": recipe["eval_iters"] * recipe["batch_size"] * recipe["block_size"],
        "rows": rows, "per_model": per, "differences": diffs, "table_md": table,
    }
    os.makedirs(a.results, exist_ok=True)
    path = os.path.join(a.results, "realtext_seeds.json")
    write_json(path, out)
    plot(out, os.path.join(a.results, "realtext_seeds.png"), title)
    print(f"\n{title}\n\n{table}\n\nwrote {path} and realtext_seeds.png"
          + ("" if out["complete"] else f" ({sum(r['finished'] for r in rows)} of {len(runs)} runs finished)"))
    return out


def plot(res, path, title):
    """Left: val loss against tokens, the mean over seeds per model with a band of +- one std (and
    each seed faintly). Right: each seed's val loss at half and all tokens, with mean +- std."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [2, 1]})
    rows = [r for r in res["rows"] if r["val_curve"]]
    lo = []
    for i, m in enumerate(res["models"]):
        color, mine = f"C{i}", [r for r in rows if r["model"] == m]
        if not mine:
            continue
        for r in mine:
            ax.plot([t / 1e6 for t, _ in r["val_curve"]], [v for _, v in r["val_curve"]],
                    color=color, lw=0.6, alpha=0.35)
        common = sorted(set.intersection(*({t for t, _ in r["val_curve"]} for r in mine)))
        curves = [dict(map(tuple, r["val_curve"])) for r in mine]
        mean = [statistics.fmean(c[t] for c in curves) for t in common]
        sd = [statistics.stdev(c[t] for c in curves) if len(curves) > 1 else 0.0 for t in common]
        xs = [t / 1e6 for t in common]
        ax.plot(xs, mean, color=color, lw=1.8, label=f"{m} (mean of {len(mine)})")
        ax.fill_between(xs, [u - s for u, s in zip(mean, sd)], [u + s for u, s in zip(mean, sd)],
                        color=color, alpha=0.25)
        lo += mean[len(mean) // 4:]
        for j, key in enumerate(("half_val_loss", "final_val_loss")):
            vals = [r[key] for r in mine if r.get(key) is not None]
            if vals:
                x = j + (i - 1.5) * 0.15
                bx.scatter([x] * len(vals), vals, color=color, s=14, alpha=0.7)
                bx.errorbar(x, statistics.fmean(vals), yerr=statistics.stdev(vals) if len(vals) > 1 else 0,
                            color=color, capsize=4, marker="_", ms=14, label=m if j == 1 else None)
    if lo:  # the early losses (~10 nats at step 0) would flatten the part worth seeing
        span = max(lo) - min(lo)
        ax.set_ylim(min(lo) - 0.1 * span - 0.02, max(lo) + 0.6 * span + 0.02)
    ax.axvline(res["half_tokens"] / 1e6, color="0.6", ls=":", lw=1)
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("val loss (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    bx.set_xticks([0, 1], [f"{fmt_tokens(res['half_tokens'])} tokens", f"{fmt_tokens(res['train_tokens'])} tokens"])
    bx.set_xlim(-0.6, 1.6)
    bx.set_title("each seed, and mean ± std", fontsize=9)
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8)
    fig.tight_layout()
    write_figure(path, fig)
    plt.close(fig)


# -----------------------------------------------------------------------------------------------
# --upcycle: the two continuations of one GDN checkpoint

def upcycle_train(a, data_rec):
    """The half-way GDN runs, then the continuations of those that finished; then, unless
    --keep_checkpoint, the half-way checkpoints of seeds whose continuations both finished."""
    half, _ = upcycle_plan(a, "half")
    train_all(a, data_rec, half)
    ready = {s for _, s, _ in half if read_json(os.path.join(a.runs, f"gdn_half_s{s}", "run.json"), {}).get("finished")}
    cont = [r for r in upcycle_plan(a, "continue")[0] if r[1] in ready]
    if cont:
        train_all(a, data_rec, cont)
    for s in sorted(ready):
        done = all(read_json(os.path.join(a.runs, f"{n}_s{s}", "run.json"), {}).get("finished")
                   for n in ("gdn_cont", "prism_up"))
        if done and not a.keep_checkpoint:  # 1.7 GB each at 130M, and the curves are what is kept
            for p in glob.glob(os.path.join(a.runs, f"gdn_half_s{s}", "ckpt*")):
                os.remove(p)


def evidence_spread(a):
    """The seed spread of the evidence runs (realtext_seeds.json beside the results), for scale: the
    std over seeds of GDN's and PRISM's final val loss and of their paired difference (None with
    fewer than two seeds)."""
    ev = read_json(os.path.join(a.results, "realtext_seeds.json"))
    if not ev or ev.get("tiny") != a.tiny:
        return None
    per, diff = ev["per_model"], ev["differences"].get(f"prism − {BASELINE}", {})
    return {"file": "realtext_seeds.json", "date_utc": ev["date_utc"], "gpus": ev["gpus"],
            "train_tokens": ev["train_tokens"],
            "gdn_final_std": per.get("gdn", {}).get("final_val_loss", {}).get("std"),
            "prism_final_std": per.get("prism", {}).get("final_val_loss", {}).get("std"),
            "prism_minus_gdn_final": diff.get("final_val_loss", {}).get("mean"),
            "prism_minus_gdn_final_std": diff.get("final_val_loss", {}).get("std"),
            "seeds": ev["seeds"], "complete": ev["complete"]}


def upcycle_summary(a, data_rec):
    runs = upcycle_plan(a, "half")[0] + upcycle_plan(a, "continue")[0]
    recipe = upcycle_plan(a, "continue")[1]
    step_tokens = tokens_per_step(runs[0][2])
    half_tokens, full_tokens = a.steps // 2 * step_tokens, a.steps * step_tokens
    rows = []
    for name, s, argv in runs:
        st = read_json(os.path.join(a.runs, f"{name}_s{s}", "run.json"))
        if st is None:
            continue
        train_recs, val_recs = read_log(os.path.join(a.runs, f"{name}_s{s}", "log.jsonl"))
        end = max_iters_of(argv)
        val = {r["iter"]: r["val_loss"] for r in val_recs}
        ok = st["finished"] and st["fingerprint"] == fingerprint(argv, data_rec)
        tok_s = [r["tok_s"] for r in train_recs[len(train_recs) // 4:]]  # past compilation
        rows.append({"run": name, "model": UPCYCLE_RUNS[name], "seed": s, "finished": ok,
                     "params": count_params(argv),
                     "final_val_loss": val.get(end) if ok else None,
                     "start_val_loss": val.get(a.steps // 2), "val_curve": [[r["tokens"], r["val_loss"]] for r in val_recs],
                     "tokens_per_s": round(statistics.median(tok_s)) if tok_s else None,
                     "wall_s": st["wall_s"], "exit_code": st["exit_code"], "gpu_name": st.get("gpu_name")})
    by = {(r["run"], r["seed"]): r for r in rows if r["finished"]}
    seeds = [s for s in a.seeds if all((n, s) in by for n in UPCYCLE_RUNS)]
    pairs = []
    for s in seeds:
        g, p, h = by[("gdn_cont", s)], by[("prism_up", s)], by[("gdn_half", s)]
        gc, pc = dict(map(tuple, g["val_curve"])), dict(map(tuple, p["val_curve"]))
        pairs.append({"seed": s, "half_val_loss": h["final_val_loss"],
                      "start_gap": p["start_val_loss"] - h["final_val_loss"],  # the upcycled model's first eval
                      "gdn_final": g["final_val_loss"], "prism_final": p["final_val_loss"],
                      "diff_final": p["final_val_loss"] - g["final_val_loss"],
                      "diff_curve": [[t, pc[t] - gc[t]] for t in sorted(set(gc) & set(pc))]})
    m, sd, n = mean_std([x["diff_final"] for x in pairs])
    spread = evidence_spread(a)
    lines = [f"| seed | GDN @ {fmt_tokens(half_tokens)} | upcycled PRISM's first eval − GDN's | "
             f"GDN continued @ {fmt_tokens(full_tokens)} | upcycled PRISM @ {fmt_tokens(full_tokens)} | PRISM − GDN |",
             "|---|---|---|---|---|---|"]
    for x in pairs:
        lines.append(f"| {x['seed']} | {x['half_val_loss']:.4f} | {x['start_gap']:+.1e} | {x['gdn_final']:.4f} | "
                     f"{x['prism_final']:.4f} | {x['diff_final']:+.4f} |")
    if m is None:
        sentence = "no seed has all three runs finished."
    else:
        scale = spread and spread.get("prism_minus_gdn_final_std") or spread and spread.get("gdn_final_std")
        sentence = (f"upcycled PRISM − GDN continued at {fmt_tokens(full_tokens)} tokens: {fmt(m, sd, n, 4, True)} nats"
                    + (f"; the evidence runs' seed spread ({'paired PRISM − GDN' if spread.get('prism_minus_gdn_final_std') else 'GDN'}"
                       f" final val loss, std over {len(spread['seeds'])} seeds) is {scale:.4f} nats"
                       if scale else "; no seed spread from the evidence runs yet (fewer than two seeds there)"))
    table = "\n".join(lines) + "\n\n- " + sentence
    out = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python bench/realtext_seeds.py " + " ".join(sys.argv[1:]), "git_commit": git_commit(),
           "tiny": a.tiny, "gpus": sorted({r["gpu_name"] for r in rows if r["gpu_name"]}) or gpu_names(),
           "versions": versions(), "seeds": a.seeds, "steps": a.steps, "recipe": recipe,
           "train_args": a.train_args, "tokens_per_step": step_tokens, "half_tokens": half_tokens,
           "train_tokens": full_tokens, "data": data_rec,
           "complete": len(seeds) == len(a.seeds), "rows": rows, "pairs": pairs,
           "prism_minus_gdn_final": {"mean": m, "std": sd, "n": n}, "evidence_spread": spread, "table_md": table}
    os.makedirs(a.results, exist_ok=True)
    path = os.path.join(a.results, "realtext_upcycle.json")
    write_json(path, out)
    title = (f"{'tiny ' if a.tiny else 'GDN-130M '}to {fmt_tokens(half_tokens)} tokens, then GDN or upcycled "
             f"PRISM to {fmt_tokens(full_tokens)}; seeds {' '.join(map(str, a.seeds))}")
    upcycle_plot(out, os.path.join(a.results, "realtext_upcycle.png"), title)
    print(f"\n{title}\n\n{table}\n\nwrote {path} and realtext_upcycle.png", flush=True)
    return out


def upcycle_plot(res, path, title):
    """Left: val loss against tokens: the GDN to half way, then its two continuations (each seed).
    Right: upcycled PRISM − GDN continued against tokens, with +- the evidence runs' seed spread."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5))
    colors = {"gdn_half": "0.4", "gdn_cont": "C0", "prism_up": "C1"}
    labels = {"gdn_half": "GDN, first half", "gdn_cont": "GDN continued", "prism_up": "PRISM upcycled from it"}
    lo, seen = [], set()
    for r in res["rows"]:
        xs, ys = [t / 1e6 for t, _ in r["val_curve"]], [v for _, v in r["val_curve"]]
        ax.plot(xs, ys, color=colors[r["run"]], lw=1.4, marker=".", ms=3,
                label=None if r["run"] in seen else labels[r["run"]])
        seen.add(r["run"])
        lo += ys[len(ys) // 3:] if r["run"] == "gdn_half" else ys
    if lo:
        span = max(lo) - min(lo)
        ax.set_ylim(min(lo) - 0.1 * span - 0.02, max(lo) + 0.3 * span + 0.02)
    for z in (ax, bx):
        z.axvline(res["half_tokens"] / 1e6, color="0.6", ls=":", lw=1)
        z.set_xlabel("training tokens (M)")
        z.grid(alpha=0.3)
    ax.set_ylabel("val loss (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    for x in res["pairs"]:
        bx.plot([t / 1e6 for t, _ in x["diff_curve"]], [d for _, d in x["diff_curve"]], color="C1", lw=1.4,
                marker=".", ms=3, label=f"seed {x['seed']}")
    bx.axhline(0, color="C0", lw=1)
    sp = res["evidence_spread"] or {}
    band = sp.get("prism_minus_gdn_final_std") or sp.get("gdn_final_std")
    if band:
        bx.axhspan(-band, band, color="C0", alpha=0.15, label=f"± evidence runs' seed spread ({band:.3f})")
    bx.set_ylabel("upcycled PRISM − GDN continued (nats)")
    bx.set_title("the difference, same checkpoint, data and schedule", fontsize=9)
    bx.legend(fontsize=8)
    fig.tight_layout()
    write_figure(path, fig)
    plt.close(fig)


# -----------------------------------------------------------------------------------------------


def main(argv=None):
    rel = lambda *p: os.path.relpath(os.path.join(ROOT, *p))  # noqa: E731  (defaults, shown in --help)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--phase", choices=["all", "prepare", "train", "summary", "pack"], default="all",
                    help="all = prepare (if not yet), train, summary; pack = build --pack (CPU, once)")
    ap.add_argument("--tiny", action="store_true", help="tiny CPU configs and a few steps: a smoke test")
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS, help="models to run")
    ap.add_argument("--seeds", nargs="+", type=int, default=None,
                    help="initialisation seeds (default 0 1 2; 0 with --upcycle)")
    ap.add_argument("--upcycle", action="store_true", help="GDN to half the steps, then from its checkpoint "
                    "the other half as GDN and as upcycled PRISM (results: realtext_upcycle.json/.png)")
    ap.add_argument("--keep_checkpoint", action="store_true",
                    help="--upcycle: keep the half-way GDN checkpoint once both continuations finished")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"training steps (default {STEPS}; {TINY_STEPS} with --tiny)")
    ap.add_argument("--eval_interval", type=int, default=None,
                    help="steps between evaluations; must divide steps/2 (default steps/20; 1 with --tiny)")
    ap.add_argument("--train_args", default="", help="more train.py --key=value for every run, e.g. "
                    "'--batch_size=8 --gradient_accumulation_steps=4' (the same tokens a step) on a smaller GPU")
    ap.add_argument("--gpus", default=None, help="GPU ids for the lanes, e.g. 0,1 (default: every visible GPU)")
    ap.add_argument("--lanes", type=int, default=2, help="with --tiny: parallel CPU lanes")
    ap.add_argument("--run_timeout", type=float, default=None,
                    help="seconds a run may take (default 1800; 300 with --tiny)")
    ap.add_argument("--deadline_s", type=float, default=0, help="start no run that would end after this many "
                    "seconds from the start, and stop the ones still going then (0 = none)")
    ap.add_argument("--runs", default=None,
                    help="run folders (default bench/results/realtext_seeds, where the finished runs' run.json and "
                         "log.jsonl are kept so that a later call skips them; out/realtext_seeds_tiny with --tiny)")
    ap.add_argument("--results", default=None,
                    help="where the JSON and PNG go (default bench/results; the runs folder with --tiny)")
    ap.add_argument("--data", default=rel("data"), help="train.py's data_dir")
    ap.add_argument("--dataset", default="realtext_seeds", help="the prepared data: <data>/<dataset>/")
    ap.add_argument("--pack", default=rel("data", "realtext_pack"), help="the compressed text and the tokenizer")
    ap.add_argument("--src", default=rel("data", "realtext_seeds_src"), help="--phase pack: the corpus shards")
    ap.add_argument("--num_proc", type=int, default=min(16, os.cpu_count() or 1), help="tokenizer processes")
    ap.add_argument("--packages", action="store_true", help="print the Debian packages the corpus reads, and exit")
    ap.add_argument("--sources", action="store_true", help="print bench/realtext_corpus.py's source names, and exit")
    a = ap.parse_args(argv)
    if a.packages or a.sources:
        import realtext_corpus
        names = realtext_corpus.packages_of(list(realtext_corpus.SOURCES)) if a.packages else realtext_corpus.SOURCES
        print(" ".join(names))
        return None
    a.seeds = a.seeds or ([0] if a.upcycle else [0, 1, 2])
    a.steps = a.steps or (TINY_STEPS if a.tiny else STEPS)
    a.eval_interval = a.eval_interval or (1 if a.tiny else max(1, a.steps // 20))
    if a.steps % 2 or (a.steps // 2) % a.eval_interval:
        ap.error(f"--eval_interval {a.eval_interval} must divide half of --steps {a.steps}, "
                 "so that the half-way point is evaluated")
    a.run_timeout = a.run_timeout or (300 if a.tiny else 1800)
    name = "realtext_upcycle" if a.upcycle else "realtext_seeds"
    a.runs = os.path.abspath(a.runs or (rel("out", f"{name}_tiny") if a.tiny else rel("bench", "results", name)))
    a.results = os.path.abspath(a.results or (a.runs if a.tiny else rel("bench", "results")))
    a.data, a.pack, a.src = map(os.path.abspath, (a.data, a.pack, a.src))  # train.py runs in the repo root
    if len(set(a.seeds)) != len(a.seeds) or len(set(a.models)) != len(a.models):
        ap.error("--seeds and --models must not repeat")
    signal.signal(signal.SIGTERM, _interrupt)
    if a.phase == "pack":
        return pack(a)
    if a.phase in ("all", "prepare"):
        prepare(a)
    if a.phase == "prepare":
        return None
    data_rec = data_record(a, required=a.phase != "summary") or {}
    if a.upcycle:
        if a.phase in ("all", "train"):
            upcycle_train(a, data_rec)
        return upcycle_summary(a, data_rec)
    if a.phase in ("all", "train"):
        train_all(a, data_rec)
    return summary(a, data_rec)


if __name__ == "__main__":
    main()
