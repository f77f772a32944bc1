"""Where a training step's GPU time goes. torch.profiler over full training steps (forward,
backward, grad clip, AdamW) of the 130M configs and of fla's GDN model, run as bench.py runs
them; every GPU kernel goes into one category by its name and the operators it was launched
from. Needs a CUDA GPU (and flash-linear-attention for the fla row); writes to --out, --trace.

    python bench/profile_model.py [--models=gdn,prism L=3,fla] [--B=16] [--T=2048] [--compile]
        [--steps=3] [--out=bench/results/profile_130m.txt] [--trace=DIR]

Per model: step time, tokens/s, MFU and peak memory; GPU ms per step in each category (matmuls,
recurrence kernels, conv, attention, norms, loss, optimizer, copies/casts, other) with its share
of the GPU's busy time; the top kernels with their categories. The gap between the step time and
the busy time is the GPU idling (launch latency, host syncs, graph breaks). --trace writes one
Chrome trace per model (open in perfetto.dev) for a closer look.
"""
import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import FLA, SUITE, checkpointing, fla_peer, peer_params, suite_config  # noqa: E402
from cli import HelpFormatter  # noqa: E402
from fileio import atomic_write  # noqa: E402
from model import PEAK_FLOPS, Model, training_flops_per_token  # noqa: E402

CATEGORIES = ["matmuls", "recurrence kernels", "conv", "attention", "norms", "loss", "optimizer",
              "copies/casts", "other"]
# (category, substrings of the kernel name, substrings of the launching operators' names), in
# the order they are tried, all lower case. GEMMs count as matmuls wherever they run (the LM
# head's three GEMMs are matmuls for every model, fused loss or not); the rest of a fused
# region (loss, recurrence, conv) counts as that region.
RULES = [
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn"),
     ("scaled_dot_product", "flash_attn", "_efficient_attention")),
    ("conv", ("_conv_", "conv1d", "conv2d", "convolution", "causal_conv", "depthwise"),
     ("causalconv", "convolution", "conv1d", "shortconv", "::conv_fwd", "::conv_bwd")),
    ("matmuls", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "matmul", "sm90_", "sm80_",
                 "triton_tem"),
     ()),
    ("optimizer", ("adam", "multi_tensor", "foreach"),
     ("optimizer.step", "adamw", "clip_grad", "_foreach")),
    ("recurrence kernels", ("_fwd_prep", "_fwd_state", "_fwd_w", "_fwd_rows", "_l2norm_", "_fwd_out",
                            "_bwd_dv_local", "_bwd_state",
                            "_bwd_rows", "_bwd_local", "chunk_", "recompute_w_u", "wy_repr",
                            "solve_tril", "fused_recurrent", "kkt", "gdn_gate", "delta_rule"),
     ("chunkprism", "::chunk_fwd", "::chunk_bwd", "gateddelta", "delta_rule")),
    ("loss", ("cross_entropy", "crossentropy", "log_softmax", "softmax", "nll_loss", "logsumexp"),
     ("linear_cross_entropy", "cross_entropy", "crossentropy", "nll_loss", "log_softmax")),
    ("norms", ("rms_norm", "rmsnorm", "layer_norm", "layernorm", "l2norm", "l2_norm", "rsqrt", "norm"),
     ("rms_norm", "layer_norm", "normalize", "aten::norm", "vector_norm")),
    ("copies/casts", ("copy", "cat", "clone", "fill", "zero"),
     ("aten::copy_", "aten::cat", "aten::_to_copy", "aten::clone", "aten::contiguous",
      "aten::fill_", "aten::zero_")),
]


def category(kernel, launchers):
    """The category of a GPU kernel given its name and the names of the CPU operators it was
    launched from (innermost first)."""
    name, ops = kernel.lower(), [o.lower() for o in launchers]
    # Inductor's fused kernels are named after the ops they fuse, which can include the outputs
    # of our custom ops (..._chunk_bwd_...): those are elementwise code, not the recurrence
    inductor = name.startswith(("triton_poi_", "triton_per_", "triton_red_"))
    for cat, names, parents in RULES:
        if cat == "recurrence kernels" and inductor:
            continue
        if any(s in name for s in names) or any(p in o for o in ops for p in parents):
            return cat
    return "other"


def kernels_of(prof):
    """(name, launching operators innermost first, microseconds) for every GPU kernel."""
    from torch.autograd import DeviceType
    events = prof.events()
    cpu = {e.id: e for e in events if e.device_type == DeviceType.CPU}
    out = []
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        chain, op = [], cpu.get(getattr(e, "linked_correlation_id", 0))
        while op is not None:
            chain.append(op.name)
            op = op.cpu_parent
        out.append((e.name, chain, e.time_range.elapsed_us()))
    return out


def report(kernels, steps, top=25):
    per_cat, per_kernel = defaultdict(float), defaultdict(lambda: [0.0, 0, ""])
    for name, chain, us in kernels:
        cat = category(name, chain)
        per_cat[cat] += us
        k = per_kernel[name]
        k[0], k[1], k[2] = k[0] + us, k[1] + 1, cat
    busy = sum(per_cat.values()) / steps / 1e3
    lines = [f"GPU busy {busy:.1f} ms per step (sum of kernel times)",
             "| category | ms / step | % of GPU time |", "|---|---|---|"]
    for cat in CATEGORIES:
        ms = per_cat.get(cat, 0.0) / steps / 1e3
        lines.append(f"| {cat} | {ms:.2f} | {100 * ms / max(busy, 1e-9):.1f}% |")
    lines += ["", "| top kernels | category | ms / step | calls / step |", "|---|---|---|---|"]
    for name, (us, n, cat) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {name[:130]} | {cat} | {us / steps / 1e3:.2f} | {n / steps:g} |")
    return busy, "\n".join(lines)


def profile(model, B, T, vocab, flops_per_token, ours=True, compile=False, steps=3, warmup=3, top=25,
            trace=None):
    model = model.cuda().train()
    opt = (model.configure_optimizers(0.1, 1e-4, (0.9, 0.95)) if ours else
           torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True))
    fwd = torch.compile(model) if compile else model
    x = torch.randint(0, vocab, (B, T + 1), device="cuda")
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(inp, tgt)[1] if ours else fwd(input_ids=inp, labels=inp).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(steps):  # unprofiled: the profiler's own overhead stays out of the step time
        step()
    e.record()
    torch.cuda.synchronize()
    step_ms = s.elapsed_time(e) / steps
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    busy, text = report(kernels_of(prof), steps, top)
    head = (f"step {step_ms:.1f} ms, {B * T / step_ms:.1f} ktok/s, MFU "
            f"{100 * flops_per_token * B * T / (step_ms / 1e3) / PEAK_FLOPS:.1f}%, peak "
            f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB; GPU idle "
            f"{max(0.0, step_ms - busy):.1f} ms per step")
    return head + "\n" + text



def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--models", default="gdn,prism L=3,fla",
                   help="comma list of bench.py row-name prefixes, fla = the peer")
    p.add_argument("--B", type=int, default=16, help="sequences per step")
    p.add_argument("--T", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--compile", action="store_true", help="torch.compile every model (the peer too)")
    p.add_argument("--activation_checkpointing", type=checkpointing, nargs="?", const=True,
                   default=False, metavar="True|mlp", help="our models: recompute blocks or MLPs")
    p.add_argument("--steps", type=int, default=3, help="profiled steps per model")
    p.add_argument("--out", default=None, help="also write the report here")
    p.add_argument("--trace", default=None, help="directory for Chrome traces, one per model")
    p.add_argument("--top", type=int, default=25, help="kernels listed, the most time first")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_model.py needs a CUDA GPU")
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
    report_ = []
    for name in a.models.split(","):
        torch.manual_seed(0)
        cfg_path, over, attrs = ("config/gdn_130m.py", {}, {}) if name == "fla" else next(
            ((p_, o, at) for n, p_, o, at in SUITE if n == name), None) or next(
            ((p_, o, at) for n, p_, o, at in SUITE if n.startswith(name)), (None, None, None))
        if cfg_path is None:
            sys.exit(f"unknown model {name!r}; choose from {[r[0] for r in SUITE] + ['fla']}")
        cfg = suite_config(cfg_path, over, block_size=a.T)
        trace = os.path.join(a.trace, name.replace(" ", "_").replace("=", "") + ".json") if a.trace else None
        if name == "fla":
            m = fla_peer(cfg)
            fpt = training_flops_per_token(cfg, a.T, peer_params(m))
            text = profile(m, a.B, a.T, cfg.vocab_size, fpt, ours=False, compile=a.compile,
                           steps=a.steps, trace=trace, top=a.top)
            name = FLA
        else:
            m = Model(cfg)
            m.activation_checkpointing = a.activation_checkpointing
            for key, value in attrs.items():
                setattr(m, key, value)
            text = profile(m, a.B, a.T, cfg.vocab_size, m.flops_per_token(a.T), compile=a.compile,
                           steps=a.steps, trace=trace, top=a.top)
        report_.append(f"=== {name}, B={a.B} T={a.T}, bf16 autocast, compile={a.compile}\n{text}")
        print(report_[-1] + "\n", flush=True)
        del m
        torch.cuda.empty_cache()
    if a.out:
        atomic_write(a.out, "\n\n".join(report_) + "\n")


if __name__ == "__main__":
    main()
