#!/usr/bin/env bash
# mla_prefill A/B in one call: tools/ab_prefill.py legs alternating over PLEGS, each leg a tree:
# `new` = this tree with build-out, a name X = the tree run/xX with its bundle run/bX (unpacked from
# run/oldX.tar.xz when absent); then ncu (full set + SASS source counters, tools/ncu_source.sh) of
# this tree's kernel on NCU_CASES (tools/profile_ops.py cases).
# Prepare a tree X here: mkdir -p run/xX && git archive <commit> | tar -x -C run/xX; run/bX = that
# tree's mla_prefill bundle (cd run/xX && PYTHONPATH=$PWD ../../.venv/bin/python tools/prebuild_gpu.py
# ../bX --ops mla_prefill); tar cJf run/oldX.tar.xz -C run xX bX.
# On the device: PLEGS="X new X new" bash tools/h200_prefill_ab.sh (logs: $OUT/abp.log, $OUT/ncu_<case>*).
set -uo pipefail
OUT=${OUT:-/tmp/k3gen-out}; mkdir -p "$OUT"
[ -d build-out ] || tar xJf build-out.tar.xz
. "$(dirname "$0")/device_env.sh"
ROOT=$PWD T0=$(date +%s)
for l in ${PLEGS:-O new O new}; do
  if [ "$l" = new ]; then timeout 120 python3 tools/ab_prefill.py new
  else
    [ -d run/x$l ] || tar xJf run/old$l.tar.xz -C run
    (cd run/x$l && PYTHONPATH=$PWD:/tmp/site K3GEN_PREBUILT=$ROOT/run/b$l:$ROOT/build-out timeout 120 \
      python3 "$ROOT/tools/ab_prefill.py" $l)
  fi 2>&1 | grep -E "^AB|Error|error" | tail -20 >> "$OUT/abp.log"
done
echo "prefill ab done $(( $(date +%s) - T0 ))s" >> "$OUT/abp.log"
for c in ${NCU_CASES-prefill-h96}; do CASE=$c KREGEX='k3gen_mla_prefill$' bash tools/ncu_source.sh; done
echo "prefill ncu done $(( $(date +%s) - T0 ))s" >> "$OUT/abp.log"
