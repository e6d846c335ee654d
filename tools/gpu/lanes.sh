#!/usr/bin/env bash
# validate.sh phases side by side on the one GPU host, so one device call holds more of them:
#
#   bash tools/gpu/install.sh && LANES_LIMIT_S=480 bash tools/gpu/lanes.sh smoke@0 faults-sglang-loop@100
#
# Each argument is a lane, PHASE[+PHASE...][@SECONDS]: its phases run one after the other (one
# validate.sh) starting SECONDS in (stagger SGLang starts so the first one JIT-compiles the kernels
# the others then find in the cache). SGLang's memory fraction is of the memory free at its start,
# so servers of several lanes fit on one GPU; their step times are then those of a shared GPU.
# GPU memory is the limit: every server takes 0.45 of what is free at its start and every trainer
# needs its own, so the servers of later lanes, and trainers that start after them, run out (on the
# H200, 2026-12-04: smoke + two fault lanes + notebook 05, up to ~6 servers at once, gave CUDA OOM
# and "no GPU memory for the KV cache"; every failure of that call came from it). So at most two
# lanes run unless LANES_FORCE=1, and a lane's results are a shared GPU's.
# A lane still running at LANES_LIMIT_S (default 480) is stopped. Each lane writes under
# $OUT/<lane>/ and its PASS/FAIL lines to $OUT/<lane>.txt; all are printed at the end. Exit status:
# the number of lanes that failed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 99
O=${OUT:-/tmp/artsg-out}
LIMIT=${LANES_LIMIT_S:-480}
if (( $# > 2 )) && [[ ${LANES_FORCE:-0} != 1 ]]; then
  echo "lanes.sh: $# lanes would share one GPU's memory (see the top of this file); run at most 2, or set LANES_FORCE=1" >&2
  exit 2
fi
declare -A PID
for lane in "$@"; do
  phases=${lane%@*}; at=0; [[ $lane == *@* ]] && at=${lane##*@}
  name=${phases//+/-}; mkdir -p "$O/$name"
  (sleep "$at"; echo "[$(date +%H:%M:%S)] lane $name starts"
   OUT="$O/$name" exec timeout -k 5 $((LIMIT - at)) bash tools/gpu/validate.sh ${phases//+/ }) >"$O/$name.txt" 2>&1 &
  PID[$name]=$!
done
failed=0
for name in "${!PID[@]}"; do wait "${PID[$name]}" || failed=$((failed + 1)); done
for name in "${!PID[@]}"; do echo "== lane $name"; cat "$O/$name.txt"; done
exit $failed
