#!/usr/bin/env bash
# GPU validation phases for the H200 host, run after tools/gpu/install.sh in one device command:
#
#   bash tools/gpu/install.sh && bash tools/gpu/validate.sh models train ...
#
# Each phase runs with its own time limit, logs to $OUT/<phase>.log (the device tool brings $OUT
# back) and prints one PASS/FAIL line; a failing phase does not stop the next. Models are built
# into /tmp/models (kept while the host stays warm). Phases:
#   smoke       THE first call of a GPU session, on DEFAULT settings (tools/gpu/defaults_smoke.py): the
#               shipped tiny model (CI's weights), the quickstart notebook unchanged (10 steps, >= 3
#               reloads with unloads), 5 steps of each schedule on one server, the GPU-marked tests;
#               one PASS/FAIL line each, $OUT/<date>-<card>-smoke.json (h100, h200). Carry [".gpu-bundle", ".whl-kernel"].
#               The tests part runs beside the other two (from 75 s in): ~6.5 min on a fresh host (every
#               SGLang start 55-120 s); give the call timeout_s=600.
#   models      tiny (CI's, pretrained) and 0.5b (Qwen2.5-0.5B's shape) via python -m artsg_nb.models tiny
#   tests       pytest -m "gpu or sglang" with ARTSG_TEST_ENGINES=sglang (engine integration tests)
#   train       python -m artsg_nb.train on SGLang, colocated on this GPU, a few steps
#   notebook    the quickstart executed headless against SGLang (python -m artsg_nb.demo)
#   bench       python -m artsg_nb.bench on SGLang: schedules x radix on/off + reload latency
#               (workload A: 8 x 8 samples of a 1,500-token prompt, 128 new tokens, leaders stream;
#               BENCH_SCHEDULES, BENCH_RADIX, BENCH_REPEATS override), $OUT/bench_sglang.csv
#   bench-vllm  the same workload on vLLM (radix on unless BENCH_RADIX), $OUT/bench_vllm.csv
#   train-vllm  python -m artsg_nb.train on vLLM, colocated, a few steps on the 0.5b model (the
#               tiny model's head_dim 16 is below what vLLM's attention kernels take)
#   reload      benchmarks/reload_profile.py on SGLang with SmolLM2 r16: save / checksum / fsync / load /
#               first request, run_dir on disk vs /dev/shm (issue 17's reload target), $OUT/reload.csv
#   scale       the loop on RunConfig defaults at real sizes (tools/gpu/scale.py): random-weight Llama-shaped
#               models built here by `python -m artsg_nb.models random` with SmolLM2's tokenizer (carry .tok, the
#               tokenizer files of a SmolLM2 build; SCALE_TOKENIZER: another folder), addition_chat 16 x 8.
#               SCALE_SHAPES (default "7b 14b"): 7b runs legs at SCALE_TOKENS ("256 1024") new tokens and a
#               3-turn task with 2k-token prompts; 14b (release_memory as the defaults pick it: needs .whl-tms)
#               one leg at 256. Step parts, GPU memory peak, hit rate vs reachable, probe MAD, value checks:
#               $OUT/scale-<shape>.json, one PASS/FAIL line per leg. SCALE_STEPS (4), SCALE_LIMIT_S (per shape, 520)
#   scale-out   GRPO steps with 1 then 2 SGLang servers on this GPU behind sglang-router (0.35 of its
#               memory each), benchmarks/scale_out_gpu.py: step time, rollout tok/s, hit rate per
#               worker, $OUT/scale_out.csv (needs sglang-router: .whl-router + .whl-web). The step
#               benchmark's job (addition_chat, 16 x 8, SCALE_TOKENS=256 new tokens) on SmolLM2 when the
#               smollm2 phase built it, else the shipped tiny model (SCALE_MODEL: another)
#   tiny        the CI tiny model only (/tmp/models/tiny)
#   smollm2     SmolLM2-135M-Instruct built by `python -m artsg_nb.models` from the GGUF that install.sh
#               assembled from .gguf/p1 + .gguf/p2 (/tmp/models/smollm2)
#   random-models  the random-weight benchmark models of issue 48's jobs, built on the GPU with SmolLM2's
#               tokenizer (/tmp/models/smollm2 after the smollm2 phase, else a tokenizer folder in .tok/smollm2;
#               RANDOM_TOKENIZER: another): /tmp/models/random-1.5b and -7b, as the scale phase names them (RANDOM_SHAPES "1.5b 7b";
#               ~20-40 s for a 7B). Their rewards mean nothing: they measure speed
#   stepbench   python -m artsg_nb.bench.step: artsg_nb on SGLang (RunConfig defaults, synchronous) vs TRL's
#               GRPOTrainer in its fast path (trl_vllm: vLLM colocated, from /tmp/vsite after the kernel's
#               packages: carry the three .vllm-bundle parts first) and with plain generate (trl), same job,
#               SmolLM2 at 8 and 256 new tokens, STEP_STEPS (default 8) steps each; merged into
#               /tmp/step.csv (kept while the host stays warm) through $OUT/step.csv (written after every leg, so
#               a call cut short keeps the legs it finished). STEP_LIMIT_S: its limit; STEP_TOKENS: the jobs'
#               new tokens in running order ("8 256"); STEP_PIPELINE: "False True" runs the pipelined legs too;
#               STEP_FRAMEWORKS: which legs ("artsg_nb trl_vllm trl"; "artsg_nb" leaves TRL's out);
#               STEP_JOBS: issue 48's named jobs instead of SmolLM2 at STEP_TOKENS ("7b:256", "1.5b", ...;
#               models from /tmp/models, built when missing). Prints the ratios against each TRL mode and
#               each row's share of the card's floor
#   ab          issue 26 item 5: same-host A/B of the 8-token pipelined leg on SmolLM2 (after the smollm2 phase)
#               under the arms AB_ARMS names (default "staged plain": the served adapter's save through
#               rl/tensor_io.HostStaging vs the plain path it replaced; "switch": CPython's thread switch
#               interval at AB_SWITCH_S), alternated, AB_ROUNDS (2) rounds, ~75 s a leg (tools/gpu/ab_step.sh;
#               AB_LIMIT_S: its limit, 560); $OUT/ab.csv. ab-save: the phase with AB_ARMS "staged plain" ($OUT/ab-save.csv)
#   stepbench-pipe  the same artsg_nb legs with RunConfig(pipeline=True), merged into the same /tmp/step.csv
#               (its rows replace only pipelined ones): run it in the device call after stepbench (<= 30 s
#               apart, so the host stays warm) and $OUT/step.csv has sync, pipelined and TRL rows
#   update-spikes  tools/gpu/update_spikes.py: 20 steps (SPIKE_STEPS) on defaults under each of SPIKE_MODES
#               ("LAZY EAGER": CUDA_MODULE_LOADING), each update's split (Trainer.last_update) and, LAZY,
#               torch.profiler's top operators per step; $OUT/update-spikes-<mode>.json
#   step-profile  tools/gpu/step_profile.py on SGLang, RunConfig defaults, 6 steps (PROFILE_STEPS) of 16 x 8 with 8
#               new tokens on the shipped tiny model (PROFILE_MODEL: another model dir, PROFILE_TASK: another task,
#               PROFILE_TOKENS: other new tokens; the step benchmark's job on SmolLM2 is PROFILE_MODEL=/tmp/models/smollm2
#               PROFILE_TASK=addition_chat: `addition` pays SmolLM2 nothing and skips its updates): every round trip per step by
#               endpoint, server vs kernel time, the top 5 costs that are neither decoding nor training (issue 26),
#               $OUT/step_profile.json
#   adopt       tools/gpu/adopt_time.py on SGLang, RunConfig defaults: a kernel starts a run and takes one step, is
#               SIGKILLed, and a new kernel re-runs the cells with resume=True, adopting the live server; start_s of
#               both, the trainer's build (warm-up in it) and the first step (issue 26 item 4: reused in <= 10 s).
#               ADOPT_MODEL: another model dir (SmolLM2: /tmp/models/smollm2). $OUT/adopt.json, one PASS/FAIL adopt line
#   art-ids     tools/gpu/art_ids.py on SGLang: an art.TrainableModel registered with SGLangBackend, 16 chat
#               completions through model.openai_client(); PASS when every choice carried the server's token ids
#               and every trajectory used exactly them (issue 27; needs the art, art-polars, web and kernel sets)
#   byo         notebooks/04 (dataset task, TRL-style rewards, eval before/after) on SmolLM2, via papermill
#   quickstart-smol  notebooks/01 on SmolLM2 (learning rate follows the model), via papermill
#   art-smol    notebooks/05 (an ART rollout function trained through artsg_nb.art.SGLangBackend) on
#               SmolLM2, via papermill (needs the art and art-polars sets)
#   pipeline    30 steps synchronous vs RunConfig(pipeline=True) on SGLang, SmolLM2 (PIPE_STEPS)
#   faults-sglang  the engine-parametrised fault tests (security, loop, fleet restart) against real SGLang
#               (ARTSG_TEST_ENGINES=sglang; FAULTS_FILES, FAULTS_K override); needs .whl-router for the fleet.
#               faults-sglang-loop: the loop file alone; faults-sglang-other: the other two (two lanes)
#   colocated-pair  tools/gpu/colocated_pair.py: two SGLang workers of a colocated fleet on this GPU started
#               as Fleet.start does (in turn, each at its share of the total over the free memory), no router;
#               both must answer a request ($OUT/colocated_pair.json; worker logs under $OUT/pair)
#   sweep-smol  issue 51: an lr sweep of SWEEP_EXPERIMENTS (4) experiments on one SGLang server and one trainer,
#               together vs the same ones one after another (python -m artsg_nb.multi.bench), SmolLM2 (after the
#               smollm2 phase), addition_chat 16 x 8 at SWEEP_TOKENS (256) new tokens, SWEEP_STEPS (6) steps each;
#               steps/s of both, the time split, first-step rewards equal; $OUT/sweep_smol.json
#   sweep-7b    the same at the 7B random shape (/tmp/models/random-7b, built when missing), SWEEP_7B_STEPS (2)
#               steps each; $OUT/sweep_7b.json
#   tinker-smol issue 51: the tinker client's RL loop (python -m artsg_nb.tinker.rl_loop, tinker-cookbook's
#               rl_loop.py small) for TINKER_STEPS (12) steps against python -m artsg_nb.tinker (SGLang + a
#               MultiTrainer) on SmolLM2 (after the smollm2 phase), addition_chat 8 x 8; needs the tinker set.
#               One line per step (reward, datums, seconds); the server's log in $OUT/tinker-server.log
#   art-tiny    notebooks/05 on the shipped tiny model and SGLang: counts trajectories left out for token
#               ids the server did not send (needs the art, art-polars, web and kernel sets)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 99
source /tmp/artsg-env.sh || { echo "run tools/gpu/install.sh first"; exit 99; }
OUT=${OUT:-/tmp/artsg-out}; mkdir -p "$OUT" /tmp/models
# The flags this offline bundle needs (it leaves out FA3, flashinfer, xgrammar); CUDA graphs up to 128
# sequences cover a 16 x 8 step (80 left it decoding without graphs: sglang-0.5.14-traps.md, item 2).
export ARTSG_SGLANG_ARGS=${ARTSG_SGLANG_ARGS:-"--attention-backend triton --sampling-backend pytorch --grammar-backend none --cuda-graph-max-bs 128"}
export ARTSG_VLLM_ARGS=${ARTSG_VLLM_ARGS:-"--attention-backend TRITON_ATTN"}
export ARTSG_CACHE=/tmp/artsg-cache PYTHONUNBUFFERED=1 MPLBACKEND=Agg
# phases share one GPU one after another: a phase that exits without stop() must not leave its
# server holding GPU memory for the next (a kernel's clean exit keeps it 600 s by default)
export ARTSG_SERVER_GRACE_S=${ARTSG_SERVER_GRACE_S:-0}
TINY=/tmp/models/tiny; BIG=/tmp/models/0.5b; SMOL=/tmp/models/smollm2
FAILS=0

phase() {  # phase NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
    echo "PASS $name $((SECONDS - t0)) s"
  else
    echo "FAIL $name $((SECONDS - t0)) s"; tail -15 "$OUT/$name.log" | cut -c1-300 | sed 's/^/    /'
    FAILS=$((FAILS + 1))
  fi
}

for p in "$@"; do
  echo "[$(date +%H:%M:%S)] phase $p"
  case $p in
    smoke)       SHIPPED=$PWD/artsg_nb/models/shipped/tiny-s0-p800  # the weights CI tests (no build on the host)
                 GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h100|h200|a100|l40s|b200' | tr A-Z a-z)
                 SMOKE_JSON="$OUT/$(date +%Y%m%d)-${GPU_TAG:-gpu}-smoke.json"  # the card it ran on: kinds named H200 may get an H100
                 timeout 585 env ARTSG_TINY_MODEL=$SHIPPED python3 tools/gpu/defaults_smoke.py --model $SHIPPED \
                   --out "$SMOKE_JSON" ${SMOKE_PARTS:+--parts $SMOKE_PARTS} 2>&1 | tee "$OUT/smoke.log" \
                   | grep -E '^(PASS|FAIL) |^    |schedule ' | cut -c1-400
                 [[ ${PIPESTATUS[0]} == 0 ]] || FAILS=$((FAILS + 1)) ;;
    update-spikes)  # the same 20 steps with CUDA's lazy kernel loading (the default) and with eager loading
                 SHIPPED=$PWD/artsg_nb/models/shipped/tiny-s0-p800
                 for mode in ${SPIKE_MODES:-LAZY EAGER}; do
                   phase update-spikes-$mode 200 env CUDA_MODULE_LOADING=$mode ARTSG_TINY_MODEL=$SHIPPED python3 tools/gpu/update_spikes.py \
                     --model $SHIPPED --steps ${SPIKE_STEPS:-20} --run-dir /tmp/runs/spikes-$mode --label $mode --out "$OUT/update-spikes-$mode.json" $([[ $mode == LAZY ]] && echo --profile)
                   grep -E '^(LAZY|EAGER):' "$OUT/update-spikes-$mode.log" | cut -c1-300 | sed 's/^/    /'
                 done ;;
    models)      phase models 240 bash -c "python3 -m artsg_nb.models tiny $TINY && python3 -m artsg_nb.models tiny $BIG --size 0.5b" ;;
    tiny)        phase tiny 240 python3 -m artsg_nb.models tiny $TINY ;;
    smollm2)     phase smollm2 240 python3 -m artsg_nb.models smollm2-135m-instruct $SMOL ;;
    random-models)
                 TOK=${RANDOM_TOKENIZER:-$SMOL}; [[ -f $TOK/tokenizer_config.json ]] || TOK=$PWD/.tok/smollm2
                 phase random-models 300 bash -c "for s in ${RANDOM_SHAPES:-1.5b 7b}; do [[ -f /tmp/models/random-\$s/.complete ]] || \
                   python3 -m artsg_nb.models random --shape \$s /tmp/models/random-\$s --tokenizer $TOK || exit 1; done"
                 grep -E '^built|^/tmp' "$OUT/random-models.log" | sed 's/^/    /' ;;
    stepbench|stepbench-pipe)
                 STEP_ARGS="--frameworks ${STEP_FRAMEWORKS:-artsg_nb trl_vllm trl} --pipeline ${STEP_PIPELINE:-False}"; [[ $p == stepbench-pipe ]] && STEP_ARGS="--frameworks artsg_nb --pipeline True"
                 STEP_JOB_ARGS="--model-path $SMOL --max-new-tokens ${STEP_TOKENS:-8 256}"
                 [[ -n ${STEP_JOBS:-} ]] && STEP_JOB_ARGS="--jobs $STEP_JOBS --models-dir /tmp/models"
                 [[ -f /tmp/step.csv ]] && cp /tmp/step.csv "$OUT/step.csv"  # written in $OUT after every leg: a cut call keeps its legs
                 touch /tmp/stepbench.stamp  # the histories of this phase's legs only, not those of an earlier call's
                 phase "$p" "${STEP_LIMIT_S:-560}" python3 -m artsg_nb.bench.step --engine sglang $STEP_JOB_ARGS \
                   $STEP_ARGS --steps ${STEP_STEPS:-8} --groups 16 --group-size 8 \
                   --run-dir /tmp/runs/step --out "$OUT/step.csv"
                 [[ -f $OUT/step.csv ]] && cp "$OUT/step.csv" /tmp/step.csv
                 for d in /tmp/runs/step/*/; do  # each leg's rows: the per-step figures (overlap_median's pairs)
                   [[ $d/history.jsonl -nt /tmp/stepbench.stamp ]] && cp "$d/history.jsonl" "$OUT/$(basename "$d")-history.jsonl"; done
                 sed -n '/^artsg_nb vs TRL/,$p' "$OUT/$p.log" | tail -30 | cut -c1-250 | sed 's/^/    /' ;;
    ab|ab-save)  ARMS=${AB_ARMS:-staged plain}; [[ $p == ab-save ]] && ARMS="staged plain"  # this phase's only
                 phase "$p" "${AB_LIMIT_S:-560}" env AB_ARMS="$ARMS" bash tools/gpu/ab_step.sh $SMOL "$OUT/$p.csv"
                 grep -E '^(imported|staged|plain|switch|the plain arm|unknown arm)' "$OUT/$p.log" | cut -c1-220 | sed 's/^/    /' ;;
    step-profile) phase step-profile 300 bash -c "rm -rf /tmp/runs/step-profile && python3 tools/gpu/step_profile.py --engine sglang \
                   --steps ${PROFILE_STEPS:-6} --groups-per-step 16 --group-size 8 --max-new-tokens ${PROFILE_TOKENS:-8} ${PROFILE_MODEL:+--model-path $PROFILE_MODEL} ${PROFILE_TASK:+--task $PROFILE_TASK} \
                   --run-dir /tmp/runs/step-profile --out $OUT/step_profile.json"
                 sed -n '/^summary over steps/,$p' "$OUT/step-profile.log" | head -70 | cut -c1-200 | sed 's/^/    /' ;;
    adopt)       phase adopt 560 python3 tools/gpu/adopt_time.py --engine sglang ${ADOPT_MODEL:+--model-path $ADOPT_MODEL} \
                   --run-dir /tmp/runs/adopt --timeout-s 270 --out "$OUT/adopt.json"
                 grep -E '^(cold|adopted|PASS|FAIL) ' "$OUT/adopt.log" | cut -c1-200 | sed 's/^/    /' ;;
    art-ids)     phase art-ids 300 python3 tools/gpu/art_ids.py --engine sglang --model-path "$PWD/artsg_nb/models/shipped/tiny-s0-p800"
                 grep -E '^(sglang|PASS|FAIL) ' "$OUT/art-ids.log" | cut -c1-200 | sed 's/^/    /' ;;
    byo)         phase byo 400 python3 -m papermill notebooks/04_bring_your_own_task.ipynb "$OUT/04_byo.ipynb" \
                   -p RUN_DIR /tmp/runs/byo -p MODEL $SMOL --cwd notebooks --log-output
                 grep -E 'eval reward|train reward|pass@1' "$OUT/byo.log" | tail -4 | cut -c1-220 | sed 's/^/    /' ;;
    quickstart-smol) phase quickstart-smol 400 python3 -m papermill notebooks/01_quickstart.ipynb "$OUT/01_smol.ipynb" \
                   -p RUN_DIR /tmp/runs/qs-smol -p MODEL_PATH $SMOL --cwd notebooks --log-output
                 grep -E '^reward|reward:' "$OUT/quickstart-smol.log" | tail -2 | cut -c1-300 | sed 's/^/    /' ;;
    art-smol)    phase art-smol 400 python3 -m papermill notebooks/05_art_drop_in.ipynb "$OUT/05_art_smol.ipynb" \
                   -p RUN_DIR /tmp/runs/art-smol -p BASE_MODEL $SMOL --cwd notebooks --log-output
                 grep -E 'reward|step [0-9]' "$OUT/art-smol.log" | tail -4 | cut -c1-300 | sed 's/^/    /' ;;
    pipeline)    phase pipeline 560 bash -c "python3 -m artsg_nb.train --engine sglang --model-path $SMOL --steps ${PIPE_STEPS:-30} \
                   --group-size 8 --groups-per-step 16 --run-dir /tmp/runs/sync && python3 -m artsg_nb.train --engine sglang \
                   --model-path $SMOL --steps ${PIPE_STEPS:-30} --group-size 8 --groups-per-step 16 --pipeline --run-dir /tmp/runs/pipe" ;;
    faults-sglang|faults-sglang-loop|faults-sglang-other)
                 F=tests/faults; FILES="$F/test_security_faults.py $F/test_loop_faults.py $F/test_fleet_restart_faults.py"
                 [[ $p == faults-sglang-loop ]] && FILES=$F/test_loop_faults.py
                 [[ $p == faults-sglang-other ]] && FILES="$F/test_security_faults.py $F/test_fleet_restart_faults.py"
                 phase "$p" 560 env ARTSG_TEST_ENGINES=sglang ARTSG_TINY_MODEL=$PWD/artsg_nb/models/shipped/tiny-s0-p800 \
                   python3 -m pytest -p no:cacheprovider -q -rA -m faults ${FAULTS_K:+-k "$FAULTS_K"} ${FAULTS_FILES:-$FILES}
                 grep -E '^faults:|passed|failed|^(PASSED|FAILED|ERROR) ' "$OUT/$p.log" | tail -30 | cut -c1-200 | sed 's/^/    /' ;;
    colocated-pair) phase colocated-pair 400 python3 tools/gpu/colocated_pair.py --model $PWD/artsg_nb/models/shipped/tiny-s0-p800 \
                   --run-dir "$OUT/pair" --out "$OUT/colocated_pair.json"
                 grep -E '^(PASS|FAIL) |^\{' "$OUT/colocated-pair.log" | cut -c1-400 | sed 's/^/    /' ;;
    art-tiny)    phase art-tiny 400 env ARTSG_TINY_MODEL=$PWD/artsg_nb/models/shipped/tiny-s0-p800 python3 -m papermill \
                   notebooks/05_art_drop_in.ipynb "$OUT/05_art_tiny.ipynb" -p RUN_DIR /tmp/runs/art-tiny --cwd notebooks --log-output
                 echo "    trajectories left out for unknown token ids: $(grep -c 'left out: their token ids' "$OUT/art-tiny.log")"
                 grep -E 'reward:' "$OUT/art-tiny.log" | tail -1 | cut -c1-300 | sed 's/^/    /' ;;
    tests)       phase tests 400 env ARTSG_TEST_ENGINES=sglang ARTSG_TINY_MODEL=$TINY python3 -m pytest -p no:cacheprovider -q -m "gpu or sglang" tests ;;
    train)       phase train 400 python3 -m artsg_nb.train --engine sglang --model-path $TINY --steps ${TRAIN_STEPS:-5} --run-dir /tmp/runs/train-sglang ;;
    notebook)    phase notebook 500 python3 -m artsg_nb.demo --run-dir /tmp/runs/demo-sglang ;;
    bench|bench-vllm)
                 E=sglang; [[ $p == bench-vllm ]] && E=vllm
                 phase "$p" "${BENCH_LIMIT_S:-500}" python3 -m artsg_nb.bench --engine $E --model-path $BIG --groups 8 --group-size 8 \
                   --prompt-tokens 1500 --new-tokens 128 --no-stream-all --workload A_nostream \
                   --schedules ${BENCH_SCHEDULES:-naive prefix prefix_n n} --radix ${BENCH_RADIX:-$([[ $E == sglang ]] && echo True False || echo True)} \
                   --repeats ${BENCH_REPEATS:-3} --run-dir /tmp/runs/bench-$E --out "$OUT/bench_$E.csv"
                 grep -E "^ *$E " "$OUT/$p.log" | cut -c1-200 | sed 's/^/    /' ;;
    train-vllm)  phase train-vllm 400 python3 -m artsg_nb.train --engine vllm --model-path $BIG --steps ${TRAIN_STEPS:-3} \
                   --run-dir /tmp/runs/train-vllm ;;
    reload)      phase reload 300 python3 benchmarks/reload_profile.py --model $SMOL --engine sglang \
                   --dirs /tmp/runs/reload /dev/shm/artsg-reload --out "$OUT/reload.csv" ;;
    scale)       for shape in ${SCALE_SHAPES:-7b 14b}; do
                   M=/tmp/models/random-$shape; t0=$SECONDS
                   [[ -f $M/.complete ]] || python3 -m artsg_nb.models random --shape $shape $M \
                     --tokenizer "${SCALE_TOKENIZER:-$PWD/.tok/smollm2}" >"$OUT/scale-build-$shape.log" 2>&1 \
                     || { echo "FAIL scale build $shape"; tail -5 "$OUT/scale-build-$shape.log"; FAILS=$((FAILS + 1)); continue; }
                   echo "built $M in $((SECONDS - t0)) s"
                   EXTRA=(--tokens ${SCALE_TOKENS:-256 1024} --multi-turn); [[ $shape == 14b ]] && EXTRA=(--tokens 256)
                   timeout "${SCALE_LIMIT_S:-520}" python3 tools/gpu/scale.py --model $M "${EXTRA[@]}" --steps ${SCALE_STEPS:-4} \
                     --limit-s $(( ${SCALE_LIMIT_S:-520} - 40 )) --run-dir /tmp/runs/scale-$shape --out "$OUT/scale-$shape.json" \
                     >"$OUT/scale-$shape.log" 2>&1; rc=$?
                   grep -E '^(PASS|FAIL) scale|started in|Error' "$OUT/scale-$shape.log" | cut -c1-600
                   [[ $rc == 0 ]] || { FAILS=$((FAILS + 1)); tail -8 "$OUT/scale-$shape.log" | cut -c1-300 | sed 's/^/    /'; }
                 done ;;
    scale-out)   M=$PWD/artsg_nb/models/shipped/tiny-s0-p800; [[ -f $SMOL/config.json ]] && M=$SMOL
                 phase scale-out 540 python3 benchmarks/scale_out_gpu.py --model "${SCALE_MODEL:-$M}" --task addition_chat \
                   --max-new-tokens ${SCALE_TOKENS:-256} --out "$OUT/scale_out.csv"
                 grep -E '^\|' "$OUT/scale-out.log" | sed 's/^/    /' ;;
    sweep-smol|sweep-7b)
                 M=$SMOL; STEPS=${SWEEP_STEPS:-6}
                 if [[ $p == sweep-7b ]]; then
                   M=/tmp/models/random-7b; STEPS=${SWEEP_7B_STEPS:-2}
                   TOK=${RANDOM_TOKENIZER:-$SMOL}; [[ -f $TOK/tokenizer_config.json ]] || TOK=$PWD/.tok/smollm2
                   [[ -f $M/.complete ]] || python3 -m artsg_nb.models random --shape 7b $M --tokenizer $TOK >"$OUT/sweep-build.log" 2>&1
                 fi
                 phase "$p" "${SWEEP_LIMIT_S:-560}" python3 -m artsg_nb.multi.bench --model $M --task addition_chat \
                   --experiments ${SWEEP_EXPERIMENTS:-4} --steps $STEPS --groups-per-step 16 --group-size 8 \
                   --max-new-tokens ${SWEEP_TOKENS:-256} --run-dir /tmp/runs/$p --out "$OUT/${p/-/_}.json"
                 grep -E 'experiments x|together:|one after|first-step|errors' "$OUT/$p.log" | cut -c1-300 | sed 's/^/    /' ;;
    tinker-smol) phase tinker-smol "${TINKER_LIMIT_S:-540}" bash -c "python3 -m artsg_nb.tinker --model $SMOL --engine sglang \
                   --port 8765 --api-key tml-validate --run-dir /tmp/runs/tinker-smol >$OUT/tinker-server.log 2>&1 & S=\$!; \
                   trap 'kill -TERM \$S 2>/dev/null; wait \$S' EXIT; \
                   python3 -m artsg_nb.tinker.rl_loop --base-url http://127.0.0.1:8765 --api-key tml-validate \
                   --base-model $SMOL --task addition_chat --steps ${TINKER_STEPS:-12} --groups 8 --group-size 8 \
                   --learning-rate ${TINKER_LR:-2e-4} --lora-rank 16"
                 grep -E '^step ' "$OUT/tinker-smol.log" | cut -c1-200 | sed 's/^/    /' ;;
    *) echo "unknown phase $p"; FAILS=$((FAILS + 1)) ;;
  esac
done
for f in /tmp/runs/*/history.jsonl; do [[ -f $f ]] && cp "$f" "$OUT/$(basename "$(dirname "$f")")_history.jsonl"; done
exit $FAILS
