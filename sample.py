"""
Sample from a trained model (nanoGPT's sample.py, with flags instead of exec'd overrides).

    python sample.py --ckpt out/prism_130m/ckpt.pt --start "The meaning of life is"
    python sample.py --ckpt out/prism_130m/ckpt.pt --start FILE:prompt.txt --num_samples 1 --temperature 0

--start is the prompt text, or FILE:path to read it from a file. Every sample starts with the
document-start token (the end-of-document token that separates documents in train.bin), so an
empty prompt samples a fresh document. Decoding runs through the model's cache: GDN/PRISM layers
carry their state S and convolution buffers (constant memory in the length), attention layers a
KV cache. Text is decoded with the model's tokenizer: its directory's (an export or an fla checkpoint),
or the file its training data was prepared with, else Mistral's (tokenizer.py); --tokenizer overrides. Each
sample is printed after a line "=== sample i/n ===".
"""
import argparse
import sys
from contextlib import ExitStack

import torch

from checkpoint import load_model
from cli import HelpFormatter


def check_vocab(tokenizer, model):
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{model.config.vocab_size}: wrong --tokenizer for this checkpoint?")


def read_prompt(start):
    if start.startswith("FILE:"):
        with open(start[5:], encoding="utf-8") as f:
            return f.read()
    return start


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip() +
                                "\n\nRuns on a CUDA GPU when there is one, else on the CPU.", formatter_class=HelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint file (out_dir/ckpt.pt) or an export_hf.py directory")
    p.add_argument("--start", default="", help="prompt text, or FILE:path (default: none, a fresh document)")
    p.add_argument("--num_samples", type=int, default=3, help="samples to draw")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens generated per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="0 = no top-k cut")
    p.add_argument("--top_p", type=float, default=1.0,
                   help="nucleus: draw from the smallest set of tokens holding this much probability (1 = no cut)")
    p.add_argument("--seed", type=int, default=1337, help="torch seed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype on CUDA (CPU always runs float32)")
    p.add_argument("--state_dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the GDN/PRISM states between tokens (bfloat16: half the bytes per step)")
    p.add_argument("--tokenizer", default=None, help="tokenizer file (default: tokenizer.py's Mistral model)")
    args = p.parse_args(argv)
    if args.num_samples < 1 or args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0 or \
            not 0 < args.top_p <= 1:
        p.error("num_samples and max_new_tokens must be >= 1, temperature and top_k >= 0, top_p in (0, 1]")
    return args


def decoding_context(args):
    """What samples are drawn under: autocast in --dtype on CUDA, and SDPA kept off cuDNN's
    attention, which re-plans for every new KV length (~3 ms per layer step)."""
    ctx = ExitStack()
    if "cuda" in args.device:
        if args.dtype != "float32":
            ctx.enter_context(torch.autocast("cuda", dtype=getattr(torch, args.dtype)))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                       SDPBackend.MATH]))
    return ctx


def draw(model, x, args, eos_id):
    """One sample: the prompt x [1, T] continued by Model.generate with the flags' settings."""
    with torch.no_grad():
        return model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                              top_p=args.top_p, eos_id=eos_id, state_dtype=getattr(torch, args.state_dtype))


def main(argv=None):
    args = parse_args(argv)
    from tokenizer import load_tokenizer
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed(args.seed)
    model, meta = load_model(args.ckpt, args.device)
    from export_hf import exported_tokenizer  # the model's own: its directory's, or its data's
    try:
        tok = load_tokenizer(args.tokenizer or exported_tokenizer(args.ckpt, meta))
    except RuntimeError as e:  # no tokenizer found: offline, and no mistral-common
        raise ValueError(f"{e} (--tokenizer)")
    check_vocab(tok, model)
    ids = [tok.eos_id] + tok.encode(read_prompt(args.start))
    if len(ids) + args.max_new_tokens > model.config.block_size and \
            any(b.mixer_name == "attention" for b in model.blocks):
        print(f"note: generating past block_size={model.config.block_size}; attention layers "
              "were not trained at these positions", file=sys.stderr)
    x = torch.tensor([ids], dtype=torch.long, device=args.device)
    with decoding_context(args):
        for i in range(args.num_samples):
            # a header line the model does not write (it can write a line of dashes)
            print(f"=== sample {i + 1}/{args.num_samples} ===")
            out = draw(model, x, args, tok.eos_id)[0, 1:].tolist()  # drop the document-start token
            if tok.eos_id in out[len(ids) - 1:]:  # stop at the end of the document
                out = out[:out.index(tok.eos_id, len(ids) - 1)]
            print(tok.decode(out), flush=True)


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as e:  # bad input: the message, not a traceback
        sys.exit(f"error: {e}")
