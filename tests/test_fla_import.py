"""fla_import.py and upcycling: flash-linear-attention's GatedDeltaNetForCausalLM directories read
as model.py GDN models (CPU: every tensor, the parameter count, and the logits of fla's own layer
wiring with its GPU kernels swapped for PyTorch references; GPU: fla's real forward), and GDN
weights started as PRISM (train.py --init_from) with the solver writes zero at step 0."""
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import checkpoint
import train
from checkpoint import load_model, upcycle_state
from model import Model, ModelConfig
from test_train import make_dataset

ROOT = Path(__file__).resolve().parent.parent
TINY_FLA = dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16, expand_v=2.0,
                vocab_size=96, conv_size=4)


def fla_models():
    # imported here: fla takes ~10 s to import and warns that Triton has no driver on a CPU
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    return GatedDeltaNetConfig, GatedDeltaNetForCausalLM


def save_fla(path, seed=0, **overrides):
    """A randomly initialised fla GatedDeltaNetForCausalLM, saved with save_pretrained."""
    Config, ForCausalLM = fla_models()
    torch.manual_seed(seed)
    m = ForCausalLM(Config(**{**TINY_FLA, **overrides})).eval()
    with torch.no_grad():  # fla's init leaves norms at 1: make every tensor tell its place
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    m.save_pretrained(path)
    return m


@pytest.fixture(scope="module")
def fla_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fla") / "gdn"
    return d, save_fla(d)


@pytest.fixture
def fla_torch_ops(monkeypatch):
    """fla's model on the CPU: its Triton ops (short conv, gated delta rule, gated output norm,
    SwiGLU) replaced by PyTorch; the recurrence by fla's own reference,
    naive_recurrent_gated_delta_rule. Everything else (which projection feeds what, the block's
    residuals and norms) is fla's code. Models must be built with fuse_norm=False (the block
    norms are then nn.RMSNorm) and called with use_cache=False."""
    fla_models()
    import fla.layers.gated_deltanet as layer
    import fla.modules.mlp as mlp
    from fla.modules import FusedRMSNormGated
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    def conv(x, weight, bias=None, activation=None, **kw):  # x [B,T,C], weight [C,W]
        w = weight.shape[-1]
        y = F.conv1d(F.pad(x.transpose(1, 2), (w - 1, 0)), weight[:, None], bias, groups=weight.shape[0])
        return F.silu(y).transpose(1, 2), None

    def rule(q, k, v, g, beta, A_log, dt_bias, initial_state=None, output_final_state=False, **kw):
        assert kw["use_qk_l2norm_in_kernel"] and kw["use_gate_in_kernel"] and kw["use_beta_sigmoid_in_kernel"]
        decay = -A_log.float().exp() * F.softplus(g.float() + dt_bias)
        return naive_recurrent_gated_delta_rule(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, beta.sigmoid(),
                                                decay, initial_state=initial_state,
                                                output_final_state=output_final_state)

    monkeypatch.setattr(layer, "causal_conv1d", conv)
    monkeypatch.setattr(layer, "chunk_gated_delta_rule", rule)
    monkeypatch.setattr(layer, "fused_recurrent_gated_delta_rule", rule)
    monkeypatch.setattr(mlp, "swiglu", lambda a, b: F.silu(a) * b)
    monkeypatch.setattr(FusedRMSNormGated, "forward", lambda self, x, g, **kw:
                        F.rms_norm(x, (x.shape[-1],), self.weight, self.eps) * F.silu(g))


def fla_logits(m, idx):
    with torch.no_grad():
        return m(idx, use_cache=False).logits.float()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ----------------------------------------------------------------------------------------------
# import

def test_every_fla_tensor_lands_unchanged(fla_dir):
    path, fla = fla_dir
    model, meta = load_model(str(path), backend="chunk")
    cfg = model.config
    assert (cfg.mixer, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.value_dim) == ("gdn", 2, 64, 2, 16, 32)
    assert not cfg.tie_embeddings and meta["imported_from"]["format"] == "fla GatedDeltaNetForCausalLM"
    theirs = dict(fla.named_parameters())
    assert model.num_params(non_embedding=False) == sum(p.numel() for p in theirs.values())
    ours = dict(model.named_parameters())
    used = set()

    def same(our_name, fla_name, ours_t=None):
        t = ours[our_name] if ours_t is None else ours_t
        assert torch.equal(t, theirs[fla_name].detach()), (our_name, fla_name)
        used.add(fla_name)

    same("wte.weight", "model.embeddings.weight")
    same("lm_head.weight", "lm_head.weight")
    same("norm_f.weight", "model.norm.weight")
    for i in range(cfg.n_layer):
        f, o = f"model.layers.{i}.", f"blocks.{i}."
        same(o + "norm1.weight", f + "attn_norm.weight")
        same(o + "norm2.weight", f + "mlp_norm.weight")
        for p in "qkvabgo":
            same(o + f"mixer.{p}_proj.weight", f + f"attn.{p}_proj.weight")
        for p in ("A_log", "dt_bias", "o_norm.weight"):
            same(o + f"mixer.{p}", f + f"attn.{p}")
        for p, q in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down")):
            same(o + f"mlp.{q}.weight", f + f"mlp.{p}_proj.weight")
        conv = ours[o + "mixer.conv.weight"]
        for p, part in zip("qkv", conv.split([32, 32, 64])):  # channels q | k | v
            same(None, f + f"attn.{p}_conv1d.weight", part[:, None])
    assert used == set(theirs)
    logits, _ = model(torch.randint(0, cfg.vocab_size, (2, 11)))
    assert logits.shape == (2, 11, 96) and torch.isfinite(logits).all()


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_logits_equal_fla_layer_wiring(tmp_path, fla_torch_ops, backend):
    """fla's modules (kernels swapped for PyTorch, see fla_torch_ops) and the imported model give
    the same logits: an fp32 rounding difference, nothing more. Tied embeddings and an explicit
    MLP width too."""
    for name, extra in (("untied", {}), ("tied", dict(tie_word_embeddings=True, intermediate_size=160))):
        d = tmp_path / name
        fla = save_fla(d, seed=3, fuse_norm=False, fuse_swiglu=False, **extra)
        model, _ = load_model(str(d), backend=backend)
        model.chunk_size = 8
        assert model.num_params(non_embedding=False) == sum(p.numel() for p in fla.parameters())
        idx = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(1))
        want = fla_logits(fla, idx)
        with torch.no_grad():
            got = model(idx)[0]
        assert rel(got, want) < 2e-6, (name, rel(got, want))


def test_fla_at_a_width_its_heads_do_not_divide(tmp_path, fla_torch_ops):
    """fla's 340M and 1.3B GDNs have 6 heads at widths 1024 and 2048: no attention, so no need to
    divide the width."""
    d = tmp_path / "six"
    fla = save_fla(d, hidden_size=64, num_heads=3, head_dim=16, fuse_norm=False, fuse_swiglu=False)
    model, _ = load_model(str(d), backend="chunk")
    idx = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        assert rel(model(idx)[0], fla_logits(fla, idx)) < 2e-6


def _edit_config(src, dst, **changes):
    import shutil
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("key,value", [
    ("use_short_conv", False), ("use_gate", False), ("allow_neg_eigval", True), ("num_v_heads", 4),
    ("attn", {"layers": [1], "num_heads": 4}), ("output_gate_activation", "sigmoid"), ("hidden_act", "powlu"),
    ("attnres_block_size", 2),
])
def test_unsupported_fla_config_is_named(fla_dir, tmp_path, key, value):
    d = _edit_config(fla_dir[0], tmp_path / "bad", **{key: value})
    with pytest.raises(ValueError) as e:
        load_model(str(d))
    assert key in str(e.value) and repr(value) in str(e.value) and "config.json" in str(e.value)


def test_leftover_and_missing_tensors_are_named(fla_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    src = fla_dir[0]
    state = load_file(src / "model.safetensors")
    for name, edit in (("extra", lambda s: {**s, "model.layers.0.attn.q_conv1d.bias": torch.zeros(32)}),
                       ("missing", lambda s: {k: v for k, v in s.items() if k != "model.layers.1.attn.dt_bias"})):
        d = _edit_config(src, tmp_path / name)
        save_file(edit(state), d / "model.safetensors")
        with pytest.raises(ValueError, match="q_conv1d.bias" if name == "extra" else "layers.1.attn.dt_bias"):
            load_model(str(d))


def test_other_model_type_is_not_taken_for_fla(fla_dir, tmp_path):
    d = _edit_config(fla_dir[0], tmp_path / "gla", model_type="gla")
    with pytest.raises(ValueError, match="model_type is 'gla'"):
        load_model(str(d))



def test_sharded_truncated_and_missing_weights(fla_dir, tmp_path):
    """Shards listed in model.safetensors.index.json load as one file does; a truncated file and a
    missing one are named, a missing one with what to do when the directory has pytorch_model.bin."""
    from safetensors.torch import load_file, save_file
    src = fla_dir[0]
    whole, _ = load_model(str(src), backend="chunk")
    state = load_file(src / "model.safetensors")
    d = _edit_config(src, tmp_path / "sharded")
    os.remove(d / "model.safetensors")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ks in shards.items():
        save_file({k: state[k] for k in ks}, d / f)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    model, _ = load_model(str(d), backend="chunk")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), whole.state_dict().values()))
    second = d / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors: .*corrupt or truncated"):
        load_model(str(d))
    os.remove(second)
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors not found: the fla checkpoint"):
        load_model(str(d))
    (d / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin: .*safe_serialization=True"):
        load_model(str(d))


def _word_tokenizer(d, vocab=96):
    """A tokenizer.json (word level: w0 .. w95, </s> at 2) and the tokenizer_config.json naming its
    EOS, as transformers saves them beside an fla model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    words = {f"w{i}": i for i in range(vocab)}
    words["</s>"] = 2
    del words["w2"]
    tk = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "w1"}))


def test_sample_py_uses_the_fla_directorys_tokenizer(fla_dir, tmp_path, capsys):
    import sample
    d = _edit_config(fla_dir[0], tmp_path / "with_tok")
    _word_tokenizer(d)
    from tokenizer import load_tokenizer
    tok = load_tokenizer(str(d / "tokenizer.json"))
    assert (tok.eos_id, tok.bos_id, tok.vocab_size) == (2, 1, 96) and tok.encode("w5 w7") == [5, 7]
    sample.main(["--ckpt", str(d), "--start", "w5 w7", "--max_new_tokens", "6", "--num_samples", "1",
                 "--temperature", "0", "--device", "cpu"])
    text = capsys.readouterr().out.splitlines()[1]
    model, _ = load_model(str(d))
    ids = model.generate(torch.tensor([[2, 5, 7]]), 6, temperature=0)[0, 1:].tolist()
    if 2 in ids[2:]:
        ids = ids[:ids.index(2, 2)]
    assert text == tok.decode(ids) and text.startswith("w5 w7")


def test_export_hf_from_fla(tmp_path):
    """export_hf.py --from_fla: the directory's tokenizer.model, the export checked through
    transformers (logits equal the imported model's) and loaded back unchanged."""
    import shutil
    import export_hf
    from tokenizer import load_tokenizer
    try:
        sp = load_tokenizer()
    except Exception as e:
        pytest.skip(f"no SentencePiece tokenizer offline ({e})")
    d = tmp_path / "fla"
    save_fla(d, vocab_size=32000)
    with pytest.raises(ValueError, match="has no tokenizer.model"):
        export_hf.main(["--from_fla", str(d), "--out", str(tmp_path / "x")])
    shutil.copyfile(sp.path, d / "tokenizer.model")
    export_hf.main(["--from_fla", str(d), "--out", str(tmp_path / "hf")])
    ours, _ = load_model(str(d))
    back, meta = load_model(str(tmp_path / "hf"))
    assert meta["model_args"]["mixer"] == "gdn"
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert export_hf.exported_tokenizer(str(tmp_path / "hf")) == str(tmp_path / "hf" / "tokenizer.model")

# ----------------------------------------------------------------------------------------------
# upcycling

PRISM = dict(mixer="prism", solver_steps=3, solver_rank=8)


def upcycled(gdn, **prism):
    torch.manual_seed(5)
    cfg = ModelConfig(**{**gdn.config.__dict__, **PRISM, **prism})
    model = Model(cfg, backend=gdn.backend, chunk_size=gdn.chunk_size)
    checkpoint.check_upcycle_args(cfg.__dict__)
    state, new = upcycle_state(model.state_dict(), gdn.state_dict())
    model.load_state_dict(state)
    return model, new


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_upcycled_prism_starts_at_the_gdns_logits_and_learns(fla_dir, backend):
    gdn, _ = load_model(str(fla_dir[0]), backend=backend)
    gdn.chunk_size = 8
    prism, new = upcycled(gdn)
    assert new and all(".mixer." in k for k in new)
    for k, v in gdn.state_dict().items():
        assert torch.equal(prism.state_dict()[k], v), k
    idx = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = gdn(idx)[0], prism(idx)[0]
    assert rel(got, want) < 1e-6, rel(got, want)
    # one step: the zeroed gain gets a gradient at once; after it, every solver tensor has one
    prism.train()
    opt = torch.optim.AdamW(prism.parameters(), lr=1e-2, weight_decay=0.0)
    solver = {k: p for k, p in prism.named_parameters() if k in new}
    before = {k: p.detach().clone() for k, p in solver.items()}
    targets = torch.roll(idx, -1, 1)
    _, loss = prism(idx, targets)
    loss.backward()
    gains = [k for k in solver if ".gain_up." in k]
    assert gains and all(solver[k].grad.abs().max() > 0 for k in gains)
    opt.step()
    opt.zero_grad()
    assert all(not torch.equal(solver[k], before[k]) for k in gains)
    _, loss = prism(idx, targets)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in solver.values()), \
        [k for k, p in solver.items() if p.grad is None or p.grad.abs().max() == 0]


@pytest.mark.parametrize("change,needs", [(dict(solver_gain=False), "solver_gain"),
                                          (dict(solver_mode="linear"), "solver_mode"),
                                          (dict(solver_steps=1), "solver_steps")])
def test_upcycling_refuses_a_prism_whose_write_cannot_start_at_zero(change, needs):
    args = {**ModelConfig(**PRISM).__dict__, **change}
    with pytest.raises(ValueError, match=needs):
        checkpoint.check_upcycle_args(args)


def test_upcycle_names_tensors_that_do_not_fit(fla_dir):
    gdn, _ = load_model(str(fla_dir[0]))
    state = {**gdn.state_dict(), "blocks.0.mixer.extra": torch.zeros(3)}
    prism = Model(ModelConfig(**{**gdn.config.__dict__, **PRISM}))
    with pytest.raises(ValueError, match="blocks.0.mixer.extra"):
        upcycle_state(prism.state_dict(), state)


def _train_args(data, out, *extra):
    return ["--device=cpu", "--dtype=float32", f"--data_dir={data}", "--dataset=pat", f"--out_dir={out}",
            "--block_size=24", "--batch_size=2", "--gradient_accumulation_steps=1", "--eval_iters=1",
            "--log_interval=1", "--warmup_iters=0", "--learning_rate=1e-2", "--chunk_size=8",
            "--seed=3", "--cpu_threads=1", *extra]


def test_train_upcycles_an_fla_gdn_into_prism(fla_dir, tmp_path, capsys):
    """train.py --mixer=prism --init_from=<fla dir>: the GDN's architecture, the config's PRISM
    keys; the log says so; the first val loss is the GDN's; the run trains and its checkpoint is
    a PRISM that load_model reads."""
    data = make_dataset(tmp_path / "data", vocab=96)
    out = tmp_path / "up"
    argv = _train_args(data, out, f"--init_from={fla_dir[0]}", "--mixer=prism", "--solver_steps=3",
                       "--solver_rank=8", "--n_layer=5", "--max_iters=2", "--eval_interval=2")
    assert train.main(argv) == 0
    log = capsys.readouterr().out
    assert f"upcycling the GDN {fla_dir[0]} into PRISM (solver_steps=3, solver_rank=8)" in log
    assert "n_layer=2 (config had 5)" in log and "solver tensors new; gain_up = 0" in log
    recs = [json.loads(x) for x in open(out / "log.jsonl")]
    val0 = next(r["val_loss"] for r in recs if r.get("iter") == 0 and "val_loss" in r)
    # the GDN's own val loss on the same windows, through the same evaluate()
    gdn_out = tmp_path / "gdn"
    assert train.main(_train_args(data, gdn_out, f"--init_from={fla_dir[0]}", "--mixer=gdn",
                                  "--max_iters=1", "--eval_interval=1", "--save_checkpoints=False")) == 0
    capsys.readouterr()
    gdn_val0 = next(json.loads(x)["val_loss"] for x in open(gdn_out / "log.jsonl") if '"val_loss"' in x)
    assert abs(val0 - gdn_val0) < 1e-6, (val0, gdn_val0)
    model, meta = load_model(str(out / "ckpt.pt"))
    assert model.config.mixer == "prism" and model.config.n_layer == 2 and meta["iter_num"] == 2
    gain = model.blocks[0].mixer.gain_up[0].weight
    assert gain.abs().max() > 0  # learnt away from its zero start


def test_train_refuses_an_upcycle_that_cannot_start_at_zero(fla_dir, tmp_path, capsys):
    data = make_dataset(tmp_path / "data", vocab=96)
    argv = _train_args(data, tmp_path / "x", f"--init_from={fla_dir[0]}", "--mixer=prism", "--solver_gain=False")
    assert train.main(argv) == 2
    assert "solver_gain=False (upcycling needs True)" in capsys.readouterr().err



GDN_ARGS = ["--mixer=gdn", "--n_layer=2", "--n_embd=32", "--n_head=2", "--head_dim=16", "--vocab_size=96"]


def _losses(out):
    recs = [json.loads(x) for x in open(Path(out) / "log.jsonl")]
    return ({r["iter"]: r["loss"] for r in recs if "loss" in r},
            {r["iter"]: r["val_loss"] for r in recs if "val_loss" in r})


def test_init_continue_carries_on_a_gdn_run_as_gdn_and_as_upcycled_prism(tmp_path, capsys):
    """A GDN run stopped half way and continued with --init_continue=True is the uninterrupted run
    (same losses: iteration, data position and AdamW state carried); continued as PRISM it starts
    at the GDN's val loss, says what it did, and carries the AdamW state of every GDN tensor."""
    data = make_dataset(tmp_path / "data", vocab=96)
    common = GDN_ARGS + ["--lr_decay_iters=6", "--eval_interval=3"]
    assert train.main(_train_args(data, tmp_path / "full", *common, "--max_iters=6")) == 0
    assert train.main(_train_args(data, tmp_path / "half", *common, "--max_iters=3")) == 0
    half = tmp_path / "half" / "ckpt.pt"
    capsys.readouterr()
    assert train.main(_train_args(data, tmp_path / "gdn", *common, "--max_iters=6", f"--init_from={half}",
                                  "--init_continue=True")) == 0
    assert "continuing the run of" in capsys.readouterr().out
    full, full_val = _losses(tmp_path / "full")
    cont, cont_val = _losses(tmp_path / "gdn")
    assert sorted(cont) == [4, 5, 6] and all(cont[i] == full[i] for i in cont), (cont, full)
    assert cont_val[6] == full_val[6]
    argv = _train_args(data, tmp_path / "prism", *common, "--max_iters=6", f"--init_from={half}",
                       "--init_continue=True", "--mixer=prism", "--solver_steps=3", "--solver_rank=8")
    assert train.main(argv) == 0
    log = capsys.readouterr().out
    assert f"upcycling the GDN {half} (iter 3) into PRISM" in log
    n_gdn = len(list(Model(ModelConfig(**{**ModelConfig().__dict__, "mixer": "gdn", "n_layer": 2, "n_embd": 32,
                                          "n_head": 2, "head_dim": 16, "vocab_size": 96})).parameters()))
    assert f"at iter 3 (data position 6); AdamW state carried for {n_gdn} of" in log
    up, up_val = _losses(tmp_path / "prism")
    assert sorted(up) == [4, 5, 6] and abs(up_val[3] - full_val[3]) < 1e-6, (up_val, full_val)
    # the first step's loss is the GDN's weights' (the solver writes are zero); after its update not
    assert abs(up[4] - full[4]) < 1e-6 and up[5] != full[5] and up[6] != full[6]
    assert train.main(_train_args(data, tmp_path / "bad", *GDN_ARGS, "--init_continue=True")) == 2
    assert "init_continue" in capsys.readouterr().err

# ----------------------------------------------------------------------------------------------
# GPU: fla's own forward (its Triton kernels)

def _fla_on_gpu(path, dtype):
    from transformers import AutoModelForCausalLM
    fla_models()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["small", "340M"])
def test_logits_equal_fla_forward_on_gpu(tmp_path, shape):
    """fp32 with TF32 off: 1e-4 relative; bf16: 1e-2. Greedy decoding: the same tokens."""
    sizes = {"small": {}, "340M": dict(hidden_size=1024, num_hidden_layers=21, num_heads=6, head_dim=256,
                                        vocab_size=32000)}[shape]
    d = tmp_path / shape
    save_fla(d, **sizes)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    V = sizes.get("vocab_size", 96)
    idx = torch.randint(0, V, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    ours, _ = load_model(str(d), "cuda")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        fla = _fla_on_gpu(str(d), dtype)
        model = ours.to(dtype)
        with torch.no_grad():
            want = fla(idx, use_cache=False).logits.float()
            got = model(idx)[0].float()
        assert rel(got, want) < tol, (shape, dtype, rel(got, want))
        if dtype == torch.float32:
            prompt = idx[:1, :40]
            theirs = fla.generate(prompt, max_new_tokens=16, do_sample=False)
            mine = model.generate(prompt, 16, temperature=0, graph=False)
            assert torch.equal(mine, theirs[:, :mine.shape[1]]), (mine, theirs)
        del fla
    torch.backends.cuda.matmul.allow_tf32 = True
