#!/usr/bin/env bash
# Issue 26, build item 5: the served adapter's save through rl/tensor_io.HostStaging ("staged": the code
# as it is) against the path it replaced ("plain": host_copies + save_tensors, a new pageable copy at
# every save), on one host, the arms alternated: the step benchmark's 8-token pipelined leg
# (python -m artsg_nb.bench.step), AB_ROUNDS rounds (default 2) of both arms.
#
# The plain arm is a copy of artsg_nb/ in /tmp/ab-plain with Trainer.save_adapter's one line changed
# back, run from that folder (python -m puts the working directory first on sys.path, and the leg's
# subprocess inherits it); each leg's log says which code it imported. Prints one line per leg (step,
# rollout and train medians, step / max(rollout, train), the saves logged) and writes every leg's row,
# with its arm and round first, to OUT_CSV. Not a test: a measurement for tools/gpu/README.md item 9.
#
#   bash tools/gpu/ab_save.sh MODEL_DIR OUT_CSV        (validate.sh ab-save; AB_ENGINE: cpu for a dry run)
set -uo pipefail
model=$1 out=$2 repo=$PWD plain=/tmp/ab-plain
rm -rf "$plain" && mkdir -p "$plain" && cp -r artsg_nb "$plain/" || exit 1
sed -i -e 's/self\._adapter_staging\.save(self\._adapter_state(), /save_tensors(host_copies(self._adapter_state()), /' \
       -e 's/^from \.tensor_io import HostStaging, host_copies$/from .tensor_io import HostStaging, host_copies, save_tensors/' \
       "$plain/artsg_nb/rl/trainer.py"
grep -q 'save_tensors(host_copies(self._adapter_state()), ' "$plain/artsg_nb/rl/trainer.py" &&
  grep -q '^from .tensor_io import HostStaging, host_copies, save_tensors$' "$plain/artsg_nb/rl/trainer.py" ||
  { echo "the plain arm could not be made: Trainer.save_adapter or its import changed; update the sed here"; exit 1; }

summary() {  # summary ARM ROUND CSV LOG: one line, and the row appended to $out
  python3 - "$@" "$out" <<'EOF'
import re, sys
from pathlib import Path
import pandas as pd
arm, rnd, csv, log, out = sys.argv[1:]
row = pd.read_csv(csv).iloc[[-1]]
ratio = row.step_s_median.iloc[0] / max(row.rollout_s_median.iloc[0], row.train_s_median.iloc[0])
saves = [float(s) for s in re.findall(r"saved in ([0-9.]+) s, in the update's thread", Path(log).read_text())]
print(f"{arm} round {rnd}: step {row.step_s_median.iloc[0]:.3f} s, rollout {row.rollout_s_median.iloc[0]:.3f}, "
      f"train {row.train_s_median.iloc[0]:.3f}, step/max {ratio:.3f}, saves {min(saves, default=0):.3f}-"
      f"{max(saves, default=0):.3f} s (median {sorted(saves)[len(saves) // 2] if saves else 0:.3f}, n={len(saves)})")
row.insert(0, "round", int(rnd)); row.insert(0, "arm", arm)
row.to_csv(out, mode="a", header=not Path(out).exists(), index=False)
EOF
}

rm -f "$out"
for round in $(seq "${AB_ROUNDS:-2}"); do
  for arm in staged plain; do
    root=$repo; [[ $arm == plain ]] && root=$plain
    csv=/tmp/ab-$arm-$round.csv log=/tmp/ab-$arm-$round.log; rm -f "$csv"
    (cd "$root" && python3 -c "import artsg_nb.rl.trainer as t, inspect; src = inspect.getsource(t.Trainer.save_adapter);
print('imported', t.__file__, 'HostStaging' if '_adapter_staging.save' in src else 'plain')" &&
     python3 -m artsg_nb.bench.step --engine "${AB_ENGINE:-sglang}" --model-path "$model" --max-new-tokens 8 \
       --frameworks artsg_nb --pipeline True --steps "${AB_STEPS:-8}" --groups 16 --group-size 8 \
       --run-dir "/tmp/runs/ab-$arm" --out "$csv") >"$log" 2>&1
    if [[ -f $csv ]]; then grep '^imported' "$log"; summary "$arm" "$round" "$csv" "$log"
    else echo "$arm round $round: no row"; tail -8 "$log" | cut -c1-200; fi
  done
done
