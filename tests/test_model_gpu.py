"""On the GPU (`pytest -m gpu`, run on the H200): the PyTorch chunk backend against the float64
token-by-token recurrence, and full 130M training steps that stay finite."""
import pytest
import torch
import torch.nn.functional as F

from model import Model, ModelConfig, delta_rule_chunk, delta_rule_naive

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("L", [1, 3])
def test_chunk_matches_float64_naive_on_gpu(dtype, tol, L):
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
def test_130m_training_steps_chunk_backend(mixer):
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
