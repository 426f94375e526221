#!/usr/bin/env bash
# Issue 23 (and 27's soak and tests beside it) in one device call of at most ~590 s, for when machines
# are scarce: train variants at once (tools/h200_train_sweep.sh, MINUTES each), then evaluate the best
# (tools/h200_eval_best.sh) in what is left; tools/h200_issue27.sh (soak, tests, price; SAN=0) runs
# alongside on the same GPU. $OUT ends as all.tar.xz and the variants' NAME.tar.xz. Usage: bash tools/h200_accuracy_onecall.sh VARIANT...
set -uo pipefail
OUT=${OUT:-/tmp/k3gen-out}
mkdir -p "$OUT"
T0=$(date +%s)
if [ -n "${INIT_TAR:-}" ]; then   # a finished run (NAME.tar.xz of a sweep) to start from: INIT=its checkpoint/
  mkdir -p /tmp/init && tar xJf "$INIT_TAR" -C /tmp/init && export INIT=$(ls -d /tmp/init/*/checkpoint | head -1)
fi
(SAN=${I27_SAN:-0} SOAK_TIMEOUT=${SOAK_TIMEOUT:-200} TEST_TIMEOUT=${TEST_TIMEOUT:-200} PRICE_TIMEOUT=40 \
  bash tools/h200_issue27.sh > "$OUT/i27.log" 2>&1) & side=$!
MINUTES=${MINUTES:-4.5} STOP_AFTER=${STOP_AFTER:-330} bash tools/h200_train_sweep.sh "$@" > "$OUT/sweep.log" 2>&1
grep -E "probe|exit" "$OUT/sweep.log" | tail -12
left=$(( ${TOTAL_S:-585} - ($(date +%s) - T0) ))
echo "eval budget ${left}s"
SAN=0 PACK=0 BUDGET_S=$left N_MAIN=${N_MAIN:-400} N_GRID=${N_GRID:-60} GRID_KV=${GRID_KV:-nvfp4} GRID_SSM=${GRID_SSM:-bf16} \
  bash tools/h200_eval_best.sh; rc=$?
wait $side
tail -12 "$OUT/i27.log"
# the variants' NAME.tar.xz stay separate files (the device returns files of at most 16 MiB each)
cd "$OUT" && tar cJf /tmp/all.tar.xz --exclude='./*.tar.xz' . && find . -mindepth 1 -maxdepth 1 ! -name '*.tar.xz' \
  -exec rm -rf {} + && mv /tmp/all.tar.xz .
exit $rc
