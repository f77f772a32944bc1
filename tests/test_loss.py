"""The training step's arithmetic: the chunked linear cross-entropy equals F.cross_entropy on
float32 logits (loss and every gradient), activation checkpointing changes no gradient, and the
FLOPs formula counts what it says."""
import pytest
import torch
import torch.nn.functional as F

import model as model_module
from model import Model, ModelConfig, linear_cross_entropy, training_flops_per_token

TINY = dict(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32, head_dim=8,
            expand_v=2.0, solver_rank=8)

pytestmark = pytest.mark.usefixtures("one_thread")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()


def loss_inputs(N, D, V, dtype, seed=0, ignored=0.25):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen, dtype=dtype).requires_grad_()
    w = (torch.randn(V, D, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    t = torch.randint(0, V, (N,), generator=gen)
    t[torch.rand(N, generator=gen) < ignored] = -1
    return h, w, t


def plain_loss(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t, ignore_index=-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1000])  # N = 37: 5 and 16 leave a short chunk
def test_fused_loss_and_gradients_equal_cross_entropy(dtype, tol, chunk):
    h, w, t = loss_inputs(37, 12, 50, dtype)
    upstream = 1.7  # the backward must scale by the incoming gradient, not assume 1
    ref = plain_loss(h, w, t) if dtype == torch.float32 else \
        F.cross_entropy(h @ w.t(), t, ignore_index=-1)
    dh_ref, dw_ref = torch.autograd.grad(ref * upstream, (h, w))
    loss = linear_cross_entropy(h, w, t, chunk=chunk)
    dh, dw = torch.autograd.grad(loss * upstream, (h, w))
    assert loss.dtype == ref.dtype and (t == -1).any()
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    assert rel(dh, dh_ref) <= tol and rel(dw, dw_ref) <= tol
    assert dh.dtype == h.dtype and dw.dtype == w.dtype
    assert (dh[t == -1] == 0).all()  # an ignored row gets no gradient at all


def test_fused_loss_edge_cases():
    h, w, t = loss_inputs(9, 4, 7, torch.float64, seed=1)
    # every target ignored: nan, as F.cross_entropy, and zero gradients
    none = torch.full_like(t, -1)
    loss = linear_cross_entropy(h, w, none, chunk=4)
    ref = F.cross_entropy(h @ w.t(), none, ignore_index=-1)
    assert torch.isnan(loss) and torch.isnan(ref)
    dh, dw = torch.autograd.grad(loss, (h, w))
    assert (dh == 0).all() and (dw == 0).all()
    # no grad: the same loss, no graph; only one input needing grad: its gradient alone
    with torch.no_grad():
        nog = linear_cross_entropy(h, w, t, chunk=4)
    ref = F.cross_entropy(h @ w.t(), t, ignore_index=-1).item()
    assert nog.grad_fn is None and nog.item() == pytest.approx(ref, rel=1e-12)
    wd = w.detach()
    (dh_only,) = torch.autograd.grad(linear_cross_entropy(h, wd, t, chunk=2), (h,))
    (dh_ref,) = torch.autograd.grad(F.cross_entropy(h @ wd.t(), t, ignore_index=-1), (h,))
    assert rel(dh_only, dh_ref) <= 1e-12
    # bad shapes and chunks are named
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="chunk"):
        linear_cross_entropy(h, w, t, chunk=0)


def test_fused_loss_under_bf16_autocast():
    """The mixed-precision path (bf16 logits and products, float32 master weight, gradients
    summed in float32) on the CPU's autocast: within bf16 rounding of the plain path and of
    exact float32 math."""
    h, w, t = loss_inputs(200, 32, 300, torch.float32, seed=3)
    exact = plain_loss(h, w, t)
    g_exact = torch.autograd.grad(exact, (h, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-1)
        fused = linear_cross_entropy(h, w, t, chunk=48)
    g_plain = torch.autograd.grad(plain, (h, w))
    g_fused = torch.autograd.grad(fused, (h, w))
    assert fused.dtype == torch.float32 and all(g.dtype == torch.float32 for g in g_fused)
    assert abs(fused.item() - plain.item()) <= 1e-3 * plain.item()
    for gf, gp, ge in zip(g_fused, g_plain, g_exact):
        assert rel(gf, gp) <= 1e-2 and rel(gf, ge) <= 1e-2


def tiny(seed=0, **over):
    torch.manual_seed(seed)
    return Model(ModelConfig(**{**TINY, **over}), backend="chunk").double()


def batch(B=3, T=11, vocab=TINY["vocab_size"], seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (B, T + 1), generator=gen)
    y = x[:, 1:].clone()
    y[0, :4] = -1  # masked prompt tokens
    y[2, -1] = -1
    return x[:, :-1], y


def grads_of(model, idx, tgt):
    model.zero_grad(set_to_none=True)
    _, loss = model(idx, tgt)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("over", [dict(mixer="prism", solver_steps=3),
                                  dict(mixer="gdn", tie_embeddings=False),
                                  dict(mixer="prism", attn_layers=(1,))])
def test_model_fused_loss_matches_plain_through_every_parameter(monkeypatch, over):
    monkeypatch.setattr(model_module, "LOSS_CHUNK", 7)  # B*T = 33 rows: 7 does not divide them
    m = tiny(**over)
    idx, tgt = batch()
    m.fused_loss = False
    loss_ref, ref = grads_of(m, idx, tgt)
    m.fused_loss = True
    loss, got = grads_of(m, idx, tgt)
    assert abs(loss.item() - loss_ref.item()) <= 1e-12 * loss_ref.item()
    assert got.keys() == ref.keys()
    for name in ref:
        assert rel(got[name], ref[name]) <= 1e-10, name
    assert ref["wte.weight"].abs().sum() > 0  # the (tied) head: the fused path's weight gradient


def test_forward_returns_logits_only_when_asked():
    m = tiny()
    idx, tgt = batch()
    for fused in (False, True):
        m.fused_loss = fused
        logits, loss = m(idx, tgt)
        assert logits is None and loss.dim() == 0
        logits2, loss2 = m(idx, tgt, return_logits=True)  # the plain path, logits included
        assert torch.equal(logits2, m(idx)[0]) and logits2.shape == (3, 11, TINY["vocab_size"])
        assert loss2.item() == pytest.approx(loss.item(), rel=1e-12)
    assert m(idx)[1] is None


@pytest.mark.parametrize("mode", [True, "mlp"])
@pytest.mark.parametrize("over", [dict(mixer="prism", solver_steps=3, dropout=0.1),
                                  dict(mixer="gdn", attn_layers=(0,)),
                                  dict(mixer="prism", attn_layers=(1,), reset_at_eos=True)])
def test_activation_checkpointing_keeps_gradients(over, mode):
    m = tiny(**over)
    m.train()
    idx, tgt = batch(seed=1)
    idx[0, 5] = idx[1, 0] = idx[2, 7] = m.config.eos_id  # documents for reset_at_eos to cut
    torch.manual_seed(5)  # dropout draws the same masks: checkpoint replays the RNG state
    loss_ref, ref = grads_of(m, idx, tgt)
    m.activation_checkpointing = mode
    torch.manual_seed(5)
    loss, got = grads_of(m, idx, tgt)
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-12)
    for name in ref:
        assert rel(got[name], ref[name]) <= 1e-10, name
    m.eval()
    with torch.no_grad():  # without a backward nothing is recomputed: the same logits
        on = m(idx)[0]
        m.activation_checkpointing = False
        assert torch.equal(on, m(idx)[0])
    with pytest.raises(ValueError, match="activation_checkpointing"):
        m.activation_checkpointing = "attention"


@pytest.mark.parametrize("mode", [True, "mlp"])
def test_checkpointing_and_fused_loss_under_compile(mode):
    """torch.compile (aot_eager on CPU) over the checkpoints and the fused loss, whose chunk
    loop runs outside the graph: the gradients of the eager model that recomputes nothing."""
    m = tiny(mixer="prism", solver_steps=2)
    idx, tgt = batch(seed=2)
    loss_ref, ref = grads_of(m, idx, tgt)
    m.activation_checkpointing, m.fused_loss = mode, True
    compiled = torch.compile(m, backend="aot_eager")
    compiled.zero_grad(set_to_none=True)
    _, loss = compiled(idx, tgt)
    loss.backward()
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-10)
    for name, p in m.named_parameters():
        assert rel(p.grad, ref[name]) <= 1e-9, name


def test_flops_formula():
    base = ModelConfig(**TINY, mixer="gdn")
    n = 1000
    gdn = training_flops_per_token(base, 64, n)
    D, H, K, V, C = 32, 2, 8, 16, 64
    assert gdn == 3 * (2 * n + 2 * 2 * H * (C * (3 * K + 2 * V) + 3 * K * V))  # 2 layers
    # PRISM L=1 is GDN; every extra row costs the same; attention grows with T, GDN does not
    p = lambda L: training_flops_per_token(ModelConfig(**TINY, mixer="prism", solver_steps=L), 64, n)
    assert p(1) == gdn and p(3) - p(2) == p(2) - p(1) > 0
    att = lambda T: training_flops_per_token(ModelConfig(**TINY, mixer="attention"), T, n)
    assert att(128) - att(64) == 3 * 2 * (2 * 64 * D)  # 2 layers of 2 T D
    assert training_flops_per_token(base, 128, n) == gdn
    # the model counts a tied table once, an untied input table not at all
    tied, untied = tiny(mixer="gdn"), tiny(mixer="gdn", tie_embeddings=False)
    assert tied.flops_per_token(64) == training_flops_per_token(base, 64, tied.num_params(False))
    assert untied.flops_per_token(64) == training_flops_per_token(
        untied.config, 64, untied.num_params(True))
    assert untied.num_params(True) == tied.num_params(False)
    assert tied.estimate_mfu(4, 2.0, peak_flops=1e9) == pytest.approx(
        tied.flops_per_token(16) * 16 * 4 / 2.0 / 1e9)


# ----------------------------------------------------------------------------------------------
# on the GPU (pytest -m gpu): bf16 autocast, the compiled row kernel, real memory

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_gpu_fused_loss_matches_plain_and_saves_memory():
    torch.manual_seed(0)
    N, D, V = 16384, 768, 32000
    h = torch.randn(N, D, device="cuda").requires_grad_()
    w = (torch.randn(V, D, device="cuda") * 0.02).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    t[::5] = -1
    out = {}
    for name, fn in [("plain", plain_loss), ("fused", linear_cross_entropy)]:
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(h, w, t)
        loss.backward()
        torch.cuda.synchronize()
        out[name] = (loss.item(), h.grad.clone(), w.grad.clone(),
                     torch.cuda.max_memory_allocated() - base)
    (l0, dh0, dw0, m0), (l1, dh1, dw1, m1) = out["plain"], out["fused"]
    assert abs(l1 - l0) <= 1e-4 * l0
    assert rel(dh1, dh0) <= 2e-2 and rel(dw1, dw0) <= 2e-2  # bf16 logits and products on both
    assert m1 < m0 / 4, f"fused peak {m1 / 2**30:.2f} GiB vs plain {m0 / 2**30:.2f} GiB"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_checkpointed_training_step_matches(compile):
    torch.manual_seed(0)
    cfg = ModelConfig(**{**TINY, "n_embd": 128, "head_dim": 32, "n_head": 4, "block_size": 256},
                      mixer="prism", solver_steps=3, attn_layers=(1,))
    m = Model(cfg).cuda()
    x = torch.randint(0, cfg.vocab_size, (4, 257), device="cuda")
    grads = []
    for ckpt in (False, True):
        m.activation_checkpointing = ckpt
        fwd = torch.compile(m) if compile else m
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = fwd(x[:, :-1], x[:, 1:])
        loss.backward()
        grads.append([p.grad.float() for p in m.parameters()])
    for a, b in zip(*grads):
        assert rel(b, a) <= 2e-2
