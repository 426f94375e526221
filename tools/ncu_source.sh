#!/usr/bin/env bash
# ncu (full set + per-SASS-instruction source counters) over one launch of a tools/profile_ops.py
# case: $OUT/ncu_<case>.txt (sections) and $OUT/ncu_<case>_sass.csv (stall samples per instruction).
# Usage on the device: CASE=mla-fp8-wg bash tools/ncu_source.sh
set -u
OUT=${OUT:-/tmp/k3gen-out}
. "$(dirname "$0")/device_env.sh"
c=${CASE:-mla-fp8-wg}
timeout 240 ncu --clock-control none --set full --import-source no --launch-skip 1 --launch-count 1 \
  -k regex:"${KREGEX:-k3gen_(mla_decode|fp8_block_gemm)$}" -o "/tmp/ncu_$c" -f python3 "$(dirname "$0")/profile_ops.py" "$c" \
  2>&1 | grep -v "^==WARNING" | tail -5
ncu -i "/tmp/ncu_$c.ncu-rep" --print-summary none 2>&1 | grep -v "ctc__" > "$OUT/ncu_$c.txt"
ncu -i "/tmp/ncu_$c.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_${c}_sass.csv" 2>&1
wc -l "$OUT/ncu_$c.txt" "$OUT/ncu_${c}_sass.csv"
