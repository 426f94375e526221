#!/usr/bin/env bash
# Issue 25: the wgmma_qm fused combine (bench/notes/patches/mla_qm_fused_combine.patch) on the GPU, in one
# call: A/B against main (two legs each, tools/ab_mla.py: H12 T1 B32/B128 L8K), then in parallel the
# patched tree's tests/gpu/test_mla_decode.py, the three sanitizers over its wgmma_qm sanitize cases
# and the fused-combine test, and (issue 27) main's tests/gpu/test_fuzz_bounds.py. Prepare here (CPU), then carry build-out.tar.xz, .whl and run/fused.tar.xz:
#   .venv/bin/python tools/prebuild_gpu.py build-out && tar cJf build-out.tar.xz build-out
#   mkdir -p run/xF && git archive HEAD | tar -x -C run/xF && (cd run/xF && patch -p1 \
#     < ../../bench/notes/patches/mla_qm_fused_combine.patch && PYTHONPATH=$PWD ../../.venv/bin/python \
#     tools/prebuild_gpu.py ../bF --ops mla_decode,kv_cache_write,mla_prefill)
#   tar cJf run/fused.tar.xz -C run xF bF
# and, for the probe (optional): a copy of main with tools/probe/qm_globaltimer.patch, its bundle
# (--ops mla_decode) as run/bProbe, both in run/probe.tar.xz (tools/probe/probe_qm.py's docstring).
# On the device: DEADLINE=560 bash tools/h200_fused.sh
set -uo pipefail
T0=${T0:-$(date +%s)}   # the caller may start the deadline clock earlier
OUT=${OUT:-/tmp/k3gen-out}; mkdir -p "$OUT"
[ -d build-out ] || tar xJf build-out.tar.xz
[ -d run/xF ] || tar xJf run/fused.tar.xz -C run
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/dev.log"
ROOT=$PWD
leg() {
  if [ $1 = fused ]; then
    (cd run/xF && PYTHONPATH=$PWD:/tmp/site K3GEN_PREBUILT=$ROOT/run/bF:$ROOT/build-out timeout 90 python3 tools/ab_mla.py fused)
  else timeout 90 python3 tools/ab_mla.py main; fi
}
for l in ${LEGS:-main fused main fused}; do leg $l 2>&1 | grep -E "^AB|Error|error" | tail -8 >> "$OUT/ab.log"; done
echo "ab done $(( $(date +%s) - T0 ))s" >> "$OUT/ab.log"
# Optional: the %globaltimer probe (tools/probe/probe_qm.py) where run/probe.tar.xz holds xProbe + bProbe.
if [ -f run/probe.tar.xz ]; then
  [ -d run/xProbe ] || tar xJf run/probe.tar.xz -C run
  (cd run/xProbe && PYTHONPATH=$PWD:/tmp/site K3GEN_PREBUILT=$ROOT/run/bProbe timeout 60 python3 tools/probe/probe_qm.py \
    2>&1 | grep -E "^PROBE|Error" > "$OUT/probe.log")
fi
LEFT=$(( ${DEADLINE:-560} - ($(date +%s) - T0) - 15 ))
pids=()
# Issue 27's hypothesis fuzz on main's kernels (its EP fix, 0fadf9f, has not run on a GPU yet).
(FUZZ_LOG=$OUT/fuzz.jsonl timeout $LEFT python3 -m pytest -m gpu -q -p no:cacheprovider -n 2 tests/gpu/test_fuzz_bounds.py 2>&1 | tail -30 \
  > "$OUT/fuzz.log"; echo "fuzz exit ${PIPESTATUS[0]} $(( $(date +%s) - T0 ))s" >> "$OUT/fuzz.log") & pids+=($!)
# MAIN_TESTS: more of main's GPU test files to run meanwhile (e.g. tests/gpu/test_mla_prefill.py);
# FUZZ_SAN=1: the fuzz's reduced part under memcheck as well.
if [ -n "${MAIN_TESTS:-}" ]; then
  (timeout $LEFT python3 -m pytest -m gpu -q -p no:cacheprovider -n 2 $MAIN_TESTS 2>&1 | tail -30 > "$OUT/main_tests.log"
   echo "main tests exit ${PIPESTATUS[0]} $(( $(date +%s) - T0 ))s" >> "$OUT/main_tests.log") & pids+=($!)
fi
if [ "${FUZZ_SAN:-0}" = 1 ]; then
  (PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $LEFT compute-sanitizer --tool memcheck --report-api-errors no \
     --error-exitcode 3 python3 -m pytest -m gpu tests/gpu/test_fuzz_bounds.py -q -p no:cacheprovider -k sanitize 2>&1 \
     | grep -vE "cuGetProcAddress|^=+ +(Saved host backtrace|Host Frame|in /)" | tail -30 > "$OUT/fuzz_memcheck.log"
   echo "fuzz memcheck exit ${PIPESTATUS[0]} $(( $(date +%s) - T0 ))s" >> "$OUT/fuzz_memcheck.log") & pids+=($!)
fi
cd run/xF
export PYTHONPATH=$PWD:/tmp/site K3GEN_PREBUILT=$ROOT/run/bF:$ROOT/build-out
filt() { grep -vE "cuGetProcAddress|^=+ +(Saved host backtrace|Host Frame|in /)"; }
san() {
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $LEFT compute-sanitizer --tool $1 --report-api-errors no \
    --error-exitcode 3 python3 -m pytest -m gpu tests/gpu/test_mla_decode.py -q -p no:cacheprovider \
    -k "(sanitize and wgmma_qm) or fused" 2>&1 | filt | tail -40 > "$OUT/$1.log"
  echo "san $1 exit ${PIPESTATUS[0]} $(( $(date +%s) - T0 ))s" >> "$OUT/$1.log"
}
for t in ${SANS:-racecheck synccheck memcheck}; do san $t & pids+=($!); done
(timeout $LEFT python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/gpu/test_mla_decode.py 2>&1 | tail -30 \
  > "$OUT/mla.log"; echo "mla exit ${PIPESTATUS[0]} $(( $(date +%s) - T0 ))s" >> "$OUT/mla.log") & pids+=($!)
for p in "${pids[@]}"; do wait $p; done
echo "total $(( $(date +%s) - T0 ))s"
grep -hE "exit|passed|failed|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT"/*.log | tail -30
cat "$OUT/ab.log"
