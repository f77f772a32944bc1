"""Decoding: the static cache (Model.init_cache), Model.generate and the decoding kernels
(prism_ops/decode.py, through prism_kernel: conv_step, recurrent_prism_step, gated_rms_norm,
silu_mul, rope_kv_write, decode_attention).

CPU, PyTorch backends, float32, for GDN, PRISM L=1 and L=3, attention and a hybrid:
  * token by token through the cache, and uneven pieces, == the full forward (max abs <= 1e-4)
  * the GDN/PRISM buffers do not depend on max_len, the KV cache's grow with it; no buffer moves
  * reset_at_eos: from an EOS on, a row's logits equal those of the same tokens on a fresh cache
  * generate(): top_k=1 is the full forward's greedy argmax; sampling is seeded; eos_id stops
CPU, Triton interpreter, tiny shapes: every kernel against PyTorch (the recurrence against the
float64 token loop model.delta_rule_naive), the layers' Triton decoding step against their
PyTorch cached path, and the model on the Triton backend against its full forward.
GPU (`pytest -m gpu`): the kernels at K=128, V=256 and K=V=64 in float32 and bf16, and the
stepwise tests again through a captured CUDA graph and through generate().
"""
import inspect
import math
import os

import pytest
import torch
import torch.nn.functional as F

import model as model_py
from model import (Cache, GatedDeltaNet, Model, ModelConfig, PRISM, ShortConv, cuda_graph,
                   delta_rule_naive, segments_of)

TOL = 1e-4
CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, T, B, EOS = 61, 21, 2, 3

CASES = {
    "gdn": dict(mixer="gdn"),
    "prism_L1": dict(mixer="prism", solver_steps=1),
    "prism_L3": dict(mixer="prism", solver_steps=3),
    "attention": dict(mixer="attention"),
    "hybrid": dict(mixer="prism", solver_steps=3, attn_layers=(1,)),
}


def tiny_model(seed=0, backend="chunk", n_layer=3, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=VOCAB, block_size=64, n_layer=n_layer, n_head=2, n_embd=32,
                      head_dim=8, expand_v=2.0, solver_rank=8, eos_id=EOS, **kw)
    model = Model(cfg, backend=backend, chunk_size=8).eval()
    # random init leaves the mixers nearly silent; larger weights make a state bug visible
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "wte" not in name:
                p.mul_(4.0)
    return model


def tokens(batch=B, length=T, seed=1, no_eos=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (batch, length), generator=g)
    return x.masked_fill(x == EOS, EOS + 1) if no_eos else x


def run_pieces(model, idx, sizes):
    """Feed idx through one cache in pieces of the given sizes; return the concatenated logits."""
    cache = model.init_cache(idx.shape[0], idx.shape[1])
    out, t = [], 0
    for n in sizes:
        logits, _ = model(idx[:, t:t + n], cache=cache)
        out.append(logits)
        t += n
    assert t == idx.shape[1]
    return torch.cat(out, 1)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ------------------------------------------------------------------ the cache, PyTorch backends

@pytest.mark.parametrize("name", list(CASES))
def test_stepwise_equals_full(name):
    model = tiny_model(**CASES[name])
    idx = tokens()
    with torch.no_grad():
        full, _ = model(idx)
        step = run_pieces(model, idx, [1] * T)
    assert full.abs().max() > 0.1, "degenerate test: logits are ~0"
    assert max_err(step, full) <= TOL, f"{name}: stepwise vs full {max_err(step, full):.3e}"


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_prefill_then_step_equals_full(name):
    model = tiny_model(**CASES[name])
    idx = tokens()
    # uneven pieces: one longer than a chunk (8), one crossing a chunk border, then single steps
    with torch.no_grad():
        full, _ = model(idx)
        pieces = run_pieces(model, idx, [11, 5, 1, 1, 3])
    assert max_err(pieces, full) <= TOL, f"{name}: pieces vs full {max_err(pieces, full):.3e}"


@pytest.mark.parametrize("name", ["gdn", "prism_L3", "hybrid"])
def test_naive_backend_full_equals_chunk(name):
    """The two PyTorch backends agree on the full forward (so the step path, which always runs
    the naive recurrence, is compared against the same function either way)."""
    a = tiny_model(backend="chunk", **CASES[name])
    b = tiny_model(backend="naive", **CASES[name])
    idx = tokens()
    with torch.no_grad():
        assert max_err(a(idx)[0], b(idx)[0]) <= TOL


@pytest.mark.parametrize("name", ["gdn", "prism_L3", "attention", "hybrid"])
def test_cache_is_static(name):
    """GDN/PRISM buffers do not depend on max_len, KV buffers are linear in it, and no buffer is
    reallocated while decoding (what a captured CUDA graph relies on)."""
    model = tiny_model(**CASES[name])
    n_attn = sum(b.mixer_name == "attention" for b in model.blocks)
    small, big = model.init_cache(B, 10), model.init_cache(B, 110)
    kv_per_token = n_attn * 2 * B * 32 * 4  # k and v, n_embd floats each, per row
    assert small.nbytes() > 0 and big.nbytes() - small.nbytes() == 100 * kv_per_token
    ptrs = [t.data_ptr() for layer in small for t in layer.values()]
    with torch.no_grad():
        model(tokens(length=4), cache=small)
        for t in range(4, 10):
            model(tokens(length=10)[:, t:t + 1], cache=small)
    assert [t.data_ptr() for layer in small for t in layer.values()] == ptrs
    assert int(small.pos) == small.length == 10


def test_kv_cache_overflow_raises():
    model = tiny_model(**CASES["hybrid"])
    cache = model.init_cache(B, 6)
    with torch.no_grad():
        model(tokens(length=6), cache=cache)
        with pytest.raises(ValueError, match="do not fit"):
            model(tokens(length=1), cache=cache)
        with pytest.raises(ValueError, match="rows"):
            model(tokens(batch=1, length=1), cache=model.init_cache(B, 6))


def reset_case(model, sizes):
    """Row 0: 7 tokens, EOS, 6 tokens; row 1: 14 tokens without EOS. Fed through one cache in
    `sizes` pieces. Returns (cached logits, row 0 after the EOS on a fresh cache, logits of
    both rows with the EOS replaced (no reset), idx)."""
    idx = tokens(length=14, seed=5, no_eos=True)
    idx[0, 7] = EOS
    idx = idx.to(model.wte.weight.device)
    with torch.no_grad():
        got = run_pieces(model, idx, sizes)
        fresh = run_pieces(model, idx[:1, 7:], [1] * 7)
        plain = idx.clone()
        plain[0, 7] = EOS + 1
        before, _ = model(plain)
    return got, fresh, before, idx


@pytest.mark.parametrize("sizes", [[1] * 14, [5, 6, 3]], ids=["steps", "pieces"])
@pytest.mark.parametrize("name", ["gdn", "prism_L3", "attention", "hybrid"])
def test_reset_at_eos_in_cache(name, sizes):
    """reset_at_eos: an EOS drops the row's state, conv taps and attention window before it is
    processed, in a decoding step or inside a piece; the other row and earlier tokens are as
    without the flag."""
    model = tiny_model(reset_at_eos=True, **CASES[name])
    got, fresh, before, idx = reset_case(model, sizes)
    assert max_err(got[:1, 7:], fresh) <= TOL, "row 0 after its EOS differs from a fresh start"
    assert max_err(got[:1, :7], before[:1, :7]) <= TOL and max_err(got[1:], before[1:]) <= TOL
    assert max_err(got[:1, 8:], before[:1, 8:]) > 1e-3, "degenerate test: the reset changed nothing"


@pytest.mark.parametrize("name", ["gdn", "prism_L3", "attention", "hybrid"])
def test_generate_greedy_matches_full_forward_argmax(name):
    model = tiny_model(**CASES[name])
    prompt = tokens(length=6)
    n_new = 10
    with torch.no_grad():
        torch.manual_seed(123)
        out1 = model.generate(prompt, n_new, temperature=1.0, top_k=1)
        torch.manual_seed(456)  # a different seed must not matter with top_k=1
        out2 = model.generate(prompt, n_new, temperature=0.0)
        ref = prompt.clone()  # reference: recompute the whole sequence every step, no cache
        for _ in range(n_new):
            logits, _ = model(ref)
            ref = torch.cat([ref, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert out1.shape == (B, 6 + n_new) and torch.equal(out1[:, :6], prompt)
    assert torch.equal(out1, out2)
    assert torch.equal(out1, ref), f"{name}: cached greedy decode diverged from full-forward argmax"


def test_generate_sampling_is_seeded():
    model = tiny_model(**CASES["prism_L3"])
    prompt = tokens(length=4)
    with torch.no_grad():
        draws = []
        for seed in (7, 7, 8):
            torch.manual_seed(seed)
            draws.append(model.generate(prompt, 12, temperature=1.0, top_k=20))
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])  # 2 x 12 draws from 20 tokens: a collision is ~impossible


def test_sample_next_top_k_and_temperature():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]]).repeat(4000, 1)
    torch.manual_seed(0)
    got = model_py.sample_next(logits, temperature=1.0, top_k=2)
    assert set(got.tolist()) == {1, 2}  # only the top 2 are ever drawn
    p = math.exp(3.0) / (math.exp(3.0) + math.exp(2.9))
    assert abs((got == 1).float().mean().item() - p) < 0.03  # in proportion to softmax
    cold = model_py.sample_next(logits, temperature=0.05)
    assert (cold == 1).float().mean() > 0.8


def test_generate_stops_at_eos(monkeypatch):
    model = tiny_model(**CASES["gdn"])
    prompt = tokens(length=5)
    with torch.no_grad():
        plain = model.generate(prompt, 24, temperature=0)
        eos = int(plain[0, 5 + 2])  # row 0 draws it as its third new token
        monkeypatch.setattr(model_py, "EOS_CHECK", 4)
        out = model.generate(prompt, 24, temperature=0, eos_id=eos)
        alone = model.generate(prompt[:1], 24, temperature=0, eos_id=eos)
    cuts = []
    for row in range(B):
        new = plain[row, 5:].tolist()
        cut = new.index(eos) + 1 if eos in new else len(new)
        got = out[row, 5:].tolist()
        assert got[:cut] == new[:cut] and all(t == eos for t in got[cut:])
        cuts.append(cut)
    assert alone.shape[1] == 5 + cuts[0] and alone[0, -1] == eos  # one row: ends with its EOS
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, -1)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(prompt, 2, top_p=1.5)


def test_generate_eos_list_pads_finished_rows():
    """Several EOS ids and a pad id, as transformers' generate takes them: a row that drew any
    EOS gets pad_id after it, and the result ends with the last row's EOS."""
    model = tiny_model(**CASES["gdn"])
    prompt = tokens(length=5)
    with torch.no_grad():
        plain = model.generate(prompt, 12, temperature=0)
        a, b = int(plain[0, 5 + 1]), int(plain[1, 5 + 3])  # row 0's 2nd new token, row 1's 4th
        if a in plain[1, 5:5 + 4].tolist() or b in plain[0, 5:5 + 2].tolist():
            pytest.skip("the rows share these tokens: pick other positions")
        pad = 0 if 0 not in (a, b) else 1
        out = model.generate(prompt, 12, temperature=0, eos_id=[a, b], pad_id=pad)
    assert out.shape == (B, 5 + 4)  # row 1 ends last, at its 4th token
    assert out[0].tolist() == plain[0, :5 + 2].tolist() + [pad] * 2
    assert out[1].tolist() == plain[1, :5 + 4].tolist()


def hand_nucleus(probs, top_p):
    """The nucleus written out: tokens by falling probability, kept until they hold top_p."""
    keep, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        keep.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return keep


def test_filter_logits_top_p_and_top_k_sets():
    logits = torch.tensor([[math.log(p) for p in (0.05, 0.5, 0.15, 0.3)]])
    probs = logits.softmax(-1)[0].tolist()
    for top_p in (1e-6, 0.3, 0.6, 0.7, 0.9, 0.97, 1.0):
        kept = model_py.filter_logits(logits, top_p=top_p)[0].isfinite().nonzero().flatten().tolist()
        assert set(kept) == hand_nucleus(probs, top_p), top_p
    # top_k first, then the nucleus of what is left (renormalised); temperature before both
    both = model_py.filter_logits(logits, temperature=0.5, top_k=3, top_p=0.8)[0]
    sharp = (logits[0] / 0.5).softmax(-1)
    top3 = sharp.topk(3).indices.tolist()
    renorm = [sharp[i].item() if i in top3 else 0.0 for i in range(4)]
    renorm = [p / sum(renorm) for p in renorm]
    assert set(both.isfinite().nonzero().flatten().tolist()) == hand_nucleus(renorm, 0.8)
    assert torch.allclose(both[both.isfinite()], (logits[0] / 0.5)[both.isfinite()])


def test_sample_next_top_p_draws_the_nucleus_in_proportion():
    logits = torch.tensor([[math.log(p) for p in (0.05, 0.5, 0.15, 0.3)]]).repeat(4000, 1)
    torch.manual_seed(0)
    got = model_py.sample_next(logits, temperature=1.0, top_p=0.75)
    assert set(got.tolist()) == {1, 3}  # 0.5 + 0.3 >= 0.75; 0.5 alone is not
    assert abs((got == 1).float().mean().item() - 0.5 / 0.8) < 0.03
    assert torch.equal(model_py.sample_next(logits[:5], top_p=1e-9), logits[:5].argmax(-1))


def test_generate_top_p_is_seeded_and_stays_in_the_nucleus():
    model = tiny_model(**CASES["prism_L3"])
    prompt = tokens(length=4)
    top_p, temp = 0.6, 0.05  # random init: logits std ~0.1, so a low temperature makes a nucleus
    with torch.no_grad():
        draws = []
        for seed in (7, 7, 8):
            torch.manual_seed(seed)
            draws.append(model.generate(prompt, 10, temperature=temp, top_p=top_p))
        full = model(draws[0][:, :-1])[0][:, 3:]  # the logits each new token was drawn from
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    sizes = []
    for row in range(B):
        for t in range(10):
            probs = (full[row, t] / temp).softmax(-1).tolist()
            keep = hand_nucleus(probs, top_p)
            sizes.append(len(keep))
            assert int(draws[0][row, 4 + t]) in keep, (row, t)
    assert 1 < max(sizes) < VOCAB // 2  # the cut mattered, and was not one token every time
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, 6, top_p=1e-9), model.generate(prompt, 6, temperature=0))


# ------------------------------------------------------------------ bf16: cached decoding against the full forward
# Random init as the models start (std 0.02), not tiny_model's scaled-up weights; CPU autocast.
BF16_SPACING = torch.finfo(torch.bfloat16).eps  # 2^-7: the spacing of bf16 numbers in [1, 2)


def bf16_model(name, seed=0, n_layer=3):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=512, block_size=64, n_layer=n_layer, n_head=2, n_embd=64, head_dim=16,
                      solver_rank=8, **CASES[name])
    return Model(cfg, backend="chunk").eval()


def cached_and_full(fn, cache, x, prefill, bf16=True):
    """fn over x [B,T,...] whole, and through `cache` (prefill tokens, then one at a time)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        full = fn(x, None)
        pieces = [(0, prefill)] + [(t, t + 1) for t in range(prefill, x.shape[1])]
        cached = torch.cat([fn(x[:, a:b], cache) for a, b in pieces], 1)
    return cached[:, prefill:].float(), full[:, prefill:].float()


@pytest.mark.parametrize("name", ["gdn", "prism_L3"])
def test_bf16_cached_layer_differs_from_full_only_by_reordered_float32_sums(name):
    """One GDN/PRISM layer under bf16 autocast (PyTorch backends), on one bf16 input: cached
    (a prefill, then token by token) against its full forward. What is left between them is the
    recurrence's float32 sums taken in another order (token loop against chunks), which can move
    the bf16 rounding of its output by one step. That rounding is measured here: the full forward
    against itself at other chunk lengths (the same sums reordered). Bounds: the fraction of
    outputs that differ at all, twice that measured fraction plus one token's outputs (all that
    one moved rounding of the recurrence output reaches, through o_proj), and the measured
    fraction itself at most one token's outputs; the largest difference, the float32
    comparison's plus two bf16 steps at the output's scale. With any of the three roundings
    that bench/bench_bf16_gap.py switches on (the recurrence's products in bf16 under autocast,
    the token loop's output left in float32, the cached conv's products rounded to bf16),
    50-78% of the outputs differ, or the full forward moves by as much at other chunk lengths."""
    model = bf16_model(name, n_layer=1)
    layer, P, T = model.blocks[0].mixer, 16, 40
    x = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    run = lambda x, cache: layer(x, cache=cache)
    fresh = lambda dtype: Cache([layer.cache_buffers(2, T, "cpu", dtype)], 2, T, "cpu")
    got, want = cached_and_full(run, fresh(torch.bfloat16), x, P)
    got32, want32 = cached_and_full(run, fresh(torch.float32), x.float(), P, bf16=False)
    floor = 0.0  # the fraction of outputs that other chunk lengths move
    for c in (4, 8, 16, 32):
        layer.chunk_size = c
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            other = layer(x)[:, P:].float()
        floor = max(floor, (other != want).float().mean().item())
    layer.chunk_size = 64
    moved = (got != want).float().mean().item()
    assert floor <= 1 / (T - P), floor  # reordered float32 sums move a few roundings, no more
    assert moved <= 2 * floor + 1 / (T - P), (moved, floor)
    assert max_err(got, want) <= max_err(got32, want32) + 2 * BF16_SPACING * want.abs().max().item()


@pytest.mark.parametrize("name", ["gdn", "prism_L3", "hybrid", "attention"])
def test_bf16_cached_decoding_logits_within_bf16_rounding_of_full_forward(name):
    """The whole model under bf16 autocast, cached decoding against the full forward: the logits'
    largest difference is at most the float32 comparison's plus two bf16 steps at the logits'
    scale (measured after the fixes: at most one step here; on the 130M configs, BENCHMARKS.md's
    decoding section, about what another chunk length changes in the full forward)."""
    model = bf16_model(name)
    idx = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(4))
    run = lambda idx, cache: model(idx, cache=cache)[0]
    got, want = cached_and_full(run, model.init_cache(2, 40, dtype=torch.bfloat16), idx, 16)
    got32, want32 = cached_and_full(run, model.init_cache(2, 40), idx, 16, bf16=False)
    gap32 = max_err(got32, want32)
    assert gap32 <= TOL
    assert max_err(got, want) <= gap32 + 2 * BF16_SPACING * want.abs().max().item()


def test_pytorch_backends_compute_in_float32_under_autocast():
    """The token loop and the chunk form run autocast-free (in float32) and return v's dtype, as
    the Triton kernels do; the cached short conv sums its taps in float32 and rounds once, as
    F.conv1d does for the full forward."""
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 6, 2, 8, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, 6, 2, 16, generator=g).bfloat16()
    gate, beta = -torch.rand(1, 6, 2, generator=g), torch.rand(1, 6, 2, generator=g).bfloat16()
    for fn in (delta_rule_naive, model_py.delta_rule_chunk):
        plain, S = fn(q, k, v, gate, beta, output_final_state=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto, S_auto = fn(q, k, v, gate, beta, output_final_state=True)
        assert plain.dtype == auto.dtype == torch.bfloat16 and S.dtype == torch.float32
        assert torch.equal(plain, auto) and torch.equal(S, S_auto), fn.__name__
    conv = ShortConv(16, 4)
    x = torch.randn(2, 9, 16, generator=g).bfloat16()
    buf = torch.zeros(2, 3, 16, dtype=torch.bfloat16)
    steps = torch.cat([conv(x[:, t:t + 1], buf) for t in range(9)], 1)
    assert torch.equal(steps, conv(x))


# ------------------------------------------------------------------ kernels, in the interpreter
# (conftest sets TRITON_INTERPRET=1 without a GPU; on a GPU the same tests run the real kernels)

DEV = "cuda" if CUDA else "cpu"


def naive_with_resets(q, k, v, g, beta, ke, ve, state, reset):
    """Float64 reference: model.delta_rule_naive token by token, the state dropped at resets."""
    outs, S = [], state.double()
    for t in range(q.shape[1]):
        if reset is not None:
            S = S * (~reset[:, t]).double()[:, None, None, None]
        one = [None if x is None else x[:, t:t + 1].double() for x in (q, k, v, g, beta, ke, ve)]
        o, S = delta_rule_naive(*one, initial_state=S, output_final_state=True)
        outs.append(o)
    return torch.cat(outs, 1), S


def recurrence_inputs(Bn, Tn, H, K, V, L, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k = F.normalize(r(Bn, Tn, H, K), dim=-1), F.normalize(r(Bn, Tn, H, K), dim=-1)
    v, g = r(Bn, Tn, H, V), F.logsigmoid(2 * r(Bn, Tn, H) + 2)
    beta = torch.rand(Bn, Tn, H, generator=gen)
    ke = F.normalize(r(Bn, Tn, H, L - 1, K), dim=-1) if L > 1 else None
    ve = 0.3 * r(Bn, Tn, H, L - 1, V) if L > 1 else None
    S0 = r(Bn, H, K, V)
    cast = lambda x: None if x is None else x.to(device, dtype)
    return [cast(x) for x in (q, k, v, g, beta, ke, ve)], S0.to(device)


def check_recurrent_step(Bn, Tn, H, K, V, L, dtype, tol):
    from prism_kernel import recurrent_prism_step
    xs, S0 = recurrence_inputs(Bn, Tn, H, K, V, L, dtype, DEV)
    reset = torch.zeros(Bn, Tn, dtype=torch.bool, device=DEV)
    reset[0, Tn // 2] = True
    for rs in (None, reset):
        S = S0.clone()
        o, S_out = recurrent_prism_step(*xs, state=S, reset=rs)
        o_ref, S_ref = naive_with_resets(*xs, S0, rs)
        assert S_out is S, "the state is updated in place"
        assert o.dtype == dtype and rel(o, o_ref) <= tol and rel(S, S_ref) <= tol, (rel(o, o_ref), rel(S, S_ref))


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("Tn", [1, 5])
def test_recurrent_step_matches_naive(Tn, L):
    check_recurrent_step(2, Tn, 2, 8, 16, L, torch.float32, 1e-5)


def test_recurrent_step_shapes_and_errors():
    from prism_kernel import recurrent_prism_step
    xs, S0 = recurrence_inputs(1, 1, 2, 8, 16, 2, torch.float32, DEV)
    o, S = recurrent_prism_step(*(x[:, 0] for x in xs))  # no T axis, state from zeros
    o_ref, S_ref = naive_with_resets(*xs, torch.zeros_like(S0), None)
    assert o.shape == (1, 2, 16) and rel(o, o_ref[:, 0]) < 1e-5 and rel(S, S_ref) < 1e-5
    with pytest.raises(ValueError, match="state must be"):
        recurrent_prism_step(*xs, state=S0.double())
    with pytest.raises(ValueError, match="together"):
        recurrent_prism_step(*xs[:5], ke=xs[5])


def shortconv_reference(conv, x, buf, reset):
    b = buf.clone()
    return conv.cached(x, b, reset), b


@pytest.mark.parametrize("Tn", [1, 2, 9, 70])
def test_conv_step_matches_pytorch(Tn):
    from prism_kernel import conv_step
    torch.manual_seed(Tn)
    C, W = 20, 4
    conv = ShortConv(C, W).to(DEV)
    wide = torch.randn(B, Tn, C + 7, device=DEV)
    x = wide[..., 3:3 + C]  # strided rows, as a slice of the fused projection
    buf = torch.randn(B, W - 1, C, device=DEV)
    for reset in (None, torch.rand(B, Tn, device=DEV) < 0.3):
        y_ref, buf_ref = shortconv_reference(conv, x, buf, reset)
        b = buf.clone()
        y = conv_step(x, b, conv.weight, reset)
        assert max_err(y, y_ref) < 1e-5 and max_err(b, buf_ref) < 1e-6
    # the PyTorch form itself: against conv1d on [buffer; x] (no reset)
    y_ref, buf_ref = shortconv_reference(conv, x, buf, None)
    xp = torch.cat([buf, x], 1)
    direct = F.silu(F.conv1d(xp.transpose(1, 2), conv.weight[:, None, :], groups=C).transpose(1, 2))
    assert max_err(y_ref, direct) < 1e-5 and max_err(buf_ref, xp[:, -(W - 1):]) == 0


def test_gated_norm_add_norm_and_silu_mul():
    from prism_kernel import add_rms_norm, gated_rms_norm, silu_mul
    torch.manual_seed(0)
    o, w = torch.randn(2, 3, 4, 16, device=DEV), torch.randn(16, device=DEV)
    wide = torch.randn(2, 3, 4 * 16 + 5, device=DEV)
    gate = wide[..., 5:]
    ref = F.rms_norm(o, (16,), w, 1e-6) * F.silu(gate.view(2, 3, 4, 16))
    assert max_err(gated_rms_norm(o, gate, w, 1e-6), ref.flatten(2)) < 1e-5
    x = torch.randn(2, 3, 2 * 40, device=DEV)
    assert max_err(silu_mul(x), F.silu(x[..., :40]) * x[..., 40:]) < 1e-6
    y, w = torch.randn_like(x), torch.randn(80, device=DEV)
    s, h = add_rms_norm(x, y, w, 1e-6)
    assert max_err(s, x + y) < 1e-6 and max_err(h, F.rms_norm(x + y, (80,), w, 1e-6)) < 1e-5


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_and_rope_write(splits):
    from prism_kernel import decode_attention, rope_kv_write
    torch.manual_seed(splits)
    Bn, L, H, D, pos = 2, 200, 2, 8, 150
    kc, vc = torch.randn(Bn, L, H, D, device=DEV), torch.randn(Bn, L, H, D, device=DEV)
    begin = torch.tensor([0, 97], device=DEV)
    qkv = torch.randn(Bn, 1, 3 * H * D + 4, device=DEV)[..., 4:]
    ang = torch.arange(L, device=DEV).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    q = rope_kv_write(qkv, ang.cos(), ang.sin(), torch.tensor(pos, device=DEV), begin, kc, vc)
    q_ref, k_ref, v_ref = qkv.view(Bn, 1, 3, H, D).unbind(2)
    rp = (pos - begin)[:, None]
    assert max_err(q, model_py.rope(q_ref, rp, 10000)) < 1e-5
    assert max_err(kc[:, pos:pos + 1], model_py.rope(k_ref, rp, 10000)) < 1e-5 and torch.equal(vc[:, pos:pos + 1], v_ref)
    y = decode_attention(q, kc, vc, begin, torch.tensor(pos, device=DEV), splits=splits)
    j = torch.arange(L, device=DEV)
    mask = (j <= pos) & (j >= begin[:, None])
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                         attn_mask=mask[:, None, None])
    assert max_err(y, ref.transpose(1, 2)) < 1e-5


SOLVERS = {
    "own_gelu": dict(),
    "shared_linear": dict(solver_keys="shared", solver_mode="linear"),
    "base_nogain": dict(solver_keys="base", solver_gain=False),
    "own_noact_noanchor": dict(solver_nonlinear=False, solver_anchor=False),
    "gdn": dict(solver_steps=1),
}


@pytest.mark.parametrize("name", list(SOLVERS))
def test_layer_step_matches_pytorch_path(name):
    """PRISM's (and GDN's) Triton decoding step, with the solver write formed in the kernel,
    against the same layer's PyTorch cached path from the same nonzero buffers."""
    torch.manual_seed(0)
    kw = {"solver_steps": 3, **SOLVERS[name]}
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=32, head_dim=8, solver_rank=8, **kw)
    layer = PRISM(cfg).to(DEV)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    x = torch.randn(B, 3, 32, device=DEV)
    reset = torch.tensor([[False, True, False], [False, False, False]], device=DEV)
    y_ref, ref = layer_steps(layer, x, B, torch.float32, reset, backend="chunk")
    y, got = layer_steps(layer, x, B, torch.float32, reset)
    assert rel(y, y_ref) < 1e-5
    for key in ref:
        assert rel(got[key], ref[key]) < 1e-5, key


def layer_steps(layer, x, batch, dtype, reset=None, backend=None):
    """One call of the layer on a cache whose buffers are filled with the same random numbers
    every time: the Triton step (backend None) or the layer's forward on `backend`."""
    torch.manual_seed(1)
    dev = x.device
    cache = Cache([layer.cache_buffers(batch, x.shape[1], dev, dtype)], batch, x.shape[1], dev)
    for t in cache.layers[0].values():
        t.normal_()
    cache.reset = reset  # what Model.forward's begin_step sets, and its segments
    seg = None if reset is None else segments_of(torch.where(reset, EOS, EOS + 1), EOS)
    with torch.no_grad():
        if backend is None:
            y = layer.step(x, cache)
        else:
            layer.backend = backend
            y = layer(x, seg, cache)
    return y, cache.layers[0]


@pytest.mark.parametrize("name", ["gdn", "prism_L3", "hybrid"])
def test_triton_backend_cache_equals_full(name):
    """The model's decoding path on the Triton backend (fused step kernels, decode attention)
    against the full forward of the PyTorch chunk backend."""
    model = tiny_model(n_layer=2, **CASES[name])
    idx = tokens(length=9)
    with torch.no_grad():
        full, _ = model(idx)
        model.backend = "triton"
        got = run_pieces(model, idx, [4, 1, 1, 3])
    assert max_err(got, full) <= TOL


@pytest.mark.parametrize("reset_at_eos", [False, True])
@pytest.mark.parametrize("name", list(model_py.MIXERS))
def test_mixer_protocol_step_equals_forward(name, reset_at_eos):
    """Every mixer has forward(x, seg, cache) and step(x, cache) and nothing else in their
    signatures (no kernel options), and a sequence fed as a forward prefill, then steps of one
    and of two tokens through the cache, equals the one forward of the whole sequence."""
    cls = model_py.MIXERS[name]
    assert list(inspect.signature(cls.forward).parameters) == ["self", "x", "seg", "cache"], name
    assert list(inspect.signature(cls.step).parameters) == ["self", "x", "cache"], name
    kw = {"solver_steps": 3} if name == "prism" else {}
    model = tiny_model(n_layer=1, mixer=name, reset_at_eos=reset_at_eos, **kw).to(DEV)
    layer = model.blocks[0].mixer
    assert type(layer) is cls
    idx = tokens(length=6, seed=2).to(DEV)
    idx[0, 3] = EOS                                         # a document starts mid-way in row 0
    x = torch.randn(B, 6, 32, device=DEV)
    seg = (lambda ids: segments_of(ids, EOS)) if reset_at_eos else (lambda ids: None)
    cache = model.init_cache(B, 6)
    out, t = [], 0
    with torch.no_grad():
        full = layer(x, seg(idx))
        for n, fn in [(2, "forward"), (1, "step"), (1, "step"), (2, "step")]:
            piece = slice(t, t + n)
            cache.begin_step(idx[:, piece])                  # what Model.forward does around a call
            y = layer(x[:, piece], seg(idx[:, piece]), cache) if fn == "forward" else layer.step(x[:, piece], cache)
            cache.end_step(n)
            out.append(y)
            t += n
    got = torch.cat(out, 1)
    assert full.abs().max() > 0.1, "degenerate test: the output is ~0"
    assert max_err(got, full) <= TOL, f"{name}: step vs forward {max_err(got, full):.3e}"


def check_bf16_state(Bn, H, K, V, L):
    """A bf16 state is read, updated in float32 over the call's tokens and rounded to nearest
    once when stored: the float32 state's step from the same (rounded) start, then rounded."""
    from prism_kernel import recurrent_prism_step
    xs, S0 = recurrence_inputs(Bn, 5, H, K, V, L, torch.float32, DEV)
    S16 = S0.to(torch.bfloat16)
    S32 = S16.float()
    o16, out = recurrent_prism_step(*xs, state=S16)
    o32, _ = recurrent_prism_step(*xs, state=S32)
    assert out is S16 and S16.dtype == torch.bfloat16
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    # the interpreter runs both calls op for op: bit-equal outputs. A GPU compiles the two state
    # dtypes into two kernels whose float32 sums may contract and order differently (an ulp or so)
    if interpreted:
        assert torch.equal(o16, o32)
    else:
        torch.testing.assert_close(o16, o32, rtol=1e-5, atol=1e-7)
    assert not torch.equal(S16.float(), S32), "degenerate test: the state needed no rounding"
    # a GPU rounds float32 -> bf16 to nearest: within half a bf16 ulp of the float32 state (plus
    # the float32 reordering above). Triton's CPU interpreter truncates such casts (every bf16
    # store it runs): there within one ulp.
    ulp = 2.0 ** (torch.floor(torch.log2(S32.abs())) - 7)
    bound = ulp if interpreted else ulp / 2 + 1e-5 * S32.abs() + 1e-7
    assert ((S16.float() - S32).abs() <= bound).all()
    with pytest.raises(ValueError, match="state must be"):
        recurrent_prism_step(*xs, state=S0.half())


@pytest.mark.parametrize("L", [1, 3])
def test_recurrent_step_bf16_state(L):
    check_bf16_state(2, 2, 8, 16, L)


@pytest.mark.parametrize("backend", ["chunk", "triton"])
@pytest.mark.parametrize("name", ["gdn", "prism_L3", "hybrid"])
def test_bf16_state_cache(name, backend):
    """init_cache(state_dtype=torch.bfloat16): the GDN/PRISM states stay bf16 at the same address
    through prefill and steps; the logits are the float32 state's up to bf16 rounding (different,
    and close). generate() takes the option through to its cache."""
    model = tiny_model(n_layer=2, **CASES[name])
    model.backend = backend
    idx = tokens(length=9)
    with torch.no_grad():
        ref = run_pieces(model, idx, [4, 1, 1, 3])
        cache = model.init_cache(idx.shape[0], idx.shape[1], state_dtype=torch.bfloat16)
        states = [buf["state"] for buf in cache if "state" in buf]
        ptrs = [s.data_ptr() for s in states]
        out, t = [], 0
        for n in [4, 1, 1, 3]:
            out.append(model(idx[:, t:t + n], cache=cache)[0])
            t += n
        got = torch.cat(out, 1)
    assert states and all(s.dtype == torch.bfloat16 for s in states)
    assert [buf["state"].data_ptr() for buf in cache if "state" in buf] == ptrs
    assert 0 < max_err(got, ref) and rel(got, ref) <= 2e-2, (max_err(got, ref), rel(got, ref))
    with pytest.raises(ValueError, match="state_dtype"):
        model.init_cache(1, 4, state_dtype=torch.float16)
    seen = []
    real = model.init_cache
    model.init_cache = lambda *a, **kw: seen.append(list(a) + list(kw.values())) or real(*a, **kw)
    model.generate(idx[:, :3], 2, temperature=0, state_dtype=torch.bfloat16, graph=False)
    assert len(seen) == 1 and torch.bfloat16 in seen[0], seen


# ------------------------------------------------------------------ GPU

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("K,V", [(128, 256), (64, 64)])
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("Tn", [1, 7, 64])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_recurrent_step_matches_naive(Tn, L, K, V, dtype, tol):
    check_recurrent_step(3, Tn, 6, K, V, L, dtype, tol)


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_recurrent_step_bf16_state(L):
    check_bf16_state(4, 6, 128, 256, L)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("mixer", ["gdn", "prism"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_130m_layer_step(mixer, dtype, tol):
    """The 130M layer shape (K=128, V=256, D=768): Triton step vs the PyTorch cached path."""
    torch.manual_seed(0)
    cfg = ModelConfig(mixer=mixer)
    layer = (PRISM if mixer == "prism" else GatedDeltaNet)(cfg).cuda().to(dtype)
    x = torch.randn(16, 4, 768, device="cuda", dtype=dtype)
    y_ref, ref = layer_steps(layer, x, 16, dtype, backend="chunk")
    y, got = layer_steps(layer, x, 16, dtype)
    assert rel(y, y_ref) <= tol and rel(got["state"], ref["state"]) <= tol


def graphed_logits(model, idx, prefill):
    """Prefill, two eager steps, then every further token by replaying one captured step."""
    Bn, Tn = idx.shape
    cache = model.init_cache(Bn, Tn)
    out = [model(idx[:, :prefill], cache=cache)[0]]
    tok = idx[:, prefill:prefill + 1].clone()
    logits = torch.empty(Bn, 1, model.config.vocab_size, device=idx.device)

    def step():
        logits.copy_(model(tok, cache=cache)[0])
    t = prefill
    for _ in range(2):
        tok.copy_(idx[:, t:t + 1])
        step()
        out.append(logits.clone())
        t += 1
    replay = cuda_graph(step, warmup=0)
    while t < Tn:
        tok.copy_(idx[:, t:t + 1])
        replay()
        out.append(logits.clone())
        t += 1
    return torch.cat(out, 1)


@pytest.mark.parametrize("backend", ["chunk", "triton"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_stepwise_prefill_and_graph_equal_full(name, backend):
    """Float32 on the GPU: the full forward against the cache path eagerly (steps, pieces) and
    through a captured CUDA graph replayed per token."""
    model = tiny_model(backend=backend, **CASES[name]).cuda()
    idx = tokens().cuda()
    with torch.no_grad():
        full, _ = model(idx)
        step = run_pieces(model, idx, [1] * T)
        pieces = run_pieces(model, idx, [11, 5, 1, 1, 3])
        graphed = graphed_logits(model, idx, 5)
    for what, got in (("stepwise", step), ("prefill", pieces), ("graph", graphed)):
        assert max_err(got, full) <= TOL, f"{name}/{backend} {what}: {max_err(got, full):.3e}"


@pytest.mark.parametrize("name", ["gdn", "prism_L3", "attention", "hybrid"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_generate_graph_equals_full_forward(name):
    model = tiny_model(backend="triton", **CASES[name]).cuda()
    prompt = tokens(length=6).cuda()
    with torch.no_grad():
        graphed = model.generate(prompt, 15, temperature=0)
        eager = model.generate(prompt, 15, temperature=0, graph=False)
        ref = prompt.clone()
        for _ in range(15):
            ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], 1)
        drawn = model.generate(prompt, 15, temperature=1.0, top_k=10)
    assert torch.equal(graphed, eager) and torch.equal(graphed, ref)
    assert drawn.shape == ref.shape and 0 <= drawn.min() and drawn.max() < VOCAB


@pytest.mark.parametrize("sizes", [[1] * 14, [5, 6, 3]], ids=["steps", "pieces"])
@pytest.mark.parametrize("name", ["gdn", "prism_L3", "attention", "hybrid"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_reset_at_eos_in_cache(name, sizes):
    model = tiny_model(backend="triton", reset_at_eos=True, **CASES[name]).cuda()
    got, fresh, before, idx = reset_case(model, sizes)
    assert max_err(got[:1, 7:], fresh) <= TOL
    assert max_err(got[:1, :7], before[:1, :7]) <= TOL and max_err(got[1:], before[1:]) <= TOL


@pytest.mark.parametrize("mixer", ["gdn", "prism", "hybrid", "transformer"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_130m_bf16_graph_step(mixer):
    """The 130M models in bf16: logits through the captured step match the eager cache path,
    and generate() runs (graph, batch 4, prompt 40, 40 tokens, top-k sampling)."""
    kw = {"gdn": dict(mixer="gdn"), "prism": dict(mixer="prism"),
          "hybrid": dict(mixer="prism", attn_layers=(5, 11)), "transformer": dict(mixer="attention")}[mixer]
    torch.manual_seed(0)
    model = Model(ModelConfig(**kw)).cuda().to(torch.bfloat16).eval()
    idx = torch.randint(0, 32000, (4, 48), device="cuda")
    with torch.no_grad():
        eager = run_pieces(model, idx, [40] + [1] * 8)
        graphed = graphed_logits(model, idx, 40)
        out = model.generate(idx[:, :40], 40, temperature=0.8, top_k=50)
    assert torch.isfinite(graphed).all() and rel(graphed[:, 40:], eager[:, 40:]) < 1e-2
    assert out.shape == (4, 80) and out.min() >= 0 and out.max() < 32000
