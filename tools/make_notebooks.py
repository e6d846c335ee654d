"""Write the notebooks from this script, so their source is reviewable and they are born clean.

`python tools/make_notebooks.py` rewrites notebooks/*.ipynb (no outputs, no execution counts).
Edit the cells here, not in Jupyter, then re-run it; CI fails if a committed notebook has outputs.
"""
import nbformat as nbf
from pathlib import Path

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


def write(name, cells):
    nb = nbf.v4.new_notebook(cells=cells, metadata=KERNEL)
    OUT.mkdir(exist_ok=True)
    nbf.write(nb, OUT / name)


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
GROUPS_PER_STEP = 4
MORE_STEPS = 6             # steps run by the loop cell
LEARNING_RATE = 2e-3
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

The curves redraw in place after each reload.
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

if __name__ == "__main__":
    write("01_quickstart.ipynb", QUICKSTART)
