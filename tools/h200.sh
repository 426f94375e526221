#!/usr/bin/env bash
# The GPU run on the H200: GPU test tier, compute-sanitizer on a reduced matrix, benchmarks.
# Expects cubins built here with `k3gen build --arch sm90 --out build-out` (the H200's driver
# rejects PTX from NVRTC 13.5 but loads its cubins) and wheels of missing packages in .whl/.
# Usage on the device: bash tools/h200.sh [pytest -k expression]
set -uo pipefail
OUT=${OUT:-/tmp/k3gen-out}
mkdir -p "$OUT"
# The whole bundle is ~60 MB, over the device's 64 MiB carry with the tree: carry build-out.tar.xz
# (tar cJf build-out.tar.xz build-out, ~5 MB) instead and it is unpacked here.
if [ -f build-out.tar.xz ] && [ ! -d build-out ]; then tar xJf build-out.tar.xz; fi
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/smi.txt"
python3 -m k3gen collect-env | tee "$OUT/env.txt"
rc=0
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu tests/gpu -q --maxfail=${MAXFAIL:-30} -p no:cacheprovider \
    ${1:+-k "$1"} 2>&1 | tee "$OUT/gpu_tests.log"; rc=$((rc | ${PIPESTATUS[0]}))
fi
for op in ${BENCH_OPS:-kda_decode kv_cache_write act_quant_fp8 moe_route attn_res}; do
  timeout ${BENCH_TIMEOUT:-200} python3 -m bench --op "$op" --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench_$op.log"; rc=$((rc | ${PIPESTATUS[0]}))
done
if [ "${SANITIZE:-1}" = 1 ]; then
  # Memcheck over the reduced matrices; torch's caching allocator off so it cannot hide OOB accesses.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool memcheck --report-api-errors no \
    --error-exitcode 3 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -k "sanitize" 2>&1 \
    | grep -vE "cuGetProcAddress|^=+ +(Saved host backtrace|Host Frame|in /)" | tail -40 | tee "$OUT/memcheck.log"
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "${RACECHECK:-1}" = 1 ]; then
  # Shared-memory races and barrier misuse on the same reduced matrix (issue 27). Not yet run on the H200.
  for tool in racecheck synccheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --report-api-errors no \
      --error-exitcode 3 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -k "sanitize" 2>&1 \
      | grep -vE "cuGetProcAddress|^=+ +(Saved host backtrace|Host Frame|in /)" | tail -40 | tee "$OUT/$tool.log"
    rc=$((rc | ${PIPESTATUS[0]}))
  done
fi
echo "h200.sh exit $rc"
exit $rc
