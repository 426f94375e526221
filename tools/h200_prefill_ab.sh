#!/usr/bin/env bash
# mla_prefill A/B in one call: the tree run/xO with its bundle run/bO (the old kernels) against this
# tree and build-out (the new), tools/ab_prefill.py legs alternating (PLEGS), then ncu (full set +
# SASS source counters, tools/ncu_source.sh) of this tree's kernel on NCU_CASES (tools/profile_ops.py).
# Prepare here: mkdir -p run/xO && git archive <old> | tar -x -C run/xO; run/bO = the old bundle's
# mla_prefill cubins with their bundle.json entries; tar cJf run/old.tar.xz -C run xO bO.
# OLD=M uses run/xM, run/bM and run/oldM.tar.xz instead (another baseline).
# On the device: bash tools/h200_prefill_ab.sh (logs: $OUT/abp.log, $OUT/ncu_<case>*).
set -uo pipefail
OUT=${OUT:-/tmp/k3gen-out}; mkdir -p "$OUT"
[ -d build-out ] || tar xJf build-out.tar.xz
O=${OLD:-O}
[ -d run/x$O ] || tar xJf run/old${OLD:-}.tar.xz -C run
. "$(dirname "$0")/device_env.sh"
ROOT=$PWD T0=$(date +%s)
for l in ${PLEGS:-old new old new}; do
  if [ "$l" = old ]; then
    (cd run/x$O && PYTHONPATH=$PWD:/tmp/site K3GEN_PREBUILT=$ROOT/run/b$O:$ROOT/build-out timeout 120 \
      python3 "$ROOT/tools/ab_prefill.py" old)
  else timeout 120 python3 tools/ab_prefill.py new; fi 2>&1 | grep -E "^AB|Error|error" | tail -20 >> "$OUT/abp.log"
done
echo "prefill ab done $(( $(date +%s) - T0 ))s" >> "$OUT/abp.log"
for c in ${NCU_CASES-prefill-h96}; do CASE=$c KREGEX='k3gen_mla_prefill$' bash tools/ncu_source.sh; done
echo "prefill ncu done $(( $(date +%s) - T0 ))s" >> "$OUT/abp.log"
