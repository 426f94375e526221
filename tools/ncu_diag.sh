#!/usr/bin/env bash
# ncu over one launch (after one warm-up) of named tools/profile_ops.py cases: the full section
# set into $OUT/ncu_full.txt, and a second pass of headline metrics (DRAM read/write, L2, tensor
# pipe, issue, every warp-stall reason per issued instruction) into $OUT/ncu_diag.txt.
# Usage: CASES="verify-b128 gemm-m128" bash tools/ncu_diag.sh
set -u
OUT=${OUT:-/tmp/k3gen-out}
. "$(dirname "$0")/device_env.sh"
st=smsp__average_warps_issue_stalled
reasons="long_scoreboard short_scoreboard barrier membar mio_throttle lg_throttle wait math_pipe_throttle not_selected selected drain sleeping dispatch_stall no_instruction tex_throttle imc_miss branch_resolving misc"
m="gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
m="$m,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
m="$m,sm__inst_executed.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active"
for r in $reasons; do m="$m,${st}_${r}_per_issue_active.ratio"; done
for c in ${CASES:-verify-b128 verify-b32 gemm-m128}; do
  echo "=== $c"
  timeout 150 ncu --clock-control none --set full --launch-skip 1 --launch-count 1 \
    -k regex:"${KREGEX:-k3gen_}" python3 "$(dirname "$0")/profile_ops.py" $c 2>&1 | grep -v "^==WARNING\|ctc__"
done > "$OUT/ncu_full.txt" 2>&1
for c in ${CASES:-verify-b128 verify-b32 gemm-m128}; do
  echo "=== $c"
  timeout 150 ncu --clock-control none --metrics "$m" --launch-skip 1 --launch-count 1 \
    -k regex:"${KREGEX:-k3gen_}" python3 "$(dirname "$0")/profile_ops.py" $c 2>&1 | grep -v "^==WARNING\|ctc__"
done > "$OUT/ncu_diag.txt" 2>&1
wc -l "$OUT"/ncu_*.txt
