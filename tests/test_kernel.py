"""prism_kernel.py against the float64 token-by-token recurrence (model.delta_rule_naive).

CPU (CI): the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set below before
triton is imported) at tiny shapes. GPU (`pytest -m gpu`, H200): fresh random inputs every run,
every buffer the kernels allocate poisoned with NaN, relative Frobenius error <= 1e-4 (float32)
and <= 1e-2 (bf16) for the output, the final state and every gradient, L = 1..4,
T in {100, 2048, 8191}; L = 1 forward against flash-linear-attention when it is importable.
Run `python bench/bench_kernel.py --warm` first: it compiles every variant these tests use in
parallel processes (about 45 s on the H200 instead of several minutes one after another).
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import prism_kernel  # noqa: E402
from prism_kernel import chunk_prism, recurrent_prism_step  # noqa: E402
from model import delta_rule_naive, delta_rule_chunk  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dke", "dve", "dh0"]


def make_inputs(B, T, H, K, V, L, device, g_range=(-3.0, 0.0), gen=None, h0=True):
    """Fresh random float32 inputs on `device`: unit q, k, ke; log-decays in g_range."""
    r = lambda *s: torch.randn(*s, generator=gen).to(device)
    u = lambda *s: torch.rand(*s, generator=gen).to(device)
    q = F.normalize(r(B, T, H, K), dim=-1)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    lo, hi = g_range
    g = lo + (hi - lo) * u(B, T, H)
    beta = u(B, T, H)
    ke = F.normalize(r(B, T, H, L - 1, K), dim=-1) if L > 1 else None
    ve = 0.5 * r(B, T, H, L - 1, V) if L > 1 else None
    s0 = r(B, H, K, V) * 0.5 if h0 else None
    return [q, k, v, g, beta, ke, ve, s0]


def run_with_grads(fn, xs, dtype, gen_seed):
    """Forward + backward of fn on copies of xs cast to dtype (g and the state stay float32
    unless dtype is float64). Upstream gradients are fixed random tensors (seeded)."""
    cast = []
    for i, x in enumerate(xs):
        if x is None:
            cast.append(None)
            continue
        keep32 = i in (3, 7) and dtype != torch.float64  # g, initial state
        cast.append(x.to(torch.float32 if keep32 else dtype).detach().requires_grad_())
    q, k, v, g, beta, ke, ve, s0 = cast
    o, ht = fn(q, k, v, g, beta, ke, ve, initial_state=s0, output_final_state=True)
    gen = torch.Generator().manual_seed(gen_seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(o.device)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    return [o, ht] + [x.grad if x is not None else None for x in cast]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def compare(out, ref, tol, tag=""):
    errs = {}
    for name, a, b in zip(NAMES, out, ref):
        if b is None:
            assert a is None, f"{tag} {name}: expected no gradient"
            continue
        assert a is not None, f"{tag} {name}: missing"
        assert torch.isfinite(a).all(), f"{tag} {name}: non-finite values (unwritten or overflow)"
        errs[name] = rel_err(a, b)
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{tag} rel. Frobenius error over {tol}: {bad} (all: {errs})"
    return errs


def check_against_naive(B, T, H, K, V, L, dtype, tol, device=DEV, h0=True, g_range=(-3.0, 0.0), seed=None,
                        reference=delta_rule_naive):
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    xs = make_inputs(B, T, H, K, V, L, device, g_range=g_range, gen=gen, h0=h0)
    # the reference sees exactly the values the kernel sees (inputs rounded to dtype first)
    xr = [None if x is None else (x if i in (3, 7) else x.to(dtype)) for i, x in enumerate(xs)]
    ref = run_with_grads(reference, xr, torch.float64, 1)
    out = run_with_grads(chunk_prism, xr, dtype, 1)
    return compare(out, ref, tol, tag=f"B={B} T={T} H={H} K={K} V={V} L={L} {dtype}")


# ---------------------------------------------------------------------------------------------
# CI: interpreter on CPU (on a GPU machine these run compiled, at the same tiny shapes)

@pytest.mark.parametrize("T,H,K,V,L,h0", [
    (20, 1, 16, 32, 1, False),   # one partial chunk, GDN
    (64, 2, 16, 16, 2, True),    # exactly one chunk
    (70, 2, 32, 16, 3, True),    # T not a multiple of the chunk
    (130, 1, 16, 32, 4, True),   # three chunks, last one partial
])
def test_tiny_float32_vs_naive(T, H, K, V, L, h0):
    check_against_naive(1, T, H, K, V, L, torch.float32, 1e-4, h0=h0, seed=1234 + T)


def test_tiny_bf16_vs_naive():
    check_against_naive(2, 70, 1, 16, 16, 2, torch.bfloat16, 2e-2, seed=7)


def test_extreme_decays_stay_finite():
    # decays near 0 (g = -40 per token: exp(sum) underflows) and near 1 (g ~ -1e-6), mixed
    gen = torch.Generator().manual_seed(3)
    for g_range in [(-40.0, -20.0), (-1e-6, 0.0)]:
        xs = make_inputs(1, 130, 1, 16, 16, 2, DEV, g_range=g_range, gen=gen)
        ref = run_with_grads(delta_rule_naive, xs, torch.float64, 2)
        out = run_with_grads(chunk_prism, xs, torch.float32, 2)
        compare(out, ref, 1e-4, tag=f"g in {g_range}")


def test_matches_chunk_backend_and_defaults():
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta, ke, ve, _ = make_inputs(1, 70, 2, 16, 16, 3, DEV, gen=gen, h0=False)
    o, st = chunk_prism(q, k, v, g, beta, ke, ve)
    assert st is None
    o_ref, _ = delta_rule_chunk(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                ke.double(), ve.double())
    assert rel_err(o, o_ref) < 1e-4
    # ke with zero extra rows is GDN; an explicit scale is honoured
    o1, _ = chunk_prism(q, k, v, g, beta, ke[..., :0, :], ve[..., :0, :], scale=0.3)
    o2, _ = delta_rule_naive(q.double(), k.double(), v.double(), g.double(), beta.double(), scale=0.3)
    assert rel_err(o1, o2) < 1e-4


def test_recurrent_step_continues_chunk():
    # prefill with the kernel, then decode token by token: same outputs as one naive pass
    gen = torch.Generator().manual_seed(11)
    T0, T1 = 40, 5
    xs = make_inputs(1, T0 + T1, 2, 16, 16, 3, DEV, gen=gen, h0=False)
    q, k, v, g, beta, ke, ve, _ = xs
    o_ref, s_ref = delta_rule_naive(*(x.double() for x in xs[:7]), output_final_state=True)
    _, S = chunk_prism(*(x[:, :T0] for x in xs[:7]), output_final_state=True)
    for t in range(T0, T0 + T1):
        o_t, S = recurrent_prism_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], ke[:, t], ve[:, t],
                                      state=S)
        assert rel_err(o_t, o_ref[:, t]) < 1e-5
    assert rel_err(S, s_ref) < 1e-5
    o4, S4 = recurrent_prism_step(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1])
    assert o4.shape == (1, 1, 2, 16) and S4.shape == (1, 2, 16, 16)


def test_bad_inputs_raise():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta, ke, ve, _ = make_inputs(1, 8, 1, 16, 16, 2, DEV, gen=gen, h0=False)
    with pytest.raises(ValueError, match="ke must be"):
        chunk_prism(q, k, v, g, beta, ke[..., :8], ve)
    with pytest.raises(ValueError, match="together"):
        chunk_prism(q, k, v, g, beta, ke, None)
    with pytest.raises(ValueError, match="g must be"):
        chunk_prism(q, k, v, g[:, :4], beta)
    with pytest.raises(ValueError, match="float64"):
        chunk_prism(q.double(), k.double(), v.double(), g, beta)
    # mixed dtypes are promoted (here to float32) and the output keeps v's dtype
    o, _ = chunk_prism(q.bfloat16(), k, v, g, beta)
    assert o.dtype == torch.float32 and torch.isfinite(o).all()
    with pytest.raises(ValueError, match="initial_state"):
        chunk_prism(q, k, v, g, beta, initial_state=torch.zeros(1, 1, 16, 8, device=DEV))


# ---------------------------------------------------------------------------------------------
# GPU (H200): fresh inputs every run, buffers poisoned with NaN

gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(prism_kernel, "POISON", True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [100, 2048, 8191])
@pytest.mark.parametrize("L", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,tol,D", [(torch.float32, 1e-4, 64), (torch.bfloat16, 1e-2, 128)])
def test_gpu_vs_naive(poisoned, T, L, dtype, tol, D):
    # the token loop costs ~4 ms a token (forward + backward, float64, launch-bound): up to
    # T = 2048 the reference is delta_rule_naive itself; at T = 8191 it is delta_rule_chunk in
    # float64 (checked against the naive loop in tests/test_model.py and by the T <= 2048 cases)
    ref = delta_rule_naive if T <= 2048 else delta_rule_chunk
    errs = check_against_naive(2, T, 2, D, D, L, dtype, tol, reference=ref)
    print(f"\nT={T} L={L} {dtype}: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("K,V,dtype,tol", [(128, 256, torch.bfloat16, 1e-2), (256, 256, torch.bfloat16, 1e-2)])
def test_gpu_head_dims(poisoned, K, V, dtype, tol):
    errs = check_against_naive(1, 300, 2, K, V, 3, dtype, tol)
    print(f"\nK={K} V={V} {dtype}: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("g_range", [(-30.0, -10.0), (-1e-4, 0.0)])
def test_gpu_long_sequence_extreme_decay(poisoned, g_range):
    # T = 65536: no NaN/Inf, and the chunk backend in float64 agrees
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    xs = make_inputs(1, 65536, 1, 64, 64, 3, "cuda", g_range=g_range, gen=gen)
    ref = run_with_grads(delta_rule_chunk, xs, torch.float64, 3)
    out = run_with_grads(chunk_prism, xs, torch.float32, 3)
    errs = compare(out, ref, 1e-4, tag=f"T=65536 g in {g_range}")
    print(f"\nT=65536 g in {g_range}: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2)])
def test_gpu_gdn_matches_fla(poisoned, dtype, tol):
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, g, beta, _, _, s0 = make_inputs(2, 1000, 4, 128, 128, 1, "cuda", gen=gen)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    o, st = chunk_prism(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o_f, st_f = fla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    e_o, e_s = rel_err(o, o_f), rel_err(st, st_f)
    print(f"\nvs fla {dtype}: o={e_o:.1e} state={e_s:.1e}")
    assert e_o < tol and e_s < tol


@pytest.mark.parametrize("mixer", ["gdn", "prism"])
def test_model_triton_backend_matches_chunk(mixer):
    """The model's triton path (what CUDA uses by default) against its chunk path: logits and
    every parameter gradient, through the layers' real q/k/v/g/beta/ke/ve."""
    from model import Model, ModelConfig
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, block_size=80, n_layer=1, n_head=2, n_embd=32, head_dim=16,
                      expand_v=1.0, mixer=mixer, solver_steps=3, solver_rank=8)
    model = Model(cfg).to(DEV)
    idx = torch.randint(0, 50, (1, 70), device=DEV)
    grads = {}
    for backend in ("chunk", "triton"):
        model.backend = backend
        model.zero_grad()
        logits, loss = model(idx, idx, return_logits=True)
        loss.backward()
        grads[backend] = (logits.detach(), [p.grad.clone() for p in model.parameters()])
    assert rel_err(grads["triton"][0], grads["chunk"][0]) < 1e-4
    for a, b in zip(grads["triton"][1], grads["chunk"][1]):
        assert rel_err(a, b) < 1e-3


# ---------------------------------------------------------------------------------------------
# the short causal conv (+ SiLU) kernel, against F.conv1d in float64

def conv_reference(x, w, silu):
    W = w.shape[1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), w[:, None, :], groups=x.shape[2]).transpose(1, 2)
    return F.silu(y) if silu else y


def check_conv(B, T, C, W, silu, dtype, tol, device=DEV):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(B, T, C, generator=gen).to(device, dtype)
    w = (torch.randn(C, W, generator=gen) / W ** 0.5).to(device)
    dy = torch.randn(B, T, C, generator=gen, dtype=torch.float64).to(device)
    outs = []
    for fn, cast in ((conv_reference, torch.float64), (prism_kernel.causal_conv, None)):
        xi = x.to(cast or dtype).detach().requires_grad_()
        wi = w.to(cast or torch.float32).detach().requires_grad_()
        y = fn(xi, wi, silu)
        (y.double() * dy).sum().backward()
        outs.append((y, xi.grad, wi.grad))
    for name, a, b in zip(("y", "dx", "dw"), outs[1], outs[0]):
        assert a.dtype == (dtype if name != "dw" else torch.float32)
        assert torch.isfinite(a).all(), f"conv {name}: non-finite (unwritten?)"
        e = rel_err(a, b)
        assert e <= tol, f"conv B={B} T={T} C={C} W={W} silu={silu} {dtype} {name}: rel err {e:.1e}"


@pytest.mark.parametrize("T,C,W,silu", [(37, 10, 4, True), (5, 3, 4, False), (70, 130, 3, True)])
def test_causal_conv_vs_conv1d(T, C, W, silu):
    check_conv(2, T, C, W, silu, torch.float32, 1e-5)


def test_causal_conv_in_model_matches_torch_path():
    from model import ShortConv
    torch.manual_seed(0)
    conv = ShortConv(12, 4).to(DEV)
    x = torch.randn(2, 33, 12, device=DEV)
    assert rel_err(conv(x, fused=True), conv(x)) < 1e-6
    buf = torch.randn(2, 3, 12, device=DEV)  # a cache's last inputs: conv_step continues from them
    ref = buf.clone()
    assert rel_err(conv(x, buf, fused=True), conv(x, ref)) < 1e-6 and torch.equal(buf, ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_gpu_causal_conv(poisoned, dtype, tol):
    check_conv(3, 2500, 3072, 4, True, dtype, tol)
    check_conv(1, 100, 768, 4, False, dtype, tol)
