#!/usr/bin/env bash
# Run test suites as a new user's fresh clone would, and say at the end how each went.
#
# What it does: makes an empty temporary HOME and points every cache the project and its
# libraries keep into it (artsg_nb's models, downloads and server records; Hugging Face, pip,
# matplotlib, IPython, Jupyter, XDG dirs), so a stale cache can never make a run pass; runs each
# suite named on the command line even when an earlier one failed; then prints each suite's
# closing pytest lines (and the faults suite's own line) and exits 1 if any suite failed.
# What it does not: install anything (`make venv` does), or keep the temporary HOME (it is
# removed on exit; KEEP_TEST_HOME=1 keeps it and says where it is).
#
#   tools/run_tests.sh faults+notebooks+ranks+fleets main   # what `make test` runs: two lanes side by side
#   tools/run_tests.sh faults                        # `make test-faults` (also -notebooks, -ranks, -main)
set -uo pipefail

PY=${PY:-.venv/bin/python}
NB_TIMEOUT=${NB_TIMEOUT:-900}
PYTEST=("$PY" -m pytest -p no:cacheprovider -q)
NOTEBOOK_TESTS=(tests/test_notebooks.py tests/test_browser.py)  # the notebooks suite's, not main's
RANK_TESTS=(tests/test_distributed.py)  # the ranks suite's (torch.distributed trainer ranks), not main's
FLEET_TESTS=(tests/test_fleet.py tests/test_router.py tests/test_fleet_lora_n.py)  # the fleets suite's (several engines behind a router)

suite_command() {
    case $1 in
        faults) echo "${PYTEST[*]} -m faults --durations=10" ;;
        # everything that executes a notebook: the notebooks by nbmake, but the quickstart, which
        # tests/test_notebooks.py executes (unchanged, its defaults) and checks, and the browser test
        notebooks) echo "${PYTEST[*]} -m 'not faults' --nbmake --nbmake-timeout=$NB_TIMEOUT" \
                        "--deselect notebooks/01_quickstart.ipynb::01_quickstart.ipynb --durations=8 notebooks" \
                        "${NOTEBOOK_TESTS[*]}" ;;
        # trainer ranks in processes of their own: a suite apart only so that `make test` can run it
        # in the faults+notebooks lane, which is shorter than main's by about its length
        ranks) echo "${PYTEST[*]} -m 'not faults' --durations=5 ${RANK_TESTS[*]}" ;;
        # engines behind a router, in processes of their own: apart for the same reason as ranks
        fleets) echo "${PYTEST[*]} -m 'not faults' --durations=5 ${FLEET_TESTS[*]}" ;;
        main) echo "${PYTEST[*]} -m 'not faults' --durations=15 tests ${NOTEBOOK_TESTS[*]/#/--ignore=}" \
                   "${RANK_TESTS[*]/#/--ignore=} ${FLEET_TESTS[*]/#/--ignore=}" ;;
        *) echo "unknown suite '$1' (known: faults, notebooks, ranks, fleets, main)" >&2; return 2 ;;
    esac
}

fresh_home() {
    home=$(mktemp -d -t artsg-test-home.XXXXXX)
    if [[ -n ${KEEP_TEST_HOME:-} ]]; then echo "test HOME kept in $home"; else trap 'rm -rf "$home"' EXIT; fi
    export HOME=$home XDG_CACHE_HOME=$home/.cache XDG_CONFIG_HOME=$home/.config XDG_DATA_HOME=$home/.local/share
    export ARTSG_CACHE=$home/.cache/artsg_nb ARTSG_STATE_DIR=$home/.cache/artsg_nb/servers
    export HF_HOME=$home/.cache/huggingface PIP_CACHE_DIR=$home/.cache/pip MPLCONFIGDIR=$home/.config/matplotlib
    export IPYTHONDIR=$home/.ipython JUPYTER_CONFIG_DIR=$home/.jupyter JUPYTER_DATA_DIR=$home/.local/share/jupyter
    export TORCHINDUCTOR_CACHE_DIR=$home/.cache/torchinductor TRITON_CACHE_DIR=$home/.cache/triton
    # an outer setting would point the tests at a cache other than the fresh one
    unset HF_HUB_CACHE HF_DATASETS_CACHE TRANSFORMERS_CACHE TORCH_HOME JUPYTER_RUNTIME_DIR
    if [[ -n ${ARTSG_TINY_MODEL:-} ]]; then echo "ARTSG_TINY_MODEL is set: the tests run on $ARTSG_TINY_MODEL"; fi
}

# pytest's closing line ("3 failed, 40 passed in 12.3s"), the faults line, the short summary's FAILED/ERROR lines
closing_lines() {
    local closing='(passed|failed|errors?|skipped|deselected|no tests ran).* in [0-9.]+s'
    [[ -f $1 ]] || return 1
    grep -E "^(FAILED|ERROR) |^faults: [0-9]+ injected|$closing" "$1" | tail -n 40
}

# Each argument is a lane: one suite, or suites joined by "+", run one after the other.
lanes=("$@")
suites=()
for lane in "${lanes[@]}"; do IFS=+ read -ra names <<<"$lane"; suites+=("${names[@]}"); done
(( ${#lanes[@]} )) || { echo "usage: $0 LANE... (a lane: a suite, or suites joined by +; suites: faults, notebooks, ranks, fleets, main)" >&2; exit 2; }
for name in "${suites[@]}"; do suite_command "$name" >/dev/null || exit 2; done
fresh_home
declare -A rc
# SUITES_SIDE_BY_SIDE=1 (make test's default): every lane but the last runs in the background,
# its output shown when it ends; each suite keeps about one of CI's two cores busy, so side by
# side the lanes take the longest one's time. Measured on a 2-core machine (2026-12-07, one
# torch thread a lane): faults, notebooks and ranks 6.9 + 4.1 + 1.4 min beside main's 14.8, 15.0
# in all; fleets (~1.2 min) moved out of main to even the lanes.
# The faults suite's server records are private per module (tests/faults/conftest.py), so one
# suite's orphan reaping never touches the other's servers.
run_suite() {  # suite $1, its header and output into $home/$1.log (on the terminal too with $2 = tee); its exit status
    local cmd header
    cmd=$(suite_command "$1")
    header="==== suite $1: $cmd"
    if [[ ${2:-} == tee ]]; then
        echo "$header"
        eval "$cmd" 2>&1 | tee -i "$home/$1.log"  # -i: a Ctrl-C reaches pytest, which prints its summary
        return "${PIPESTATUS[0]}"
    fi
    echo "$header" >"$home/$1.log"
    eval "$cmd" >>"$home/$1.log" 2>&1
}
run_lane() {  # the suites of lane $1 in order, each one's exit status into $home/<suite>.rc; an
              # interrupted suite (pytest's 2: Ctrl-C; above 128: a signal) ends its lane
    local name names status
    IFS=+ read -ra names <<<"$1"
    for name in "${names[@]}"; do
        run_suite "$name" "${2:-}"
        status=$?
        echo "$status" >"$home/$name.rc"
        if (( status == 2 || status > 128 )); then return "$status"; fi
    done
}
# Side by side, each lane's processes get an equal share of the CPUs as torch's (OpenMP's) thread
# count: on CI's 2 cores, two lanes each spinning 2 threads over the other's made `make test` take
# 18.8 min where its lanes alone take 11.3 (main) and ~15 (faults+notebooks+ranks) in all.
if [[ ${SUITES_SIDE_BY_SIDE:-0} == 1 && ${#lanes[@]} -gt 1 && -z ${OMP_NUM_THREADS:-} ]]; then
    cpus=$(nproc)  # before the export: nproc follows OMP_NUM_THREADS
    threads=$(( cpus / ${#lanes[@]} ))
    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
    echo "==== ${#lanes[@]} lanes side by side on $cpus CPUs: OMP_NUM_THREADS=$OMP_NUM_THREADS in each"
fi
last=${lanes[-1]}
bg=()
for lane in "${lanes[@]}"; do
    if [[ ${SUITES_SIDE_BY_SIDE:-0} == 1 && $lane != "$last" ]]; then
        echo "==== lane $lane: in the background; its output follows when it ends"
        run_lane "$lane" >"$home/lane.$lane.out" 2>&1 &
        bg+=("$!:$lane")
        continue
    fi
    run_lane "$lane" tee
done
for entry in "${bg[@]}"; do
    wait "${entry%%:*}"
    lane=${entry#*:}
    echo "==== lane $lane (ran in the background): its output"
    cat "$home/lane.$lane.out"
    IFS=+ read -ra names <<<"$lane"
    for name in "${names[@]}"; do
        [[ -f $home/$name.log ]] && cat "$home/$name.log"
    done
done
for name in "${suites[@]}"; do  # none: its lane ended before it (interrupted) or died
    rc[$name]=$(cat "$home/$name.rc" 2>/dev/null || echo "none (not run to its end)")
done

echo
echo "==== every suite's summary (HOME and caches were an empty $home)"
failed=()
for name in "${suites[@]}"; do
    echo "-- suite $name: exit ${rc[$name]}"
    closing_lines "$home/$name.log" || echo "(no pytest summary line: it stopped early; see the output above)"
    [[ ${rc[$name]} == 0 ]] || failed+=("$name")
done
if (( ${#failed[@]} )); then
    echo "==== FAILED suites: ${failed[*]}"
    exit 1
fi
