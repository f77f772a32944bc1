#!/usr/bin/env bash
# DDP scaling of PRISM-130M: tokens/s on 1 GPU, then on 2 GPUs (torchrun), with the same per-GPU
# micro-batch and per-GPU accumulation, on synthetic tokens. Writes $RESULTS_DIR/ddp_scaling.json
# (default RESULTS_DIR=bench/results) plus both runs' stdout. Needs 2 CUDA GPUs; ~2-4 minutes on 2 H200s.
#
#   bash bench/ddp_scaling.sh                        # defaults below
#   MICRO=8 ITERS=20 BACKEND=chunk bash bench/ddp_scaling.sh
#
# Throughput = tokens / time over the iterations after WARMUP (kernel compilation, allocator
# warm-up excluded); scaling = tok/s(2 GPUs) / tok/s(1 GPU), ideal 2.0.
set -euo pipefail
cd "$(dirname "$0")/.."

# NVLink multicast (NVLS) stays off: on some hosts it hangs collectives or takes the GPUs down
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
RESULTS_DIR=${RESULTS_DIR:-bench/results}
MICRO=${MICRO:-16}          # sequences per GPU per micro-step
ACCUM=${ACCUM:-2}           # micro-steps per GPU per iteration
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
CONFIG=${CONFIG:-config/prism_130m.py}
BACKEND=${BACKEND:-}        # empty = model.py's default (triton on CUDA when it imports, else chunk)
WORK=$(mktemp -d /tmp/ddp_scaling.XXXX)
mkdir -p "$RESULTS_DIR"
trap 'rm -rf "$WORK"' EXIT

python3 - "$WORK/data/synthetic" <<'PY'
import json, os, sys
import numpy as np
d = sys.argv[1]; os.makedirs(d)
rng = np.random.default_rng(0)
rng.integers(0, 32000, 40_000_000, dtype=np.uint16).tofile(f"{d}/train.bin")
rng.integers(0, 32000, 1_000_000, dtype=np.uint16).tofile(f"{d}/val.bin")
json.dump({"vocab_size": 32000, "tokenizer": "synthetic-uniform"}, open(f"{d}/meta.json", "w"))
PY

common=("$CONFIG" --data_dir="$WORK/data" --dataset=synthetic --batch_size="$MICRO"
        --max_iters="$ITERS" --eval_interval=100000 --eval_iters=1 --log_interval=1
        --warmup_iters=5 --keep_checkpoints=1 --compile="${COMPILE:-False}")  # committed run: eager
[ -n "$BACKEND" ] && common+=(--backend="$BACKEND")

echo "== 1 GPU"
CUDA_VISIBLE_DEVICES=0 python3 train.py "${common[@]}" --out_dir="$WORK/one" \
    --gradient_accumulation_steps="$ACCUM" 2>&1 | tee "$RESULTS_DIR/ddp_scaling_1gpu.log"
echo "== 2 GPUs"
python3 -m torch.distributed.run --standalone --nproc_per_node=2 train.py "${common[@]}" --out_dir="$WORK/two" \
    --gradient_accumulation_steps=$((2 * ACCUM)) 2>&1 | tee "$RESULTS_DIR/ddp_scaling_2gpu.log"

python3 - "$WORK" "$RESULTS_DIR" "$MICRO" "$ACCUM" "$ITERS" "$WARMUP" "$CONFIG" "${BACKEND:-default}" <<'PY'
import json, re, sys, time
import torch
work, out, micro, accum, iters, warmup, config, backend = sys.argv[1:]
warmup = int(warmup)

def measure(run):
    recs = [json.loads(l) for l in open(f"{work}/{run}/log.jsonl")]
    steps = [r for r in recs if "tok_s" in r and r["iter"] > warmup]
    assert steps, f"no timed iterations after warmup {warmup} in {run}"
    tok = sum(r["tok_s"] * r["dt"] for r in steps)
    log = open(f"{out}/ddp_scaling_{'1gpu' if run == 'one' else '2gpu'}.log").read()
    used = re.search(r"backend (\w+)", log)
    return {"tok_s": tok / sum(r["dt"] for r in steps), "iters_timed": len(steps),
            "peak_mem_gib": max(r.get("mem_gib", 0) for r in steps),
            "final_loss": steps[-1]["loss"], "backend": used.group(1) if used else None}

one, two = measure("one"), measure("two")
block_size = int(re.search(r"x (\d+) tokens =", open(f"{out}/ddp_scaling_1gpu.log").read()).group(1))
res = {
    "what": "PRISM-130M DDP scaling, same per-GPU micro-batch, synthetic tokens",
    "config": config, "backend_requested": backend, "micro_batch_per_gpu": int(micro),
    "accum_per_gpu": int(accum), "block_size": block_size, "iters": int(iters), "warmup_iters_excluded": warmup,
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (smoke test)",
    "gpus": 2, "torch": torch.__version__,
    "one_gpu": one, "two_gpus": two,
    "scaling": two["tok_s"] / one["tok_s"], "efficiency": two["tok_s"] / one["tok_s"] / 2,
    "command": "bash bench/ddp_scaling.sh", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
}
json.dump(res, open(f"{out}/ddp_scaling.json", "w"), indent=2)
print(json.dumps(res, indent=2))
print(f"scaling 1 -> 2 GPUs: {res['scaling']:.3f}x ({one['tok_s']:,.0f} -> {two['tok_s']:,.0f} tok/s)")
PY
