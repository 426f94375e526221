#!/usr/bin/env bash
# ncu (full set) over one launch of each named case of tools/profile_ops.py; report in $OUT/ncu.txt.
set -u
OUT=${OUT:-/tmp/k3gen-out}
. "$(dirname "$0")/device_env.sh"
for c in ${CASES:-mla-bf16 mla-fp8 mla-nvfp4 mla-h128 gemm-m1 gemm-m128 gemm-qkvg-m8}; do
  echo "=== $c"
  timeout 120 ncu --clock-control none --set full --launch-skip 1 --launch-count 1 \
    -k regex:"${KREGEX:-k3gen_(mla_decode|fp8_block_gemm)$}" python3 "$(dirname "$0")/profile_ops.py" $c 2>&1 \
    | grep -v "^==WARNING\|ctc__"
done > "$OUT/ncu.txt" 2>&1
grep -c "Section: GPU Speed" "$OUT/ncu.txt"
