"""Headless GRPO: `python -m artsg_nb.train --task SPEC --steps N [--engine ...] [--run-dir D]`.

The same code path as the notebooks (session.GRPORun), for clusters and for checks. The flags are
generated from the dataclasses (tyro): every RunConfig field (`--model-path`, `--learning-rate`,
`--max-new-tokens`, `--group-size`, ...) and GRPOConfig's under `--grpo.` (`--grpo.loss-type`,
`--grpo.beta`, ...), plus `--steps` and `--list-tasks`; `--help` lists them with their docstrings.
`--task` takes a registered name, or "package.module:ATTR" naming a Task in an importable module
(the current directory is on the path). Without `--run-dir` a run goes to runs/<task name>.

Prints one line per step and leaves adapters, checkpoints, history.jsonl, the server log and a
plot of the curves in the run directory. `--list-tasks` prints one task per line, its name first.
A user error (unknown task, a task spec that does not import, no server environment, no GPU, bad
model path, busy port, lost server, ...) prints its message, which says what to try, without a
traceback and exits with status 1.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass, field, fields, replace
from typing import Annotated

import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

from .tasks.dataset import DatasetColumnError, RewardFunctionCheckError
from .tasks.task_code import TaskCodeError
from .models.pretrained import ModelNameError
from .rl.distributed import DistributedError
from .engines import AdapterRankError, MemorySaverError
from .serving.gpus import CudaAlreadyInitializedError, NoGpuError
from .rl.lora import AdapterSaveError
from .view.plots import save_training_plot
from .rollout.trajectory import NoRewardError, RolloutsFailedError
from .run.config import ConfigError, ConfigMismatchError, glue_flag_values, split_flags
from .serving.server import ServerError
from .serving.server_env import ServerEnvNotFoundError
from .run.session import GRPORun, RunConfig, ServerLostError
from .tasks.registry import Task, UnknownTaskError, list_tasks, resolve_task
from .rl.trainer import CheckpointError


RUN_DIR_OF_TASK = "runs/<task>"
"""--run-dir's default as --help shows it: runs/ and the task's name (parse_args fills it in)."""


@dataclass
class CliRunConfig(RunConfig):
    """RunConfig as the command line sees it: the two fields whose notebook help would mislead."""

    task: Annotated[str | Task, tyro.conf.arg(help=(
        'A registered task name (see --list-tasks) or "package.module:ATTR" naming a Task in an importable '
        "module (the current directory is on the path), e.g. my_tasks:task for Task.from_dataset(...) in my_tasks.py."
    ))] = "addition"
    run_dir: Annotated[str, tyro.conf.arg(help=(
        "Adapters, checkpoints, history and server logs go here; runs/ and the task's name when not given. "
        "A used one's earlier run is moved to <run-dir>/archive/<date>/ unless --resume."
    ))] = RUN_DIR_OF_TASK

    def as_run_config(self) -> RunConfig:
        return RunConfig(**{f.name: getattr(self, f.name) for f in fields(RunConfig)})


@dataclass
class TrainArgs:
    """GRPO of a LoRA adapter, headless: the notebook's GRPORun from the command line."""

    run: Annotated[CliRunConfig, tyro.conf.arg(name="")] = field(default_factory=CliRunConfig)
    steps: int = 10
    """GRPO steps to run."""
    list_tasks: bool = False
    """Print the registered tasks (name, tab, description) and exit."""


_REGISTRY = ConstructorRegistry()


@_REGISTRY.primitive_rule
def _task_flag(type_info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    """`--task` is one string (a name or "module:ATTR"), resolved by the session, not a subcommand."""
    if type_info.type != (str | Task):
        return None
    return PrimitiveConstructorSpec(nargs=1, metavar="NAME|MODULE:ATTR", instance_from_str=lambda args: args[0],
                                    is_instance=lambda x: isinstance(x, (str, Task)),
                                    str_from_instance=lambda x: [x if isinstance(x, str) else x.name])


def parse_args(argv=None) -> TrainArgs:
    argv = sys.argv[1:] if argv is None else list(argv)
    with _REGISTRY:
        args = tyro.cli(TrainArgs, args=glue_flag_values(argv, ["--server-args"]), prog="python -m artsg_nb.train",
                        description=__doc__.splitlines()[0])
    run = replace(args.run.as_run_config(), server_args=split_flags(args.run.server_args))  # "--a b" → ("--a", "b")
    if run.run_dir == RUN_DIR_OF_TASK:
        name = resolve_task(run.task).name if ":" in str(run.task) else run.task
        run = replace(run, run_dir=f"runs/{name}")
    args.run = run
    return args


async def _train(run: GRPORun, steps: int) -> None:
    await run.run(steps)


def user_errors() -> tuple[type[Exception], ...]:
    """Errors whose message already says what happened and what to try: no traceback for them."""
    return (UnknownTaskError, ServerEnvNotFoundError, NoGpuError, CudaAlreadyInitializedError, ServerError,
            ServerLostError, AdapterSaveError, AdapterRankError, CheckpointError, MemorySaverError,
            DatasetColumnError, NoRewardError, ConfigMismatchError, DistributedError, ConfigError, ModelNameError,
            RewardFunctionCheckError, RolloutsFailedError, TaskCodeError)


def main(argv=None) -> int:
    try:
        return _main(argv)
    except user_errors() as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _main(argv=None) -> int:
    # ARTSG_LOG_LEVEL=INFO shows each step's phases (run/step.py) and the servers' starts.
    logging.basicConfig(level=os.environ.get("ARTSG_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(name)s: %(message)s")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # "--task mymod:task" finds mymod.py where the command runs
    a = parse_args(argv)
    if a.list_tasks:
        for t in list_tasks():
            print(f"{t.name}\t{t.description}")
        return 0
    t0 = time.perf_counter()
    with GRPORun(a.run) as run:
        asyncio.run(_train(run, a.steps))
        df = run.history.df
    save_training_plot(df, run.run_dir / "training.png")
    first, last = df["reward_mean"].iloc[0], df["reward_mean"].iloc[-1]
    print(f"done: {len(df)} steps in {time.perf_counter() - t0:.1f} s | reward {first:.3f} -> {last:.3f} | "
          f"history {run.run_dir / 'history.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
