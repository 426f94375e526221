#!/usr/bin/env bash
# The accuracy run of issue 23 on the H200 (docs/ACCURACY.md): train the acc model, then evaluate it.
# Carry build-acc.tar.xz: the kernels of the acc model, which are the tiny preset's, built on the CPU:
#   k3gen build --arch sm90 --model tiny --drafts 0,3 --out build-acc && tar cJf build-acc.tar.xz build-acc
# Usage on the device (each a call of at most 10 minutes):
#   bash tools/h200_accuracy.sh train     # MINUTES (default 8) of training; resumes if RUN/state.pt exists
#   bash tools/h200_accuracy.sh eval      # the table: FP32 reference + kernel path grid, within ~9 minutes
# What comes back in $OUT: train.log, train_log.jsonl, summary.json, checkpoint/ (the trained model in the
# official MXFP4 layout), fp32.safetensors (the master weights), eval-main/, eval-grid/, eval/ (merged table).
# The eval call's cell times are estimates until the first run: each cell's seconds are in the table; cells
# that would start past the budget are skipped (the last batch / speculative settings of every group first).
set -uo pipefail
OUT=${OUT:-/tmp/k3gen-out}
RUN=${RUN:-runs/acc}
mkdir -p "$OUT"
if [ -f build-acc.tar.xz ] && [ ! -d build-acc ]; then tar xJf build-acc.tar.xz; fi
. "$(dirname "$0")/device_env.sh"
export K3GEN_PREBUILT=$PWD/build-acc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/smi.txt"
# Overrides for a dry run on a CPU (docs/ACCURACY.md): CONFIG=toy, EVAL_PATH=reference, MAIN_BATCH=8,
# GRID_BATCH=1,2, GRID_KV / GRID_SSM (the grid's dtypes), LENGTHS=64,128, N_MAIN / N_GRID small,
# MAIN_PCT (the main part's share of BUDGET_S), CK / FP another checkpoint.
EVAL_PATH=${EVAL_PATH:-kernel}
T0=$(date +%s)
left() { echo $(( ${BUDGET_S:-570} - ($(date +%s) - T0) )); }
rc=0
case "${1:-}" in
  train)
    args=(--config "${CONFIG:-acc}" --out "$RUN" --minutes "${MINUTES:-8}" --stop-after "${STOP_AFTER:-555}")
    [ -f "$RUN/state.pt" ] && args+=(--resume)
    python3 -m model train "${args[@]}" 2>&1 | tee "$OUT/train.log"; rc=${PIPESTATUS[0]}
    cp "$RUN/train_log.jsonl" "$RUN/summary.json" "$OUT/" 2>/dev/null
    if [ -d "$RUN/checkpoint" ]; then cp -r "$RUN/checkpoint" "$OUT/"; cp "$RUN/fp32.safetensors" "$OUT/"; fi
    ;;
  eval)
    CK=${CK:-$RUN/checkpoint}
    FP=${FP:-$RUN/fp32.safetensors}
    [ -d "$CK" ] || { echo "no checkpoint at $CK: run 'train' first (or carry it and set CK=, FP=)"; exit 2; }
    common=(--checkpoint "$CK" --path "$EVAL_PATH" ${LENGTHS:+--lengths "$LENGTHS"})
    fp=(); [ -f "$FP" ] && fp=(--fp32-weights "$FP")
    # 1. FP32 reference (checkpoint values and FP32 master weights) + every KV x SSM dtype, batch 8 on graphs
    python3 -m model eval "${common[@]}" "${fp[@]}" --kv bf16,fp8,nvfp4 --ssm fp32,bf16 --batch "${MAIN_BATCH:-8g}" --spec 0 \
      --questions "${N_MAIN:-1000}" --out "$OUT/eval-main" --max-seconds $(( $(left) * ${MAIN_PCT:-47} / 100 )) 2>&1 \
      | tee "$OUT/eval-main.log"
    rc=$((rc | ${PIPESTATUS[0]}))
    # 2. batch 1/2/4/8 eager and 8 on graphs x plain / n-gram speculative decoding, on fewer questions
    python3 -m model eval "${common[@]}" --fp32 off --kv "${GRID_KV:-bf16,fp8,nvfp4}" --ssm "${GRID_SSM:-fp32,bf16}" \
      --batch "${GRID_BATCH:-1,2,4,8,8g}" --spec 0,3 \
      --questions "${N_GRID:-200}" --out "$OUT/eval-grid" --max-seconds $(( $(left) > 60 ? $(left) - 30 : 30 )) 2>&1 | tee "$OUT/eval-grid.log"
    rc=$((rc | ${PIPESTATUS[0]}))
    python3 -m model eval --merge "$OUT/eval-main" "$OUT/eval-grid" --out "$OUT/eval" 2>&1 | tee "$OUT/eval.log"
    ;;
  *)
    echo "usage: bash tools/h200_accuracy.sh train|eval"; exit 2 ;;
esac
echo "h200_accuracy.sh $1 exit $rc after $(( $(date +%s) - T0 ))s"
exit $rc
