#!/usr/bin/env bash
# Train several variants of the acc model at once on the H200 (docs/ACCURACY.md): the training step is
# launch-bound at these sizes, so concurrent runs share the GPU at little cost each. One variant per
# argument, NAME[@CONFIG]:SET,SET,... where each SET is a `--set` override of `python -m model train`
# and CONFIG a preset (default $CONFIG or acc), e.g.
#   bash tools/h200_train_sweep.sh base: k1@acc-k1: lr:lr=3e-3,warmup=100
# Each trains MINUTES (default 7) into runs/NAME; $OUT/NAME.tar.xz holds its logs, summary and
# checkpoint/ (the MXFP4 layout); fp32.safetensors stays in runs/NAME for an eval call on the same machine.
# INIT=DIR starts every variant from a finished run's weights (`python -m model train --init`).
set -uo pipefail
OUT=${OUT:-/tmp/k3gen-out}
mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/smi.txt"
pids=()
for v in "$@"; do
  head=${v%%:*}; sets=${v#*:}; name=${head%@*}; cfg=${CONFIG:-acc}
  [[ $head == *@* ]] && cfg=${head#*@}
  args=(--config "$cfg" --out "runs/$name" --minutes "${MINUTES:-7}" --stop-after "${STOP_AFTER:-540}")
  IFS=, read -ra list <<< "$sets"
  for s in "${list[@]}"; do [ -n "$s" ] && args+=(--set "$s"); done
  [ -f "runs/$name/state.pt" ] && args+=(--resume)
  [ -n "${INIT:-}" ] && args+=(--init "$INIT")   # a finished run's checkpoint/ to start from
  python3 -m model train "${args[@]}" > "$OUT/train-$name.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for v in "$@"; do
  head=${v%%:*}; name=${head%@*}
  tar cJf "$OUT/$name.tar.xz" --exclude=state.pt --exclude=fp32.safetensors -C runs "$name" 2>/dev/null
  grep -E "probe|done|Error" "$OUT/train-$name.log" | tail -4
done
echo "h200_train_sweep.sh exit $rc"
exit $rc
