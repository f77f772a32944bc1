#!/usr/bin/env bash
# The small real-text comparison: GDN-130M, PRISM-130M and hybrid-130M trained for the SAME number
# of tokens, same seed and data order (train.py's DataOrder is a seeded function of the step), on
# data/realtext (Debian-packaged English, bench/realtext_corpus.py). Needs a CUDA GPU (about 9
# minutes for the three models on one H200); TINY=1 runs the tiny configs on any machine.
#
#   bash bench/realtext.sh                     (TOKENS=16777216 = 256 steps of 65,536 tokens)
#   GPUS="0 1" bash bench/realtext.sh          the models in parallel lanes on two GPUs
#
# Writes to $RESULTS_DIR (default out/realtext_result):
#   realtext_val.png        plot.py: train (smoothed) and val loss against tokens, three models
#   realtext_summary.json   per model: final val loss and perplexity, the val curve, tokens,
#                           tokens/s, wall time, exit code; and the val losses at the last
#                           iteration all three reached (the fair comparison if one was cut short)
#   realtext_train.log      the three runs' stdout/stderr, concatenated
#   realtext_<model>.jsonl  train.py's log.jsonl of each run
#
# With GPUS="0 1", model i trains on GPU GPUS[i mod n] (each lane runs its models one after
# another), then one summary follows; every model still sees the same tokens in the same order,
# so the comparison is unchanged. PHASE=train|summary|all (default all) splits the two halves,
# e.g. to train one model on a GPU that first ran something else:
#   CUDA_VISIBLE_DEVICES=1 MODELS="gdn prism" PHASE=train bash bench/realtext.sh &
#   (other work on GPU 0); CUDA_VISIBLE_DEVICES=0 MODELS=hybrid PHASE=train bash bench/realtext.sh
#   wait; PHASE=summary bash bench/realtext.sh
# Env: TOKENS (per model; rounded up to whole steps), MODELS ("gdn prism hybrid"), RUN_TIMEOUT
# (seconds per model, default 600; SIGTERM makes train.py stop cleanly at the end of a step),
# SAVE_CKPT=1 to keep train.py's checkpoints (off by default: model + AdamW state is 1.75 GB a
# save, ~17 saves a run), RUNS (out dirs), DATA_DIR / DATASET, TRAIN_ARGS (more train.py
# --key=value, appended; keep the tokens per step, e.g. "--batch_size=8
# --gradient_accumulation_steps=4" if 16 sequences do not fit), TINY=1: the tiny CPU configs
# and a few iterations (a smoke test of this script; tests/test_realtext.py runs it).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS_DIR=${RESULTS_DIR:-out/realtext_result}
RUNS=${RUNS:-out/realtext}
MODELS=${MODELS:-"gdn prism hybrid"}
TINY=${TINY:-0}
DATA_DIR=${DATA_DIR:-data}
DATASET=${DATASET:-realtext}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$RESULTS_DIR" "$RUNS"

if [ "$TINY" = 1 ]; then
    SIZE="tiny (2.2M)"
    TOKENS=${TOKENS:-2048}
    STEP_TOKENS=$((4 * 2 * 64))               # config/tiny_cpu.py: 4 x 64, accum 2
    RUN_TIMEOUT=${RUN_TIMEOUT:-120}
    declare -A CONF=([gdn]=config/tiny_gdn.py [prism]=config/tiny_cpu.py [hybrid]=config/tiny_hybrid.py)
    EXTRA=(--warmup_iters=1 --lr_decay_iters=0 --eval_interval=2 --eval_iters=2 --log_interval=1)
else
    SIZE=130M
    TOKENS=${TOKENS:-16777216}
    STEP_TOKENS=$((16 * 2 * 2048))            # config/realtext.py: 16 x 2048, accum 2
    RUN_TIMEOUT=${RUN_TIMEOUT:-600}           # one model takes 2-4 minutes on an H200
    declare -A CONF=([gdn]="config/gdn_130m.py config/realtext.py"
                     [prism]="config/prism_130m.py config/realtext.py"
                     [hybrid]="config/hybrid_130m.py config/realtext.py")
    EXTRA=()
fi
ITERS=$(( (TOKENS + STEP_TOKENS - 1) / STEP_TOKENS ))
echo "realtext: models [$MODELS], $ITERS iters x $STEP_TOKENS tokens = $((ITERS * STEP_TOKENS)) tokens each," \
     "timeout ${RUN_TIMEOUT}s each, data $DATA_DIR/$DATASET"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

PHASE=${PHASE:-all}
GPUS=(${GPUS:-})
train_one() {  # $1 = model; its stdout/stderr, exit code and wall time stay in $RUNS/$1
    local m=$1 t0 rc secs save args
    rm -rf "${RUNS:?}/$m"; mkdir -p "$RUNS/$m"
    args=(${CONF[$m]} --out_dir="$RUNS/$m" --data_dir="$DATA_DIR" --dataset="$DATASET"
          --max_iters="$ITERS" "${EXTRA[@]}" ${TRAIN_ARGS:-})
    echo "=== $m: train.py ${args[*]}" > "$RUNS/$m/train.log"
    echo "=== $m: training (GPU ${CUDA_VISIBLE_DEVICES:-default})"
    t0=$(date +%s.%N)
    save=$([ "${SAVE_CKPT:-0}" = 1 ] && echo True || echo False)
    timeout -k 15 "$RUN_TIMEOUT" $PY train.py "${args[@]}" --save_checkpoints=$save >> "$RUNS/$m/train.log" 2>&1
    rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    echo "$m=$rc=$secs" > "$RUNS/$m/wall.txt"
    echo "=== $m: exit $rc after $secs s" | tee -a "$RUNS/$m/train.log"
    tail -4 "$RUNS/$m/train.log" | grep -v '^===' || true
}
for m in $MODELS; do
    [ -n "${CONF[$m]:-}" ] || { echo "realtext.sh: unknown model '$m' (gdn, prism, hybrid)" >&2; exit 2; }
done
if [ "$PHASE" != summary ]; then
    if [ ${#GPUS[@]} -gt 1 ]; then
        i=0; declare -A LANE=()
        for m in $MODELS; do g=${GPUS[$((i % ${#GPUS[@]}))]}; LANE[$g]="${LANE[$g]:-} $m"; i=$((i + 1)); done
        for g in "${!LANE[@]}"; do
            ( export CUDA_VISIBLE_DEVICES=$g; for m in ${LANE[$g]}; do train_one "$m"; done ) &
        done
        wait
    else
        for m in $MODELS; do train_one "$m"; done
    fi
fi
[ "$PHASE" = train ] && exit 0

LOG="$RESULTS_DIR/realtext_train.log"
: > "$LOG"
WALL=()
for m in $MODELS; do
    [ -f "$RUNS/$m/wall.txt" ] || { echo "realtext.sh: $m has no finished run in $RUNS/$m" >&2; continue; }
    WALL+=("$(cat "$RUNS/$m/wall.txt")")
    cat "$RUNS/$m/train.log" >> "$LOG"
    [ -f "$RUNS/$m/log.jsonl" ] && cp "$RUNS/$m/log.jsonl" "$RESULTS_DIR/realtext_$m.jsonl"
done

logs=()
for m in $MODELS; do [ -s "$RUNS/$m/log.jsonl" ] && logs+=("$RUNS/$m/log.jsonl"); done
if [ ${#logs[@]} -gt 0 ]; then
    $PY plot.py "${logs[@]}" --x=tokens --smooth=5 --out="$RESULTS_DIR/realtext_val.png" \
        --title="GDN / PRISM / hybrid $SIZE: $((ITERS * STEP_TOKENS)) tokens of Debian English (data/realtext)" \
        2>&1 | tee -a "$LOG" | tail -1
fi

$PY - "$RESULTS_DIR/realtext_summary.json" "$RUNS" "$DATA_DIR/$DATASET" "$ITERS" "$STEP_TOKENS" "$TINY" "${WALL[@]}" <<'EOF'
import json, math, os, re, statistics, subprocess, sys, time
from fileio import atomic_write  # stdin's script: the current directory (the repo root) is on sys.path
out, runs, data, iters, step_tokens, tiny, *walls = sys.argv[1:]
iters, step_tokens = int(iters), int(step_tokens)
log_text = open(os.path.join(os.path.dirname(out), "realtext_train.log"), errors="replace").read()
models, vals = {}, {}
for w in walls:
    name, rc, secs = w.split("=")
    recs = []
    path = os.path.join(runs, name, "log.jsonl")
    if os.path.isfile(path):
        recs = [json.loads(l) for l in open(path) if l.strip()]
    val = [(r["iter"], r["tokens"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    train = [r for r in recs if r.get("loss") is not None]
    tok_s = [r["tok_s"] for r in train[len(train) // 5:]]  # skip the first fifth: compile, warm-up
    m = re.search(rf"=== {name}: train\.py.*?\nmodel: ([\d.]+)M parameters", log_text, re.S)
    vals[name] = {it: v for it, _, v in val}
    models[name] = {
        "exit_code": int(rc), "wall_s": round(float(secs), 1),
        "params_M": float(m.group(1)) if m else None,
        "iters_done": train[-1]["iter"] if train else 0, "tokens_done": train[-1]["tokens"] if train else 0,
        "finished": bool(train) and train[-1]["iter"] >= iters and int(rc) == 0,
        "final_val_loss": val[-1][2] if val else None,
        "final_val_ppl": round(math.exp(val[-1][2]), 3) if val else None,
        "final_val_iter": val[-1][0] if val else None,
        "final_train_loss": train[-1]["loss"] if train else None,
        "tok_s_median": round(statistics.median(tok_s)) if tok_s else None,
        "peak_mem_gib": max((r.get("mem_gib", 0) for r in train), default=None),
        "val_curve": [[it, tok, round(v, 4)] for it, tok, v in val],
    }
common = set.intersection(*(set(v) for v in vals.values())) if vals else set()
last = max(common) if common else None
meta = {}
if os.path.isfile(os.path.join(data, "meta.json")):
    meta = json.load(open(os.path.join(data, "meta.json")))
def sh(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
try:
    from importlib.metadata import version
    torch_v = version("torch")
except Exception:  # not installed as a distribution: leave it out
    torch_v = None
summary = {
    "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    # one model per GPU; the host may have several (GPUS lanes): name one and count them
    "device": (lambda g: f"{g[0]} (host with {len(g)})" if len(g) > 1 else (g[0] if g else "cpu"))(
        (sh(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]) or "").splitlines()),
    "torch": torch_v, "tiny_smoke_test": tiny == "1",
    "command": "bash bench/realtext.sh", "iters": iters, "tokens_per_step": step_tokens,
    "tokens_per_model": iters * step_tokens,
    "fraction_of_paper_2B_tokens": round(iters * step_tokens / 2e9, 5),
    "data": {k: meta.get(k) for k in ("train_tokens", "val_tokens", "train_documents", "val_documents",
                                       "tokenizer", "tokenizer_sha256") if k in meta},
    "same_tokens_all": len({m["tokens_done"] for m in models.values()}) == 1,
    "compare_at_iter": last,
    "compare_at_tokens": last * step_tokens if last is not None else None,
    "val_loss_at_compare": {n: round(vals[n][last], 4) for n in vals} if last is not None else {},
    "val_ppl_at_compare": {n: round(math.exp(vals[n][last]), 3) for n in vals} if last is not None else {},
    "models": models,
}
atomic_write(out, json.dumps(summary, indent=1))
print(f"at iter {last} ({summary['compare_at_tokens']} tokens): "
      + ", ".join(f"{n} val {v} (ppl {summary['val_ppl_at_compare'][n]})" for n, v in summary["val_loss_at_compare"].items()))
for n, m in models.items():
    print(f"  {n}: exit {m['exit_code']}, {m['iters_done']}/{iters} iters, {m['tok_s_median']} tok/s, {m['wall_s']} s")
EOF
ls -la "$RESULTS_DIR"
