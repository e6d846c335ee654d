#!/usr/bin/env bash
# Issue 26, build item 5: same-host A/B of the step benchmark's 8-token pipelined leg
# (python -m artsg_nb.bench.step) under two or more variants ("arms") of the kernel's process, the arms
# alternated for AB_ROUNDS rounds (default 2). AB_ARMS (default "staged plain") names them:
#   staged  the code as it is (the served adapter's save through rl/tensor_io.HostStaging)
#   plain   a copy of artsg_nb/ in /tmp/ab-plain with Trainer.save_adapter's one line changed back to the
#           path HostStaging replaced (host_copies + save_tensors: a new pageable copy at every save), run
#           from that folder (python -m puts the working directory first on sys.path, and the leg's
#           subprocess inherits it)
#   switch  the code as it is, with CPython's thread switch interval at AB_SWITCH_S (default 0.0005 s;
#           Python's own is 0.005 s) in the leg's kernel-side processes (a sitecustomize on PYTHONPATH; the
#           server's PYTHONPATH is its own, server_env.py):
#           is the update's thread, launching kernels op by op, waiting on the GIL behind the event loop
#           that runs the rollouts ahead (and the other way round)?
# Each leg's log says which code and interval it ran. Prints one line per leg (step, rollout and train
# medians, step / max of those medians, the per-step overlap median, the saves logged) and writes every
# leg's row, with its arm and round first, to OUT_CSV; exits 1 if a leg gave no row. Not a test: a measurement for tools/gpu/README.md item 9.
#
#   bash tools/gpu/ab_step.sh MODEL_DIR OUT_CSV      (validate.sh ab / ab-save; AB_ENGINE: cpu for a dry run)
set -uo pipefail
model=$1 out=$2 repo=$PWD arms=${AB_ARMS:-staged plain}
for arm in $arms; do  # every name checked before any leg spends device time
  case $arm in staged|plain|switch) ;; *) echo "unknown arm $arm in AB_ARMS: choose from staged plain switch"; exit 1 ;; esac
done
if [[ " $arms " == *" plain "* ]]; then
  plain=/tmp/ab-plain
  rm -rf "$plain" && mkdir -p "$plain" && cp -r artsg_nb "$plain/" || exit 1
  sed -i -e 's/self\._adapter_staging\.save(self\._adapter_state(), /save_tensors(host_copies(self._adapter_state()), /' \
         -e 's/^from \.tensor_io import HostStaging, host_copies$/from .tensor_io import HostStaging, host_copies, save_tensors/' \
         "$plain/artsg_nb/rl/trainer.py"
  grep -q 'save_tensors(host_copies(self._adapter_state()), ' "$plain/artsg_nb/rl/trainer.py" &&
    grep -q '^from .tensor_io import HostStaging, host_copies, save_tensors$' "$plain/artsg_nb/rl/trainer.py" ||
    { echo "the plain arm could not be made: Trainer.save_adapter or its import changed; update the sed here"; exit 1; }
fi
switch_dir=/tmp/ab-switch
rm -rf "$switch_dir" && mkdir -p "$switch_dir" &&
  printf 'import sys\nsys.setswitchinterval(%s)\n' "${AB_SWITCH_S:-0.0005}" > "$switch_dir/sitecustomize.py" || exit 1

summary() {  # summary ARM ROUND CSV LOG: one line, and the row appended to $out
  python3 - "$@" "$out" <<'EOF'
import re, sys
from pathlib import Path
import pandas as pd
arm, rnd, csv, log, out = sys.argv[1:]
row = pd.read_csv(csv).iloc[[-1]]
r = row.iloc[0]
ratio = r.step_s_median / max(r.rollout_s_median, r.train_s_median)
saves = [float(s) for s in re.findall(r"saved in ([0-9.]+) s, in the update's thread", Path(log).read_text())]
print(f"{arm} round {rnd}: step {r.step_s_median:.3f} s, rollout {r.rollout_s_median:.3f}, train {r.train_s_median:.3f}, "
      f"step/max {ratio:.3f}, per-step overlap {r.get('overlap_median', float('nan')):.3f}, saves "
      f"{min(saves, default=0):.3f}-{max(saves, default=0):.3f} s (median "
      f"{sorted(saves)[len(saves) // 2] if saves else 0:.3f}, n={len(saves)})")
row.insert(0, "round", int(rnd)); row.insert(0, "arm", arm)
row.to_csv(out, mode="a", header=not Path(out).exists(), index=False)
EOF
}

rm -f "$out"
failed=0
for round in $(seq "${AB_ROUNDS:-2}"); do
  for arm in $arms; do
    root=$repo path=${PYTHONPATH:-}
    case $arm in
      plain)  root=$plain ;;
      switch) path=$switch_dir${path:+:$path} ;;
    esac
    csv=/tmp/ab-$arm-$round.csv log=/tmp/ab-$arm-$round.log; rm -f "$csv"
    (cd "$root" && export PYTHONPATH=$path && python3 -c "import sys, artsg_nb.rl.trainer as t, inspect
src = inspect.getsource(t.Trainer.save_adapter)
print('imported', t.__file__, 'HostStaging' if '_adapter_staging.save' in src else 'plain', 'switch interval', sys.getswitchinterval())" &&
     python3 -m artsg_nb.bench.step --engine "${AB_ENGINE:-sglang}" --model-path "$model" --max-new-tokens 8 \
       --frameworks artsg_nb --pipeline True --steps "${AB_STEPS:-8}" --groups 16 --group-size 8 \
       --run-dir "/tmp/runs/ab-$arm" --out "$csv") >"$log" 2>&1
    if [[ -f $csv ]]; then grep '^imported' "$log"; summary "$arm" "$round" "$csv" "$log"
    else echo "$arm round $round: no row"; tail -8 "$log" | cut -c1-200; failed=$((failed + 1)); fi
  done
done
(( failed == 0 )) || { echo "$failed leg(s) gave no row"; exit 1; }
