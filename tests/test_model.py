"""The model's math: backends agree, L=1 is GDN, causality, the rank of the PRISM write,
every ablation switch matters, and the configuration rejects nonsense. On a GPU (-m gpu): the
chunk backend in float32 and bf16 against float64, and 130M training steps that stay finite."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from model import (Model, ModelConfig, PRISM, GatedDeltaNet, delta_rule_chunk, delta_rule_naive)

TINY = dict(vocab_size=97, block_size=64, n_layer=2, n_head=2, n_embd=32, head_dim=8,
            expand_v=2.0, solver_rank=8)


def rand_inputs(B, T, H, K, V, L, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q = F.normalize(r(B, T, H, K), dim=-1)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    # decays spanning strong forgetting to almost none
    g = F.logsigmoid(r(B, T, H) * 2 + 2)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    ke = F.normalize(r(B, T, H, L - 1, K), dim=-1) if L > 1 else None
    ve = 0.5 * r(B, T, H, L - 1, V) if L > 1 else None
    S0 = r(B, H, K, V)
    xs = [q, k, v, g, beta, ke, ve, S0]
    return [x.to(dtype) if x is not None else None for x in xs]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_chunk_matches_naive_float64(L):
    q, k, v, g, beta, ke, ve, S0 = rand_inputs(2, 45, 2, 8, 12, L, torch.float64)  # 45: not a multiple of 16
    o1, s1 = delta_rule_naive(q, k, v, g, beta, ke, ve, initial_state=S0, output_final_state=True)
    o2, s2 = delta_rule_chunk(q, k, v, g, beta, ke, ve, initial_state=S0, output_final_state=True,
                              chunk_size=16)
    assert rel(o2, o1) <= 1e-10 and rel(s2, s1) <= 1e-10


@pytest.mark.parametrize("L", [1, 3])
def test_chunk_matches_naive_float32(L):
    q, k, v, g, beta, ke, ve, S0 = rand_inputs(2, 70, 2, 8, 12, L, torch.float32, seed=1)
    o1, s1 = delta_rule_naive(*(x.double() if x is not None else None
                                for x in (q, k, v, g, beta, ke, ve)),
                              initial_state=S0.double(), output_final_state=True)
    o2, s2 = delta_rule_chunk(q, k, v, g, beta, ke, ve, initial_state=S0, output_final_state=True,
                              chunk_size=16)
    assert o2.dtype == torch.float32
    assert rel(o2, o1) <= 1e-5 and rel(s2, s1) <= 1e-5


@pytest.mark.parametrize("L", [1, 2, 4])
def test_chunk_gradients_match_naive(L):
    xs = rand_inputs(1, 21, 2, 4, 6, L, torch.float64, seed=2)
    xs = [x.requires_grad_() if x is not None else None for x in xs]
    q, k, v, g, beta, ke, ve, S0 = xs
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(1, 21, 2, 6, generator=gen, dtype=torch.float64)
    dS = torch.randn(1, 2, 4, 6, generator=gen, dtype=torch.float64)
    grads = []
    for fn in (delta_rule_naive, lambda *a, **kw: delta_rule_chunk(*a, chunk_size=8, **kw)):
        o, s = fn(q, k, v, g, beta, ke, ve, initial_state=S0, output_final_state=True)
        leaves = [x for x in xs if x is not None]
        grads.append(torch.autograd.grad((o * do).sum() + (s * dS).sum(), leaves))
    for a, b in zip(*grads):
        assert rel(b, a) <= 1e-10


def test_no_overflow_with_extreme_decays():
    # cumulative log-decay over a chunk of -3000 must not overflow exp() anywhere
    q, k, v, g, beta, ke, ve, S0 = rand_inputs(1, 64, 1, 8, 8, 2, torch.float32, seed=4)
    g = torch.full_like(g, -50.0)
    g[:, ::2] = -1e-6
    o, s = delta_rule_chunk(q, k, v, g, beta, ke, ve, initial_state=S0, output_final_state=True)
    o_ref, s_ref = delta_rule_naive(q, k, v, g, beta, ke, ve, initial_state=S0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel(o, o_ref) <= 1e-5


def layer_pair(**over):
    cfg = ModelConfig(**{**TINY, **over})
    torch.manual_seed(0)
    return cfg


def test_prism_L1_is_gdn():
    torch.manual_seed(0)
    gdn = Model(ModelConfig(**TINY, mixer="gdn"))
    prism = Model(ModelConfig(**TINY, mixer="prism", solver_steps=1))
    prism.load_state_dict(gdn.state_dict(), strict=True)   # same parameters, no extras
    idx = torch.randint(0, TINY["vocab_size"], (2, 40))
    assert torch.equal(gdn(idx)[0], prism(idx)[0])
    # and more steps add parameters but keep GDN's under the same names
    prism3 = Model(ModelConfig(**TINY, mixer="prism", solver_steps=3))
    missing, unexpected = prism3.load_state_dict(gdn.state_dict(), strict=False)
    assert not unexpected and all("solver" in m or "_up" in m or "anchor" in m or "step_proj" in m
                                  for m in missing)


@pytest.mark.parametrize("over", [dict(mixer="gdn"), dict(mixer="prism"),
                                  dict(mixer="attention"), dict(mixer="prism", attn_layers=[1])])
def test_causality(over):
    torch.manual_seed(0)
    model = Model(ModelConfig(**TINY, **over)).double()
    idx = torch.randint(0, TINY["vocab_size"], (1, 40))
    base = model(idx)[0]
    for t in (0, 17, 39):
        idx2 = idx.clone()
        idx2[0, t] = (idx2[0, t] + 1) % TINY["vocab_size"]
        out = model(idx2)[0]
        assert torch.equal(out[:, :t], base[:, :t]), f"position {t} leaked backwards"
        assert not torch.allclose(out[:, t], base[:, t])


def per_token_write(layer, x):
    """The matrix PRISM adds to the state at each token: b k v^T + sum_l ke ve^T."""
    B, T, _ = x.shape
    H, K, V = layer.H, layer.K, layer.V
    qkv = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], -1)
    _, k, v = layer.conv(qkv).split([H * K, H * K, H * V], -1)
    k = F.normalize(k.view(B, T, H, K), dim=-1)
    v = v.view(B, T, H, V)
    beta = layer.b_proj(x).sigmoid()
    ke, ve = layer.solver_write(x, k, v)
    W = torch.einsum("bthk,bthv->bthkv", k * beta[..., None], v)
    if ke is not None:
        W = W + torch.einsum("bthlk,bthlv->bthkv", ke, ve)
    return W


@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_write_has_rank_L(L):
    torch.manual_seed(0)
    cfg = ModelConfig(**{**TINY, "head_dim": 16}, solver_steps=L)
    layer = PRISM(cfg).double()
    with torch.no_grad():  # larger random weights so every term is clearly non-zero
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    x = torch.randn(1, 12, cfg.n_embd, dtype=torch.float64)
    W = per_token_write(layer, x)
    s = torch.linalg.svdvals(W.flatten(0, 2))                     # [tokens*heads, min(K,V)]
    ranks = (s > 1e-9 * s[:, :1]).sum(-1)
    assert (ranks == L).all(), ranks


SWITCHES = [dict(solver_nonlinear=False), dict(solver_anchor=False), dict(solver_gain=False),
            dict(solver_keys="shared"), dict(solver_keys="base"), dict(solver_mode="linear"),
            dict(solver_steps=2), dict(solver_steps=1)]


@pytest.mark.parametrize("over", SWITCHES)
def test_every_switch_changes_the_function(over):
    torch.manual_seed(0)
    base = Model(ModelConfig(**TINY, mixer="prism", solver_steps=3)).double()
    model = Model(ModelConfig(**TINY, mixer="prism", **{"solver_steps": 3, **over})).double()
    own = model.state_dict()   # share every weight whose name and shape match
    model.load_state_dict({n: p for n, p in base.state_dict().items()
                           if n in own and own[n].shape == p.shape}, strict=False)
    with torch.no_grad():
        for m in (base, model):  # make the solver write large enough to see
            for n, p in m.named_parameters():
                if "_up" in n or "solver_down" in n:
                    p.mul_(10)
    idx = torch.randint(0, TINY["vocab_size"], (2, 33))
    a, b = base(idx)[0], model(idx)[0]
    assert rel(b, a) > 1e-6, over


def test_backends_agree_on_the_model():
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY, mixer="prism", attn_layers=[0])
    model = Model(cfg).double()
    idx = torch.randint(0, TINY["vocab_size"], (2, 50))
    outs = {}
    for backend in ("naive", "chunk"):
        model.backend = backend
        outs[backend] = model(idx)[0]
    assert rel(outs["chunk"], outs["naive"]) <= 1e-10


def test_kernel_options_reach_every_layer():
    """backend and chunk_size travel as the other switches do: the Model's setters write them
    onto every recurrent layer (the mixers take no such forward arguments)."""
    cfg = ModelConfig(**TINY, mixer="prism", attn_layers=[0])
    model = Model(cfg, backend="naive", chunk_size=8)
    recurrent = [b.mixer for b in model.blocks if isinstance(b.mixer, GatedDeltaNet)]
    assert len(recurrent) == 1
    assert all(m.backend == "naive" and m.chunk_size == 8 for m in recurrent)
    model.backend, model.chunk_size = None, 16
    assert all(m.backend is None and m.chunk_size == 16 for m in recurrent)
    assert model.backend == "chunk"   # None resolves per device: the PyTorch chunk backend on CPU
    assert not hasattr(model.blocks[0].mixer, "backend")   # attention has no kernel options
    with pytest.raises(ValueError, match="chunk_size"):
        model.chunk_size = 0


def test_parameter_budget_130m():
    with torch.device("meta"):  # count without allocating
        gdn = Model(ModelConfig(mixer="gdn")).num_params(non_embedding=False)
        prism = Model(ModelConfig(mixer="prism")).num_params(non_embedding=False)
    assert 120e6 <= gdn <= 140e6, gdn
    assert gdn < prism <= 1.10 * gdn, (gdn, prism)


@pytest.mark.parametrize("bad", [dict(mixer="mamba"), dict(solver_keys="x"),
                                 dict(attn_layers=[99]), dict(solver_steps=0),
                                 # attention splits the width into heads (GDN/PRISM alone need not)
                                 dict(n_embd=64, n_head=3, attn_layers=[0]),
                                 dict(mixer="attention", n_embd=64, n_head=3)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        ModelConfig(**bad)


def test_config_rejects_unknown_field():
    with pytest.raises(TypeError):
        ModelConfig(solver_step=3)


def test_token_ids_out_of_vocab_error():
    model = Model(ModelConfig(**TINY))
    with pytest.raises(ValueError, match="token ids"):
        model(torch.tensor([[0, TINY["vocab_size"]]]))


def test_optimizer_groups():
    model = Model(ModelConfig(**TINY, mixer="prism"))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    nd = {names[id(p)].split(".")[-1] for p in no_decay["params"]}
    assert {"A_log", "dt_bias", "weight"} <= nd          # norms' weights are 1-D
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params(False)


def test_legacy_model_args_load_and_unknown_keys_fail():
    """Older checkpoints stored the run-time backend and chunk size with the hyperparameters."""
    cfg = ModelConfig.from_dict({**TINY, "backend": "triton", "chunk_size": 16})
    assert cfg == ModelConfig(**TINY)
    with pytest.raises(ValueError, match="unknown keys"):
        ModelConfig.from_dict({**TINY, "n_layers": 3})
    with pytest.raises(ValueError, match="backend"):
        Model(ModelConfig(**TINY), backend="cuda")


@pytest.mark.parametrize("variant", [dict(), dict(solver_keys="shared", solver_gain=False),
                                     dict(solver_keys="base", solver_mode="linear"),
                                     dict(solver_nonlinear=False, solver_steps=4)])
def test_fused_solver_chain_equals_the_pytorch_chain(variant, monkeypatch):
    """The Triton backend's solver chain (prism_kernel.solver_chain, Model.fused_chain) gives the
    loss and every gradient of model.solver_chain's PyTorch ops, for each solver switch."""
    from model import kernels
    pk, calls = kernels(), []
    fused_chain = pk.solver_chain
    monkeypatch.setattr(pk, "solver_chain", lambda *a, **k: calls.append(1) or fused_chain(*a, **k))
    torch.manual_seed(0)
    model = Model(ModelConfig(**{**TINY, "mixer": "prism", "solver_steps": 3, **variant}), backend="triton")
    idx = torch.randint(0, TINY["vocab_size"], (2, 16))
    runs = []
    for fused in (True, False):
        model.fused_chain = fused
        assert model.fused_chain is fused
        calls.clear()
        model.zero_grad(set_to_none=True)
        loss = model(idx, idx)[1]
        loss.backward()
        # each layer: once forward, once more where the backward reruns the solver write
        assert len(calls) == (2 * TINY["n_layer"] if fused else 0)
        runs.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l1, g1), (l0, g0) = runs
    assert abs(l1 - l0) <= 1e-6 * abs(l0)
    bad = {n: ((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-30)).item() for n in g0}
    assert all(e <= 1e-5 for e in bad.values()), {n: e for n, e in bad.items() if e > 1e-5}


def test_recompute_solver_same_gradients_less_saved():
    """recompute_solver (the default) reruns the solver rows in the backward: the same loss and
    gradients as saving them, with fewer bytes held for the backward."""
    torch.manual_seed(0)
    model = Model(ModelConfig(**TINY, mixer="prism", solver_steps=3)).double()
    idx = torch.randint(0, TINY["vocab_size"], (2, 40))
    runs = {}
    for on in (True, False):
        model.recompute_solver = on
        model.zero_grad(set_to_none=True)
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx, idx)[1]
        loss.backward()
        runs[on] = loss.item(), sum(saved), {n: p.grad.clone() for n, p in model.named_parameters()}
    (l1, b1, g1), (l0, b0, g0) = runs[True], runs[False]
    assert l1 == l0 and all(torch.allclose(g1[n], g0[n], rtol=1e-12, atol=1e-14) for n in g0)
    assert b1 < b0, (b1, b0)
    assert all(b.mixer.recompute is False for b in model.blocks)   # the switch reaches every layer
    model.recompute_solver = True
    model.activation_checkpointing = True   # whole blocks rerun: the solver is not rerun inside them too
    assert all(b.mixer.recompute is False for b in model.blocks)
    model.activation_checkpointing = "mlp"
    assert all(b.mixer.recompute is True for b in model.blocks)


# ------------------------------------------------------------------ on the GPU (pytest -m gpu)

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_chunk_matches_float64_naive(dtype, tol, L):
    B, T, H, K, V = 2, 300, 4, 64, 128
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.float64)
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    v, g = r(B, T, H, V), F.logsigmoid(r(B, T, H) * 2 + 2)
    beta = torch.rand(B, T, H, device="cuda", generator=gen, dtype=torch.float64)
    ke = F.normalize(r(B, T, H, L - 1, K), dim=-1) if L > 1 else None
    ve = 0.3 * r(B, T, H, L - 1, V) if L > 1 else None
    S0 = r(B, H, K, V)
    cast = lambda x: x.to(dtype).requires_grad_() if x is not None else None
    xs = [cast(x) for x in (q, k, v, g, beta, ke, ve)]
    S0c = S0.float().requires_grad_()
    o, s = delta_rule_chunk(*xs, initial_state=S0c, output_final_state=True)
    do, dS = r(B, T, H, V), r(B, H, K, V)
    ((o.double() * do).sum() + (s.double() * dS).sum()).backward()
    # reference: float64 on the same (rounded) inputs
    ref = [x.detach().double().requires_grad_() if x is not None else None for x in xs]
    S0r = S0c.detach().double().requires_grad_()
    o_ref, s_ref = delta_rule_naive(*ref, initial_state=S0r, output_final_state=True)
    ((o_ref * do).sum() + (s_ref * dS).sum()).backward()
    assert torch.isfinite(o).all() and rel(o, o_ref) <= tol and rel(s, s_ref) <= tol
    for a, b in zip(xs + [S0c], ref + [S0r]):
        if a is not None:
            assert rel(a.grad, b.grad) <= tol


@pytest.mark.parametrize("mixer", ["gdn", "prism"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_130m_training_steps_chunk_backend(mixer):
    torch.manual_seed(0)
    model = Model(ModelConfig(mixer=mixer, block_size=2048), backend="chunk").cuda()
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    x = torch.randint(0, 32000, (2, 2049), device="cuda")
    losses = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
