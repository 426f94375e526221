#!/usr/bin/env bash
# Issue 27's model-level GPU tests alone (spec == greedy bitwise, batch invariance: 41 cases, 17 of them
# model runs that never finished beside the sanitizers), with per-test durations, then the invariant
# mode's price for FP8 KV. Carry build-out.tar.xz (tools/prebuild_gpu.py) and .whl/.
#   DEADLINE=560 bash tools/h200_model27.sh     (WORKERS: xdist workers, 3 by default: each model test
#   is launch-bound on one GPU, so more processes only time-slice it)
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/k3gen-out}; mkdir -p "$OUT"
[ -d build-out ] || tar xJf build-out.tar.xz
. "$(dirname "$0")/device_env.sh"
export K3GEN_PREBUILT=$PWD/build-out
left() { echo $(( ${DEADLINE:-560} - ($(date +%s) - T0) - ${1:-0} )); }
timeout $(left ${PRICE_S:-120}) python3 -m pytest -m gpu -q -p no:cacheprovider -n ${WORKERS:-3} --durations=0 \
  tests/gpu/test_spec_lossless.py tests/gpu/test_model_invariance.py 2>&1 | grep -vE "Warning|warner" \
  | tail -70 > "$OUT/model27.log"
echo "tests exit ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> "$OUT/model27.log"
timeout $(left 5) python3 tools/invariant_price.py --kv ${PRICE_KV:-fp8} 2>&1 | tail -8 > "$OUT/price.log"
echo "price exit ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> "$OUT/price.log"
tail -25 "$OUT/model27.log"; cat "$OUT/price.log"
