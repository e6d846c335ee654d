"""Write the notebooks from this script, so their source is reviewable and they are born clean.

`python tools/make_notebooks.py [OUT_DIR]` rewrites notebooks/*.ipynb (or writes them to OUT_DIR)
with no outputs, no execution counts, and cell ids numbered in order, so that the output is the
same byte for byte on every run.
Edit the cells here, not in Jupyter, then re-run it; CI (tests/test_notebooks.py) fails if a
committed notebook has outputs or differs from what this script writes.
"""
import sys
from pathlib import Path

import nbformat as nbf

OUT = Path(__file__).resolve().parent.parent / "notebooks"
KERNEL = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"}}


def md(text):
    return nbf.v4.new_markdown_cell(text.strip())


def code(text, tags=()):
    c = nbf.v4.new_code_cell(text.strip())
    if tags:
        c.metadata["tags"] = list(tags)
    return c


def write(out_dir, name, cells):
    for i, cell in enumerate(cells):
        cell.id = f"cell-{i:02d}"  # nbformat would draw random ids: the file must be reproducible
    nb = nbf.v4.new_notebook(cells=cells, metadata=KERNEL)
    out_dir.mkdir(parents=True, exist_ok=True)
    nbf.write(nb, out_dir / name)


QUICKSTART = [
    md("""
# Quickstart: GRPO of a LoRA adapter with rollouts from SGLang

One GRPO step per cell: rollouts from the inference server, rewards, one update of the LoRA
weights, the new adapter hot-reloaded into the server, curves redrawn. Without a GPU it runs on the
CPU engine with an offline tiny model, so every cell works on a laptop.
"""),
    code('''
# Parameters (papermill / nbmake can override these). CPU-sized defaults; GPU-sized ones below.
RUN_DIR = "../runs/quickstart"
TASK = "addition"          # python -m artsg_nb.train --list-tasks
ENGINE = "auto"            # "sglang" with a GPU, the CPU engine without; or "vllm"
MODEL_PATH = None          # None: the offline tiny model
GROUP_SIZE = 8             # G samples per prompt
GROUPS_PER_STEP = 8
MORE_STEPS = 8             # steps run by the loop cell
LEARNING_RATE = 3e-3
''', tags=["parameters"]),
    md("""
## Plan the GPUs

This runs before anything touches CUDA in the kernel: `CUDA_VISIBLE_DEVICES` cannot change once
CUDA has initialised. 2+ GPUs → the server on GPU 0 and the trainer on the rest; 1 GPU → both share
it (the server keeps a memory fraction); no GPU → the CPU engine.
"""),
    code('''
import artsg_nb as ag

plan = ag.plan_gpus(ag.list_gpus())
print(plan.describe())
if plan.mode != "cpu":  # a GPU is present: bigger defaults
    GROUP_SIZE, GROUPS_PER_STEP, MORE_STEPS = 16, 8, 20
'''),
    md("""
## Start the server and the trainer

The server runs as a subprocess of this kernel, in its own environment and process group, bound to
127.0.0.1; its log goes to the run directory. Re-running this cell with the same configuration
reuses the live server. The trainer loads the same base model with a fresh LoRA adapter, which is
saved as `policy-step-0` and loaded into the server.
"""),
    code('''
cfg = ag.RunConfig(task=TASK, engine=ENGINE, model_path=MODEL_PATH, run_dir=RUN_DIR,
                   group_size=GROUP_SIZE, groups_per_step=GROUPS_PER_STEP, learning_rate=LEARNING_RATE)
run = ag.GRPORun(cfg).start()
print(run.server.url, "| log:", run.server.log_path)
'''),
    md("""
## The dashboard

GPU roles and memory (or "CPU engine"), the server's status and the adapter in service, and the
prefix-cache hit rate — cumulative and for the last step — computed from the server's token
counters. It refreshes in the background until the server stops.
"""),
    code('''
dashboard = ag.Dashboard(run.plan, run.server, run.tracker, adapter_fn=lambda: run.adapter).show()
'''),
    md("""
## One GRPO step

Each group's `GROUP_SIZE` samples share a prompt, so the server's radix cache computes the prompt
once per group (the group leader goes first). Rewards are normalised within each group into
advantages; one clipped policy-gradient update follows; the adapter is saved as
`policy-step-1`, loaded into the server, and checked: the server's logprobs on a probe sequence
must match the trainer's (`probe_mad`).
"""),
    code('''
row = await run.step()
dashboard.refresh()
live = ag.LivePlot()
live.update(run.history.df)
'''),
    md("""
## Another step

Rollouts now come from `policy-step-1`. The prefix cache never carries over between policy
versions (the server keys it by adapter load), so each step's hit rate is about its own groups.
"""),
    code('''
row = await run.step()
dashboard.refresh()
live.update(run.history.df)
'''),
    md("""
## N more steps

The curves redraw in place after each reload. With the offline tiny model the reward climbs from
about 0.4 to about 0.85 within ten steps: the model starts out answering half the questions in a
sentence ("The sum is 7."), which the checker scores 0, and GRPO removes that habit.
"""),
    code('''
def after_step(row):
    live.update(run.history.df)
    dashboard.refresh()

await run.run(MORE_STEPS, on_step=after_step)
'''),
    md("""
## The history

One row per step: reward, loss, KL, clip fraction, importance-sampling ratio against the server's
logprobs (≈ 1 on-policy), tokens, rollout / train / reload seconds and the step's hit rate. It is
also in `history.jsonl` in the run directory.
"""),
    code('''
cols = ["step", "adapter", "reward_mean", "reward_std", "loss", "is_ratio_mean", "hit_rate",
        "rollout_s", "train_s", "reload_s"]
run.history.df[cols].round(4)
'''),
    code('''
from pathlib import Path

fig = ag.plot_training(run.history.df)
fig.savefig(Path(RUN_DIR) / "training.png", dpi=110)
print("reward:", " -> ".join(f"{r:.2f}" for r in run.history.df["reward_mean"]))
'''),
    md("""
## Stop

Stops the dashboard thread and the server (by its process group). Adapters, checkpoints and the
history stay in the run directory; `RunConfig(resume=True)` continues from the newest checkpoint.
"""),
    code('''
dashboard.stop()
run.stop()
'''),
]

MULTI_TURN = [
    md("""
# Multi-turn agent: why prefix caching matters

GRPO on `guess_number`, a game of up to four turns that opens with a long system prompt, and a
look at the prefix-cache hit rate turn by turn: turn 1 of every episode starts with the same
prompt, and every later turn re-sends the episode's whole history, which the server's radix cache
still holds. Without a GPU it runs on the CPU engine with an offline tiny model.
"""),
    code('''
# Parameters (papermill / nbmake can override these). CPU-sized defaults; GPU-sized ones below.
RUN_DIR = "../runs/multi_turn"
TASK = "guess_number"      # multi-turn; python -m artsg_nb.train --list-tasks
ENGINE = "auto"            # "sglang" with a GPU, the CPU engine without; or "vllm"
MODEL_PATH = None          # None: the offline tiny model
GROUP_SIZE = 4             # G episodes per prompt
GROUPS_PER_STEP = 2
STEPS = 3                  # GRPO steps run by the loop cell
LEARNING_RATE = 2e-3
SCHEDULES = ("naive", "prefix")  # turn-1 submission orders to compare (rollout.SCHEDULES)
''', tags=["parameters"]),
    md("""
## Plan the GPUs

As in the quickstart: this runs before anything touches CUDA in the kernel. No GPU → the CPU engine.
"""),
    code('''
import artsg_nb as ag
from artsg_nb import bench, metrics, plots

plan = ag.plan_gpus(ag.list_gpus())
print(plan.describe())
if plan.mode != "cpu":  # a GPU is present: bigger defaults
    GROUP_SIZE, GROUPS_PER_STEP, STEPS = 8, 8, 10
'''),
    md("""
## The task

The environment picks a secret number; the agent guesses, hears "Higher." or "Lower.", and
guesses again, up to four times. The reward is paid at the end and falls with each extra guess.
Every episode opens with the same messages (the secret lives in the environment), so the system
prompt below is what the cache can share across all of a step's episodes.
"""),
    code('''
task = ag.get_task(TASK)
print(task.description, "\\n")
for message in task.make_env(seed=0).reset():
    print(f"[{message['role']}]\\n{message['content']}\\n")
'''),
    md("""
## Start the server and the trainer

The server runs as a subprocess of this kernel in its own process group, bound to 127.0.0.1, with
its log in the run directory; the trainer holds a fresh LoRA adapter (`policy-step-0`).
"""),
    code('''
cfg = ag.RunConfig(task=TASK, engine=ENGINE, model_path=MODEL_PATH, run_dir=RUN_DIR,
                   group_size=GROUP_SIZE, groups_per_step=GROUPS_PER_STEP, learning_rate=LEARNING_RATE)
run = ag.GRPORun(cfg).start()
print(run.server.url, "| log:", run.server.log_path)
'''),
    md("""
## The dashboard

GPU roles (or "CPU engine"), the server and the adapter it serves, and the prefix-cache hit rate
from the server's token counters, cumulative and for the last step.
"""),
    code('''
dashboard = ag.Dashboard(run.plan, run.server, run.tracker, adapter_fn=lambda: run.adapter).show()
'''),
    md("""
## A few GRPO steps

Each step plays `GROUPS_PER_STEP` × `GROUP_SIZE` episodes turn by turn under the current adapter,
trains on the whole conversations (only the model's own tokens carry loss), and hot-reloads the
new adapter. The step's hit rate covers all of its turns; the curves redraw after each reload.
"""),
    code('''
live = ag.LivePlot()

def after_step(row):
    live.update(run.history.df)
    dashboard.refresh()

await run.run(STEPS, on_step=after_step)
'''),
    md("""
## Hit rate per turn

One more batch of episodes under the newest adapter (not trained on), with the cache flushed
first, and the server's prompt and cached token counts summed per turn. `theoretical` is what a
perfect cache would reuse: at turn 1 every copy of the opening prompt but the first, at a later
turn the episode's history up to the end of its last reply. A later turn can beat it slightly:
episodes that made the same guesses have identical histories, which the cache shares too.
"""),
    code('''
groups = await run.rollouts(bench.held_out_seeds(run), schedule="prefix")
turns = metrics.turn_hit_rates(groups)
turns.round(3)
'''),
    code('''
plots.plot_turn_hit_rates(turns)
'''),
    md("""
## What the cache saves

Without a prefix cache every turn would prefill its whole history again; the server would
compute all `prompt_tokens`. With it, it computes only `computed_tokens`: the new env message and
the generation prompt of each turn, plus one copy of the opening prompt.
"""),
    code('''
prompt, computed = turns["prompt_tokens"].sum(), turns["computed_tokens"].sum()
print(f"prefill: {computed} of {prompt} prompt tokens computed, {prompt / computed:.0f}x less than without a cache")
'''),
    md("""
## Naive vs prefix submission

The same seeds under each schedule, the cache flushed before each. `naive` sends every episode's
first turn at once; `prefix` sends one leader per group first and its followers when the leader's
first token streams back, when its prompt is in the cache. Only turn 1 differs: later turns
extend each episode's own history either way.

SGLang computes identical prompts that share one prefill batch in full, so there `naive` loses
most of turn 1's reuse (the rollout benchmark measured 0.28 instead of 0.875 on an H200 for 8
groups of 8). The CPU engine prefills one request at a time, so on CPU both schedules reach the
theoretical rate and the bars match.
"""),
    code('''
comparison = await bench.compare_schedules(run, SCHEDULES)
display(comparison.round(3))
plots.plot_turn_hit_rates(comparison)
'''),
    md("""
## Stop

Stops the dashboard thread and the server (by its process group). Adapters, checkpoints and the
history stay in the run directory.
"""),
    code('''
dashboard.stop()
run.stop()
'''),
]

ENGINES = [
    md("""
# vLLM vs SGLang: rollout-shaped benchmarks

Runs the rollout benchmark (`artsg_nb.bench`: P prompts × G samples, as a GRPO step submits them)
on the engines this machine has — the CPU engine without a GPU; SGLang, and vLLM when its
environment is found, with one — plots throughput, time to first token, prefix-cache hit rate and
adapter reload latency side by side, then shows the committed H200 results.
"""),
    code('''
# Parameters (papermill / nbmake can override these). CPU-sized defaults; GPU-sized ones below.
RUN_DIR = "../runs/bench"              # server logs and this run's CSVs
RESULTS_DIR = "../benchmarks/results"  # committed results (CSVs from python -m artsg_nb.bench)
RESULTS_GPU = "H200"                   # which committed results to show
GROUPS = 2                             # P prompts per run
GROUP_SIZE = 4                         # G samples per prompt
PROMPT_TOKENS = 256                    # turn-1 prompt length
NEW_TOKENS = 16                        # tokens generated per sample (fixed)
TURNS = 1
SCHEDULES = ("naive", "prefix", "n")   # turn-1 submission orders (rollout.SCHEDULES)
RADIX = (True, False)                  # prefix cache on, and off for contrast (one server each)
REPEATS = 1
''', tags=["parameters"]),
    md("""
## Which engines

Without a GPU only the CPU engine runs (it is what CI executes this notebook with). With a GPU,
SGLang and vLLM each run in their own environment (`environment-server.yml`,
`environment-vllm.yml`); an engine whose environment is not found is listed with where it was
looked for, and skipped.
"""),
    code('''
import artsg_nb as ag
from artsg_nb import bench
from artsg_nb.bench import BenchConfig

plan = ag.plan_gpus(ag.list_gpus())
print(plan.describe())
if plan.mode != "cpu":  # the reference workload: 8 x 8 samples, ~1,500-token prompts
    GROUPS, GROUP_SIZE, PROMPT_TOKENS, NEW_TOKENS, RADIX, REPEATS = 8, 8, 1500, 128, (True,), 3
engines = bench.engine_availability(plan)
engines
'''),
    md("""
## Run the benchmark

For each engine and cache setting, a server is started, every schedule is run on fresh prompts
with the cache flushed first (after a warm-up run), the same token payloads are replayed with
plain httpx as the raw-engine baseline (`raw_fraction` = toolkit / raw throughput), and the
adapter reload is timed (save + load + first request). Each server is stopped when its runs are
done; the CSVs go to `RUN_DIR`.
"""),
    code('''
cfg = BenchConfig(groups=GROUPS, group_size=GROUP_SIZE, prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS,
                  turns=TURNS, schedules=SCHEDULES, radix=RADIX, repeats=REPEATS, run_dir=RUN_DIR)
runs = bench.bench_engines(cfg, engines.engine[engines.available])
bench.results_table(runs).round(3)
'''),
    md("""
## Side by side

Toolkit rows only (what training sees). The dashed ticks on the hit-rate panel are the
theoretical maximum, (G-1)/G for one turn. On the CPU engine every schedule reaches it (prefills
run one at a time) and "no radix" shows what the cache is worth; on SGLang `naive` falls short of
it, which is what the `prefix` schedule fixes. CPU timings share 2 cores between client and
server: compare them only with each other.
"""),
    code('''
ag.plot_engine_comparison(runs[runs["mode"] == "toolkit"])
'''),
    md("""
## The committed H200 results

Benchmarks measured on an H200 host are committed under `benchmarks/results/` (format:
`benchmarks/results/README.md`). Each file records its date, GPU, engine version and flags; for
each engine and workload the newest file is shown.
"""),
    code('''
results = bench.latest_results(bench.load_results(RESULTS_DIR, gpu=RESULTS_GPU))
if results.empty:
    print(f"No {RESULTS_GPU} results are committed in {RESULTS_DIR} yet: they are added after the "
          "GPU runs (see benchmarks/results/README.md). The plots above are this machine's.")
else:
    display(bench.result_sources(results))
    display(bench.results_table(results).round(3))
'''),
    md("""
One chart per workload (rows of different shapes are never averaged together). What to look
for: `naive` far below the dashed theoretical hit rate on SGLang, which `prefix` closes, and
what that does to throughput and time to first token; vLLM beside it where it was run.
"""),
    code('''
for workload, rows in results[results["mode"] == "toolkit"].groupby("workload", sort=False):
    print(workload)
    display(ag.plot_engine_comparison(rows))
'''),
    md("""
## Stop

The benchmark stops each server it starts; this also stops any left running by an interrupted
cell (by process group).
"""),
    code('''
from artsg_nb.server import stop_all

stop_all()
'''),
]

NOTEBOOKS = {"01_quickstart.ipynb": QUICKSTART, "02_multi_turn_agent.ipynb": MULTI_TURN,
             "03_vllm_vs_sglang.ipynb": ENGINES}

if __name__ == "__main__":
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    for name, cells in NOTEBOOKS.items():
        write(out_dir, name, cells)
