"""
Export a checkpoint as a transformers model directory, and read one back.

    python export_hf.py --ckpt out/prism_130m/ckpt.pt --out hf/prism_130m
    python export_hf.py --ckpt out/prism_130m/ckpt.pt --out hf/prism_130m --dtype bfloat16 --force

The directory needs neither this repo nor a network (and works the same after a hub upload):
  config.json              PrismConfig: model.py's ModelConfig fields; auto_map -> hf_modeling.py
  model.safetensors        the weights, named "model." + model.py's names (a tied head stored once)
  generation_config.json   bos = eos = </s> (the document-start token), pad = <unk>
  tokenizer.json, tokenizer_config.json
                           the SentencePiece model as a `tokenizers` BPE that encodes exactly as
                           tokenizer.py does (checked at export); tokenizer.model is the original
  hf_modeling.py, model.py, prism_kernel.py, prism_ops/
                           what trust_remote_code=True runs: copies of this repo's files.
                           hf_modeling.py only adapts model.py's Model to transformers
  README.md                a short model card

Written into a temporary directory beside --out, loaded back through transformers and checked
(logits equal to the checkpoint's, token ids equal to tokenizer.py's), and only then renamed into
place: --out is the complete export or untouched.

A flash-linear-attention GatedDeltaNetForCausalLM directory (fla_import.py) exports the same way,
its tokenizer.model the tokenizer:
    python export_hf.py --from_fla path/to/fla_gdn --out hf/gdn_from_fla

The other direction, for sample.py, eval/ and train.py --init_from:
    model, model_args = load_exported("hf/prism_130m")
and checkpoint.load_model reads an exported directory wherever it reads a checkpoint file (through
checkpoint.read_exported, which lives beside it so that checkpoint.py needs nothing of this file).
"""
import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile

import torch

from checkpoint import MODEL_TYPE, load_model, read_exported  # noqa: F401  (read_exported: the way back)
from fileio import fsync_dir
from pretrained_dir import config_model_type

SPACE = "\u2581"
# texts the exported tokenizer must encode as tokenizer.py does before an export is published
CHECK_TEXTS = [
    "", " ", "  ", "Hello world", " Hello", "Hello ", "  two  spaces  ", "\n", "\n\nlead", "end\n",
    "a\tb\r\nc\x0b\x0cd", "x" + " " * 40 + "y", " " * 33, "Ünïcødé café naïve e\u0301", "東京 42 ساعة",
    "emoji 😀🚀 and rare \U0001f9ea", "\x00\x01 control", "fullwidth Ａ ①", "\u2581literal \u2581\u2581marks",
    "</s> <s> <unk> are text here", "<0x41> looks like a byte piece", "def f(x):\n    return x  # ok\n",
    "1.5e3 + 2,000 = 3500", "ﬁ ligature", "a\u3000b", "The quick brown fox jumps over the lazy dog.",
]


def _fail(path, why):
    raise ValueError(f"{path}: {why}")


# ---------------------------------------------------------------------------------------- tokenizer

def hf_tokenizer(tok):
    """tokenizer.py's SentencePiece BPE model as a transformers PreTrainedTokenizerFast (a
    `tokenizers` BPE: loads without sentencepiece or protobuf). Same ids as tok.encode():
      * merges in SentencePiece's order: by the merged piece's score, highest first. Mistral gives
        every whitespace-run piece the same score and SentencePiece then merges the leftmost pair
        first; ranking those merges by longer left part first reproduces that;
      * its normalizer: add_dummy_prefix (a leading U+2581), spaces -> U+2581, nothing else;
      * control pieces (<s>, </s>, <unk>) are never produced from text (split_special_tokens).
    tok(text) prepends </s>, the document-start token (hf_modeling.py says why); add_special_tokens=False
    gives tok.encode(text) exactly. Checked on CHECK_TEXTS by check_tokenizer()."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    sp = tok.sp
    n = sp.get_piece_size()
    special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    if len(vocab) != n:
        _fail(tok.path, "duplicate pieces: not a SentencePiece BPE model this exporter understands")
    plain = {sp.id_to_piece(i): sp.get_score(i) for i in range(n)
             if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))}
    merges = []
    for piece, score in plain.items():
        for j in range(1, len(piece)):
            left, right = piece[:j], piece[j:]
            if left in plain and right in plain:
                if not piece.strip(SPACE):  # a whitespace run: after all text merges, leftmost-first
                    merges.append(((1, -len(left), len(right)), left, right))
                else:
                    merges.append(((0, -score, vocab[left], vocab[right]), left, right))
    merges = [(left, right) for _, left, right in sorted(merges)]
    unk = sp.id_to_piece(sp.unk_id())
    eos = sp.id_to_piece(tok.eos_id)

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                   byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False)
                                for i in special])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{eos} $A", pair=f"{eos} $A {eos}:1 $B:1", special_tokens=[(eos, tok.eos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=eos, eos_token=eos, unk_token=unk, pad_token=unk,
        split_special_tokens=True, padding_side="right", clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"])


def check_tokenizer(hf_tok, tok, where, texts=CHECK_TEXTS):
    """Raise unless hf_tok encodes and decodes `texts` exactly as tokenizer.py's `tok`."""
    for text in texts:
        want = tok.encode(text)
        got = hf_tok(text, add_special_tokens=False)["input_ids"]
        if got != want:
            _fail(where, f"the exported tokenizer encodes {text!r} as {got}, tokenizer.py ({tok.path}) "
                         f"as {want}: this SentencePiece model cannot be exported exactly")
        if hf_tok(text)["input_ids"] != [tok.eos_id] + want:
            _fail(where, f"the exported tokenizer does not start {text!r} with the document-start token")
        if hf_tok.decode(want) != tok.decode(want):
            _fail(where, f"the exported tokenizer decodes {want} as {hf_tok.decode(want)!r}, "
                         f"tokenizer.py as {tok.decode(want)!r}")


def check_vocab(tok, model, meta, ckpt):
    """The tokenizer must be the one the checkpoint was trained with (as far as it records)."""
    V = model.config.vocab_size
    if tok.vocab_size > V:
        _fail(tok.path, f"tokenizer has {tok.vocab_size} tokens but {ckpt} only {V}: not the "
                        f"tokenizer this model was trained with (pass it with --tokenizer)")
    data = meta.get("data_meta") or {}
    sha = data.get("tokenizer_sha256")
    if sha and sha != tok.sha256:
        _fail(tok.path, f"sha256 {tok.sha256[:12]}..., but {ckpt} was trained on data tokenized with "
                        f"{data.get('tokenizer')} (sha256 {sha[:12]}...): pass that file with --tokenizer")
    for key, have in (("vocab_size", tok.vocab_size), ("eos_id", tok.eos_id)):
        if key in data and data[key] != have:
            _fail(tok.path, f"{key} {have}, but {ckpt} was trained on data with {key} {data[key]}")


# ---------------------------------------------------------------------------------------- export

def model_card(name, model, tok, dtype):
    cfg = model.config
    kinds = sorted({b.mixer_name for b in model.blocks})
    return f"""---
library_name: transformers
tags: [prism, gated-deltanet, linear-attention, custom_code]
---
# {name}

A {"/".join(kinds)} language model ({model.num_params(non_embedding=False) / 1e6:.1f}M parameters,
{cfg.n_layer} layers, width {cfg.n_embd}, trained context {cfg.block_size}), exported from a PRISM
checkpoint. Weights in {dtype}; tokenizer {tok.name}.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(PATH, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)
ids = tok("The meaning of life is", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0], skip_special_tokens=True))
```

* `tok(text)` starts with `</s>`: the model saw it before every training document (it never saw `<s>`).
* Padding: right padding for scoring; `generate()` takes unpadded prompts (left padding raises).
* On CUDA the recurrence runs the Triton kernels of `prism_kernel.py` and `prism_ops/` (needs `triton`); on CPU, PyTorch.
"""


def _set_tokenizer_class(path):
    """transformers 5 saves the class as "TokenizersBackend"; "PreTrainedTokenizerFast" is the name
    that transformers 4 also knows (5 maps it to the same class)."""
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _publishable(d):
    """Permissions as the umask says (mkdtemp and some writers use 0600/0700), data on disk; the
    same for the folders inside (prism_ops/)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(d, 0o777 & ~umask)
    for name in os.listdir(d):
        p = os.path.join(d, name)
        if os.path.isdir(p):
            _publishable(p)
            continue
        os.chmod(p, 0o666 & ~umask)
        with open(p, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(d)


def _fsync_dir(d):
    """The directory's entries, and its own entry in its parent."""
    fsync_dir(d)
    fsync_dir(os.path.dirname(d))


def verify(path, model, tok, dtype):
    """Load `path` as a user would (transformers, trust_remote_code) and compare with `model` and
    tokenizer.py. Returns the largest relative logit difference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    try:
        hf_tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # no question about config code
        check_tokenizer(hf_tok, tok, path)
        ids = hf_tok(CHECK_TEXTS[-1] + " " + CHECK_TEXTS[13], return_tensors="pt")["input_ids"]
        ids = ids[:, :model.config.block_size]
        ref = model
        if dtype != torch.float32:  # the reference model with the exported (rounded) weights
            ref = type(model)(model.config, backend="chunk").eval()
            ref.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        with torch.no_grad():
            want = ref(ids)[0].float()
            got = hf(ids).logits.float()
        rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        if not rel <= 1e-5:
            _fail(path, f"exported model's logits differ from the checkpoint's (max relative {rel:.2e})")
        return rel
    finally:  # transformers copied the code into its module cache under the temporary name: drop it
        entry = os.path.dirname(sys.modules[type(hf).__module__].__file__)
        while os.path.dirname(entry) != entry and \
                os.path.basename(os.path.dirname(entry)) != "transformers_modules":
            entry = os.path.dirname(entry)  # transformers_modules/<dir name>[/<hash>]/hf_modeling.py
        if os.path.basename(os.path.dirname(entry)) == "transformers_modules" and \
                os.path.basename(entry).startswith("_export_tmp_"):
            shutil.rmtree(entry, ignore_errors=True)


def export(ckpt, out, tokenizer=None, dtype="float32", force=False):
    """Write the transformers directory `out` for checkpoint `ckpt` (a file, or an exported dir)."""
    from tokenizer import load_tokenizer
    from transformers import GenerationConfig

    from hf_modeling import PrismConfig, PrismForCausalLM

    out = os.path.abspath(out)
    if os.path.exists(out):
        if not force:
            raise FileExistsError(f"{out} exists; pass --force to replace it")
        if config_model_type(out) != MODEL_TYPE:  # --force replaces an earlier export, never a training directory
            raise FileExistsError(f"{out} exists and is not a directory written by export_hf.py; "
                                  f"refusing to replace it")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model, meta = load_model(ckpt, "cpu", backend="chunk")
    tok = load_tokenizer(tokenizer)
    check_vocab(tok, model, meta, ckpt)
    hf_tok = hf_tokenizer(tok)
    check_tokenizer(hf_tok, tok, tok.path)

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="_export_tmp_", dir=parent)
    try:
        unk = tok.sp.unk_id()
        args = dataclasses.asdict(model.config)
        args["attn_layers"] = list(args["attn_layers"])
        data = meta.get("data_meta") or {}
        where = os.path.abspath(ckpt)  # run folder + file, not the whole local path
        provenance = {"checkpoint": os.path.relpath(where, os.path.dirname(os.path.dirname(where))),
                      "iter_num": meta.get("iter_num"),
                      "best_val_loss": meta.get("best_val_loss"), "tokenizer": tok.name,
                      "tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                      "dataset": (meta.get("config") or {}).get("dataset", data.get("dataset"))}
        config = PrismConfig(**args, bos_token_id=tok.eos_id, eos_token_id=tok.eos_id, pad_token_id=unk,
                             architectures=["PrismForCausalLM"], prism_export=provenance)
        hf = PrismForCausalLM(config).eval()
        hf.model.load_state_dict(model.state_dict())
        hf.to(torch_dtype)
        hf.generation_config = GenerationConfig(bos_token_id=tok.eos_id, eos_token_id=tok.eos_id,
                                                pad_token_id=unk)
        hf.save_pretrained(tmp)
        del hf
        hf_tok.save_pretrained(tmp)
        _set_tokenizer_class(os.path.join(tmp, "tokenizer_config.json"))
        shutil.copyfile(tok.path, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(model_card(os.path.basename(out), model, tok, dtype))
        rel = verify(tmp, model, tok, torch_dtype)
        _publishable(tmp)
        if os.path.exists(out):  # --force: swap, so that `out` is never a half-written directory
            old = tempfile.mkdtemp(prefix="_export_old_", dir=parent)
            previous = os.path.join(old, "previous")
            os.rename(out, previous)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(previous, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        _fsync_dir(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, rel


# ---------------------------------------------------------------------------------------- read back

def exported_tokenizer(path, meta=None):
    """The tokenizer a model comes with: a directory's (an export's or an fla checkpoint's)
    tokenizer.model, else its tokenizer.json; for a checkpoint file, the tokenizer file its training
    data was prepared with (meta: load_model's), when that file is here. None: tokenizer.py's default."""
    if os.path.isdir(path):
        for name in ("tokenizer.model", "tokenizer.json"):
            p = os.path.join(path, name)
            if os.path.isfile(p):
                return p
        return None
    recorded = ((meta or {}).get("data_meta") or {}).get("tokenizer")
    return recorded if isinstance(recorded, str) and os.path.isfile(recorded) else None


def load_exported(path, device="cpu", backend=None):
    """(Model, model_args) from an exported directory, checked as checkpoint.load_model checks
    a checkpoint (same names, shapes, finite values)."""
    model, meta = load_model(path, device, backend=backend)
    return model, meta["model_args"]


def fla_tokenizer(path):
    """The SentencePiece file of an fla directory, which the export's tokenizer is built from."""
    from fla_import import is_fla_dir
    if not is_fla_dir(path):
        raise ValueError(f"{path}: not a flash-linear-attention GatedDeltaNetForCausalLM directory "
                         f"(config.json with model_type 'gated_deltanet')")
    sp = os.path.join(path, "tokenizer.model")
    if os.path.isfile(sp):
        return sp
    raise ValueError(f"{path} has no tokenizer.model: the export builds its tokenizer from a SentencePiece "
                     f"model (pass one with --tokenizer). Without exporting, the directory loads as it is: "
                     f"sample.py --ckpt {path}, train.py --init_from={path}")


def main(argv=None):
    p = argparse.ArgumentParser(description="export a checkpoint as a transformers model directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="checkpoint file (out_dir/ckpt.pt) or an exported directory")
    src.add_argument("--from_fla", metavar="DIR", help="a flash-linear-attention GatedDeltaNetForCausalLM "
                     "directory (its tokenizer.model is the default --tokenizer)")
    p.add_argument("--out", required=True, help="directory to write (atomically)")
    p.add_argument("--tokenizer", default=None,
                   help="SentencePiece model the training data was tokenized with (default: tokenizer.py's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights in the safetensors file")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    a = p.parse_args(argv)
    if a.from_fla:
        a.ckpt, a.tokenizer = a.from_fla, a.tokenizer or fla_tokenizer(a.from_fla)
    out, rel = export(a.ckpt, a.out, a.tokenizer, a.dtype, a.force)
    print(f"wrote {out} (checked: transformers logits vs the checkpoint's, max relative difference "
          f"{rel:.1e}; tokenizer ids equal tokenizer.py's on {len(CHECK_TEXTS)} texts)")


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, FileExistsError, ValueError) as e:  # bad input: the message, not a traceback
        sys.exit(f"error: {e}")
