"""
Score a checkpoint with lm-evaluation-harness (its own API and task definitions).

    python eval/harness.py --ckpt out/prism_130m/ckpt.pt                    # all default tasks
    python eval/harness.py --ckpt out/prism_130m/ckpt.pt --tasks wikitext,lambada_openai --limit 200
    python eval/harness.py --ckpt hf/prism_130m                             # a directory of export_hf.py
    python eval/compare.py out/*/eval.json                                 # side by side
  offline: fetch the tasks' data where the hub is reachable, score from that folder anywhere
    python eval/task_data.py data/eval_tasks
    python eval/harness.py --ckpt out/prism_130m/ckpt.pt --tasks_dir data/eval_tasks

Default tasks: wikitext (word perplexity), lambada_openai (perplexity and accuracy) and the
zero-shot set lambada_openai, piqa, hellaswag, winogrande, arc_easy, arc_challenge, boolq,
openbookqa, sciq. Results go to --output (default: eval.json next to the checkpoint, or inside an
exported directory) together with a markdown table in the paper's layout (also printed, and
written next to it as .md).

Why a registered lm-eval `LM` subclass beside the transformers export (export_hf.py, which
lm-eval's own `hf` model can score too): our model is one nn.Module with its own recurrent
cache and kernels, and HFLM drives a model through generic code paths (attention masks,
padding side, KV-cache objects) made for attention. The adapter below calls model.py
directly, and reuses lm-eval's own pieces where the scoring rules live (TemplateLM's
context/continuation split, get_rolling_token_windows / make_disjoint_window), so the numbers
follow HFLM's conventions exactly:
  * a request (context, continuation) is scored as HFLM scores causal models: trailing spaces
    of the context move to the continuation, context+continuation is encoded as a whole and
    split at len(encode(context)); the input is (ctx+cont)[-(max_length+1):][:-1]; the result is
    the sum of the continuation's log-probs and whether greedy argmax reproduces it exactly;
  * every encoded text starts with the document-start token (prefix_token_id, by default the
    tokenizer's end-of-document token: train.bin separates documents with it, so that is what
    the model saw before each document). HFLM does the same with Mistral's BOS. An empty context
    becomes just that token;
  * loglikelihood_rolling (perplexity) splits a document into lm-eval's disjoint windows of
    max_length (= block_size) tokens, the first conditioned on the document-start token.
Requests are sorted by length (longest first, as HFLM) and batched with right padding: the model
is causal, so padding after a sequence cannot change the logits of its positions (tested). On
CUDA the forward runs under bf16 autocast and the scored positions' logits are recomputed in
float32 from the final hidden state; log-softmax is always float32, sums float64.
generate_until decodes with model.generate (greedy unless a task samples, with its temperature,
top_k and top_p), then cuts at the stop strings.
"""
import argparse
import datetime
import json
import logging
import os
import sys
import time
from contextlib import ExitStack, nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from tqdm import tqdm  # noqa: E402

from lm_eval import simple_evaluate, utils as lm_utils  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from eval import task_data  # noqa: E402
from eval.compare import results_table  # noqa: E402
from cli import HelpFormatter  # noqa: E402
from fileio import atomic_write  # noqa: E402

DEFAULT_TASKS = list(task_data.TASK_YAMLS)  # wikitext, lambada_openai and the zero-shot set


@register_model("prism")
class PrismLM(TemplateLM):
    """lm-eval LM over a model.py Model (or anything with .config.block_size,
    forward(idx) -> (logits [B,T,V], _) and, for generation tasks, Model.generate's
    generate(idx, n, temperature=, eos_id=), plus top_k= / top_p= when a sampling task sets
    them) and any tokenizer with encode/decode/eos_id.

    Registered as "prism": code that imports this module can also call
    simple_evaluate(model="prism", model_args="ckpt=PATH,batch_size=64", tasks=[...]).
    """

    def __init__(self, model=None, tokenizer=None, ckpt=None, device=None, batch_size=64,
                 max_length=None, dtype="bfloat16", add_prefix=True, prefix_token_id=None,
                 max_gen_toks=256, backend=None, tokenizer_path=None):
        super().__init__()
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        meta = None
        if model is None:
            if ckpt is None:
                raise ValueError("PrismLM needs a model or a ckpt path")
            from checkpoint import load_model
            model, meta = load_model(ckpt, device, backend=backend)
        if tokenizer is None:
            from export_hf import exported_tokenizer  # the model's own: its directory's, or its data's
            from tokenizer import load_tokenizer
            tokenizer = load_tokenizer(tokenizer_path or (exported_tokenizer(ckpt, meta) if ckpt else None))
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is not None and tokenizer.vocab_size > vocab:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens, the model {vocab}")
        self.model = model.eval().to(device)
        self.tokenizer = tokenizer
        self._device = torch.device(device)
        self.batch_size = int(batch_size)
        self._max_length = int(max_length or model.config.block_size)
        self.add_prefix = add_prefix if isinstance(add_prefix, bool) else str(add_prefix) == "True"
        self._prefix = tokenizer.eos_id if prefix_token_id is None else int(prefix_token_id)
        if not 0 <= self._prefix < (vocab or tokenizer.vocab_size):
            raise ValueError(f"prefix token id {self._prefix} outside the vocabulary")
        self.max_gen_toks = int(max_gen_toks)
        self.autocast_dtype = None
        if self._device.type == "cuda" and dtype not in (None, "float32"):
            self.autocast_dtype = getattr(torch, dtype)
        # float32 head over the scored rows needs the final hidden state: hook model.norm_f
        self._fp32_head = (self.autocast_dtype is not None and hasattr(model, "norm_f")
                           and hasattr(model, "lm_head") and model.lm_head.bias is None)
        self._hidden = None
        if self._fp32_head:
            model.norm_f.register_forward_hook(lambda m, i, o: setattr(self, "_hidden", o))
        self.tokens_scored = 0  # continuation tokens scored, for throughput numbers

    # ---- what TemplateLM needs
    @property
    def eot_token_id(self):
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self):
        return self._prefix

    @property
    def max_length(self):
        return self._max_length

    @property
    def tokenizer_name(self):
        return str(getattr(self.tokenizer, "name", type(self.tokenizer).__name__))

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        ids = list(self.tokenizer.encode(string))
        add = self.add_prefix if add_special_tokens is None else add_special_tokens
        return [self._prefix] + ids if add else ids

    def tok_decode(self, tokens, **kwargs):
        return self.tokenizer.decode(list(tokens))

    def _autocast(self):
        """bf16 autocast on CUDA, and SDPA kept off cuDNN attention: that backend builds a new
        plan for every sequence length (~3 ms per layer call on the H200), and the lengths here
        change with every batch and every decoding step."""
        if self._device.type != "cuda":
            return nullcontext()
        stack = ExitStack()
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast("cuda", dtype=self.autocast_dtype))
        stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                         SDPBackend.MATH]))
        return stack

    # ---- scoring
    @torch.no_grad()
    def _score_batch(self, items):
        """items: list of (input tokens, continuation tokens) whose continuation is the tail of
        the input's next-token targets. Returns [(sum log p(cont), greedy), ...]."""
        T = max(len(inp) for inp, _ in items)
        if self._device.type == "cuda":  # few distinct shapes: kernels compile/tune once per shape
            T = -(-T // 64) * 64
        x = torch.full((len(items), T), self.eot_token_id, dtype=torch.long)
        rows, cols, tgt = [], [], []
        for i, (inp, cont) in enumerate(items):
            x[i, :len(inp)] = torch.tensor(inp, dtype=torch.long)  # right padding
            rows += [i] * len(cont)
            cols += range(len(inp) - len(cont), len(inp))
            tgt += cont
        dev = self._device
        rows = torch.tensor(rows, device=dev)
        cols = torch.tensor(cols, device=dev)
        tgt = torch.tensor(tgt, device=dev)
        with self._autocast():
            logits, _ = self.model(x.to(dev))
        if self._fp32_head:
            sel_h, W = self._hidden[rows, cols].float(), self.model.lm_head.weight.float()
            self._hidden = None
        else:
            sel = logits[rows, cols]
        logp, hit = [], []
        step = 4096  # rows of the [N, vocab] float32 log-softmax at a time
        for s in range(0, len(tgt), step):
            z = F.linear(sel_h[s:s + step], W) if self._fp32_head else sel[s:s + step].float()
            lp = F.log_softmax(z, -1)
            logp.append(lp.gather(1, tgt[s:s + step, None])[:, 0])
            hit.append(lp.argmax(-1) == tgt[s:s + step])
        logp, hit = torch.cat(logp).double(), torch.cat(hit)
        sums = torch.zeros(len(items), dtype=torch.float64, device=dev).index_add_(0, rows, logp)
        miss = torch.zeros(len(items), dtype=torch.long, device=dev).index_add_(0, rows, (~hit).long())
        self.tokens_scored += len(tgt)
        return list(zip(sums.tolist(), (miss == 0).tolist()))

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """requests: [(request strings or None, context tokens, continuation tokens)]."""
        items = []
        for req, ctx, cont in requests:
            if not cont:
                raise ValueError(f"empty continuation after tokenization: {req!r}")
            if len(cont) > self.max_length:
                raise ValueError(f"continuation of {len(cont)} tokens exceeds max_length "
                                 f"{self.max_length}: {req!r}")
            if not ctx:
                raise ValueError(f"empty context tokens (missing prefix token?): {req!r}")
            items.append(((ctx + cont)[-(self.max_length + 1):][:-1], cont))
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))  # longest first
        res = [None] * len(items)
        pbar = tqdm(total=len(items), disable=disable_tqdm, desc="loglikelihood", unit="req")
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            for i, r in zip(idx, self._score_batch([items[i] for i in idx])):
                res[i] = r
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], r)
            pbar.update(len(idx))
        pbar.close()
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        windows, owner = [], []
        for n, req in enumerate(requests):
            (string,) = req.args
            toks = self.tok_encode(string, add_special_tokens=False)
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=toks, prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(n)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        total = [0.0] * len(requests)
        for n, (ll, _) in zip(owner, scores):
            total[n] += ll
        for req, ll in zip(requests, total):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, ll)
        return total

    # ---- generation (greedy unless the task asks to sample): model.generate
    def generate_until(self, requests, disable_tqdm=False):
        """Each request decoded by model.generate (static cache, CUDA graphs on the GPU) in
        batches of equal context length, up to EOS, then cut at the first stop string (HFLM's
        rule: decoding on past a stop string does not change the text before it)."""
        jobs = {}
        for n, req in enumerate(requests):
            context, kw = req.args
            kw = dict(kw or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", kw.get("max_new_tokens", self.max_gen_toks)))
            sampled = bool(kw.get("do_sample", False))
            temp = float(kw.get("temperature", 0.0)) if sampled else 0.0
            cut = ()  # top_k 0 is no cut, as in transformers
            if sampled:
                cut = tuple((k, v) for k, v in (("top_k", kw.get("top_k") or None), ("top_p", kw.get("top_p")))
                            if v is not None)
            if max_new >= self.max_length:
                raise ValueError(f"max_gen_toks {max_new} must be < max_length {self.max_length}")
            ctx = self.tok_encode(context)[-(self.max_length - max_new):]
            jobs.setdefault((len(ctx), max_new, tuple(until), temp, cut), []).append((n, ctx))
        out = [None] * len(requests)
        eos = self.eot_token_id
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until", unit="req")
        for (T, max_new, until, temp, cut), items in jobs.items():
            for b in range(0, len(items), self.batch_size):
                chunk = items[b:b + self.batch_size]
                x = torch.tensor([c for _, c in chunk], dtype=torch.long, device=self._device)
                with torch.no_grad(), self._autocast():
                    y = self.model.generate(x, max_new, temperature=temp, eos_id=eos, **dict(cut))
                for (n, _), toks in zip(chunk, y[:, T:].tolist()):
                    s = self.tok_decode(toks[:toks.index(eos)] if eos in toks else toks)
                    for u in until:  # cut at the first stop string, as HFLM does
                        s = s.split(u)[0]
                    out[n] = s
                    self.cache_hook.add_partial("generate_until", requests[n].args, s)
                pbar.update(len(chunk))
        pbar.close()
        return out


def task_manager(tasks, include_path=None, include_defaults=True, tasks_dir=None):
    """lm-eval's TaskManager for `tasks`, once each task's data is known to be readable here
    (task_data.TaskDataMissing names those that are not, before lm-eval starts):
      * tasks_dir: a copy written by eval/task_data.py; its files are checked, its task YAMLs
        indexed alone and the hub switched off;
      * else, when the hub does not answer, the hub is switched off (no retries) and the local
        datasets cache must hold every task's dataset."""
    offline = False
    if tasks_dir is not None:
        include_path, include_defaults = task_data.copy_yamls(tasks_dir, tasks), False
        task_data.go_offline()
    elif not task_data.hub_reachable():
        task_data.go_offline()
        offline = True
    known = [] if include_path else [t for t in tasks if t in task_data.TASK_YAMLS]
    if offline:  # the default tasks' YAMLs are found without lm-eval's scan: checked before it
        task_data.check_cache(known)
    tm = TaskManager(include_path=include_path, include_defaults=include_defaults)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}; check --tasks / --include_path")
    if offline:
        task_data.check_cache([t for t in tasks if t not in known], tm)
    return tm


class _DropDefaultsNotes(logging.Filter):
    """lm-eval warns, for every task and metric, that a metric's aggregation or direction is its
    default: true of most tasks, and the news that matters drowns in it."""

    def filter(self, record):
        msg = record.getMessage()
        return not ("but aggregation is not" in msg or "but higher_is_better is not" in msg)


logging.getLogger("lm_eval.api.task").addFilter(_DropDefaultsNotes())


def evaluate(lm, tasks, include_path=None, include_defaults=True, tasks_dir=None, limit=None,
             log_samples=False, bootstrap_iters=1000, tm=None):
    """Run lm-eval's simple_evaluate on our LM; returns lm-eval's results dict. tm: a TaskManager
    from task_manager() (default: one built here from include_path / include_defaults / tasks_dir)."""
    tm = tm or task_manager(tasks, include_path, include_defaults, tasks_dir)
    try:
        return simple_evaluate(model=lm, tasks=list(tasks), task_manager=tm, limit=limit,
                               log_samples=log_samples, bootstrap_iters=bootstrap_iters)
    except Exception as e:
        if not _unreachable(e):
            raise
        raise task_data.TaskDataMissing(
            f"a dataset could not be reached ({e}); fetch the tasks' data where the hub is "
            f"reachable ({task_data.fetch_command('DIR', tasks)}) and score with "
            "--tasks_dir DIR") from e


_UNREACHABLE = {"ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError",
                "ConnectTimeout", "ReadTimeout", "Timeout"}


def _unreachable(e):
    """Does e, or what caused it, say that the hub or a dataset on it could not be reached?"""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if (isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in _UNREACHABLE
                or "Couldn't reach" in str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def _parse_limit(s):
    if s is None:
        return None
    v = float(s)
    if v <= 0:
        raise argparse.ArgumentTypeError("--limit must be > 0")
    return int(v) if v >= 1 and v.is_integer() else v



def main(argv=None):
    p = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]) + "\n\nOn a CUDA GPU when there is one "
                                "(bf16), else on the CPU (float32). Writes --output and a .md table beside it.",
                                formatter_class=HelpFormatter)
    p.add_argument("--ckpt", required=True,
                   help="checkpoint file (out_dir/ckpt.pt) or a directory written by export_hf.py")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma list of lm-eval tasks")
    p.add_argument("--tasks_dir", default=None,
                   help="read every task's data from this copy (written by eval/task_data.py), hub off")
    p.add_argument("--include_path", default=None, help="extra folder of task YAMLs")
    p.add_argument("--only_include_path", action="store_true",
                   help="index only --include_path tasks (skips lm-eval's ~15 s scan of its own)")
    p.add_argument("--batch_size", type=int, default=64, help="requests per forward pass")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--limit", type=_parse_limit, default=None,
                   help="examples per task (a fraction if < 1; default: all); for smoke tests only")
    p.add_argument("--output", default=None,
                   help="results JSON (default: eval.json in the checkpoint's folder, or in the exported directory)")
    p.add_argument("--tokenizer", default=None, help="tokenizer file (default: an exported directory's "
                   "tokenizer.model, else tokenizer.py's Mistral model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="autocast dtype on CUDA (CPU runs float32)")
    p.add_argument("--max_length", type=int, default=None, help="context window (default: the model's block_size)")
    p.add_argument("--backend", default=None, choices=["naive", "chunk", "triton"],
                   help="recurrence backend (default: triton on CUDA, else chunk)")
    p.add_argument("--no_prefix", action="store_true",
                   help="do not start every request with the document-start token")
    p.add_argument("--prefix_id", type=int, default=None,
                   help="document-start token id (default: the tokenizer's EOS, train.bin's separator)")
    p.add_argument("--bootstrap_iters", type=int, default=1000, help="for stderr; 0 = none")
    p.add_argument("--log_samples", action="store_true", help="keep per-example records in the JSON")
    p.add_argument("--label", default=None,
                   help="row label in the table (default: the name of that folder or exported directory)")
    p.add_argument("--debug", action="store_true", help="on an error, show the traceback")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error("--batch_size must be >= 1")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        p.error("--tasks is empty")
    if args.only_include_path and not args.include_path:
        p.error("--only_include_path needs --include_path")
    if args.tasks_dir and args.include_path:
        p.error("--tasks_dir reads every task from the copy; leave out --include_path")
    try:
        return score(args, tasks)
    except (task_data.TaskDataMissing, FileNotFoundError, ValueError) as e:  # bad input or no data:
        if args.debug:                                            # the message, not a traceback
            raise
        sys.exit(f"error: {e}")


def score(args, tasks):
    # the tasks' data first: a missing dataset is a message in seconds, before a model loads
    tm = task_manager(tasks, args.include_path, not args.only_include_path, args.tasks_dir)
    lm = PrismLM(ckpt=args.ckpt, device=args.device, batch_size=args.batch_size,
                 max_length=args.max_length, dtype=args.dtype, add_prefix=not args.no_prefix,
                 prefix_token_id=args.prefix_id, backend=args.backend, tokenizer_path=args.tokenizer)
    t0 = time.time()
    out = evaluate(lm, tasks, tm=tm, limit=args.limit, log_samples=args.log_samples,
                   bootstrap_iters=args.bootstrap_iters)
    elapsed = time.time() - t0
    ckpt = os.path.abspath(args.ckpt)
    run_dir = ckpt if os.path.isdir(ckpt) else os.path.dirname(ckpt)  # an exported directory is its own
    label = args.label or os.path.basename(run_dir)
    table = results_table([(label, out["results"])])
    record = {
        "label": label, "ckpt": ckpt, "tasks": tasks, "limit": args.limit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if lm.device.type == "cuda" else "cpu",
        "dtype": args.dtype if lm.device.type == "cuda" else "float32",
        "batch_size": args.batch_size, "max_length": lm.max_length, "elapsed_s": round(elapsed, 1),
        "tokens_scored": lm.tokens_scored, "model_args": dict(vars(lm.model.config)),
        "results": out["results"], "versions": out.get("versions"), "n-shot": out.get("n-shot"),
        "higher_is_better": out.get("higher_is_better"), "table": table,
    }
    if args.log_samples:
        record["samples"] = out.get("samples")
    path = args.output or os.path.join(run_dir, "eval.json")
    atomic_write(path, json.dumps(record, indent=2, default=lm_utils.handle_non_serializable))
    atomic_write(os.path.splitext(path)[0] + ".md", table)
    print(lm_utils.make_table(out))
    print(table)
    print(f"wrote {path} ({elapsed:.0f} s, {lm.tokens_scored / max(elapsed, 1e-9):,.0f} scored tok/s)")
    return record


if __name__ == "__main__":
    main()
