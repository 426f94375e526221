#!/usr/bin/env bash
# Issue 27's H200 checks (docs/ROBUSTNESS.md if present; else the issue): the serving soak, the
# lossless / invariance / bounds-fuzz GPU tests, and the fuzz + reduced matrix under
# compute-sanitizer memcheck, racecheck and synccheck, and the invariant mode's price (tools/invariant_price.py).
# Steps by env (1 = run): SOAK, TESTS, PRICE, SAN.
# Carry build-out.tar.xz (tools/prebuild_gpu.py) and build-acc.tar.xz (the tiny preset's kernels, which
# the soak runs). Logs go to $OUT; FUZZ_LOG collects the fuzz counts.
set -uo pipefail
OUT=${OUT:-/tmp/k3gen-out}
mkdir -p "$OUT"
for b in build-out build-acc; do [ -f $b.tar.xz ] && [ ! -d $b ] && tar xJf $b.tar.xz; done
. "$(dirname "$0")/device_env.sh"
export K3GEN_PREBUILT=$PWD/build-out:$PWD/build-acc FUZZ_LOG=$OUT/fuzz.jsonl
rc=0
filt() { grep -vE "cuGetProcAddress|^=+ +(Saved host backtrace|Host Frame|in /)"; }
if [ "${SOAK:-1}" = 1 ]; then
  timeout ${SOAK_TIMEOUT:-240} python3 tools/soak.py --steps ${SOAK_STEPS:-2500} --path kernel --device cuda 2>&1 \
    | tail -20 | tee "$OUT/soak.log"; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-250} python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 ${T27_FILES:-tests/gpu/test_fuzz_bounds.py \
    tests/gpu/test_spec_lossless.py tests/gpu/test_model_invariance.py tests/gpu/test_model_chunked_prefill.py} 2>&1 \
    | tail -40 | tee "$OUT/tests27.log"; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "${PRICE:-1}" = 1 ]; then
  for kv in bf16 fp8; do
    timeout ${PRICE_TIMEOUT:-120} python3 tools/invariant_price.py --kv $kv 2>&1 | tail -8 | tee -a "$OUT/price.log"
    rc=$((rc | ${PIPESTATUS[0]}))
  done
fi
if [ "${SAN:-1}" = 1 ]; then
  for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --report-api-errors no \
      --error-exitcode 3 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -k "${SAN_K:-sanitize}" 2>&1 \
      | filt | tail -30 | tee "$OUT/$tool.log"; rc=$((rc | ${PIPESTATUS[0]}))
  done
fi
echo "h200_issue27.sh exit $rc"
exit $rc
