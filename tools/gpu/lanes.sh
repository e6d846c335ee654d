#!/usr/bin/env bash
# validate.sh phases side by side on the one GPU host, so one device call holds more of them:
#
#   bash tools/gpu/install.sh && LANES_LIMIT_S=480 bash tools/gpu/lanes.sh smoke@0 faults-sglang@100 art-tiny@160
#
# Each argument is a lane, PHASE[+PHASE...][@SECONDS]: its phases run one after the other (one
# validate.sh) starting SECONDS in (stagger SGLang starts so the first one JIT-compiles the kernels
# the others then find in the cache). SGLang's memory fraction is of the memory free at its start,
# so servers of several lanes fit on one GPU; their step times are then those of a shared GPU.
# A lane still running at LANES_LIMIT_S (default 480) is stopped. Each lane writes under
# $OUT/<lane>/ and its PASS/FAIL lines to $OUT/<lane>.txt; all are printed at the end. Exit status:
# the number of lanes that failed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 99
O=${OUT:-/tmp/artsg-out}
LIMIT=${LANES_LIMIT_S:-480}
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
