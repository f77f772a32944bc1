#!/usr/bin/env bash
# Every GPU check and benchmark of this repo in one command, most important first, each under its
# own time limit so that one slow step cannot starve the rest. Needs a CUDA GPU; writes to $RESULTS_DIR
# (default bench/results): gpu_env.txt, gpu_tests.log, kernel_bench.json, conv_bench.json, train_bench.json and
# bench_eval_<date>.json.
#
#   bash bench/gpu_suite.sh                          # tests kernel train eval
#   STEPS="tests kernel" bash bench/gpu_suite.sh     # a subset, in this order
#
# Env: STEPS, TESTS (pytest paths, default tests), TESTS_JOBS (GPU tests at once, default 8),
# TESTS_TIMEOUT / KERNEL_TIMEOUT / TRAIN_TIMEOUT / EVAL_TIMEOUT (seconds per step; the float64
# references make the full GPU test set take over 5 minutes even 16 at once on one H200). The kernel and training tables compare against flash-linear-attention
# (`pip install flash-linear-attention==0.6.0`); on a machine without a package index, wheels put
# in .whl/ and .whl_eval/ are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS_DIR=${RESULTS_DIR:-bench/results}
STEPS=${STEPS:-"tests kernel train eval"}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in .whl .whl_eval; do
    if ls $d/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site $d/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    fi
done
python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
    || { echo "gpu_suite.sh: needs a CUDA GPU (torch.cuda.is_available() is False)" >&2; exit 1; }
mkdir -p "$RESULTS_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RESULTS_DIR/gpu_env.txt"
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has tests; then  # correctness first: compiled kernels, chunk backend, decoding, eval, all vs float64
    timeout 60 python3 bench/bench_kernel.py --warm > /dev/null 2>&1
    # one process per test, TESTS_JOBS at once; skips and import errors are reported, not passed
    timeout ${TESTS_TIMEOUT:-900} python3 bench/run_gpu_tests.py ${TESTS:-tests} -j ${TESTS_JOBS:-8} \
        --log "$RESULTS_DIR/gpu_tests.log" | tail -12
fi
if has kernel; then
    timeout ${KERNEL_TIMEOUT:-150} python3 bench/bench_kernel.py 2>&1 | tail -25
    RESULTS_DIR="$RESULTS_DIR" timeout ${KERNEL_TIMEOUT:-150} python3 bench/bench_conv.py 2>&1 | tail -9
fi
if has train; then  # transformer / GDN / PRISM L=2,3 / hybrid / fla GDN model, same run
    timeout ${TRAIN_TIMEOUT:-180} python3 bench.py --suite --seqlens=2048,8192,16384 --steps=6 --warmup=2 \
        --out="$RESULTS_DIR/train_bench.json" 2>&1 | tail -25
fi
if has eval; then
    timeout ${EVAL_TIMEOUT:-120} python3 bench/bench_eval.py 2>&1 | tail -20
fi
ls -la "$RESULTS_DIR"
