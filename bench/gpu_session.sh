#!/usr/bin/env bash
# Every GPU check and benchmark of this repo in one call on one H200, most important first,
# each under its own time limit so one slow step cannot starve the rest. Results land in $OUT
# (at most 8 files come back from the device tool): copy them into bench/results/.
#
#   device run, kind nvidia-h200, carry [".whl", ".whl_eval"], command:
#     bash bench/gpu_session.sh            (or STEPS="tests kernel train" to pick)
#
# Env: STEPS, TESTS (pytest paths, default tests), TESTS_TIMEOUT / KERNEL_TIMEOUT / TRAIN_TIMEOUT /
# EVAL_TIMEOUT (seconds per step; the defaults fit one 10-minute call only for some STEPS: the
# float64 references make the full GPU test set take over 5 minutes on its own).
#
# .whl holds flash-linear-attention + fla-core 0.6.0 (the peer), .whl_eval lm-eval and what it
# needs that the image lacks; see bench/KERNEL_NOTES.md and eval/lm_eval.py for the downloads.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
STEPS=${STEPS:-"tests kernel train eval"}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in .whl .whl_eval; do
    if ls $d/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site $d/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    fi
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_env.txt"
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has tests; then  # correctness first: compiled kernels, chunk backend, decoding, eval, all vs float64
    timeout 60 python3 bench/bench_kernel.py --warm > /dev/null 2>&1
    timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" ${TESTS:-tests} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -5
fi
if has kernel; then
    timeout ${KERNEL_TIMEOUT:-150} python3 bench/bench_kernel.py 2>&1 | tail -25
fi
if has train; then  # transformer / GDN / PRISM L=2,3 / hybrid / fla GDN model, same run
    timeout ${TRAIN_TIMEOUT:-180} python3 bench.py --suite --seqlens=2048,8192,16384 --steps=6 --warmup=2 \
        --out="$OUT/train_bench.json" 2>&1 | tail -25
fi
if has eval; then
    timeout ${EVAL_TIMEOUT:-120} python3 bench/bench_eval.py 2>&1 | tail -20
fi
ls -la "$OUT"
