"""export_hf.py and hf_modeling.py: checkpoints as transformers models, offline, tiny models on CPU.

Checked, on GDN, PRISM, hybrid and transformer checkpoints exported to directories:
  * AutoTokenizer encodes (and decodes) exactly as tokenizer.py on varied text;
  * AutoModelForCausalLM logits equal model.py's; the tied head is stored once;
  * generate() runs on model.py's cache (PrismCache) and its greedy tokens equal Model.generate's
    and sample.py's; cached steps equal a full forward; beam search reorders the state;
  * generate()'s fast path (Model.generate): greedy equals transformers' own loop token for token,
    EOS rows padded as it pads them, sampling seeded and within transformers' top-k/top-p sets (and
    in their proportions), generation_config defaults as transformers resolves them, and every
    request it does not take gives transformers' result;
  * padding: right padding scores right, left padding and padded generate() raise;
  * lm-eval's own `hf` model gives eval/'s loglikelihoods and perplexities (local tasks);
  * the directory loads in a fresh interpreter without this repo, names no import that a
    hub download would fail on, and survives save_pretrained;
  * the other direction (load_exported, checkpoint.load_model, PrismLM on a directory);
  * bad input: clear errors naming the file, no half-written or leftover directories.
"""
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import export_hf  # noqa: E402
from export_hf import CHECK_TEXTS, export, load_exported, read_exported  # noqa: E402
from model import Model, ModelConfig  # noqa: E402
from checkpoint import load_model  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = load_tokenizer()  # Mistral-7B-v0.1, from the mistral-common package offline
BLOCK = 32
VARIANTS = {
    "gdn": dict(mixer="gdn"),
    "prism": dict(mixer="prism"),
    "hybrid": dict(mixer="prism", attn_layers=(1,)),
    "transformer": dict(mixer="attention"),
}
PROMPT = "The meaning of life is"


def tiny_config(**kw):
    base = dict(vocab_size=32000, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, head_dim=16,
                mlp_hidden=64, solver_rank=8, solver_steps=3)
    return ModelConfig(**{**base, **kw})


def save_ckpt(path, model, data_meta=None, **extra):
    meta = {"tokenizer": TOK.name, "tokenizer_sha256": TOK.sha256, "vocab_size": TOK.vocab_size,
            "eos_id": TOK.eos_id} if data_meta is None else data_meta
    torch.save({"model": model.state_dict(), "model_args": dataclasses.asdict(model.config),
                "iter_num": 7, "data_meta": meta, **extra}, path)
    return str(path)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{variant: (checkpoint path, exported dir, the checkpoint's Model)}."""
    d = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, kw) in enumerate(VARIANTS.items()):
        torch.manual_seed(i)
        model = Model(tiny_config(**kw)).eval()
        ckpt = save_ckpt(d / f"{name}.pt", model)
        path, rel = export(ckpt, d / f"hf_{name}")
        assert rel <= 1e-5
        out[name] = (ckpt, path, model)
    return out


_LOADED = {}


def hf_model(path):
    if path not in _LOADED:
        _LOADED[path] = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    return _LOADED[path]


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def random_ids(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 32000, (B, T), generator=g)
    ids[:, 0] = TOK.eos_id  # documents start with </s>
    return ids


def greedy_rows_match(hf_out, ref, prompt_len, eos, pad):
    """HF stops a row at EOS and pads it; Model.generate never stops: compare up to the EOS."""
    for h, r in zip(hf_out.tolist(), ref.tolist()):
        gen = r[prompt_len:]
        if eos in gen:
            gen = gen[:gen.index(eos) + 1]
        want = r[:prompt_len] + gen
        assert h[:len(want)] == want
        assert all(t == pad for t in h[len(want):])


# ------------------------------------------------------------------------------------ tokenizer
def tokenizer_texts():
    from pydoc_data.topics import topics
    rng = random.Random(0)
    alphabet = " \n\t\u2581abcXYZ019.,-_<>/sé東😀\u0301\u3000"
    texts = list(CHECK_TEXTS) + list(topics.values())[:150]
    texts += [" " * k + w for k in range(0, 70) for w in ("x", "\n", "", "\u2581", " a")]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(500)]
    texts += ["".join(chr(rng.choice([rng.randint(32, 0xD7FF), rng.randint(0xE000, 0x2FFFF)]))
                      for _ in range(rng.randint(1, 20))) for _ in range(300)]
    return texts


def test_tokenizer_encodes_as_tokenizer_py(exports):
    _, path, _ = exports["prism"]
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # the tokenizer runs no custom code
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (TOK.eos_id, TOK.eos_id, TOK.sp.unk_id())
    texts = tokenizer_texts()
    bad = [t for t in texts if tok(t, add_special_tokens=False)["input_ids"] != TOK.encode(t)]
    assert not bad, f"{len(bad)} texts encode differently, e.g. {bad[:3]!r}"
    assert all(tok(t)["input_ids"] == [TOK.eos_id] + TOK.encode(t) for t in texts[:200])
    ids = [TOK.encode(t) for t in texts]
    assert [tok.decode(i) for i in ids] == [TOK.decode(i) for i in ids]
    assert tok(texts[:50], add_special_tokens=False)["input_ids"] == ids[:50]  # batch path too
    assert tok.decode([TOK.eos_id] + ids[3], skip_special_tokens=True) == TOK.decode(ids[3])


# ------------------------------------------------------------------------------------ same numbers
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_model_py(exports, variant):
    _, path, model = exports[variant]
    hf = hf_model(path)
    assert hf.dtype == torch.float32 and type(hf).__name__ == "PrismForCausalLM"
    ids = random_ids(2, 20, seed=1)
    with torch.no_grad():
        want = model(ids)[0]
        got = hf(ids).logits
    assert rel_err(got, want) <= 1e-5
    # tied head: one tensor in the model, stored once in the file
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert hf.model.lm_head.weight.data_ptr() == hf.model.wte.weight.data_ptr()
    assert "model.wte.weight" in keys and "model.lm_head.weight" not in keys
    assert {f"model.{k}" for k in model.state_dict()} - keys == {"model.lm_head.weight"}


def test_untied_head_exports_both_matrices(tmp_path):
    torch.manual_seed(5)
    model = Model(tiny_config(mixer="gdn", tie_embeddings=False)).eval()
    path, _ = export(save_ckpt(tmp_path / "untied.pt", model), tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    assert hf.model.lm_head.weight.data_ptr() != hf.model.wte.weight.data_ptr()
    ids = random_ids(1, 12)
    with torch.no_grad():
        assert rel_err(hf(ids).logits, model(ids)[0]) <= 1e-5


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_generate_greedy_equals_model_generate(exports, variant):
    from hf_modeling import CACHE_ARG
    _, path, model = exports[variant]
    hf, tok = hf_model(path), AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    ref = model.generate(ids, 12, temperature=0)
    out = hf.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    greedy_rows_match(out.sequences, ref, ids.shape[1], TOK.eos_id, tok.pad_token_id)
    cache = out[CACHE_ARG]
    assert type(cache).__name__ == "PrismCache"  # decoded on model.py's own cache
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    no_cache = hf.generate(ids, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(no_cache, out.sequences)


def test_sample_py_greedy_text(exports, capsys):
    import sample
    ckpt, path, _ = exports["hybrid"]
    texts = []
    for src in (ckpt, path):  # sample.py on the checkpoint, and on the exported directory
        sample.main(["--ckpt", src, "--start", PROMPT, "--num_samples", "1", "--max_new_tokens", "10",
                     "--temperature", "0", "--device", "cpu"])
        header, text = capsys.readouterr().out.split("\n", 1)
        assert header == "=== sample 1/1 ==="
        texts.append(text.rstrip("\n"))
    hf, tok = hf_model(path), AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    out = hf.generate(ids, max_new_tokens=10, do_sample=False)[0, 1:].tolist()
    if TOK.eos_id in out[ids.shape[1] - 1:]:
        out = out[:out.index(TOK.eos_id, ids.shape[1] - 1)]
    assert texts[0] == texts[1] == tok.decode(out)


def test_cached_steps_equal_full_forward(exports):
    from hf_modeling import CACHE_ARG
    _, path, _ = exports["hybrid"]
    hf = hf_model(path)
    ids = random_ids(2, 14, seed=2)
    with torch.no_grad():
        full = hf(ids).logits
        out = hf(ids[:, :5], use_cache=True)
        cache, steps = out[CACHE_ARG], [out.logits]
        for t in range(5, 14):
            out = hf(ids[:, t:t + 1], **{CACHE_ARG: cache}, use_cache=True)
            steps.append(out.logits)
    assert cache.get_seq_length() == 14
    assert rel_err(torch.cat(steps, 1), full) <= 1e-5


def test_beam_search_reorders_the_recurrent_state(exports, monkeypatch):
    _, path, _ = exports["hybrid"]
    hf = hf_model(path)
    cache_cls = type(hf).forward.__globals__["PrismCache"]
    calls = []
    orig = cache_cls.reorder_cache
    monkeypatch.setattr(cache_cls, "reorder_cache",
                        lambda self, idx: (calls.append(idx.tolist()), orig(self, idx)))
    ids = random_ids(1, 6, seed=3)
    kw = dict(max_new_tokens=6, num_beams=4, num_return_sequences=4, do_sample=False)
    with_cache = hf.generate(ids, **kw)
    assert any(c != list(range(len(c))) for c in calls), "beams never swapped rows: the test says nothing"
    without = hf.generate(ids, use_cache=False, **kw)
    assert torch.equal(with_cache, without)


def test_padding_right_scores_left_and_generate_raise(exports):
    _, path, _ = exports["hybrid"]
    hf, tok = hf_model(path), AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    texts = ["Hello", "The meaning of life is"]
    enc = tok(texts, return_tensors="pt", padding=True)
    assert tok.padding_side == "right" and not bool(enc["attention_mask"].all())
    with torch.no_grad():
        batch = hf(**enc).logits
        for i, t in enumerate(texts):
            one = hf(tok(t, return_tensors="pt")["input_ids"]).logits[0]
            assert rel_err(batch[i, :one.shape[0]], one) <= 1e-5
        with pytest.raises(ValueError, match="generate"):
            hf.generate(**enc, max_new_tokens=3)
        tok.padding_side = "left"
        left = tok(texts, return_tensors="pt", padding=True)
        with pytest.raises(ValueError, match="left padding"):
            hf(**left)
        with pytest.raises(ValueError, match="padded prompts"):
            hf.generate(**left, max_new_tokens=3)
    # equal-length prompts batch fine: each row as if alone
    ids = random_ids(2, 7, seed=4)
    both = hf.generate(ids, max_new_tokens=5, do_sample=False)
    for i in range(2):
        one = hf.generate(ids[i:i + 1], max_new_tokens=5, do_sample=False)
        assert both[i, :one.shape[1]].tolist() == one[0].tolist()


def test_sampling_runs_on_the_cache(exports):
    _, path, _ = exports["gdn"]
    hf = hf_model(path)
    ids = random_ids(1, 5)
    kw = dict(max_new_tokens=6, do_sample=True, top_k=50, num_return_sequences=3)
    torch.manual_seed(0)
    a = transformers_generate(hf, ids, **kw)  # transformers' loop, on PrismCache
    torch.manual_seed(0)
    b = hf.generate(ids, use_cache=False, **kw)
    assert a.shape[0] == 3 and torch.equal(a, b)


# ------------------------------------------------------------------------------------ generate(): fast path
def transformers_generate(hf, *args, **kwargs):
    """transformers' own generate on the model (its Python loop over forward()), whatever
    PrismForCausalLM.generate would choose."""
    from transformers import GenerationMixin
    return GenerationMixin.generate(hf, *args, **kwargs)


@pytest.fixture
def fast_calls(monkeypatch):
    """Records the arguments of every Model.generate call that a PrismForCausalLM.generate makes."""
    calls = []

    def spy(hf):
        inner = hf.model.generate
        monkeypatch.setattr(hf.model, "generate", lambda *a, **k: calls.append(k) or inner(*a, **k))
        return hf
    return calls, spy


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fast_generate_greedy_equals_transformers_loop(exports, variant, fast_calls):
    from transformers import GenerationConfig
    calls, spy = fast_calls
    hf = spy(hf_model(exports[variant][1]))
    ids = random_ids(2, 7, seed=11)  # two prompts of equal length
    requests = [dict(max_new_tokens=12, do_sample=False), dict(max_length=15),
                dict(max_new_tokens=9, attention_mask=torch.ones_like(ids)),
                dict(generation_config=GenerationConfig(max_new_tokens=8, eos_token_id=TOK.eos_id,
                                                        pad_token_id=TOK.sp.unk_id())),
                dict()]  # model.generation_config alone: greedy, transformers' default length
    for kw in requests:
        calls.clear()
        got = hf.generate(ids, **kw)
        assert len(calls) == 1 and calls[0]["temperature"] == 0, (kw, calls)
        want = transformers_generate(hf, ids, **kw)
        assert got.dtype == torch.long and torch.equal(got, want), kw
    assert hf.generate(input_ids=ids, max_new_tokens=3).shape == (2, 10)
    hf.fast_generate = False
    try:
        calls.clear()
        assert torch.equal(hf.generate(ids, max_new_tokens=5), want[:, :12]) and not calls
    finally:
        hf.fast_generate = True


def test_fast_generate_eos_rows_padded_as_transformers_pads_them(exports, fast_calls):
    calls, spy = fast_calls
    hf = spy(hf_model(exports["prism"][1]))
    ids = random_ids(3, 6, seed=12)
    plain = transformers_generate(hf, ids, max_new_tokens=10, eos_token_id=None)
    a, b = int(plain[0, 6 + 2]), int(plain[1, 6 + 4])  # row 0's 3rd new token, row 1's 5th
    for kw in (dict(eos_token_id=a), dict(eos_token_id=[5, a, b], pad_token_id=7),
               dict(eos_token_id=[a, b, int(plain[2, 6])])):  # every row ends: the result is shorter
        calls.clear()
        got = hf.generate(ids, max_new_tokens=10, **kw)
        want = transformers_generate(hf, ids, max_new_tokens=10, **kw)
        assert len(calls) == 1 and torch.equal(got, want), (kw, got, want)
    assert want.shape[1] < 6 + 10
    pad = 7
    got = hf.generate(ids, max_new_tokens=10, eos_token_id=[5, a, b], pad_token_id=pad)
    row0 = plain[0, :6 + 10].tolist()
    cut = 6 + min(i for i, t in enumerate(row0[6:]) if t in (5, a, b)) + 1
    assert got[0].tolist() == row0[:cut] + [pad] * (got.shape[1] - cut)
    one = hf.generate(ids[:1], max_new_tokens=10, eos_token_id=a)  # one row: ends with its EOS
    assert one[0, -1] == a and one.shape[1] <= 6 + 3


def small_vocab_model(seed=0, vocab=61):
    """A PrismForCausalLM built in memory (no export, no tokenizer) with a small vocabulary and
    weights scaled up so that its next-token distributions are peaked: allowed sets are small."""
    from hf_modeling import PrismConfig, PrismForCausalLM
    cfg = PrismConfig(**dataclasses.asdict(tiny_config(mixer="prism", vocab_size=vocab)),
                      eos_token_id=vocab - 1, pad_token_id=0, bos_token_id=vocab - 1)
    torch.manual_seed(seed)
    hf = PrismForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.model.named_parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    return hf


def hand_allowed(logits, temperature, top_k, top_p):
    """The tokens transformers may draw, written out: logits / temperature, the top_k largest
    (ties at the k-th kept), then by falling probability until the kept ones hold top_p."""
    x = (logits.double() / temperature).tolist()
    ranked = sorted(range(len(x)), key=lambda i: -x[i])
    if top_k:
        ranked = [i for i in ranked if x[i] >= x[ranked[top_k - 1]]]
    z = sum(math.exp(x[i] - x[ranked[0]]) for i in ranked)
    keep, mass = set(), 0.0
    for i in ranked:
        keep.add(i)
        mass += math.exp(x[i] - x[ranked[0]]) / z
        if mass >= top_p - 1e-9:
            break
    return keep


def test_filter_logits_equals_transformers_warpers():
    """model.filter_logits (Model.generate's sampling) keeps exactly transformers' sets:
    temperature, top-k (with ties at the k-th) and top-p, alone and together."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    from model import filter_logits
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 61, generator=g) * 3
    logits[:8, :5] = logits[:8, :1]  # exact ties, around the k-th too
    logits[8:16] = (logits[8:16] * 2).round() / 2
    for temperature, top_k, top_p in [(1.0, 5, None), (0.7, None, 0.9), (1.3, 10, 0.5), (1.0, 1, None),
                                      (0.5, None, 0.0), (1.0, 61, 0.999), (2.0, 3, 1.0)]:
        want = logits.clone()
        if temperature != 1.0:
            want = TemperatureLogitsWarper(temperature)(None, want)
        if top_k:
            want = TopKLogitsWarper(top_k)(None, want)
        if top_p is not None and top_p < 1.0:
            want = TopPLogitsWarper(top_p)(None, want)
        got = filter_logits(logits, temperature, top_k, top_p)
        assert torch.equal(got.isfinite(), want.isfinite()), (temperature, top_k, top_p)
        assert torch.allclose(got[got.isfinite()], want[want.isfinite()])


def test_fast_generate_sampling_is_seeded_and_draws_only_allowed_tokens(fast_calls):
    calls, spy = fast_calls
    hf = spy(small_vocab_model())
    ids = torch.randint(1, 60, (4, 5), generator=torch.Generator().manual_seed(3))
    sizes = []
    for temperature, top_k, top_p in [(1.0, 4, 1.0), (0.8, 0, 0.7), (1.5, 6, 0.8)]:
        kw = dict(max_new_tokens=8, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                  eos_token_id=None)
        draws = []
        for seed in (1, 1, 2):
            torch.manual_seed(seed)
            calls.clear()
            draws.append(hf.generate(ids, **kw))
            assert len(calls) == 1
        assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
        with torch.no_grad():
            full = hf(draws[0][:, :-1]).logits[:, ids.shape[1] - 1:]  # what each new token was drawn from
        for row in range(ids.shape[0]):
            for t in range(8):
                keep = hand_allowed(full[row, t], temperature, top_k, top_p)
                sizes.append(len(keep))
                assert int(draws[0][row, ids.shape[1] + t]) in keep, (temperature, top_k, top_p, row, t)
    assert 1 < max(sizes) < 61 // 2  # the sets were neither everything nor a single token


def test_fast_generate_samples_transformers_distribution(fast_calls):
    """The first new token of many copies of one prompt: drawn in the proportions of
    softmax(transformers' warpers(logits)), num_return_sequences taken as transformers takes it."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
    calls, spy = fast_calls
    hf = spy(small_vocab_model(seed=1))
    hf.model.backend = "naive"  # 4000 rows of 4 tokens: the token loop, not chunks padded to 64
    ids = torch.tensor([[60, 5, 9, 14]])
    n = 4000
    torch.manual_seed(0)
    out = hf.generate(ids, max_new_tokens=1, do_sample=True, top_k=8, top_p=0.9, num_return_sequences=n)
    assert len(calls) == 1 and out.shape == (n, 5) and torch.equal(out[:, :4], ids.expand(n, 4))
    with torch.no_grad():
        logits = hf(ids).logits[:, -1]
    probs = TopPLogitsWarper(0.9)(None, TopKLogitsWarper(8)(None, logits)).softmax(-1)[0]
    freq = torch.bincount(out[:, -1], minlength=61).double() / n
    assert (freq[probs == 0] == 0).all() and (probs > 0).sum() > 2
    assert (freq - probs).abs().max() < 0.03, (freq[probs > 0], probs[probs > 0])


def test_generation_config_defaults_choose_the_mode(fast_calls, monkeypatch):
    """model.generation_config decides, the call's arguments override it, as in transformers."""
    calls, spy = fast_calls
    hf = spy(small_vocab_model())
    ids = torch.randint(1, 60, (2, 4), generator=torch.Generator().manual_seed(4))
    hf.generate(ids, max_new_tokens=3)
    assert calls[-1]["temperature"] == 0  # the default generation_config: greedy
    monkeypatch.setattr(hf.generation_config, "do_sample", True)
    monkeypatch.setattr(hf.generation_config, "top_k", 7)
    monkeypatch.setattr(hf.generation_config, "temperature", 0.6)
    hf.generate(ids, max_new_tokens=3)
    assert calls[-1]["temperature"] == 0.6 and calls[-1]["top_k"] == 7 and "top_p" not in calls[-1]
    hf.generate(ids, max_new_tokens=3, top_p=0.5, temperature=1.0)
    assert calls[-1]["temperature"] == 1.0 and calls[-1]["top_k"] == 7 and calls[-1]["top_p"] == 0.5
    n = len(calls)
    got = hf.generate(ids, max_new_tokens=3, do_sample=False)
    assert calls[-1]["temperature"] == 0 and len(calls) == n + 1
    assert torch.equal(got, transformers_generate(hf, ids, max_new_tokens=3, do_sample=False))


def test_unsupported_requests_fall_back_to_transformers(exports, fast_calls):
    """Anything Model.generate does not compute alike runs transformers' loop, with its result."""
    from transformers import LogitsProcessorList, StoppingCriteriaList
    from transformers.generation.logits_process import MinLengthLogitsProcessor
    from transformers.generation.stopping_criteria import MaxLengthCriteria
    calls, spy = fast_calls
    hf = spy(hf_model(exports["hybrid"][1]))
    ids = random_ids(2, 6, seed=13)
    eos = int(transformers_generate(hf, ids, max_new_tokens=6)[0, 6 + 1])
    base = dict(max_new_tokens=6, eos_token_id=eos)
    for kw in (dict(repetition_penalty=1.5), dict(min_new_tokens=4), dict(min_length=9),
               dict(no_repeat_ngram_size=2), dict(bad_words_ids=[[eos]]), dict(num_beams=2),
               dict(suppress_tokens=[eos]), dict(use_cache=False),
               dict(logits_processor=LogitsProcessorList([MinLengthLogitsProcessor(10, eos)])),
               dict(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(9)]))):
        calls.clear()
        got = hf.generate(ids, **base, **kw)
        assert not calls, kw
        assert torch.equal(got, transformers_generate(hf, ids, **base, **kw)), kw
    calls.clear()
    out = hf.generate(ids, **base, return_dict_in_generate=True, output_scores=True)
    assert not calls and len(out.scores) == out.sequences.shape[1] - 6
    assert torch.equal(out.sequences, hf.generate(ids, **base))  # the same tokens either way
    torch.manual_seed(0)
    a = hf.generate(ids, **base, do_sample=True, min_p=0.1)
    torch.manual_seed(0)
    assert torch.equal(a, transformers_generate(hf, ids, **base, do_sample=True, min_p=0.1))
    assert len(calls) == 1  # only the plain call above took Model.generate


def test_labels_loss_is_shifted_cross_entropy(exports):
    _, path, model = exports["prism"]
    hf = hf_model(path)
    ids = random_ids(2, 10)
    labels = ids.clone()
    labels[0, 4:7] = -100  # transformers' ignore index
    with torch.no_grad():
        out = hf(ids, labels=labels)
        logits = model(ids)[0]
        want = F.cross_entropy(logits[:, :-1].reshape(-1, 32000), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert abs(out.loss.item() - want.item()) <= 1e-5 * abs(want.item())
    assert rel_err(out.logits, logits) <= 1e-5
    with pytest.raises(ValueError, match="labels"):
        hf(ids, labels=labels, use_cache=True)


# ------------------------------------------------------------------------------------ lm-eval
def _instances(kind, args):
    from lm_eval.api.instance import Instance
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


LL_REQUESTS = [("The cat sat on", " the mat"), ("", "Hello world"), ("Ünïcødé  ", "café\n"),
               ("a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3, " end"),
               ("Question: 2+2=", " 4"), ("  leading", " spaces  ")]
DOCS = ["A long document that needs more than one window. " * 8, "short one", "東京 42 \n\n end"]


def test_lm_eval_hf_model_matches_eval_adapter(exports):
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (pip install accelerate)")
    from lm_eval.models.huggingface import HFLM

    from eval.harness import PrismLM
    ckpt, path, model = exports["hybrid"]
    ours = PrismLM(ckpt=ckpt, device="cpu", batch_size=3)
    theirs = HFLM(pretrained=path, trust_remote_code=True, device="cpu", batch_size=3)
    assert theirs.max_length == ours.max_length == BLOCK and theirs.prefix_token_id == ours.prefix_token_id
    a = theirs.loglikelihood(_instances("loglikelihood", LL_REQUESTS))
    b = ours.loglikelihood(_instances("loglikelihood", LL_REQUESTS))
    for (la, ga), (lb, gb) in zip(a, b):
        assert abs(la - lb) <= 1e-4 * abs(lb) and ga == gb
    docs = _instances("loglikelihood_rolling", [(d,) for d in DOCS])
    want = ours.loglikelihood_rolling(docs)
    # perplexity: HFLM's rolling windows score tok_encode(doc), which (as with any tokenizer that
    # adds a BOS) starts with the prefix token: by default a document is scored as </s> + doc after
    # </s>. add_bos_token=False scores the document alone, as eval/ does.
    for got, doc in list(zip(theirs.loglikelihood_rolling(docs), DOCS))[1:]:  # one window each
        toks = [TOK.eos_id, TOK.eos_id] + TOK.encode(doc)
        with torch.no_grad():
            lp = F.log_softmax(model(torch.tensor([toks[:-1]]))[0][0].float(), -1)
        direct = lp.gather(1, torch.tensor(toks[1:])[:, None]).sum().item()
        assert abs(got - direct) <= 1e-4 * abs(direct)
    exact = HFLM(pretrained=path, trust_remote_code=True, device="cpu", batch_size=3, add_bos_token=False)
    for got, w in zip(exact.loglikelihood_rolling(docs), want):
        assert abs(got - w) <= 1e-4 * abs(w)
    gen = _instances("generate_until", [("The meaning of", {"until": ["\n"], "max_gen_toks": 6})])
    hf1 = HFLM(pretrained=path, trust_remote_code=True, device="cpu", batch_size=1)
    assert hf1.generate_until(gen) == ours.generate_until(gen)


def _local_task(task_dir, src, files):
    """A real lm-eval task YAML with its dataset swapped for local JSON files {split: path}."""
    import lm_eval
    tasks = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
    with open(os.path.join(tasks, src)) as f:
        lines = [ln for ln in f.read().splitlines() if not ln.startswith(("dataset_path:", "dataset_name:"))]
    lines += ["dataset_path: json", "dataset_kwargs:", "  data_files:"]
    lines += [f"    {split}: {path}" for split, path in files.items()]
    with open(os.path.join(task_dir, os.path.basename(src)), "w") as f:
        f.write("\n".join(lines) + "\n")
    if src.startswith("wikitext"):
        shutil.copy(os.path.join(tasks, "wikitext", "preprocess_wikitext.py"), task_dir)


def test_lm_eval_simple_evaluate_local_tasks(exports, tmp_path):
    """`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True` through its Python
    API, on lambada_openai and wikitext with local data: eval/'s numbers."""
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (pip install accelerate)")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from eval.harness import PrismLM, evaluate
    ckpt, path, _ = exports["prism"]
    lam, wiki = tmp_path / "lam.jsonl", tmp_path / "wiki.jsonl"
    lam_docs = ["the cat sat on the mat", "she opened the door and saw a dog", "rain fell all night"]
    lam.write_text("".join(json.dumps({"text": t}) + "\n" for t in lam_docs))
    wiki.write_text("".join(json.dumps({"page": p}) + "\n" for p in
                            [" = Title = \n Some text , with words . \n", " = Short = \n A tiny page . \n"]))
    _local_task(str(tmp_path), "lambada/lambada_openai.yaml", {"test": str(lam)})
    _local_task(str(tmp_path), "wikitext/wikitext.yaml", {"train": str(wiki), "validation": str(wiki),
                                                          "test": str(wiki)})
    ours = evaluate(PrismLM(ckpt=ckpt, device="cpu", batch_size=4), ["lambada_openai", "wikitext"],
                    include_path=str(tmp_path), include_defaults=False, bootstrap_iters=0)["results"]
    tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
    base = f"pretrained={path},trust_remote_code=True,device=cpu,batch_size=4"
    lam_hf = simple_evaluate(model="hf", model_args=base, tasks=["lambada_openai"], task_manager=tm,
                             bootstrap_iters=0)["results"]["lambada_openai"]
    wiki_hf = simple_evaluate(model="hf", model_args=base + ",add_bos_token=False", tasks=["wikitext"],
                              task_manager=tm, bootstrap_iters=0)["results"]["wikitext"]
    for res, task, metrics in ((lam_hf, "lambada_openai", ["perplexity,none", "acc,none"]),
                               (wiki_hf, "wikitext", ["word_perplexity,none", "byte_perplexity,none"])):
        for m in metrics:
            want = ours[task][m]
            assert abs(res[m] - want) <= 1e-4 * max(abs(want), 1e-12), (task, m, res[m], want)


# ------------------------------------------------------------------------------------ self-contained
def test_loads_in_a_fresh_interpreter_without_this_repo(exports, tmp_path):
    _, path, model = exports["prism"]
    code = r"""
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, prompt, out = sys.argv[1:]
tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
ids = tok(prompt, return_tensors="pt")["input_ids"]
with torch.no_grad():
    logits = m(ids).logits
gen = m.generate(ids, max_new_tokens=6, do_sample=False)
mod_dir = os.path.dirname(sys.modules[type(m).__module__].__file__)
torch.save({"ids": ids, "logits": logits, "gen": gen, "files": sorted(os.listdir(mod_dir)),
            "top_level": [n for n in ("model", "hf_modeling", "prism_kernel", "prism_ops", "sample") if n in sys.modules],
            "path": sys.path}, out)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    work = tmp_path / "elsewhere"
    work.mkdir()
    res = tmp_path / "res.pt"
    r = subprocess.run([sys.executable, "-I", "-c", code, path, PROMPT, str(res)], cwd=work, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(res)
    assert ROOT not in got["path"] and not got["top_level"]
    assert {"hf_modeling.py", "model.py", "prism_kernel.py"} <= set(got["files"])  # kernels beside model.py
    assert got["ids"][0].tolist() == [TOK.eos_id] + TOK.encode(PROMPT)
    with torch.no_grad():
        assert rel_err(got["logits"], model(got["ids"])[0]) <= 1e-5
    greedy_rows_match(got["gen"], model.generate(got["ids"], 6, temperature=0), got["ids"].shape[1],
                      TOK.eos_id, TOK.sp.unk_id())


def test_exported_code_imports_only_torch_and_transformers(exports):
    """A hub download checks that every module an import statement in the downloaded code names
    is installed, before running anything: no repo module, and no Triton (CPU users lack it)."""
    from transformers.dynamic_module_utils import get_imports, get_relative_imports
    _, path, _ = exports["prism"]
    todo, seen = ["hf_modeling"], set()
    while todo:
        name = todo.pop()
        seen.add(name)
        f = os.path.join(path, name + ".py")
        outside = [m for m in get_imports(f)
                   if m not in sys.stdlib_module_names and m not in ("torch", "transformers")]
        assert not outside, f"{name}.py imports {outside}"
        todo += [m for m in get_relative_imports(f) if m not in seen]
    assert seen == {"hf_modeling", "model"}  # prism_kernel.py is fetched at run time, not imported
    for name in export_hf_code_files():
        with open(os.path.join(path, name), "rb") as a, open(os.path.join(ROOT, name), "rb") as b:
            assert a.read() == b.read(), f"{name} is not this repo's file"


def test_exported_model_runs_its_own_copy_of_the_kernels(exports):
    """prism_kernel.py reaches the package transformers imports model.py from, and the Triton
    backend runs it (here in Triton's interpreter on CPU; on CUDA it is the default backend)."""
    pytest.importorskip("triton")
    _, path, model = exports["prism"]
    hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    model_mod = sys.modules[type(hf.model).__module__]
    kernels = model_mod.kernels()
    assert os.path.dirname(kernels.__file__) == os.path.dirname(model_mod.__file__) != ROOT
    # and its own stages, the prism_ops/ copied beside it (not this repo's package)
    assert all(m.__name__ == f"{kernels.__package__}.prism_ops.{m.__name__.rsplit('.', 1)[1]}" for m in kernels._STAGES)
    hf.model.backend = "triton"
    ids = random_ids(1, 16, seed=8)
    with torch.no_grad():
        assert rel_err(hf(ids).logits, model(ids)[0]) <= 1e-4


def export_hf_code_files():
    from hf_modeling import CODE_FILES
    return CODE_FILES


def test_exported_code_files_are_all_the_kernel_files():
    """An exported directory carries prism_kernel.py and every file of prism_ops/ (the package
    it imports), and hf_modeling fetches each of them: none left behind, none missing here."""
    from hf_modeling import KERNEL_FILES
    package = sorted(f"prism_ops/{f}" for f in os.listdir(os.path.join(ROOT, "prism_ops")) if f.endswith(".py"))
    assert KERNEL_FILES[0] == "prism_kernel.py" and sorted(KERNEL_FILES[1:]) == package
    assert set(KERNEL_FILES) <= set(export_hf_code_files())


def test_save_pretrained_keeps_the_directory_loadable(exports, tmp_path):
    _, path, model = exports["hybrid"]
    hf = hf_model(path)
    again = tmp_path / "again"
    hf.save_pretrained(again)
    assert all((again / name).is_file() for name in export_hf_code_files())
    with open(again / "config.json") as f:
        assert json.load(f)["auto_map"]["AutoModelForCausalLM"] == "hf_modeling.PrismForCausalLM"
    hf2 = AutoModelForCausalLM.from_pretrained(again, trust_remote_code=True)
    ids = random_ids(1, 9)
    with torch.no_grad():
        assert rel_err(hf2(ids).logits, model(ids)[0]) <= 1e-5
    back, _ = load_exported(str(again))
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------------ the other direction
@pytest.mark.parametrize("variant", ["gdn", "transformer"])
def test_load_exported_gives_the_checkpoint_back(exports, variant):
    pytest.importorskip("lm_eval")
    from eval.harness import PrismLM
    ckpt, path, model = exports[variant]
    back, args = load_exported(path)
    assert ModelConfig(**args) == model.config and dataclasses.asdict(back.config) == args
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    if model.config.tie_embeddings:
        assert back.lm_head.weight is back.wte.weight
    # train.py --init_from: a fresh Model of these args takes the weights
    fresh = Model(ModelConfig(**args))
    fresh.load_state_dict(back.state_dict())
    m2, meta = load_model(path)  # sample.py / eval/ read a directory as a checkpoint
    assert meta["data_meta"]["tokenizer_sha256"] == TOK.sha256
    assert export_hf.exported_tokenizer(path) == os.path.join(path, "tokenizer.model")
    assert export_hf.exported_tokenizer(ckpt) is None
    reqs = _instances("loglikelihood", LL_REQUESTS[:3])
    on_dir = PrismLM(ckpt=path, device="cpu")
    assert on_dir.tokenizer.path == os.path.join(path, "tokenizer.model")  # the export's own tokenizer
    a = on_dir.loglikelihood(reqs)
    b = PrismLM(ckpt=ckpt, device="cpu").loglikelihood(reqs)
    assert a == b


# ------------------------------------------------------------------------------------ bad input, atomicity
def leftovers(parent):
    return [n for n in os.listdir(parent) if n.startswith("_export_")]


def test_export_bad_inputs_are_clear_and_leave_nothing(tmp_path):
    out = tmp_path / "hf"
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="junk.pt"):
        export(str(junk), out)
    notours = tmp_path / "notours.pt"
    torch.save({"state_dict": {}}, notours)
    with pytest.raises(ValueError, match="notours.pt.*model_args"):
        export(str(notours), out)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        export(str(tmp_path / "missing.pt"), out)
    small = Model(tiny_config(mixer="gdn", vocab_size=1000))
    with pytest.raises(ValueError, match=r"tokenizer\.model.*32000 tokens.*small\.pt only 1000"):
        export(save_ckpt(tmp_path / "small.pt", small, data_meta={}), out)
    other = Model(tiny_config(mixer="gdn"))
    wrong = save_ckpt(tmp_path / "wrong.pt", other,
                      data_meta={"tokenizer": "other", "tokenizer_sha256": "ab" * 32})
    with pytest.raises(ValueError, match="trained on data tokenized with other"):
        export(wrong, out)
    with pytest.raises(FileNotFoundError, match="nope.model"):
        export(save_ckpt(tmp_path / "ok.pt", other), out, tokenizer=str(tmp_path / "nope.model"))
    assert not out.exists() and not leftovers(tmp_path)


def tmp_modules():
    """Entries transformers' module cache holds for export's temporary directories."""
    from transformers.dynamic_module_utils import HF_MODULES_CACHE
    d = os.path.join(HF_MODULES_CACHE, "transformers_modules")
    return {n for n in os.listdir(d) if n.startswith("_export_tmp_")} if os.path.isdir(d) else set()


def test_export_is_atomic_and_force_replaces_only_exports(tmp_path, monkeypatch):
    torch.manual_seed(9)
    model = Model(tiny_config(mixer="gdn")).eval()
    ckpt = save_ckpt(tmp_path / "m.pt", model)
    tmp_modules_before = tmp_modules()
    out = tmp_path / "hf"
    export(ckpt, out)
    with pytest.raises(FileExistsError, match="--force"):
        export(ckpt, out)
    files = lambda d: {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}
    before = files(out)

    def broken(*a, **k):
        raise ValueError("simulated failure after writing")
    monkeypatch.setattr(export_hf, "verify", broken)
    with pytest.raises(ValueError, match="simulated"):
        export(ckpt, out, force=True)
    assert files(out) == before and not leftovers(tmp_path)
    monkeypatch.undo()
    train_dir = tmp_path / "train_out"
    train_dir.mkdir()
    (train_dir / "ckpt.pt").write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="not a directory written by export_hf.py"):
        export(ckpt, train_dir, force=True)
    assert (train_dir / "ckpt.pt").read_bytes() == b"precious"
    path, _ = export(ckpt, out, dtype="bfloat16", force=True)  # replaced, in bf16 this time
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.wte.weight").dtype == torch.bfloat16
    assert not leftovers(tmp_path) and oct(os.stat(path).st_mode & 0o777) != oct(0o700)
    assert tmp_modules() == tmp_modules_before  # verify() dropped its copy of the code


def test_read_exported_errors_name_the_file(exports, tmp_path):
    _, path, _ = exports["gdn"]
    d = tmp_path / "copy"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config\.json.*model_type is 'llama'"):
        read_exported(str(d))
    (d / "config.json").write_text(json.dumps({**cfg, "solver_keys": "nope"}))
    with pytest.raises(ValueError, match=r"config\.json.*solver_keys"):
        read_exported(str(d))
    (d / "config.json").write_text(json.dumps(cfg))
    t = json.loads((d / "tokenizer.json").read_text())
    t["added_tokens"].append({**t["added_tokens"][0], "id": 40000, "content": "<extra>"})
    (d / "tokenizer.json").write_text(json.dumps(t))
    with pytest.raises(ValueError, match=r"tokenizer\.json.*40000.*32000"):
        read_exported(str(d))
    shutil.copy(os.path.join(path, "tokenizer.json"), d / "tokenizer.json")
    w = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(w[:len(w) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt or truncated"):
        read_exported(str(d))
    os.remove(d / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_model(str(d))
    os.remove(d / "config.json")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_exported(str(d))


def test_cli(exports, tmp_path, capsys):
    ckpt, _, _ = exports["gdn"]
    export_hf.main(["--ckpt", ckpt, "--out", str(tmp_path / "cli")])
    assert "wrote" in capsys.readouterr().out and (tmp_path / "cli" / "model.safetensors").exists()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "export_hf.py"), "--ckpt", ckpt, "--out",
                        str(tmp_path / "cli")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0 and r.stderr.strip().startswith("error:") and "--force" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_cuda_export_runs_the_triton_kernels(exports):
    """needs a CUDA GPU (and Triton): the exported model finds prism_kernel.py beside model.py."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for variant in ("prism", "hybrid"):
        _, path, model = exports[variant]
        hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).cuda().eval()
        assert hf.model.backend == "triton"
        ref = Model(model.config, backend="triton").cuda().eval()
        ref.load_state_dict(model.state_dict())
        ids = random_ids(2, 100, seed=6).cuda()
        with torch.no_grad():
            assert rel_err(hf(ids).logits, ref(ids)[0]) <= 1e-5
        p = ids[:1, :8]
        greedy_rows_match(hf.generate(p, max_new_tokens=16, do_sample=False),
                          ref.generate(p, 16, temperature=0), 8, TOK.eos_id, TOK.sp.unk_id())


def test_train_py_fine_tunes_an_exported_directory(exports, tmp_path, capsys):
    """train.py --init_from=<exported dir>: a model from the hub trains here, from its weights."""
    import numpy as np
    import train
    ckpt, path, model = exports["prism"]
    d = tmp_path / "data" / "toy"
    d.mkdir(parents=True)
    ids = np.random.default_rng(0).integers(0, 500, 4000).astype(np.uint16)
    ids[:3000].tofile(d / "train.bin")
    ids[3000:].tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 32000, "tokenizer": TOK.name,
                                             "tokenizer_sha256": TOK.sha256, "eos_id": TOK.eos_id}))
    argv = [f"--init_from={path}", f"--data_dir={tmp_path / 'data'}", "--dataset=toy",
            f"--out_dir={tmp_path / 'out'}", "--device=cpu", "--dtype=float32", "--max_iters=1",
            "--eval_interval=1", "--eval_iters=1", "--batch_size=2", "--gradient_accumulation_steps=1",
            f"--block_size={BLOCK}", "--n_layer=5"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert f"initialising from {path}" in out and "n_layer=2 (config had 5)" in out
    saved = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert saved["model_args"]["n_layer"] == 2 and saved["iter_num"] == 1
