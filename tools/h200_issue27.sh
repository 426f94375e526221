#!/usr/bin/env bash
# Issue 27's H200 checks (docs/ROBUSTNESS.md if present; else the issue): the serving soak, the
# lossless / invariance / bounds-fuzz GPU tests, and the fuzz + reduced matrix under
# compute-sanitizer memcheck, racecheck and synccheck, and the invariant mode's price (tools/invariant_price.py).
# Steps by env (1 = run): SOAK, TESTS, PRICE, SAN; PAR=1 runs the steps and the three sanitizers at
# once (the GPU is mostly idle under each: launch-bound model steps, sanitizer-bound tests).
# Carry build-out.tar.xz (tools/prebuild_gpu.py) and build-acc.tar.xz (the tiny preset's kernels, which
# the soak runs). Logs go to $OUT; FUZZ_LOG collects the fuzz counts.
# SAN_FLAGS: more compute-sanitizer flags (e.g. '--racecheck-report all --print-limit 0', with SAN_K narrowing the -k to one test).
set -uo pipefail
OUT=${OUT:-/tmp/k3gen-out}
mkdir -p "$OUT"
for b in build-out build-acc; do [ -f $b.tar.xz ] && [ ! -d $b ] && tar xJf $b.tar.xz; done
. "$(dirname "$0")/device_env.sh"
export K3GEN_PREBUILT=$PWD/build-out:$PWD/build-acc FUZZ_LOG=$OUT/fuzz.jsonl
filt() { grep -vE "cuGetProcAddress|^=+ +(Saved host backtrace|Host Frame|in /)"; }
soak() {
  timeout ${SOAK_TIMEOUT:-240} python3 tools/soak.py --steps ${SOAK_STEPS:-2500} --slots ${SOAK_SLOTS:-8} \
    --arrive ${SOAK_ARRIVE:-0.3} --path kernel --device cuda 2>&1 | tail -20 > "$OUT/soak.log"; return ${PIPESTATUS[0]}
}
# T27_GROUPS: ';'-separated groups of test files, one pytest process each, at once (tests27-N.log).
tests() {
  local groups=${T27_GROUPS:-tests/gpu/test_fuzz_bounds.py tests/gpu/test_spec_lossless.py tests/gpu/test_model_invariance.py tests/gpu/test_model_chunked_prefill.py}
  local r=0 i=0 g p pids=()
  IFS=';' read -ra gs <<< "$groups"
  for g in "${gs[@]}"; do
    i=$((i + 1))
    ( timeout ${TEST_TIMEOUT:-250} python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 $g ${T27_K:+-k "$T27_K"} 2>&1 \
      | tail -40 > "$OUT/tests27-$i.log"; exit ${PIPESTATUS[0]} ) & pids+=($!)
  done
  for p in "${pids[@]}"; do wait $p || r=1; done
  cat "$OUT"/tests27-*.log > "$OUT/tests27.log"
  return $r
}
price() {
  local r=0 kv
  for kv in bf16 fp8; do
    timeout ${PRICE_TIMEOUT:-120} python3 tools/invariant_price.py --kv $kv 2>&1 | tail -8 >> "$OUT/price.log"
    r=$((r | ${PIPESTATUS[0]}))
  done
  return $r
}
san() {
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $1 --report-api-errors no ${SAN_FLAGS:-} \
    --error-exitcode 3 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -k "${SAN_K:-sanitize}" 2>&1 \
    | filt | tail -30 > "$OUT/$1.log"; return ${PIPESTATUS[0]}
}
jobs=()
[ "${SOAK:-1}" = 1 ] && jobs+=(soak)
[ "${TESTS:-1}" = 1 ] && jobs+=(tests)
[ "${PRICE:-1}" = 1 ] && jobs+=(price)
if [ "${SAN:-1}" = 1 ]; then for t in ${SAN_TOOLS:-memcheck racecheck synccheck}; do jobs+=("san $t"); done; fi
rc=0 pids=()
for j in "${jobs[@]}"; do
  if [ "${PAR:-0}" = 1 ]; then $j & pids+=($!); else $j; r=$?; echo "$j exit $r"; rc=$((rc | r)); fi
done
for k in "${!pids[@]}"; do wait ${pids[$k]}; r=$?; echo "${jobs[$k]} exit $r"; rc=$((rc | r)); done
for f in soak tests27 price memcheck racecheck synccheck; do [ -f "$OUT/$f.log" ] && { echo "== $f"; tail -${TAIL:-12} "$OUT/$f.log"; }; done
echo "h200_issue27.sh exit $rc"
exit $rc
