#!/usr/bin/env bash
# One device call under a hard deadline: issue 27's soak, tests and racecheck (tools/h200_issue27.sh,
# PAR=1) beside the batch / graphs / speculative grid of a trained checkpoint (carry it as
# ck/NAME.tar.xz; CK_NAME picks it). Everything under $OUT ends in all.tar.xz, even when a step
# runs out of time (the device returns at most 8 files). Usage: DEADLINE=540 bash tools/h200_check27_grid.sh
set -uo pipefail
OUT=${OUT:-/tmp/k3gen-out}
mkdir -p "$OUT" runs
T0=$(date +%s)
DEADLINE=${DEADLINE:-540}
for b in build-out build-acc; do [ -f $b.tar.xz ] && [ ! -d $b ] && tar xJf $b.tar.xz; done
name=${CK_NAME:-acc2}
[ -d runs/$name ] || tar xJf ck/$name.tar.xz -C runs
left=$((DEADLINE - 20))
(PAR=1 PRICE=0 SAN_TOOLS=${SAN_TOOLS:-racecheck} SAN_TIMEOUT=$left SOAK_TIMEOUT=$left TEST_TIMEOUT=$left \
  bash tools/h200_issue27.sh > "$OUT/i27.log" 2>&1) & side=$!
(
  . tools/device_env.sh
  export K3GEN_PREBUILT=$PWD/build-acc
  timeout $left python3 -m model eval --checkpoint runs/$name/checkpoint --path kernel --fp32 off \
    --kv "${GRID_KV:-bf16,nvfp4}" --ssm "${GRID_SSM:-fp32,bf16}" --batch 1,2,4,8,8g --spec 0,3 \
    --questions "${N_GRID:-60}" --out "$OUT/eval-grid" --max-seconds $((left - 40)) > "$OUT/eval-grid.log" 2>&1
  echo "eval exit $?" >> "$OUT/eval-grid.log"
) & ev=$!
wait $ev; wait $side
echo "after $(( $(date +%s) - T0 ))s"
grep -E "exit|passed|failed|SUMMARY|reproducible|steps \(" "$OUT"/i27.log "$OUT"/*.log 2>/dev/null | tail -30
cd "$OUT" && tar cJf /tmp/all.tar.xz . && find . -mindepth 1 -maxdepth 1 -exec rm -rf {} + && mv /tmp/all.tar.xz .
