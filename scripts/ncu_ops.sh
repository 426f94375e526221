#!/usr/bin/env bash
# ncu (full set) over one launch of each named case of scripts/profile_ops.py; report in $OUT/ncu.txt.
set -u
OUT=${OUT:-/tmp/k3gen-out}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} K3GEN_GPU=1 K3GEN_PREBUILT=$PWD/build-out K3GEN_DISABLE_JIT=1
export K3GEN_CACHE_DIR=/tmp/k3gen-cache
for c in ${CASES:-mla-bf16 mla-fp8 mla-nvfp4 mla-h128 gemm-m1 gemm-m128 gemm-qkvg-m8}; do
  echo "=== $c"
  timeout 120 ncu --clock-control none --set full --launch-skip 1 --launch-count 1 \
    -k regex:"${KREGEX:-k3gen_(mla_decode|fp8_block_gemm)$}" python3 scripts/profile_ops.py $c 2>&1 \
    | grep -v "^==WARNING\|ctc__"
done > "$OUT/ncu.txt" 2>&1
grep -c "Section: GPU Speed" "$OUT/ncu.txt"
