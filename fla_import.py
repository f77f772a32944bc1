"""
flash-linear-attention's Gated DeltaNet checkpoints (GatedDeltaNetForCausalLM, model_type
"gated_deltanet", as fla's save_pretrained writes them) read as model.py GDN models.

    from checkpoint import load_model
    model, meta = load_model("path/to/fla_dir")          # recognises the directory

read_fla(path) is what load_model calls: config.json -> ModelConfig (mixer "gdn"), and every
safetensors tensor renamed into model.py's names. Both models compute the same function:

  fla                                           model.py
  model.embeddings                              wte
  layers.i.attn_norm / mlp_norm                 blocks.i.norm1 / norm2
  layers.i.attn.{q,k,v,a,b,g,o}_proj            blocks.i.mixer.{q,k,v,a,b,g,o}_proj
  layers.i.attn.{q,k,v}_conv1d  [C,1,W] each    blocks.i.mixer.conv  [Cq+Ck+Cv, W], channels q|k|v
  layers.i.attn.A_log, dt_bias, o_norm          blocks.i.mixer.A_log, dt_bias, o_norm
  layers.i.mlp.{gate,up,down}_proj              blocks.i.mlp.w_{gate,up,down}
  model.norm, lm_head                           norm_f, lm_head (absent when tied)

Configs that compute something model.py does not are refused by name (UNSUPPORTED), and any
tensor left over or missing after the renaming is named in the error. Needs safetensors only:
neither fla nor transformers is imported.
"""
import os

from pretrained_dir import config_model_type, read_config, read_weights

FLA_MODEL_TYPE = "gated_deltanet"

# fla config key -> (the value model.py computes, what that value means): anything else is refused
UNSUPPORTED = {
    "attn": (None, "hybrid models with fla softmax-attention layers"),
    "use_short_conv": (True, "GDN without its short convolutions"),
    "use_gate": (True, "GDN without the output gate (o_norm then is a plain RMSNorm)"),
    "allow_neg_eigval": (False, "beta in (0, 2) (negative eigenvalues)"),
    "num_v_heads": (None, "grouped value heads (num_v_heads != num_heads)"),
    "hidden_act": ("swish", "an MLP activation other than SwiGLU"),
    "attnres_block_size": (None, "attention residuals between blocks"),
    "norm_first": (False, "an extra input norm inside the mixer"),
    "conv_bias": (False, "biases on the short convolutions"),
}
GATE_ACTIVATIONS = ("swish", "silu")  # output_gate_activation; "sigmoid" is refused


def _fail(path, why):
    raise ValueError(f"{path}: {why}")


def is_fla_dir(path):
    """True when `path` is a directory whose config.json says model_type "gated_deltanet"."""
    return config_model_type(path) == FLA_MODEL_TYPE


def fla_mlp_hidden(cfg):
    """fla's GatedMLP width: intermediate_size, else 2/3 * hidden_ratio * hidden_size rounded up
    to a multiple of 256."""
    if cfg.get("intermediate_size"):
        return int(cfg["intermediate_size"])
    ratio = cfg.get("hidden_ratio") or 4
    width = int(cfg["hidden_size"] * ratio * 2 / 3)
    return 256 * ((width + 255) // 256)


def model_args_from_fla(cfg, where):
    """model.py's ModelConfig fields for an fla GatedDeltaNetConfig dict (config.json)."""
    if cfg.get("model_type") != FLA_MODEL_TYPE:
        _fail(where, f"model_type is {cfg.get('model_type')!r}, expected {FLA_MODEL_TYPE!r} "
                     "(fla's GatedDeltaNetForCausalLM)")
    archs = cfg.get("architectures") or ["GatedDeltaNetForCausalLM"]
    if archs != ["GatedDeltaNetForCausalLM"]:
        _fail(where, f"architectures is {archs}, expected ['GatedDeltaNetForCausalLM']")
    for key, (ours, what) in UNSUPPORTED.items():
        have = cfg.get(key, ours)
        if key == "num_v_heads" and have == cfg.get("num_heads"):
            continue  # as many value heads as heads: plain GDN
        if have != ours:
            _fail(where, f"{key} = {have!r} is not supported: model.py has no {what} "
                         f"(it computes {key} = {ours!r})")
    act = cfg.get("output_gate_activation", "swish")
    if act not in GATE_ACTIVATIONS:
        _fail(where, f"output_gate_activation = {act!r} is not supported: model.py's output gate is "
                     f"swish (silu)")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim")
               if not isinstance(cfg.get(k), int)]
    if missing:
        _fail(where, f"lacks the whole-number keys {missing}")
    eos = cfg.get("eos_token_id")
    args = dict(
        mixer="gdn", attn_layers=(), bias=False,
        vocab_size=cfg["vocab_size"], n_embd=cfg["hidden_size"], n_layer=cfg["num_hidden_layers"],
        n_head=cfg["num_heads"], head_dim=cfg["head_dim"], expand_v=float(cfg.get("expand_v", 2.0)),
        conv_size=int(cfg.get("conv_size", 4)), norm_eps=float(cfg.get("norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), mlp_hidden=fla_mlp_hidden(cfg),
        block_size=int(cfg.get("max_position_embeddings") or 2048),
        init_std=float(cfg.get("initializer_range", 0.02)))
    if isinstance(eos, int):
        args["eos_id"] = eos
    return args


def rename_fla_state(fla_state, n_layer, tie, where):
    """fla's tensors (names as in its safetensors) -> model.py's state dict. Raises naming every
    tensor it did not use or could not find."""
    import torch
    left = dict(fla_state)
    state = {}

    def take(name):
        if name not in left:
            _fail(where, f"tensor {name!r} is missing (a GatedDeltaNetForCausalLM checkpoint has it)")
        return left.pop(name)

    state["wte.weight"] = take("model.embeddings.weight")
    for i in range(n_layer):
        f, o = f"model.layers.{i}.", f"blocks.{i}."
        state[o + "norm1.weight"] = take(f + "attn_norm.weight")
        state[o + "norm2.weight"] = take(f + "mlp_norm.weight")
        for p in ("q", "k", "v", "a", "b", "g", "o"):
            state[o + f"mixer.{p}_proj.weight"] = take(f + f"attn.{p}_proj.weight")
        convs = [take(f + f"attn.{p}_conv1d.weight") for p in ("q", "k", "v")]
        if any(c.dim() != 3 or c.shape[1] != 1 for c in convs):
            _fail(where, f"{f}attn.*_conv1d.weight have shapes {[tuple(c.shape) for c in convs]}, "
                         "expected depthwise [channels, 1, width]")
        state[o + "mixer.conv.weight"] = torch.cat([c[:, 0] for c in convs])
        for p in ("A_log", "dt_bias", "o_norm.weight"):
            state[o + f"mixer.{p}"] = take(f + f"attn.{p}")
        for p, q in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down")):
            state[o + f"mlp.{q}.weight"] = take(f + f"mlp.{p}_proj.weight")
    state["norm_f.weight"] = take("model.norm.weight")
    if tie:
        head = left.pop("lm_head.weight", None)  # fla stores a tied head once, or twice
        if head is not None and not head.equal(state["wte.weight"]):
            _fail(where, "tie_word_embeddings is true but lm_head.weight differs from model.embeddings.weight")
        state["lm_head.weight"] = state["wte.weight"]
    else:
        state["lm_head.weight"] = take("lm_head.weight")
    if left:
        names = sorted(left)
        _fail(where, f"{len(names)} tensors have no place in model.py's GDN: {names[:8]}"
                     f"{' ...' if len(names) > 8 else ''}")
    return state


def read_fla(path):
    """An fla GatedDeltaNetForCausalLM directory as a checkpoint dict ({"model": state dict in
    model.py's names, "model_args", "data_meta", "imported_from"}), for checkpoint.load_model.
    data_meta names the tokenizer the directory ships (tokenizer.py's Tokenizer reads it)."""
    cfg_path, cfg = read_config(path, f"{path} is not a transformers model directory")
    args = model_args_from_fla(cfg, cfg_path)
    tensors = {}
    for _, shard in read_weights(path, "fla checkpoint"):
        tensors.update(shard)
    state = rename_fla_state(tensors, args["n_layer"], args["tie_embeddings"], path)
    # the tokenizer may hold fewer ids than the (padded) vocab_size: only the EOS is checked against it
    data_meta = {"eos_id": args["eos_id"]} if "eos_id" in args else {}
    return {"model": state, "model_args": args, "data_meta": data_meta,
            "imported_from": {"format": "fla GatedDeltaNetForCausalLM", "path": os.path.abspath(path),
                              "fla_config": cfg}}
