"""reset_at_eos: packed documents without cross-talk.

The property: with reset_at_eos every EOS starts a segment (the EOS is its first token). From an
EOS on, the logits equal those of the same tokens run alone with no cache, and the tokens before
a row's first EOS equal that prefix run alone; so the gradient of a loss summed over the packed
batch equals the sum of the segments' gradients. Checked for GDN, PRISM (L=3) and a hybrid, on
the naive and chunk backends (float64) and the Triton kernels (float32; in the interpreter on
CPU), with EOS at position 0, consecutive EOS, EOS at the last position and a row without EOS.
Also: a cache across an EOS (prefill and one-token steps) equals the segment run alone; the
backends' cu_seqlens equal one call per sequence; the flag off leaves the model as it was.
"""
import inspect

import pytest
import torch
import torch.nn.functional as F

import model as model_module
from model import Model, ModelConfig, delta_rule_chunk, delta_rule_naive, segments_of

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, EOS = 61, 2
CUDA = torch.cuda.is_available()
CASES = {
    "gdn": dict(mixer="gdn"),
    "prism_L3": dict(mixer="prism", solver_steps=3),
    "hybrid": dict(mixer="prism", solver_steps=3, attn_layers=(1,)),
}


def tiny_model(backend, dtype, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=VOCAB, block_size=64, n_layer=3, n_head=2, n_embd=32, head_dim=8,
                      expand_v=2.0, solver_rank=8, eos_id=EOS, **kw)
    model = Model(cfg, backend=backend, chunk_size=8).to(dtype)
    # random init leaves the mixers nearly silent; larger weights make a leak across EOS visible
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "wte" not in name:
                p.mul_(4.0)
    return model


def packed_batch(T=20, seed=1):
    """Row 0: EOS at 0, EOS at 5 and 6 (consecutive), EOS last. Row 1: no EOS. Row 2: a prefix
    that continues (no EOS at 0), then an EOS at 9."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(EOS + 1, VOCAB, (3, T), generator=g)
    idx[0, [0, 5, 6, T - 1]] = EOS
    idx[2, 9] = EOS
    return idx


def pieces(idx):
    """(row, start, end) of every segment: cut before each EOS."""
    out = []
    for b, row in enumerate(idx.tolist()):
        cuts = sorted({0, len(row)} | {t for t, x in enumerate(row) if x == EOS})
        out += [(b, s, e) for s, e in zip(cuts, cuts[1:])]
    return out


def close(a, b, tol):
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    return err <= tol * max(scale, 1.0), f"max abs diff {err:.3e} (scale {scale:.3e})"


def require_varlen_kernels():
    import prism_kernel
    lacking = [f.__name__ for f in (prism_kernel.chunk_prism, prism_kernel.causal_conv)
               if "cu_seqlens" not in inspect.signature(f).parameters]
    if lacking:
        pytest.fail(f"prism_kernel.{' and '.join(lacking)} take no cu_seqlens: reset_at_eos on the "
                    f"triton backend needs the varlen kernels")


# backend: dtype, tolerance of logits, of gradients. float64 for the PyTorch backends (the decay
# is computed in float32 whatever the weights, hence the gradients' looser bound); the kernels
# take float32 (compiled on a GPU, else in the interpreter at these tiny shapes)
BACKENDS = {"naive": (torch.float64, 1e-10, 1e-6), "chunk": (torch.float64, 1e-10, 1e-6),
            "triton": (torch.float32, 2e-5, 1e-4)}
DEVICE = "cuda" if CUDA else "cpu"


def setup(backend, name):
    if backend == "triton":
        require_varlen_kernels()
    dtype, tol, grad_tol = BACKENDS[backend]
    model = tiny_model(backend, dtype, reset_at_eos=True, **CASES[name]).to(DEVICE)
    return model, tol, grad_tol


# ----------------------------------------------------------------------------------------------
# the property, forward and gradients

@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", list(CASES))
def test_packed_equals_segments_alone(name, backend):
    model, tol, grad_tol = setup(backend, name)
    idx = packed_batch().to(DEVICE)
    logits, _ = model(idx)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(logits.shape, generator=g, dtype=logits.dtype).to(DEVICE)  # random cotangent
    params = [p for p in model.parameters()]
    packed_grads = torch.autograd.grad((logits * w).sum(), params, allow_unused=True)
    total = 0
    for b, s, e in pieces(idx):
        alone, _ = model(idx[b:b + 1, s:e])
        ok, msg = close(logits[b, s:e], alone[0], tol)
        assert ok, f"{name}/{backend}: row {b} tokens {s}:{e} differ from the segment alone: {msg}"
        total = total + (alone[0] * w[b, s:e]).sum()
    alone_grads = torch.autograd.grad(total, params, allow_unused=True)
    names = [n for n, _ in model.named_parameters()]
    for n, a, b in zip(names, packed_grads, alone_grads):
        assert (a is None) == (b is None), n
        if a is not None:
            ok, msg = close(a, b, grad_tol)
            assert ok, f"{name}/{backend}: gradient of {n}: {msg}"


@pytest.mark.parametrize("name", list(CASES))
def test_reset_changes_what_follows_an_eos(name):
    """Guards the property test: without the reset, the tokens after an EOS do see the past."""
    idx = packed_batch()
    off = tiny_model("chunk", torch.float64, **CASES[name])
    on = tiny_model("chunk", torch.float64, reset_at_eos=True, **CASES[name])
    with torch.no_grad():
        a, b = off(idx)[0], on(idx)[0]
    assert close(b[1], a[1], 1e-12)[0], "a row without EOS must not change"
    assert close(b[2, :9], a[2, :9], 1e-12)[0], "tokens before the first EOS must not change"
    assert (a[2, 9:] - b[2, 9:]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------
# with a cache: prefill and decoding across EOS

def run_pieces(model, idx, sizes):
    cache = model.init_cache(idx.shape[0], idx.shape[1])
    out, t = [], 0
    for n in sizes:
        out.append(model(idx[:, t:t + n], cache=cache)[0])
        t += n
    assert t == idx.shape[1]
    return torch.cat(out, 1)


@pytest.mark.parametrize("backend,name", [("chunk", n) for n in CASES] + [("naive", "hybrid"),
                                                                           ("triton", "hybrid")])
def test_cache_across_eos_equals_segment_alone(name, backend):
    """Prompts that hold EOS, pieces that start with EOS in one row and continue in the other,
    and one-token steps that are EOS: every logit equals its segment run alone."""
    model, tol, _ = setup(backend, name)
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(EOS + 1, VOCAB, (2, 26), generator=g)
    idx[0, [7, 12, 15, 16]] = EOS      # inside the prompt, at a piece start, as steps (consecutive)
    idx[1, [3, 10, 18]] = EOS          # a step of row 1 while row 0 continues, and vice versa
    idx = idx.to(DEVICE)
    sizes = [10, 2, 4, 1, 1, 1, 7]     # pieces start at 10 (EOS in row 1), 12 (EOS in row 0), 16, ...
    with torch.no_grad():
        cached = run_pieces(model, idx, sizes)
        for b, s, e in pieces(idx):
            alone, _ = model(idx[b:b + 1, s:e])
            ok, msg = close(cached[b, s:e], alone[0], tol)
            assert ok, f"{name}/{backend}: cached row {b} tokens {s}:{e} vs the segment alone: {msg}"


@pytest.mark.parametrize("name", list(CASES))
def test_generate_after_a_prompt_with_eos_ignores_what_came_before(name):
    model = tiny_model("chunk", torch.float64, reset_at_eos=True, **CASES[name])
    g = torch.Generator().manual_seed(4)
    doc = torch.randint(EOS + 1, VOCAB, (1, 5), generator=g)
    doc[0, 0] = EOS
    before = torch.randint(EOS + 1, VOCAB, (1, 9), generator=g)
    with torch.no_grad():
        a = model.generate(torch.cat([before, doc], 1), 8, temperature=0)
        b = model.generate(doc, 8, temperature=0)
    assert torch.equal(a[:, before.shape[1]:], b)


# ----------------------------------------------------------------------------------------------
# the pieces: segments, the backends' cu_seqlens, the kernels' interface

def test_segments_of():
    idx = torch.tensor([[2, 5, 5, 2, 2, 5], [5, 5, 2, 5, 5, 2]])
    seg = segments_of(idx, 2)
    assert seg.cu_seqlens.tolist() == [0, 3, 4, 6, 8, 11, 12]
    assert seg.cu_seqlens.dtype == torch.int32
    assert seg.pos.tolist() == [[0, 1, 2, 0, 0, 1], [0, 1, 0, 1, 2, 0]]
    assert seg.cont.tolist() == [[False] * 6, [True, True, False, False, False, False]]
    assert seg.first.tolist() == [0, 3] and seg.last.tolist() == [2, 5]
    step = segments_of(torch.tensor([[2], [5]]), 2)  # a decode step: one segment per row
    assert step.cu_seqlens.tolist() == [0, 1, 2] and step.cont.tolist() == [[False], [True]]


def rand_inputs(T, H, K, V, L, N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    xs = [F.normalize(r(1, T, H, K), dim=-1), F.normalize(r(1, T, H, K), dim=-1), r(1, T, H, V),
          F.logsigmoid(r(1, T, H) * 2 + 2), torch.rand(1, T, H, generator=gen, dtype=torch.float64),
          F.normalize(r(1, T, H, L - 1, K), dim=-1) if L > 1 else None,
          0.5 * r(1, T, H, L - 1, V) if L > 1 else None, r(N, H, K, V)]
    return xs


CU = [0, 1, 2, 13, 30, 31, 45]   # one-token sequences, one longer than a chunk (8), an odd end


def per_sequence(fn, xs, cu):
    q, k, v, g, beta, ke, ve, h0 = xs
    outs, finals = [], []
    for n, (s, e) in enumerate(zip(cu, cu[1:])):
        cut = lambda x: None if x is None else x[:, s:e]
        o, ht = fn(cut(q), cut(k), cut(v), cut(g), cut(beta), cut(ke), cut(ve),
                   initial_state=h0[n:n + 1], output_final_state=True)
        outs.append(o)
        finals.append(ht)
    return torch.cat(outs, 1), torch.cat(finals)


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("fn", [delta_rule_naive, lambda *a, **kw: delta_rule_chunk(*a, chunk_size=8, **kw)],
                         ids=["naive", "chunk"])
def test_backend_cu_seqlens_equals_one_call_per_sequence(fn, L):
    xs = [x.requires_grad_() if x is not None else None for x in rand_inputs(45, 2, 4, 6, L, len(CU) - 1)]
    q, k, v, g, beta, ke, ve, h0 = xs
    cu = torch.tensor(CU, dtype=torch.int32)
    o, ht = fn(q, k, v, g, beta, ke, ve, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = per_sequence(delta_rule_naive, xs, CU)
    assert ht.shape == h0.shape
    assert close(o, o_ref, 1e-10)[0] and close(ht, ht_ref, 1e-10)[0]
    leaves = [x for x in xs if x is not None]
    gen = torch.Generator().manual_seed(9)
    do, dh = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    ga = torch.autograd.grad((o * do).sum() + (ht * dh).sum(), leaves)
    gb = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dh).sum(), leaves)
    for a, b in zip(ga, gb):
        assert close(a, b, 1e-10)[0]


@pytest.mark.parametrize("bad", [[0, 5, 5, 45], [1, 45], [0, 44], [0, 20, 10, 45]])
def test_bad_cu_seqlens_is_refused(bad):
    q, k, v, g, beta, ke, ve, _ = rand_inputs(45, 1, 4, 4, 1, 1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        delta_rule_chunk(q, k, v, g, beta, cu_seqlens=torch.tensor(bad))


@pytest.mark.parametrize("L", [1, 3])
def test_kernel_cu_seqlens_interface(L):
    """The varlen interface the model is written against: chunk_prism with cu_seqlens and
    per-sequence initial/final states; causal_conv with cu_seqlens."""
    require_varlen_kernels()
    from prism_kernel import causal_conv, chunk_prism
    xs = [x.float().to(DEVICE) if x is not None else None
          for x in rand_inputs(45, 2, 16, 16, L, len(CU) - 1, seed=6)]
    cu = torch.tensor(CU, dtype=torch.int32, device=DEVICE)
    o, ht = chunk_prism(*xs[:7], initial_state=xs[7], output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = per_sequence(delta_rule_naive, [x.double() if x is not None else None for x in xs], CU)
    assert ht.shape == xs[7].shape
    for got, ref in ((o, o_ref), (ht, ht_ref)):
        ok, msg = close(got, ref, 1e-5)
        assert ok, msg
    x = torch.randn(1, 45, 12, dtype=torch.float64)
    w = torch.randn(12, 4, dtype=torch.float64)
    conv = model_module.ShortConv(12, 4).double()
    with torch.no_grad():
        conv.weight.copy_(w)
        ref = torch.cat([conv(x[:, s:e]) for s, e in zip(CU, CU[1:])], 1)
    y = causal_conv(x.float().to(DEVICE), w.float().to(DEVICE), cu_seqlens=cu)
    ok, msg = close(y, ref, 1e-5)
    assert ok, msg


# ----------------------------------------------------------------------------------------------
# the flag off: the model as it was

@pytest.mark.parametrize("backend", ["naive", "chunk"])
@pytest.mark.parametrize("name", list(CASES))
def test_flag_off_never_segments(name, backend, monkeypatch):
    """Off, the forward (with or without a cache) builds no segments and ignores eos_id: its
    logits are bitwise those of a model whose eos_id names another token, EOS in the input."""
    a = tiny_model(backend, torch.float32, **CASES[name])
    b = tiny_model(backend, torch.float32, **CASES[name])
    b.config.eos_id = 7
    def refuse(*args):
        raise AssertionError("segments built with reset_at_eos off")
    monkeypatch.setattr(model_module, "segments_of", refuse)
    idx = packed_batch()
    with torch.no_grad():
        assert torch.equal(a(idx)[0], b(idx)[0])
        assert torch.equal(run_pieces(a, idx, [7, 1, 12]), run_pieces(b, idx, [7, 1, 12]))


def test_flag_adds_no_weights_and_old_args_load_off():
    a = tiny_model("chunk", torch.float32, **CASES["hybrid"])
    b = tiny_model("chunk", torch.float32, reset_at_eos=True, **CASES["hybrid"])
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    old = {k: v for k, v in a.config.__dict__.items() if k not in ("reset_at_eos", "eos_id")}
    assert ModelConfig.from_dict(old).reset_at_eos is False


def test_flag_on_without_eos_matches_flag_off():
    idx = packed_batch()[1:2]                       # the row without EOS
    for name in CASES:
        off = tiny_model("chunk", torch.float64, **CASES[name])
        on = tiny_model("chunk", torch.float64, reset_at_eos=True, **CASES[name])
        with torch.no_grad():
            assert close(on(idx)[0], off(idx)[0], 1e-12)[0]


def test_config_checks_eos_id():
    with pytest.raises(ValueError, match="eos_id"):
        ModelConfig(vocab_size=10, reset_at_eos=True, eos_id=10)


def test_train_takes_eos_id_from_meta():
    from settings import MODEL_DEFAULTS, UserError
    from train_aids import check_resume_model_args, data_eos_id
    args = dict(MODEL_DEFAULTS, reset_at_eos=True)
    assert data_eos_id({"eos_id": 0}, args) == 0            # the data decides
    assert data_eos_id({}, args) == args["eos_id"]         # no meta: the config's
    assert data_eos_id({"eos_id": 0}, dict(args, reset_at_eos=False)) == args["eos_id"]
    with pytest.raises(UserError, match="eos_id"):          # the config names another
        data_eos_id({"eos_id": 0}, dict(args, eos_id=5))
    ckpt_args = {k: v for k, v in MODEL_DEFAULTS.items() if k not in ("reset_at_eos", "eos_id")}
    check_resume_model_args(ckpt_args, dict(MODEL_DEFAULTS))  # older checkpoints resume


def test_train_runs_with_reset_at_eos(tmp_path, capsys):
    """train.py end to end: the data's eos_id (here 0) reaches the model and its checkpoint."""
    import numpy as np
    import train
    d = tmp_path / "docs"
    d.mkdir()
    rng = np.random.default_rng(0)
    data = rng.integers(1, 64, 6000)
    data[rng.random(6000) < 0.05] = 0                            # documents ~20 tokens long
    data[:5400].astype(np.uint16).tofile(d / "train.bin")
    data[5400:].astype(np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text('{"vocab_size": 64, "eos_id": 0}')
    argv = ["--vocab_size=64", "--n_layer=2", "--n_embd=32", "--n_head=2", "--head_dim=16",
            "--block_size=32", "--solver_rank=8", "--attn_layers=[1]", "--batch_size=4",
            "--gradient_accumulation_steps=1", "--max_iters=2", "--eval_interval=2", "--eval_iters=1",
            "--device=cpu", "--dtype=float32", "--backend=chunk", "--reset_at_eos=True",
            f"--data_dir={tmp_path}", "--dataset=docs"]
    assert train.main(argv + [f"--out_dir={tmp_path / 'out'}"]) == 0
    ckpt = torch.load(max((tmp_path / "out").glob("ckpt_*.pt")), weights_only=False)
    assert ckpt["model_args"]["reset_at_eos"] is True and ckpt["model_args"]["eos_id"] == 0
    assert train.main(argv + [f"--out_dir={tmp_path / 'out2'}", "--eos_id=5"]) == 2
    assert "eos_id" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# on the GPU: bf16 under autocast, the shapes the 130M models train at

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_bf16_packed_equals_segments_alone(name):
    require_varlen_kernels()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=256, head_dim=64,
                      solver_rank=32, eos_id=EOS, reset_at_eos=True,
                      **{**CASES[name], "attn_layers": (1,) if name == "hybrid" else ()})
    model = Model(cfg, backend="triton").cuda()
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(EOS + 1, VOCAB, (2, 1000), generator=g)
    idx[0, [0, 130, 131, 700]] = EOS
    idx[1, [64, 999]] = EOS
    idx = idx.cuda()
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        logits, _ = model(idx)
        for b, s, e in pieces(idx):
            alone, _ = model(idx[b:b + 1, s:e])
            ok, msg = close(logits[b, s:e], alone[0], 2e-2)
            assert ok, f"{name}: row {b} tokens {s}:{e}: {msg}"
