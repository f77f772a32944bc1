"""
transformers wrapper around model.py: AutoConfig / AutoModelForCausalLM / generate() for PRISM models.

export_hf.py copies this file, model.py and the kernels (prism_kernel.py, prism_ops/) into every
exported directory, which then loads without this repo (trust_remote_code=True runs this file):

    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained("hf/prism_130m")
    model = AutoModelForCausalLM.from_pretrained("hf/prism_130m", trust_remote_code=True)
    ids = tok("The meaning of life is", return_tensors="pt").input_ids  # [</s>, ...]: see below
    out = model.generate(ids, max_new_tokens=50, do_sample=False)
    print(tok.decode(out[0], skip_special_tokens=True))

The network is model.py's Model, unchanged; this file only translates: PrismConfig holds
ModelConfig's fields, forward() calls Model.forward, and PrismCache hands transformers whatever
Model.init_cache() returns (GDN/PRISM state + conv buffers, attention K/V). Conventions:
  * every document starts with </s>: train.bin separates documents with it and never holds <s>,
    so the exported tokenizer's bos_token is </s> (as GPT-2's bos and eos are both <|endoftext|>)
    and tok(text) puts it in front; pad is <unk>, which the byte-fallback tokenizer never emits;
  * padding: a recurrent state cannot mask tokens out, so left padding is refused with an error;
    right padding is fine without a cache (scoring), and generate() takes unpadded prompts;
  * generate(): greedy and top-k / top-p sampling run model.py's Model.generate (static cache,
    fused decoding steps, a CUDA graph per token on CUDA) and return what transformers returns;
    every other request (beam search, other logits processors, return_dict_in_generate, ...) runs
    transformers' own loop on the recurrent cache (PrismCache); assisted decoding is refused by
    transformers for stateful models.
"""
import filecmp
import logging as py_logging
import math
import os
import shutil
import warnings
from dataclasses import fields

import torch
from transformers import GenerationMixin, PreTrainedModel, PretrainedConfig
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

try:  # in an exported directory transformers imports this file as a package: model.py is a sibling
    from .model import IGNORE_INDEX, Model, ModelConfig
except ImportError:
    if __package__:
        raise
    from model import IGNORE_INDEX, Model, ModelConfig  # in this repo

logger = logging.get_logger(__name__)

MODEL_TYPE = "prism_lm"
AUTO_MAP = {"AutoConfig": "hf_modeling.PrismConfig", "AutoModelForCausalLM": "hf_modeling.PrismForCausalLM"}
# the Triton kernels: the entry point and its stages (prism_ops/), fetched at run time
KERNEL_FILES = ("prism_kernel.py", "prism_ops/__init__.py", "prism_ops/tiles.py", "prism_ops/chunk_fwd.py",
                "prism_ops/chunk_bwd.py", "prism_ops/l2norm.py", "prism_ops/conv.py", "prism_ops/solver.py",
                "prism_ops/decode.py")
CODE_FILES = ("hf_modeling.py", "model.py") + KERNEL_FILES  # what an exported directory runs
# transformers >= 5.24 calls the cache `cache`; earlier versions `past_key_values`
CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

PADDING_HELP = ("a recurrent state (GDN/PRISM layers) cannot mask tokens out, so the supported "
                "inputs are: right padding for scoring without a cache (tokenizer.padding_side='right'; "
                "the padded positions' logits are meaningless), and unpadded prompts for generate() and "
                "cached decoding (one prompt, or a batch of prompts of equal length)")


class PrismConfig(PretrainedConfig):
    """model.py's ModelConfig fields, flat in config.json, plus transformers' own keys."""
    model_type = MODEL_TYPE
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                     "num_attention_heads": "n_head", "max_position_embeddings": "block_size"}

    def __init__(self, **kwargs):
        args = {f.name: kwargs.pop(f.name) for f in fields(ModelConfig) if f.name in kwargs}
        cfg = ModelConfig(**args)  # validates; unset fields take model.py's defaults
        for f in fields(ModelConfig):
            v = getattr(cfg, f.name)
            setattr(self, f.name, list(v) if isinstance(v, tuple) else v)
        kwargs["tie_word_embeddings"] = cfg.tie_embeddings
        super().__init__(**kwargs)

    def model_config(self):
        return ModelConfig(**{f.name: getattr(self, f.name) for f in fields(ModelConfig)})


def _batch_tensors(obj, batch, seen=None):
    """The tensors of a cache object whose first dimension is the batch, whatever its layout
    (model.py's per-layer dicts, or any nesting of lists, tuples, dicts and plain objects)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.dim() and obj.shape[0] == batch:
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _batch_tensors(v, batch, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _batch_tensors(v, batch, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for v in vars(obj).values():
            yield from _batch_tensors(v, batch, seen)


class PrismCache(Cache):
    """transformers' handle on model.py's decoding cache: `state` is Model.init_cache(batch_size,
    max_len), passed as is to Model.forward(cache=...); `seen` counts the tokens it holds.
    max_len bounds only attention layers' static KV cache (the recurrent state has no limit)."""
    is_compileable = False
    is_croppable = False

    def __init__(self, model, batch_size, max_len):
        try:
            super().__init__(layers=[])
        except TypeError:  # transformers before the layered Cache
            super().__init__()
        self.state = model.init_cache(batch_size, max_len)
        self.batch = batch_size
        self.seen = 0

    def __repr__(self):
        return f"PrismCache(batch={self.batch}, seen={self.seen})"

    def __len__(self):
        return len(self.state) if hasattr(self.state, "__len__") else 0

    @property
    def batch_size(self):
        return self.batch

    def get_seq_length(self, layer_idx=0):
        return self.seen

    def get_max_cache_shape(self, layer_idx=0):
        return -1  # the recurrent state does not grow; attention K/V grow without a bound

    def reorder_cache(self, beam_idx):
        """Beam search: row i takes row beam_idx[i]'s state, in place (static buffers keep their address)."""
        for t in _batch_tensors(self.state, self.batch):
            t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("PrismCache: a recurrent state cannot be cropped, re-batched or "
                                  "rolled back; use greedy, sampling or beam search decoding")

    crop = batch_repeat_interleave = batch_select_indices = _unsupported


def _install_kernel_file(config):
    """Put the kernels (KERNEL_FILES: prism_kernel.py and prism_ops/) beside model.py in
    transformers' module cache, where model.kernels() imports them on CUDA. transformers copies
    only the files that this file imports, and importing prism_kernel needs Triton, so they are
    fetched here (from the exported directory or the hub)."""
    if not __package__:
        return  # this repo: prism_kernel is a top-level module
    here = os.path.dirname(os.path.abspath(__file__))
    name = str(getattr(config, "_name_or_path", "") or "")
    for i, fname in enumerate(KERNEL_FILES):
        dst = os.path.join(here, fname)
        src = None
        if name:
            from transformers.utils import cached_file
            src = cached_file(name, fname, revision=getattr(config, "_commit_hash", None),
                              _raise_exceptions_for_missing_entries=False,
                              _raise_exceptions_for_connection_errors=False)
        if src and os.path.isfile(src):
            if not (os.path.isfile(dst) and filecmp.cmp(src, dst, shallow=False)):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                tmp = f"{dst}.tmp.{os.getpid()}"
                shutil.copyfile(src, tmp)
                os.replace(tmp, dst)
        elif i == 0 and not os.path.isfile(dst):
            if torch.cuda.is_available():
                logger.warning(f"prism_kernel.py not found in {name or 'the model directory'}: on CUDA the "
                               "recurrence runs model.py's PyTorch chunk backend instead of the Triton kernels")
            return


class _HeldWarnings:
    """Holds the warnings (warnings.warn, and transformers' loggers) raised inside the block;
    replay() gives them out as they would have been. generate() reads a call with transformers'
    helpers and, when the call then goes to transformers' generate, drops them: it warns itself."""

    def __enter__(self):
        self.root = py_logging.getLogger("transformers")
        self.records = []
        self.handler = py_logging.Handler()
        self.handler.emit = self.records.append
        self.saved = (self.root.handlers[:], self.root.propagate)
        self.root.handlers, self.root.propagate = [self.handler], False
        self.catch = warnings.catch_warnings(record=True)
        self.caught = self.catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self.catch.__exit__(*exc)
        self.root.handlers, self.root.propagate = self.saved
        return False

    def replay(self):
        for w in self.caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        for r in self.records:
            py_logging.getLogger(r.name).handle(r)


class PrismForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = PrismConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.wte.weight"}
    _is_stateful = True               # transformers: no assisted decoding (it would roll the state back)
    supports_gradient_checkpointing = False

    def __init__(self, config):
        super().__init__(config)
        self.model = Model(config.model_config())
        _install_kernel_file(config)
        self.post_init()

    def _init_weights(self, module):
        pass  # model.py initialises its own weights; from_pretrained then overwrites them all

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # generate() must not make a DynamicCache: forward() makes a PrismCache

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value):
        self.model.wte = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, cache=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        """Logits [B, T, vocab] (and the loss of `labels`, shifted inside as transformers does).
        With use_cache=True the call continues the sequence held in `cache` (a fresh PrismCache
        when none is given) and returns it."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("PrismForCausalLM takes input_ids (inputs_embeds is not supported)")
        if output_attentions or output_hidden_states:
            raise ValueError("PrismForCausalLM returns no attentions or hidden states")
        cache = cache if cache is not None else past_key_values
        use_cache = cache is not None if use_cache is None else use_cache
        if attention_mask is not None and not bool(attention_mask.all()):
            m = attention_mask.bool()
            if use_cache or cache is not None:
                raise ValueError(f"PrismForCausalLM: generate()/cached decoding got an attention_mask "
                                 f"with zeros (padded prompts); {PADDING_HELP}")
            if (m[:, 1:] & ~m[:, :-1]).any():
                raise ValueError(f"PrismForCausalLM: attention_mask has zeros before real tokens "
                                 f"(left padding); {PADDING_HELP}")
        loss = None
        if use_cache:
            if labels is not None:
                raise ValueError("PrismForCausalLM: labels (a loss) with use_cache=True are not supported")
            if cache is None or (not isinstance(cache, PrismCache) and cache.get_seq_length() == 0):
                # room for block_size tokens after the prompt (attention layers' static KV cache)
                cache = PrismCache(self.model, input_ids.shape[0], input_ids.shape[1] + self.config.block_size)
            elif not isinstance(cache, PrismCache):
                raise ValueError(f"PrismForCausalLM needs its own PrismCache, got {type(cache).__name__}")
            logits, _ = self.model(input_ids, cache=cache.state)
            cache.seen += input_ids.shape[1]
        elif labels is not None:  # transformers shifts inside: position t predicts labels[t + 1]
            targets = torch.full_like(input_ids, IGNORE_INDEX)
            targets[:, :-1] = labels[:, 1:].to(input_ids.device)
            targets[targets == -100] = IGNORE_INDEX
            logits, loss = self.model(input_ids, targets=targets, return_logits=True)
            cache = None
        else:
            logits, _ = self.model(input_ids)
            cache = None
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_ARG: cache})
        return out if return_dict is not False else out.to_tuple()

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None,
                                      attention_mask=None, inputs_embeds=None, use_cache=True, **kwargs):
        cache = cache if cache is not None else past_key_values
        if inputs_embeds is not None:
            raise ValueError("PrismForCausalLM.generate takes input_ids (inputs_embeds is not supported)")
        if isinstance(cache, PrismCache) and cache.seen:
            if cache.seen >= input_ids.shape[1]:
                raise ValueError(f"the cache holds {cache.seen} tokens but input_ids only {input_ids.shape[1]}")
            input_ids = input_ids[:, cache.seen:]  # only the tokens the state has not read yet
        return {"input_ids": input_ids, "attention_mask": attention_mask, CACHE_ARG: cache,
                "use_cache": use_cache}

    fast_generate = True  # generate(): model.py's decoding loop for the requests it computes alike

    def generate(self, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None,
                 *args, **kwargs):
        """transformers' generate(); the requests that model.py's Model.generate computes alike run
        there: a static cache, fused decoding steps, on CUDA one CUDA-graph replay per token
        (transformers' own loop runs a Python step of forward() per token).

        Those requests are: input_ids of one prompt or of equal-length prompts (no padding; an
        all-ones attention_mask at most); greedy decoding, or sampling (do_sample=True) with
        temperature, top_k and top_p, num_return_sequences too; max_new_tokens or max_length;
        eos_token_id (an id or a list) and pad_token_id. They are read as transformers reads them
        (generation_config, else model.generation_config, overridden by the call's arguments;
        transformers' own helpers build the logits processors and stopping criteria), and go to
        Model.generate only when those are no more than temperature, top-k, top-p, the maximum
        length and the EOS. The result is what transformers returns for them: a LongTensor of
        prompt + new tokens, where a row that drew an EOS has pad_token_id (else the first EOS)
        after it, and decoding ends once every row has. Greedy tokens are those of transformers'
        loop; sampled tokens are draws from the same filtered distribution (model.filter_logits
        keeps transformers' top-k and top-p sets), from another random stream.

        Every other request runs transformers' own generate (GenerationMixin.generate, on
        PrismCache), so it returns whatever that returns: return_dict_in_generate and the
        output_scores / output_logits outputs, beam search, any other logits processor
        (repetition_penalty, min_length, min_new_tokens, no_repeat_ngram_size, bad_words_ids,
        min_p, typical_p, ...) or stopping criterion (stop_strings, max_time), logits_processor,
        stopping_criteria, a streamer or an assistant model, use_cache=False, a cache passed in,
        padded prompts (which raise there). `model.fast_generate = False` sends every call there."""
        plan = None
        if self.fast_generate and not args and not logits_processor and not stopping_criteria:
            with _HeldWarnings() as held:
                try:
                    plan = self._fast_generate_plan(inputs, generation_config, kwargs)
                except Exception as e:  # bad arguments raise again in transformers' generate
                    logger.info(f"generate(): transformers' decoding loop ({type(e).__name__}: {e})")
            if plan is not None:
                held.replay()  # the warnings transformers would give for these arguments
        if plan is None:
            return super().generate(inputs, generation_config, logits_processor, stopping_criteria,
                                    *args, **kwargs)
        ids, draw, device = plan
        return self.model.generate(ids, **draw).to(device)

    def _fast_generate_plan(self, inputs, generation_config, kwargs):
        """(input_ids, Model.generate's arguments, the result's device) when Model.generate
        computes what transformers' generate would for this call, else None. Follows
        GenerationMixin.generate's own steps (its helpers, in its order) as far as its decoding
        loop; a helper that raises sends the call to transformers' generate, which raises it."""
        from transformers.generation.configuration_utils import GenerationMode
        from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                            TopKLogitsWarper, TopPLogitsWarper)
        from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria,
                                                               StoppingCriteriaList)
        kwargs = dict(kwargs)
        ids = kwargs.pop("input_ids", None) if inputs is None else inputs
        if not (torch.is_tensor(ids) and ids.dim() == 2 and ids.shape[1] > 0 and ids.dtype == torch.long) \
                or "input_ids" in kwargs:
            return None
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and (mask.shape != ids.shape or not bool(mask.all())):
            return None
        kwargs.pop("tokenizer", None)  # read only for stop_strings, which take transformers' loop

        def given(key):  # set by the call, its generation_config or the model's (transformers' test)
            return kwargs.get(key) is not None or getattr(self.generation_config, key) is not None or \
                (generation_config is not None and getattr(generation_config, key) is not None)
        default_max, default_min = not given("max_length"), not given("min_length")
        gc, model_kwargs = self._prepare_generation_config(generation_config, **kwargs)
        if any(v is not None for v in model_kwargs.values()):  # forward() inputs, a cache, a streamer, ...
            return None
        mode = gc.get_generation_mode()
        if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE) or gc.return_dict_in_generate \
                or gc.output_scores or gc.output_logits or gc.output_attentions or gc.output_hidden_states \
                or gc.use_cache is False or gc.cache_implementation is not None \
                or getattr(gc, "token_healing", False) or getattr(gc, "prefill_chunk_size", None) is not None:
            return None
        copies = gc.num_return_sequences or 1
        if copies != 1 and mode != GenerationMode.SAMPLE:
            return None  # transformers refuses it
        self._prepare_special_tokens(gc, mask is not None, device=ids.device, batch_size=ids.shape[0])
        ids = ids.repeat_interleave(copies, 0) if copies != 1 else ids
        T0 = ids.shape[1]
        gc = self._prepare_generated_length(generation_config=gc, has_default_max_length=default_max,
                                            has_default_min_length=default_min, model_input_name="input_ids",
                                            input_ids_length=T0, inputs_tensor=ids)
        self._validate_generated_length(gc, T0, default_max)
        procs = self._get_logits_processor(generation_config=gc, input_ids_seq_length=T0, encoder_input_ids=ids,
                                           logits_processor=LogitsProcessorList(), device=ids.device,
                                           model_kwargs={})
        draw = dict(temperature=0.0)
        if mode == GenerationMode.SAMPLE:  # the warpers Model.generate applies, in its order
            draw, order = dict(temperature=1.0), (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
            ranks = [order.index(type(p)) if type(p) in order else -1 for p in procs]
            if -1 in ranks or ranks != sorted(set(ranks)) or \
                    any(getattr(p, "filter_value", -math.inf) != -math.inf for p in procs) or \
                    any(getattr(p, "min_tokens_to_keep", 1) != 1 for p in procs if type(p) is TopPLogitsWarper):
                return None
            for p in procs:
                if type(p) is TemperatureLogitsWarper:
                    draw["temperature"] = float(p.temperature)
                elif type(p) is TopKLogitsWarper:
                    draw["top_k"] = int(p.top_k)
                else:
                    draw["top_p"] = float(p.top_p)
        elif len(procs):
            return None
        max_length, eos = None, None
        for c in self._get_stopping_criteria(generation_config=gc, stopping_criteria=StoppingCriteriaList()):
            if type(c) is MaxLengthCriteria:
                max_length = c.max_length
            elif type(c) is EosTokenCriteria:
                eos = torch.as_tensor(c.eos_token_id).view(-1).tolist()
            else:
                return None
        if max_length is None or max_length <= T0:
            return None
        if eos:
            draw.update(eos_id=eos, pad_id=int(gc._pad_token_tensor))
        return ids.to(self.device), dict(max_new_tokens=max_length - T0, **draw), ids.device

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, plus the code files, so that a saved (or pushed)
        directory loads with trust_remote_code=True like the exported one."""
        self.config.auto_map = dict(AUTO_MAP)
        out = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            here = os.path.dirname(os.path.abspath(__file__))
            for name in CODE_FILES:
                src, dst = os.path.join(here, name), os.path.join(save_directory, name)
                if not os.path.isfile(src):
                    logger.warning(f"{src} not found: {save_directory} will lack {name}")
                elif not (os.path.isfile(dst) and os.path.samefile(src, dst)):
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    shutil.copyfile(src, dst)
        return out
