"""
The chunk-local backward in two forms, chunk by chunk, at a million tokens: the one kernel
(_bwd_local, the default at K <= 128) and the key-block pair (_bwd_local_cc + _bwd_local_dqk)
at a launch given as prism_kernel overrides. Both run on the same inputs (the GPU million-token
test's, tests/test_kernel.py long_inputs: B=1, H=6, L=3, bf16, a nonzero initial state); every
output and gradient is compared with the float32 chunk reference (segmented_reference, as that
test does) in chunks of 64 tokens, and the two forms with each other.

    python bench/check_local_pair.py --seed 1499976706
    python bench/check_local_pair.py --pair local_bk=64,bwd_local_cc.num_warps=8,bwd_local_dqk.num_warps=8
    python bench/check_local_pair.py --K 256 --V 128 --T 524288 --one '' --pair ''   # the defaults at K=256

Needs a CUDA GPU (~70 GB at the default shape). Prints one line per tensor and writes
$RESULTS_DIR/local_pair_check_<seed>_K<K>.json (bench/results when RESULTS_DIR is unset):
per tensor, each form's worst and median chunk error against the reference, how many chunks
are over 0.05, the five worst with their reference norms, and the pair's worst and median
chunk difference from the one kernel.
"""
import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import prism_kernel  # noqa: E402
from fileio import atomic_write  # noqa: E402
from prism_kernel import chunk_prism  # noqa: E402
from test_kernel import NAMES, chunk_rel_errs, long_inputs, rel_err, segmented_reference  # noqa: E402


def overrides(text):
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1499976706)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=256)
    ap.add_argument("--T", type=int, default=2**20)
    ap.add_argument("--one", default="", help="overrides of the first form (default: none, the one kernel at K <= 128)")
    ap.add_argument("--pair", default="local_bk=64,bwd_local_cc.num_warps=4,bwd_local_dqk.num_warps=4",
                    help="overrides of the second form")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("check_local_pair.py needs a CUDA GPU")
    variants = {"one": overrides(a.one), "pair": overrides(a.pair)}
    B, T, H, K, V, NE = 1, a.T, 6, a.K, a.V, 2
    bf = torch.bfloat16
    q, k, v, g, beta, ke, ve, s0, do, dht = long_inputs(torch.Generator(device="cuda").manual_seed(a.seed),
                                                        T, H, K, V, NE)

    outs, launches = {}, {}
    for name, ov in variants.items():   # each form's outputs and gradients, kept on the host
        prism_kernel.OVERRIDES.clear()
        prism_kernel.OVERRIDES.update(ov)
        launches[name] = {kn: c for kn, c in prism_kernel.launch_config(K, V, bf, NE, H)[2].items()
                          if kn.startswith("bwd_local")}
        print(name, launches[name], flush=True)
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, ke, ve, s0)]
        o, ht = chunk_prism(*xs[:7], initial_state=xs[7], output_final_state=True)
        torch.autograd.backward([o, ht], [do, dht])
        outs[name] = {"o": o.detach().cpu(), "final_state": ht.detach().cpu()}
        outs[name].update({n: x.grad.cpu() for n, x in zip(NAMES[2:], xs)})
        del o, ht, xs
        torch.cuda.empty_cache()
    prism_kernel.OVERRIDES.clear()

    errs = {n: {vn: [] for vn in variants} for n in NAMES}
    norms = {n: [] for n in NAMES}
    diffs = {n: [] for n in NAMES}

    def check(name, sl, ref):
        for vn in variants:
            x = (outs[vn][name][:, sl] if sl is not None else outs[vn][name]).cuda()
            if sl is None:
                errs[name][vn].append(torch.tensor([rel_err(x, ref)]))
            else:
                errs[name][vn].append(chunk_rel_errs(x, ref).cpu())
        if sl is not None:
            b = ref.float().flatten(2)
            pad = (-b.shape[1]) % 64
            norms[name].append(F.pad(b, (0, 0, 0, pad)).unflatten(1, (-1, 64)).pow(2).sum((0, 2, 3)).sqrt().cpu())
            diffs[name].append(chunk_rel_errs(outs["pair"][name][:, sl].cuda(), outs["one"][name][:, sl].cuda().float()).cpu())

    segmented_reference([q, k, v, g, beta, ke, ve], s0, do, dht, check)

    res = {}
    for n in NAMES:
        row = {}
        for vn in variants:
            e = torch.cat(errs[n][vn])
            row.update({vn + "_worst": e.max().item(), vn + "_median": e.median().item(),
                        vn + "_n_over_0.05": int((e > 0.05).sum())})
        if norms[n]:
            e1, e2 = torch.cat(errs[n]["one"]), torch.cat(errs[n]["pair"])
            nn_, d = torch.cat(norms[n]), torch.cat(diffs[n])
            row.update(one_worst_norm=nn_[e1.argmax()].item(), pair_worst_norm=nn_[e2.argmax()].item(),
                       median_norm=nn_.median().item(), pair_vs_one_worst=d.max().item(),
                       pair_vs_one_median=d.median().item(),
                       top5_one=[(round(e1[i].item(), 4), round(nn_[i].item(), 3)) for i in e1.topk(5).indices.tolist()],
                       top5_pair=[(round(e2[i].item(), 4), round(nn_[i].item(), 3)) for i in e2.topk(5).indices.tolist()])
        res[n] = row
        print(n, json.dumps(row), flush=True)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                seed=a.seed, shape=dict(B=B, T=T, H=H, K=K, V=V, L=NE + 1, dtype="bfloat16"),
                launches=launches, command=" ".join(["python", "bench/check_local_pair.py"] + sys.argv[1:]))
    out_dir = os.environ.get("RESULTS_DIR", os.path.join(ROOT, "bench", "results"))
    path = os.path.join(out_dir, f"local_pair_check_{a.seed}_K{K}.json")
    atomic_write(path, json.dumps(dict(meta, res=res), indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
