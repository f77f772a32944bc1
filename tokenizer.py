"""
The Mistral-7B-v0.1 tokenizer (SentencePiece BPE, 32000 pieces), found without fuss.

    from tokenizer import load_tokenizer
    tok = load_tokenizer()            # or load_tokenizer("path/to/tokenizer.model")
    ids = tok.encode("Hello world")   # no BOS, no EOS
    tok.decode(ids)

Where the file comes from (first that works):
  1. `path`, when given (any SentencePiece model; no checksum is imposed on it).
  2. The model hub's `mistralai/Mistral-7B-v0.1` tokenizer.model: from the local hub cache, or
     downloaded when huggingface.co answers within a few seconds (skipped when HF_HUB_OFFLINE=1).
  3. The identical file shipped inside the `mistral-common` package
     (mistral_common/data/tokenizer.model.v1), so no network is needed.
Files from 2 and 3 must have the sha256 below; anything else is an error, not a silent swap.

Speed: SentencePiece BPE encodes ~0.6M tokens/s per core here, and slower on long texts. BPE
only merges symbols into pieces of the vocabulary, so it never merges across a place in the text
where no piece could span: before a space that follows a non-space (no piece has the space mark
after another character) and around a newline, tab or digit (they only ever stand alone). Cut at
those places, a text encodes as the concatenation of its segments, and segments repeat: the
batch methods cache them and send only unseen ones to SentencePiece: identical ids, 1.5-2x faster
on unseen text and 2.5-3.5x once the cache is warm (bench/bench_prepare.py).
Both properties are checked on the vocabulary at load; a tokenizer without them is simply
encoded by SentencePiece whole.
"""

import importlib.util
import os
import re
import socket
from array import array
from itertools import chain
from urllib.parse import urlparse

import numpy as np
import sentencepiece as spm

from fileio import sha256_file  # torch-free, like this file

MISTRAL_REPO = "mistralai/Mistral-7B-v0.1"
MISTRAL_SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"
SPACE = "\u2581"  # SentencePiece's visible space
_LONERS = "\n\r\t\x0b\x0c0123456789"  # characters that may only ever be pieces on their own
_CACHE_MAX = 500_000  # segments per process (~150 MB); cleared when full


class Tokenizer:
    def __init__(self, model_path, name=None, sha256=None):
        self.path = str(model_path)
        self.sha256 = sha256 or sha256_file(self.path)
        self.sp = spm.SentencePieceProcessor(model_file=self.path)
        self.name = name or (MISTRAL_REPO if self.sha256 == MISTRAL_SHA256 else self.path)
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        self._trailing_space = self.sp.encode("a ")[len(self.sp.encode("a")):]
        self._cache = {}
        self._cache_reset()
        self.fast = self._segmenting_is_exact()

    def __repr__(self):
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]}...)"

    def encode(self, text):
        """str -> list[int], without BOS/EOS."""
        return self.sp.encode(text)

    def decode(self, ids):
        return self.sp.decode([int(i) for i in ids])

    def encode_batch(self, texts):
        """list[str] -> list[list[int]], same ids as encode() on each, faster."""
        if not self.fast:
            return self.sp.encode(list(texts), num_threads=1)
        cache = self._cache
        return [self.sp.encode(t) if segs is None else list(chain.from_iterable(cache[w] for w in segs))
                for t, segs in zip(texts, self._split(texts))]

    def encode_concat(self, texts, sep_id):
        """Encode texts into one flat array with `sep_id` after each text (the worker fast path).
        Returns (ids, ends): ids uint16 (int32 if the vocab needs it), ends[i] = end of text i
        including its separator."""
        out, ends = [], []
        if self.fast:
            cache = self._cache
            for t, segs in zip(texts, self._split(texts)):
                if segs is None:
                    out += self.sp.encode(t)
                else:
                    for w in segs:
                        out += cache[w]
                out.append(sep_id)
                ends.append(len(out))
        else:
            for ids in self.sp.encode(list(texts), num_threads=1):
                out += ids
                out.append(sep_id)
                ends.append(len(out))
        if self.vocab_size < 65536:  # array('H') converts ~2x faster than np.array, and range-checks
            return np.frombuffer(array("H", out), dtype=np.uint16), np.array(ends, dtype=np.int64)
        return np.array(out, dtype=np.int32), np.array(ends, dtype=np.int64)

    def _split(self, texts):
        """Texts -> lists of segments, every segment now in the cache; None for a text that
        SentencePiece must see whole (empty, or holding a literal U+2581, which it reads as a space)."""
        # a leading ' ' stands for SentencePiece's dummy prefix: then every segment that follows a
        # space starts with ' ', and encode(segment[1:]) (which adds the prefix back) is its encoding
        lists = [self._segments(" " + t) if t and SPACE not in t else None for t in texts]
        segs = set()
        for ws in lists:
            if ws:
                segs.update(ws)
        cache = self._cache
        new = segs.difference(cache)
        if len(cache) + len(new) > _CACHE_MAX:
            self._cache_reset()
            new = segs.difference(cache)
        led = [w for w in new if w[0] == " "]
        for w, ids in zip(led, self.sp.encode([w[1:] for w in led], num_threads=1)):
            cache[w] = ids
        # a segment after a newline/digit has no dummy prefix: encode it behind a newline, drop that
        bare = [w for w in new if w[0] != " "]
        k = len(self._newline)
        for w, ids in zip(bare, self.sp.encode(["\n" + w for w in bare], num_threads=1)):
            cache[w] = ids[k:]
        return lists

    def _cache_reset(self):
        # a lone trailing space: encode("") is empty, so its ids come from a text that ends in one
        self._cache.clear()
        self._cache[" "] = self._trailing_space

    def _segmenting_is_exact(self):
        """Check the two vocabulary properties (module docstring); set up the segmenter."""
        text_pieces = [self.sp.id_to_piece(i) for i in range(self.vocab_size)
                       if not (self.sp.is_byte(i) or self.sp.is_control(i) or self.sp.is_unknown(i))]
        if any(map(re.compile(f"[^{SPACE}]{SPACE}").search, text_pieces)):
            return False
        long = "".join(p for p in text_pieces if len(p) > 1)
        loners = "".join(c for c in _LONERS if c not in long)
        self._newline = self.sp.encode("\n")
        if "\n" not in loners:
            loners = ""  # segments after a loner need a loner to be encoded behind: newline it is
        cls = re.escape(loners)
        # spaces + ordinary text | spaces alone (before a loner, or at the end) | one loner
        self._segments = re.compile(f" *[^ {cls}]+| +|[{cls}]" if loners else r" +[^ ]*").findall
        self.loners = loners
        # and the normalizer must keep spaces, newlines and digits as they are
        sample = ["  Hello,  world!\n\tfoo  ", " a b  c   d ", "x", " ", "  ", "Ünïcødé 東京 42 ,. ",
                  "def f(x):\n    return x  # ok\n", "end with space ", "\n\nlead", "7 up", "a\r\n\x0b\x0c1.5e3\n"]
        self.fast = True
        try:
            return self.encode_batch(sample) == [self.sp.encode(s) for s in sample]
        finally:
            self._cache_reset()


def _hub_reachable(timeout=3.0):
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_hub():
    """Path of the hub's tokenizer.model, or None (not installed, offline, gated, unreachable)."""
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        return None
    cached = try_to_load_from_cache(MISTRAL_REPO, "tokenizer.model")
    if isinstance(cached, str):
        return cached
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline or not _hub_reachable():
        return None
    try:  # the repo is gated: without an accepted licence and a token this fails, and that is fine
        return hf_hub_download(MISTRAL_REPO, "tokenizer.model", etag_timeout=5)
    except Exception:
        return None


def _from_mistral_common():
    spec = importlib.util.find_spec("mistral_common")  # locate without importing it (slow import)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "tokenizer.model.v1")
    return path if os.path.isfile(path) else None


class JSONTokenizer:
    """A transformers tokenizer.json (the `tokenizers` library), for models that ship one instead of
    a SentencePiece file (many of fla's checkpoints): encode and decode as Tokenizer does (no
    BOS/EOS added), its EOS and BOS named by tokenizer_config.json beside it (else config.json's
    token ids). What sample.py and eval/ use; data preparation needs a SentencePiece model."""

    def __init__(self, path):
        from tokenizers import Tokenizer as Backend
        self.path = str(path)
        self.sha256 = sha256_file(self.path)
        self.name = self.path
        try:
            self.backend = Backend.from_file(self.path)
        except Exception as e:
            raise ValueError(f"{self.path}: cannot be read as a tokenizer.json ({e})")
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        here = os.path.dirname(self.path)
        self.eos_id = self._special(here, "eos")
        self.bos_id = self._special(here, "bos")
        if self.eos_id is None:
            raise ValueError(f"{self.path}: no EOS token: neither tokenizer_config.json's eos_token nor "
                             f"config.json's eos_token_id names one")

    def _special(self, here, kind):
        import json
        for name, key in (("tokenizer_config.json", f"{kind}_token"), ("config.json", f"{kind}_token_id")):
            try:
                with open(os.path.join(here, name), encoding="utf-8") as f:
                    value = json.load(f).get(key)
            except (OSError, ValueError):
                continue
            if isinstance(value, dict):  # {"content": "</s>", ...}
                value = value.get("content")
            if isinstance(value, str):
                value = self.backend.token_to_id(value)
            if isinstance(value, int):
                return value
        return None

    def __repr__(self):
        return f"JSONTokenizer({self.path!r}, vocab_size={self.vocab_size})"

    def encode(self, text):
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts):
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids):
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(path=None):
    """A SentencePiece model file, a tokenizer.json (JSONTokenizer), or with no path Mistral's."""
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        if str(path).endswith(".json"):
            return JSONTokenizer(path)
        return Tokenizer(path)
    for where, found in (("model hub", _from_hub), ("mistral-common package", _from_mistral_common)):
        p = found()
        if p is None:
            continue
        sha = sha256_file(p)
        if sha != MISTRAL_SHA256:
            raise ValueError(f"the Mistral-7B-v0.1 tokenizer from the {where} ({p}) has sha256 {sha}, "
                             f"expected {MISTRAL_SHA256}: corrupt or changed file; "
                             f"pass an explicit path to use it anyway")
        return Tokenizer(p, name=MISTRAL_REPO, sha256=sha)
    raise RuntimeError(f"no tokenizer found: the model hub's {MISTRAL_REPO} is unreachable or gated and "
                       f"the mistral-common package is not installed (pip install mistral-common), "
                       f"or pass a SentencePiece model path")
