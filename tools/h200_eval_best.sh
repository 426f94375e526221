#!/usr/bin/env bash
# After tools/h200_train_sweep.sh: evaluate the variant whose final probe answered the most retrieval
# (then arithmetic) questions, with the sanitizer part of tools/h200_issue27.sh beside it (the eval is
# light on the GPU). If the machine went cold, carry the sweep's NAME.tar.xz files in ck/ (no FP32
# master rows then). Everything under $OUT ends in all.tar.xz (the device returns at most 8 files).
set -uo pipefail
OUT=${OUT:-/tmp/k3gen-out}
mkdir -p "$OUT"
if [ ! -d runs ]; then mkdir -p runs; for t in ck/*.tar.xz; do tar xJf "$t" -C runs; done; fi
best=$(python3 - <<'PY'
import glob, json
r = []
for f in glob.glob("runs/*/summary.json"):
    p = json.load(open(f)).get("final_probe") or {}
    r.append(((p.get("retrieval", 0), p.get("arith", 0)), f.split("/")[1]))
print(max(r)[1] if r else "")
PY
)
echo "best variant: ${best:-none}" | tee "$OUT/best.txt"
[ -n "$best" ] || exit 2
pid=
if [ "${SAN:-1}" = 1 ]; then
  (SOAK=0 TESTS=0 PRICE=0 SAN_TIMEOUT=${SAN_TIMEOUT:-130} bash tools/h200_issue27.sh > "$OUT/san.log" 2>&1) & pid=$!
fi
RUN=runs/$best BUDGET_S=${BUDGET_S:-430} bash tools/h200_accuracy.sh eval > "$OUT/evalcall.log" 2>&1; rc=$?
[ -n "$pid" ] && wait $pid
grep -E "exit|Summary|passed|failed|ERROR SUMMARY" "$OUT/san.log" 2>/dev/null | tail -8
tail -25 "$OUT/evalcall.log"
if [ "${PACK:-1}" = 1 ]; then
  cd "$OUT" && tar cJf /tmp/all.tar.xz . && find . -mindepth 1 -maxdepth 1 -exec rm -rf {} + && mv /tmp/all.tar.xz .
fi
exit $rc
