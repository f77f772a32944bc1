"""
Tokenize SlimPajama (or any text) with the Mistral-7B-v0.1 tokenizer into the files train.py reads:

    out_dir/train.bin   flat uint16 token ids (np.memmap-able)
    out_dir/val.bin     same, validation documents only
    out_dir/meta.json   tokenizer name + sha256, vocab size, eos id, token/document counts,
                        sources, filters, malformed-record counts, the command

Usage:
    python data/prepare_slimpajama.py                          # 2B train + 10M val tokens, streamed
                                                               # from the hub's cerebras/SlimPajama-627B
    python data/prepare_slimpajama.py --data_files 'chunk1/*.jsonl.zst' --num_proc 2
    python data/prepare_slimpajama.py --data_files 'books/*.txt' --tokens all --val_fraction 0.01
    python data/prepare_slimpajama.py --exclude_sets github    # leave out RedPajamaGithub documents
    python data/prepare_slimpajama.py --resume                 # continue an interrupted run

Sources. By default the hub dataset's train split goes to train.bin and its validation split to
val.bin (streamed with `datasets`; only the first --tokens worth is read; SlimPajama's chunks are
already shuffled). `--dataset NAME [--dataset_config C] [--text_field F]` streams another hub
dataset the same way. `--data_files GLOB...` reads local files: .jsonl.zst (SlimPajama's own chunk
files), .jsonl, .parquet (one record per line/row, text in --text_field), and .txt (a document per
blank-line separated paragraph, or per file with --txt_docs file). Validation comes from
`--val_files GLOB...`, the hub's validation split, or, when there is none, every k-th record
(document) is held out (k = 1/--val_fraction, by default so that both budgets fill together).
A document goes to exactly one of train.bin and val.bin, never both; a held-out document that
arrives after val.bin is full is dropped rather than given to train.

Filter. SlimPajama records carry meta.redpajama_set_name, one of CommonCrawl, C4, Github, Book,
ArXiv, Wikipedia, StackExchange (with a "RedPajama" prefix). `--exclude_sets github` drops those
documents, `--include_sets c4 wikipedia` keeps only those; names are case-insensitive, with or
without the prefix. Dropped documents are counted per set in meta.json.

Separator (decided): every document is followed by one EOS (</s>, id 2); no BOS is written. The
EOS before a document is what marks its start, so a model trained on these files sees "EOS doc"
where Mistral's own models see "BOS doc": evaluation and sampling should begin a context with EOS,
not BOS. decode(train.bin split at EOS) gives back the documents.

Budgets. --tokens (default 2e9) and --val_tokens (default 10M) are met exactly, cutting the last
document short if needed; `all` takes the whole input. If the input runs out first, the files hold
what there was, a warning says so, and meta.json records train_budget_met/val_budget_met = false.

Nothing half-done. Outputs are written as *.bin.tmp and renamed when complete, so an interrupted
run never leaves a train.bin. Every --checkpoint_tokens the temp files are fsynced and the input
position saved; `--resume` truncates the temp files to that checkpoint and continues from there,
giving the same bytes as an uninterrupted run. The same inputs always give the same bytes.
Malformed records (bad JSON, missing or non-string text, bytes that are not UTF-8) are skipped,
counted and reported; past --max_malformed the run stops, naming the file and line.

Speed. Workers (--num_proc) tokenize batches of ~1 MiB of text; results are written in input
order. One worker does ~0.9M tokens/s on local .jsonl.zst on a 2-core machine
(bench/bench_prepare.py, bench/results/prepare_bench.json): ~20 min for the default 2B tokens
with 2 workers, which take 4.0 GB (train.bin) + 20 MB (val.bin) of disk.
"""

import argparse
import glob
import io
import itertools
import json
import os
import shlex
import shutil
import signal
import sys
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
import multiprocessing as mp

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from cli import HelpFormatter  # noqa: E402
from fileio import atomic_write  # noqa: E402  (torch-free: the spawned workers import this file)
from tokenizer import Tokenizer, load_tokenizer, _hub_reachable as hub_reachable  # noqa: E402

SLIMPAJAMA = "cerebras/SlimPajama-627B"
SETS = ["commoncrawl", "c4", "github", "book", "arxiv", "wikipedia", "stackexchange"]
FORMATS = (".jsonl.zst", ".jsonl", ".parquet", ".txt")
BATCH_BYTES = 1 << 20      # text per worker task: ~250k tokens, a fraction of a second
BATCH_RECORDS = 8192
PROGRESS = ".prepare_progress.json"
KILL_HOOK = "PREPARE_TEST_KILL_TASK"  # tests: the worker that gets this task id SIGKILLs itself
VERSION = 1                # bump when the byte layout changes: old checkpoints are then refused


class PrepareError(Exception):
    pass


def warn(msg):
    """A warning on stderr, the progress bar's stream, through tqdm: the bar is cleared, the line
    written whole, the bar redrawn (a plain print to stdout lands mid-bar when both are shown)."""
    from tqdm import tqdm
    tqdm.write(f"warning: {msg}", file=sys.stderr)


# -------------------------------------------------------------------------------------------------
# arguments

def parse_budget(s):
    if str(s).lower() == "all":
        return None
    try:
        n = int(s)
    except ValueError:
        n = float(s)
        if n != int(n):
            raise argparse.ArgumentTypeError(f"token budget must be a whole number or 'all', got {s}")
        n = int(n)
    if n < 0:
        raise argparse.ArgumentTypeError(f"token budget must be >= 0, got {s}")
    return n


def set_name(s):
    """'RedPajamaGithub' / 'github' / 'GitHub' -> 'github'."""
    s = str(s).lower()
    return s[len("redpajama"):] if s.startswith("redpajama") else s



def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--data_files", nargs="+", metavar="GLOB", help="local .jsonl.zst/.jsonl/.parquet/.txt files")
    p.add_argument("--val_files", nargs="+", metavar="GLOB", help="local files for val.bin")
    p.add_argument("--dataset", default=None, help=f"hub dataset to stream (default: {SLIMPAJAMA})")
    p.add_argument("--dataset_config", default=None, help="hub dataset config name")
    p.add_argument("--text_field", default="text", help="the record field that holds the text")
    p.add_argument("--txt_docs", choices=["paragraph", "file"], default="paragraph",
                   help=".txt input: a document per blank-line separated paragraph, or per file")
    p.add_argument("--val_fraction", type=float, default=None,
                   help="hold out every round(1/f)-th record when there is no validation source "
                        "(default: so that both budgets fill together)")
    p.add_argument("--exclude_sets", nargs="+", default=[], metavar="SET", help=f"drop these: {' '.join(SETS)}")
    p.add_argument("--include_sets", nargs="+", default=[], metavar="SET", help="keep only these")
    p.add_argument("--tokens", type=parse_budget, default=2_000_000_000, help="train tokens (or 'all')")
    p.add_argument("--val_tokens", type=parse_budget, default=10_000_000, help="val tokens (or 'all')")
    p.add_argument("--num_proc", type=int, default=os.cpu_count() or 1,
                   help="tokenizer worker processes (default: %(default)s, one per CPU)")
    p.add_argument("--out_dir", default=os.path.join("data", "slimpajama"), help="where the files go")
    p.add_argument("--tokenizer", default=None, help="SentencePiece model file (default: Mistral-7B-v0.1's)")
    p.add_argument("--resume", action="store_true", help="continue the interrupted run in out_dir")
    p.add_argument("--overwrite", action="store_true", help="discard an interrupted run in out_dir")
    p.add_argument("--max_malformed", type=int, default=1000, help="malformed records tolerated")
    p.add_argument("--checkpoint_tokens", type=float, default=50e6, help="tokens between checkpoints")
    p.add_argument("--batch_bytes", type=int, default=BATCH_BYTES, help="text per worker task")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)  # for meta.json
    if a.data_files and a.dataset:
        p.error("give either --data_files or --dataset, not both")
    if a.val_files and not a.data_files:
        p.error("--val_files goes with --data_files")
    if a.include_sets and a.exclude_sets:
        p.error("give either --include_sets or --exclude_sets, not both")
    for s in a.include_sets + a.exclude_sets:
        if set_name(s) not in SETS:
            p.error(f"unknown redpajama set {s!r}; known: {', '.join(SETS)}")
    if a.val_fraction is not None and not 0 < a.val_fraction < 1:
        p.error("--val_fraction must be in (0, 1)")
    if a.num_proc < 1:
        p.error("--num_proc must be >= 1")
    if a.resume and a.overwrite:
        p.error("give either --resume or --overwrite")
    return a


# -------------------------------------------------------------------------------------------------
# readers: they yield tasks (fmt, label, first, records, n_slots, end_pos). Each task covers
# n_slots record slots (lines/rows/paragraphs/files, blank lines included) of one file; `first` is
# the line of the first record (or a list, one line per record); end_pos is where to resume after
# it. Workers decode the records; the main process only splits lines.

def expand_globs(patterns, what):
    files = []
    for pat in patterns:
        hits = sorted(glob.glob(os.path.expanduser(pat), recursive=True))
        if not hits:
            raise PrepareError(f"{what}: no file matches {pat!r}")
        for f in hits:
            if os.path.isdir(f):
                continue
            if not f.endswith(FORMATS):
                raise PrepareError(f"{what}: {f}: unsupported format; use one of {', '.join(FORMATS)}")
            if f not in files:
                files.append(f)
    if not files:
        raise PrepareError(f"{what}: no input files")
    if all(os.path.getsize(f) == 0 for f in files):
        raise PrepareError(f"{what}: every input file is empty ({len(files)} files)")
    return files


def _line_batches(fh, fi, label, skip, batch_bytes):
    recs, nbytes, first, n = [], 0, skip + 1, 0
    for n, line in enumerate(fh, 1):
        if n <= skip:
            continue
        recs.append(line)
        nbytes += len(line)
        if nbytes >= batch_bytes or len(recs) >= BATCH_RECORDS:
            yield ("jsonl", label, first, recs, len(recs), (fi, n))
            recs, nbytes, first = [], 0, n + 1
    if recs:
        yield ("jsonl", label, first, recs, len(recs), (fi, n))


def _paragraph_batches(fh, fi, label, skip, batch_bytes):
    """Blank-line separated paragraphs of a text file, each one record."""
    recs, lines, nbytes, para, start, k = [], [], 0, [], 0, 0
    for n, line in enumerate(itertools.chain(fh, [b"\n"]), 1):  # a last blank line ends the last paragraph
        if n == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]  # a UTF-8 byte order mark is not text
        if line.strip():
            start = start if para else n
            para.append(line)
            continue
        if not para:
            continue
        k += 1
        if k > skip:
            recs.append(b"".join(para).rstrip(b"\r\n"))
            lines.append(start)
            nbytes += len(recs[-1])
        para = []
        if nbytes >= batch_bytes or len(recs) >= BATCH_RECORDS:
            yield ("txt", label, lines, recs, len(recs), (fi, k))
            recs, lines, nbytes = [], [], 0
    if recs:
        yield ("txt", label, lines, recs, len(recs), (fi, k))


def read_files(files, text_field, start=(0, 0), batch_bytes=BATCH_BYTES, txt_docs="paragraph"):
    for fi in range(start[0], len(files)):
        path = files[fi]
        skip = start[1] if fi == start[0] else 0
        if path.endswith(".txt") and txt_docs == "paragraph":
            with open(path, "rb") as f:
                yield from _paragraph_batches(f, fi, path, skip, batch_bytes)
        elif path.endswith(".txt"):
            if skip == 0:
                with open(path, "rb") as f:
                    yield ("txt", path, 1, [f.read()], 1, (fi, 1))
        elif path.endswith(".parquet"):
            import pyarrow.parquet as pq
            pf = pq.ParquetFile(path)
            names = pf.schema_arrow.names
            cols = [c for c in (text_field, "meta") if c in names]
            row = 0
            for b in pf.iter_batches(batch_size=max(1, min(1024, batch_bytes // 1024)), columns=cols or None):
                if row + b.num_rows <= skip:
                    row += b.num_rows
                    continue
                recs = b.to_pylist()[max(0, skip - row):]
                first = max(row, skip) + 1
                row += b.num_rows
                yield ("dict", path, first, recs, len(recs), (fi, row))
        elif path.endswith(".zst"):
            import zstandard
            with open(path, "rb") as raw:
                dctx = zstandard.ZstdDecompressor(max_window_size=2 ** 31)  # files made with --long too
                text = io.BufferedReader(dctx.stream_reader(raw, read_across_frames=True), 1 << 20)
                yield from _line_batches(text, fi, path, skip, batch_bytes)
        else:
            with open(path, "rb") as f:
                yield from _line_batches(f, fi, path, skip, batch_bytes)


def read_hub(name, config, split, text_field, start=0, batch_bytes=BATCH_BYTES):
    """Stream a hub dataset split (opened now, so errors show before any work)."""
    import datasets
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:
        raise PrepareError(f"cannot stream {name} [{split}] from the hub: {e}\n"
                           f"(offline? download the files and use --data_files)")
    if start:
        ds = ds.skip(start)
    return _hub_batches(ds, f"{name}[{split}]", text_field, start, batch_bytes)


def _hub_batches(ds, label, text_field, start, batch_bytes):
    recs, nbytes, first, n = [], 0, start + 1, start
    for r in ds:
        n += 1
        r = {k: r[k] for k in (text_field, "meta") if k in r}
        recs.append(r)
        t = r.get(text_field)
        nbytes += len(t) if isinstance(t, str) else 0
        if nbytes >= batch_bytes or len(recs) >= BATCH_RECORDS:
            yield ("dict", label, first, recs, len(recs), n)
            recs, nbytes, first = [], 0, n + 1
    if recs:
        yield ("dict", label, first, recs, len(recs), n)


def hub_splits(name, config):
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if offline or not hub_reachable():
        why = "switched off (HF_HUB_OFFLINE)" if offline else "unreachable"
        raise PrepareError(f"cannot stream {name}: the model hub is {why}; download its files and use --data_files")
    if name == SLIMPAJAMA:
        return ["train", "validation", "test"]
    try:
        import datasets
    except ImportError:
        raise PrepareError("streaming from the hub needs `pip install datasets` (or use --data_files)")
    try:
        return list(datasets.get_dataset_split_names(name, config))
    except Exception as e:
        raise PrepareError(f"cannot reach hub dataset {name}: {e}\n(offline? use --data_files)")


# -------------------------------------------------------------------------------------------------
# workers

_W = {}


def init_worker(tok_path, tok_sha, text_field, include, exclude):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's business
    _W.update(tok=Tokenizer(tok_path, sha256=tok_sha), field=text_field,
              include=set(include), exclude=set(exclude), kill=os.environ.get(KILL_HOOK))


def extract(fmt, rec, field, include=(), exclude=()):
    """One record -> (text, None) | (None, reason) for malformed | (None, 'set:NAME') filtered |
    (None, None) for blank lines and empty documents."""
    if fmt == "txt":
        try:
            return rec.decode("utf-8-sig") or None, None
        except UnicodeDecodeError as e:
            line = rec.count(b"\n", 0, e.start) + 1
            return None, f"undecodable bytes (not UTF-8) at line {line}"
    if fmt == "jsonl":
        if not rec.strip():
            return None, None
        try:
            rec = json.loads(rec)
        except UnicodeDecodeError:
            return None, "undecodable bytes (not UTF-8)"
        except ValueError as e:
            return None, f"bad JSON ({e})"
    if not isinstance(rec, dict):
        return None, "record is not a JSON object"
    text = rec.get(field)
    if text is None:
        return None, f"missing text field {field!r}"
    if not isinstance(text, str):
        return None, f"text field {field!r} is not a string ({type(text).__name__})"
    if include or exclude:
        meta = rec.get("meta")
        if isinstance(meta, str):
            try:
                meta = json.loads(meta)
            except ValueError:
                meta = None
        name = meta.get("redpajama_set_name") if isinstance(meta, dict) else None
        if not isinstance(name, str):
            return None, "missing meta.redpajama_set_name (needed by the set filter)"
        name = set_name(name)
        if (include and name not in include) or name in exclude:
            return None, "set:" + name
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return None, "undecodable text (lone surrogate)"
    return text or None, None


def encode_task(task):
    task_id, fmt, records = task
    if _W["kill"] is not None and int(_W["kill"]) == task_id:
        os.kill(os.getpid(), signal.SIGKILL)
    texts, slot, bad, filtered, empty = [], [], [], Counter(), 0
    for j, rec in enumerate(records):
        text, why = extract(fmt, rec, _W["field"], _W["include"], _W["exclude"])
        if text is not None:
            texts.append(text)
            slot.append(j)
        elif why is None:
            empty += 1
        elif why.startswith("set:"):
            filtered[why[4:]] += 1
        else:
            bad.append((j, why))
    tok = _W["tok"]
    ids, ends = tok.encode_concat(texts, tok.eos_id)
    return ids, ends, np.array(slot, dtype=np.int64), bad, filtered, empty


# -------------------------------------------------------------------------------------------------
# main process

def plan_streams(a):
    """The ordered list of streams: (split, kind, spec), split in 'val' | 'train' | 'mixed'."""
    if a.data_files:
        train = expand_globs(a.data_files, "--data_files")
        if a.val_files:
            val = expand_globs(a.val_files, "--val_files")
            both = set(os.path.realpath(f) for f in train) & set(os.path.realpath(f) for f in val)
            if both:
                raise PrepareError(f"files in both --data_files and --val_files: {sorted(both)[:3]}")
            return [("val", "files", val), ("train", "files", train)]
        return [("mixed", "files", train)]
    name = a.dataset or SLIMPAJAMA
    splits = hub_splits(name, a.dataset_config)
    if "train" not in splits:
        raise PrepareError(f"hub dataset {name} has no train split (splits: {splits})")
    if "validation" in splits:
        return [("val", "hub", (name, a.dataset_config, "validation")),
                ("train", "hub", (name, a.dataset_config, "train"))]
    return [("mixed", "hub", (name, a.dataset_config, "train"))]


def val_every(a):
    if a.val_tokens == 0:
        return 0
    if a.val_fraction is not None:
        return max(2, round(1 / a.val_fraction))
    if a.tokens is None or a.val_tokens is None:
        return 200
    return max(2, round((a.tokens + a.val_tokens) / a.val_tokens))


def describe(streams):
    out = {"train": [], "val": []}
    for split, kind, spec in streams:
        names = spec if kind == "files" else [f"{spec[0]}{'/' + spec[1] if spec[1] else ''}[{spec[2]}]"]
        for s in (("train", "val") if split == "mixed" else (split,)):
            out[s] += names
    return out


def fingerprint(a, streams, tok, k):
    srcs = []
    for split, kind, spec in streams:
        srcs.append([split, kind, [[f, os.path.getsize(f)] for f in spec] if kind == "files" else list(spec)])
    return {"version": VERSION, "streams": srcs, "text_field": a.text_field, "txt_docs": a.txt_docs,
            "tokens": a.tokens, "val_tokens": a.val_tokens, "val_every": k,
            "include_sets": sorted(map(set_name, a.include_sets)),
            "exclude_sets": sorted(map(set_name, a.exclude_sets)), "tokenizer_sha256": tok.sha256}


def check_output_dir(out_dir, need_bytes):
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, ".write_test")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise PrepareError(f"output dir {out_dir} is not writable: {e}")
    free = shutil.disk_usage(out_dir).free
    if need_bytes > free:
        raise PrepareError(f"not enough disk space in {out_dir}: need ~{need_bytes / 1e9:.2f} GB, "
                           f"{free / 1e9:.2f} GB free")


def estimate_bytes(a, streams):
    if a.tokens is not None and a.val_tokens is not None:
        return 2 * (a.tokens + a.val_tokens)
    # 'all': ~4 bytes of text per token, 2 bytes per token out, .zst expands ~3.5x
    total = 0
    for _, kind, spec in streams:
        if kind == "hub" and spec[0] == SLIMPAJAMA:
            raise PrepareError(f"--tokens all / --val_tokens all would take all of {SLIMPAJAMA} (627B tokens)")
        if kind == "files":  # a hub dataset's size is unknown here: no estimate
            total += sum(os.path.getsize(f) * (3.5 if f.endswith(".zst") else 1) for f in spec)
    return int(total / 2)


class Output:
    """train.bin.tmp / val.bin.tmp, the run's state, and the checkpoints that make it resumable.
    The state is plain JSON: input position, tokens and documents written, malformed counts."""

    def __init__(self, a, fingerprint):
        self.dir = a.out_dir
        self.created_dir = not os.path.exists(a.out_dir)  # an empty dir made here goes again on error
        self.budget = {"train": a.tokens, "val": a.val_tokens}
        self.progress = os.path.join(self.dir, PROGRESS)
        self.st = {"fingerprint": fingerprint, "stream": 0, "pos": None, "slot_base": 0,
                   "tokens": {"train": 0, "val": 0}, "docs": {"train": 0, "val": 0},
                   "truncated": {"train": False, "val": False}, "malformed": 0, "malformed_examples": [],
                   "filtered": {}, "empty": 0}
        if os.path.exists(self.progress):
            if not (a.resume or a.overwrite):
                raise PrepareError(f"{self.dir} holds an unfinished run; pass --resume to continue it "
                                   f"or --overwrite to start over")
            if a.resume:
                with open(self.progress) as f:
                    saved = json.load(f)
                old = saved.get("fingerprint", {})
                if old != fingerprint:
                    diff = [key for key in fingerprint if old.get(key) != fingerprint[key]]
                    raise PrepareError(f"--resume: the unfinished run in {self.dir} used different settings "
                                       f"({', '.join(diff)}); rerun with the same ones, or --overwrite")
                self.st = saved
        elif a.resume:
            print(f"--resume: no unfinished run in {self.dir}, starting from the beginning")
        self.saved = json.loads(json.dumps(self.st))  # what --resume would continue from

    def open(self):
        """Open the temp files; on resume cut them back to the last checkpoint."""
        self.fh = {}
        for s, n in self.st["tokens"].items():
            tmp = os.path.join(self.dir, f"{s}.bin.tmp")
            if n == 0:
                self.fh[s] = open(tmp, "wb")
                continue
            have = os.path.getsize(tmp) if os.path.exists(tmp) else -1
            if have < 2 * n:
                raise PrepareError(f"{tmp} is shorter than its checkpoint ({have} < {2 * n} bytes): "
                                   f"cannot resume, use --overwrite")
            self.fh[s] = open(tmp, "r+b")
            self.fh[s].truncate(2 * n)
            self.fh[s].seek(0, os.SEEK_END)
        if self.st["tokens"]["train"] or self.st["tokens"]["val"]:
            print(f"resuming: {self.st['tokens']['train']:,} train + {self.st['tokens']['val']:,} val tokens "
                  f"already done")
        self.checkpoint()  # from here on the run is resumable

    def checkpoint(self):
        for f in self.fh.values():
            f.flush()
            os.fsync(f.fileno())
        atomic_write(self.progress, json.dumps(self.st, indent=2))
        self.saved = json.loads(json.dumps(self.st))  # what --resume would continue from

    def full(self, s):
        return self.budget[s] is not None and self.st["tokens"][s] >= self.budget[s]

    def append(self, s, ids, ends):
        """Write documents (ids, with ends[i] the end of document i) up to the budget; -> tokens written."""
        st = self.st
        room = len(ids) if self.budget[s] is None else min(len(ids), self.budget[s] - st["tokens"][s])
        if room <= 0:
            return 0
        self.fh[s].write(ids[:room].tobytes())
        starts = np.concatenate(([0], ends[:-1]))
        st["docs"][s] += int(np.count_nonzero(starts < room))
        st["tokens"][s] += room
        st["truncated"][s] = bool(room < len(ids) and room not in ends)
        return room

    def note_bad(self, where, why, limit):
        self.st["malformed"] += 1
        if self.st["malformed"] > limit:
            raise PrepareError(f"malformed record {where}: {why}\n{self.st['malformed']} malformed records, "
                               f"more than --max_malformed={limit}; stopping")
        if len(self.st["malformed_examples"]) < 10:
            self.st["malformed_examples"].append(f"{where}: {why}")
            warn(f"skipping malformed record {where}: {why}")

    def discard_unsaved(self):
        """After an error: if no checkpoint holds any progress, remove what this run wrote (and
        out_dir itself when the run created it), since there is nothing to resume. -> True if so."""
        saved = self.saved
        if saved["stream"] or saved["pos"] is not None or any(saved["tokens"].values()):
            return False
        for f in getattr(self, "fh", {}).values():
            f.close()
        for name in (PROGRESS, "train.bin.tmp", "val.bin.tmp"):
            if os.path.exists(os.path.join(self.dir, name)):
                os.remove(os.path.join(self.dir, name))
        if self.created_dir and os.path.isdir(self.dir) and not os.listdir(self.dir):
            os.rmdir(self.dir)
        return True

    def finish(self, meta):
        """fsync, rename the temp files into place, meta.json last."""
        self.checkpoint()
        for f in self.fh.values():
            f.close()
        meta_path = os.path.join(self.dir, "meta.json")
        if os.path.exists(meta_path):
            os.remove(meta_path)  # a stale meta.json must not describe the new bins
        for s in ("val", "train"):
            os.replace(os.path.join(self.dir, f"{s}.bin.tmp"), os.path.join(self.dir, f"{s}.bin"))
        atomic_write(meta_path, json.dumps(meta, indent=2))
        os.remove(self.progress)


def absorb(out, result, task, split, k, a):
    """Write one worker result in its place. -> tokens written."""
    label, first, n_slots, end_pos = task
    ids, ends, slot, bad, filtered, empty = result
    st = out.st
    for j, why in bad:
        out.note_bad(f"{label}:{first[j] if isinstance(first, list) else first + j}", why, a.max_malformed)
    for name, c in filtered.items():
        st["filtered"][name] = st["filtered"].get(name, 0) + c
    st["empty"] += empty
    if split == "mixed" and k:  # every k-th record slot of the stream is held out for val
        lens = np.diff(ends, prepend=0)
        is_val = (st["slot_base"] + slot) % k == k - 1
        n = 0
        for s, sel in (("val", is_val), ("train", ~is_val)):
            if sel.any() and not out.full(s):
                n += out.append(s, ids[np.repeat(sel, lens)], np.cumsum(lens[sel]))
    else:
        n = out.append("train" if split == "mixed" else split, ids, ends)
    st["slot_base"] += n_slots
    st["pos"] = end_pos
    return n


def prepare(a):
    t0 = time.time()
    streams = plan_streams(a)
    try:
        tok = load_tokenizer(a.tokenizer)
    except (OSError, ValueError, RuntimeError) as e:  # none found, a missing file, not a SentencePiece model
        raise PrepareError(str(e))
    if tok.vocab_size >= 65536:
        raise PrepareError(f"vocab size {tok.vocab_size} does not fit uint16")
    k = val_every(a)
    out = Output(a, fingerprint(a, streams, tok, k))
    try:
        check_output_dir(a.out_dir, estimate_bytes(a, streams) - 2 * sum(out.st["tokens"].values()))
    except PrepareError:
        out.discard_unsaved()
        raise
    out.open()
    st = out.st
    include, exclude = sorted(map(set_name, a.include_sets)), sorted(map(set_name, a.exclude_sets))

    from tqdm import tqdm
    total = None if None in out.budget.values() else sum(out.budget.values())
    bar = tqdm(total=total, initial=sum(st["tokens"].values()), unit="tok", unit_scale=True,
               mininterval=1.0, smoothing=0.05, desc="tokenizing")
    window = deque()  # (future, task info) in input order: results are written in this order
    since_ckpt, task_id = 0, 0
    ctx = mp.get_context("spawn")  # safe even after `datasets` started its threads
    with ProcessPoolExecutor(a.num_proc, mp_context=ctx, initializer=init_worker,
                             initargs=(tok.path, tok.sha256, a.text_field, include, exclude)) as ex:
        try:
            while st["stream"] < len(streams):
                split, kind, spec = streams[st["stream"]]
                targets = ("train", "val") if split == "mixed" else (split,)
                done = all(out.full(s) for s in targets)
                if done:
                    tasks = iter(())
                elif kind == "files":
                    tasks = read_files(spec, a.text_field, tuple(st["pos"] or (0, 0)), a.batch_bytes,
                                       a.txt_docs)
                else:
                    tasks = read_hub(*spec, a.text_field, st["pos"] or 0, a.batch_bytes)
                while not done:
                    # keep a few tasks in flight per worker; write the oldest as soon as it is back
                    while len(window) <= 2 * a.num_proc + 1:
                        t = next(tasks, None)
                        if t is None:
                            break
                        fmt, label, first, records, n_slots, end_pos = t
                        window.append((ex.submit(encode_task, (task_id, fmt, records)),
                                       (label, first, n_slots, end_pos)))
                        task_id += 1
                    if not window:
                        break  # the stream ran out
                    fut, task = window.popleft()
                    n = absorb(out, fut.result(), task, split, k, a)
                    bar.update(n)
                    since_ckpt += n
                    if since_ckpt >= a.checkpoint_tokens:
                        out.checkpoint()
                        since_ckpt = 0
                    done = all(out.full(s) for s in targets)
                for fut, _ in window:
                    fut.cancel()
                window.clear()
                if hasattr(tasks, "close"):
                    tasks.close()  # closes the file it was reading
                st["stream"] += 1
                st["pos"], st["slot_base"] = None, 0
                out.checkpoint()
                since_ckpt = 0
        except BrokenProcessPool:
            raise PrepareError(f"a tokenizer worker died (killed, or out of memory?). The work up to the last "
                               f"checkpoint is kept in {a.out_dir}; continue with --resume")
        except KeyboardInterrupt:
            raise PrepareError(f"interrupted. The work up to the last checkpoint is kept in {a.out_dir}; "
                               f"continue with --resume")
        except PrepareError as e:
            if not out.discard_unsaved():
                t = out.saved["tokens"]
                e.args = (f"{e}\nThe work up to the last checkpoint ({t['train']:,} train + {t['val']:,} val "
                          f"tokens) is kept in {a.out_dir}: continue with --resume once the cause is fixed, or start "
                          f"over with --overwrite",)
            raise
        except BaseException:
            out.discard_unsaved()  # nothing checkpointed: nothing to resume, nothing left behind
            raise
        finally:
            bar.close()
            for fut, _ in window:  # on an error, don't finish the queued tasks first
                fut.cancel()

    for s in ("train", "val"):
        if not out.full(s) and out.budget[s] is not None:
            warn(f"the input ran out: {s} has {st['tokens'][s]:,} tokens, budget was {out.budget[s]:,}")
    if st["docs"]["train"] == 0:
        raise PrepareError("no documents were tokenized into train.bin (empty input, or everything filtered "
                           f"or malformed: {st['malformed']} malformed, filtered {st['filtered']})")
    meta = {
        "vocab_size": tok.vocab_size, "tokenizer": tok.name, "tokenizer_sha256": tok.sha256,
        "eos_id": tok.eos_id, "bos_id": tok.bos_id, "dtype": "uint16",
        "separator": "one EOS after every document, no BOS",
        "train_tokens": st["tokens"]["train"], "val_tokens": st["tokens"]["val"],
        "train_documents": st["docs"]["train"], "val_documents": st["docs"]["val"],
        "train_last_document_truncated": st["truncated"]["train"],
        "val_last_document_truncated": st["truncated"]["val"],
        "train_budget": out.budget["train"], "val_budget": out.budget["val"],
        "train_budget_met": out.budget["train"] is None or out.full("train"),
        "val_budget_met": out.budget["val"] is None or out.full("val"),
        "sources": describe(streams),
        "val_split": (f"every {k}th record of the train sources" if k else "none") if streams[0][0] == "mixed"
        else "separate validation source",
        "filters": {"include_sets": include, "exclude_sets": exclude, "documents_filtered_out": st["filtered"]},
        "malformed_records": st["malformed"], "malformed_examples": st["malformed_examples"],
        "empty_records": st["empty"], "text_field": a.text_field,
        "command": shlex.join(["python", "data/prepare_slimpajama.py"] + a.argv),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.time() - t0, 1),
    }
    out.finish(meta)
    dt = time.time() - t0
    n = st["tokens"]["train"] + st["tokens"]["val"]
    print(f"wrote {a.out_dir}: train {st['tokens']['train']:,} tokens ({st['docs']['train']:,} docs), "
          f"val {st['tokens']['val']:,} tokens ({st['docs']['val']:,} docs), {st['malformed']} malformed, "
          f"{dt:.1f}s, {n / max(dt, 1e-9) / 1e6:.2f}M tok/s")
    return meta


def main(argv=None):
    a = get_args(argv)
    try:
        return prepare(a)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
