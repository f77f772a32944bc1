"""Where a training step's GPU time goes: torch.profiler over full steps (forward, backward,
AdamW) of the 130M configs, top ops by self GPU time. Prints one table per model.
Needs a CUDA GPU (and flash-linear-attention for the fla row); writes the tables to --out.

    python bench/profile_model.py [--models=gdn,prism] [--B=16] [--T=2048] [--out=FILE]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import SUITE, fla_peer, suite_config  # noqa: E402
from model import Model  # noqa: E402


def profile(model, B, T, vocab, ours=True, steps=2, warmup=3, rows=25):
    model = model.cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, vocab, (B, T + 1), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if ours:
                _, loss = model(x[:, :-1], x[:, 1:])
            else:
                logits = model(input_ids=x[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    # rows are operators (aten::mm, ...Function) and the kernels they launch, so times nest
    return (f"{steps} profiled steps: divide the times by {steps} for one step\n"
            + ka.table(sort_by=key, row_limit=rows, max_name_column_width=70))


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every default that is set."""

    def _get_help_string(self, action):
        unset = action.required or action.default is False or action.default in (None, "", [])
        return action.help if unset else super()._get_help_string(action)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    p.add_argument("--models", default="gdn,prism L=3,fla",
                   help="comma list: bench.py suite names (a prefix is enough) or fla")
    p.add_argument("--B", type=int, default=16, help="sequences per step")
    p.add_argument("--T", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--out", default=None, help="also write the tables to this file")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
    report = []
    for name in a.models.split(","):
        torch.manual_seed(0)
        if name == "fla":
            cfg = suite_config("config/gdn_130m.py", {}, block_size=a.T)
            text = profile(fla_peer(cfg), a.B, a.T, cfg.vocab_size, ours=False)
        else:
            path, over = next((p_, o) for n, p_, o in SUITE if n.startswith(name))
            cfg = suite_config(path, over, block_size=a.T)
            text = profile(Model(cfg), a.B, a.T, cfg.vocab_size)
        report.append(f"=== {name}, B={a.B} T={a.T}, bf16 autocast\n{text}")
        print(report[-1], flush=True)
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n\n".join(report))


if __name__ == "__main__":
    main()
