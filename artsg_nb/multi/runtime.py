"""A sweep: N GRPO experiments on one inference server and one copy of the base model.

What it does: `Sweep(SweepConfig(...), {name: RunConfig, ...}).start()` plans the GPUs, checks that
the experiments fit in memory (memory.py: refused up front with the numbers), starts one server
(SGLang on a GPU, the CPU engine without; room for every experiment's adapter in one batch:
`--max-loras-per-batch`, `--max-lora-rank` and `--lora-target-modules` from SweepConfig.lora)
while the MultiTrainer loads the base model once, and adds each experiment: its own task, seed,
learning rate and LoRA (its RunConfig), run dir `<run_dir>/<name>` with config.json, rollouts,
adapters and history.jsonl (experiment.py).

  await sweep.step()       one step of every experiment: their rollouts go to the server together
                           (one asyncio.gather: mixed adapters in the server's batches), their
                           updates take turns on the trainer (a reload overlaps the next update)
  await sweep.run(n)       n steps of each, every experiment at its own pace (one's rollouts run
                           while another trains); `live=True` redraws their curves side by side
  sweep.table()            each experiment's served adapter, step, reward, hit rate, share of
                           the trainer's time and status (its error when it failed)
  sweep.add / remove       an experiment more, or one fewer, between steps
  sweep.attach(name, cfg)  an experiment whose rollouts come from outside (an ART model's:
                           artsg_nb.art.SGLangBackend(sweep=sweep)); `await sweep.train_on(name,
                           groups)` trains it; step() and run() leave it to its owner
  sweep.retry(name)        a failed experiment steps again (its failed step was undone)
  sweep.stop()             the server, by its process group

One experiment failing (its task raising, no reward, an exception in its update or reload) never
stops the others: its error is recorded in `table()` and the log, its step undone (the trainer back
at its served version), and it takes no more steps until `retry`. A re-run start cell stops the
sweep this kernel started in the same run_dir first.

A lost server is restarted (at most SweepConfig.max_restarts times over the sweep), every
experiment's newest version loaded again, and the phase each was in redone (serving.py).

What it does not do: resume, pipeline rollouts a step ahead, watch for a hung server, or release
the server's memory around updates. Several kernels attaching to one sweep is not built yet.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from ..files import write_atomic
from ..models.pretrained import built_model_dir
from ..serving.gpus import apply_to_kernel, list_gpus, plan_gpus, require_gpu
from ..serving.procs import RunDirLock
from ..serving.server import ServerConfig, start_server, start_while
from ..tasks.registry import resolve_task
from ..run.config import CONFIG_FILE, RunConfig, config_record, learning_rate
from ..run.rundir import archive_earlier_run
from .experiment import Experiment
from .memory import sweep_fit
from .serving import SharedServer
from .trainer import IDLE_ADAPTER, NAME_PATTERN, LoraSpec, MultiTrainer
from .view import LiveSweep, sweep_table

log = logging.getLogger(__name__)

_live: dict[Path, "Sweep"] = {}
"""The sweep this kernel started last in each run_dir: a re-run start cell stops it first."""


@dataclass
class SweepConfig:
    """What the experiments of a sweep share: the server, the base model, the LoRA room."""

    run_dir: str = "runs/sweep"
    """The sweep's folder: the server's log here, each experiment's run dir in `<run_dir>/<name>`."""
    model_path: str | None = None
    """Base model (a registered name, a directory or a hub id); None: the offline tiny model."""
    engine: str = "auto"
    """"sglang" (GPU), "cpu" (the CPU engine) or "auto" (SGLang with a GPU, the CPU engine without)."""
    lora: LoraSpec = field(default_factory=LoraSpec)
    """The largest LoRA an experiment may have: rank and target modules the server and the trainer
    are started with (an experiment's RunConfig.lora_rank above it is refused, naming both)."""
    max_loras_per_batch: int | None = None
    """Adapters in one server batch; None: one per experiment and one more (the base model)."""
    micro_batch_tokens: int | None = None
    """The trainer's micro-batch token budget (rl.trainer.TrainerConfig); None: sized by the trainer."""
    prompt_warm_up: str = "auto"
    """How a group's prompt is sent to SGLang (serving.ServerConfig.prompt_warm_up)."""
    server_args: tuple[str, ...] = ()
    """Extra server flags."""
    api_key: str | None = "auto"
    """The server's key (serving.ServerConfig.api_key)."""
    check_memory: bool = True
    """Refuse up front a sweep whose experiments do not fit in memory (memory.py)."""
    max_restarts: int = 2
    """Server restarts allowed over the sweep (serving.py); spent, every experiment stops with the cause."""


def check_name(name: str) -> None:
    """An experiment's name prefixes its served adapters (`<name>-step-N`) and names its run dir."""
    if not NAME_PATTERN.match(name) or name == IDLE_ADAPTER or "-step-" in name:
        raise ValueError(f"experiment name {name!r}: use letters, digits, '-' and '_' (at most 64, without "
                         f"'-step-', not {IDLE_ADAPTER!r}); it names its run dir and prefixes its served adapters "
                         "(<name>-step-N)")


class Sweep:
    """N experiments on one server and one trainer (module docstring)."""

    def __init__(self, cfg: SweepConfig, experiments: dict[str, RunConfig]):
        if not experiments:
            raise ValueError("a sweep needs at least one experiment: Sweep(cfg, {'name': RunConfig(...)})")
        for name in experiments:
            check_name(name)
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.configs = {name: replace(c, run_dir=str(self.run_dir / name)) for name, c in experiments.items()}
        self.experiments: dict[str, Experiment] = {}
        self.plan = self.server = self.shared = self.multi = None
        self.model_dir: str | None = None
        self._turn: asyncio.Lock | None = None  # the trainer's turn, per event loop
        self._turn_loop = None
        self._lock = RunDirLock(self.run_dir)

    @property
    def client(self):
        """The server's client (a new one after each restart)."""
        return self.shared.client if self.shared is not None else None

    @property
    def restarts(self) -> int:
        """Server restarts so far."""
        return self.shared.restarts if self.shared is not None else 0

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Sweep":
        """Resolve every task, check memory, start the server while the trainer loads, add the
        experiments. A failure stops what it started before the error goes up."""
        tasks = {name: resolve_task(c.task) for name, c in self.configs.items()}  # a typo fails first
        earlier = _live.get(self.run_dir.resolve())
        if earlier is not None and earlier is not self:  # a re-run start cell: this kernel's earlier sweep stops
            earlier.stop()
        for name, c in self.configs.items():  # and a LoRA the runtime cannot hold, before anything starts
            self._lora_of(c).check_fits(self.cfg.lora, name)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        _live[self.run_dir.resolve()] = self
        try:
            self._start(tasks)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, tasks: dict) -> None:
        cfg = self.cfg
        self.plan = plan_gpus(list_gpus())
        engine = cfg.engine if cfg.engine != "auto" else ("cpu" if self.plan.mode == "cpu" else "sglang")
        if engine != "cpu" and self.plan.mode == "cpu":
            require_gpu()
        apply_to_kernel(self.plan)
        self.model_dir = built_model_dir(cfg.model_path)
        self.check_memory(len(self.configs))
        self.server, self.multi = start_while(lambda: start_server(self._server_config(engine)),
                                              lambda: MultiTrainer(self.model_dir, cfg.lora,
                                                                   micro_batch_tokens=cfg.micro_batch_tokens))
        self.shared = SharedServer(self.server, cfg.max_restarts)
        for name, task in tasks.items():
            self._add(name, self.configs[name], task)

    def check_memory(self, experiments: int) -> None:
        """TooManyExperimentsError (with the numbers) unless `experiments` fit (memory.py)."""
        if not self.cfg.check_memory:
            return
        gpus = self.plan.gpus if self.plan is not None and self.plan.mode != "cpu" else []
        gpu = gpus[0] if gpus else None
        fit = sweep_fit(self.model_dir, experiments, self.cfg.lora.rank,
                        gpu_total_bytes=int(gpu.mem_total_mib * 2**20) if gpu else None,
                        available_bytes=int((gpu.mem_total_mib - gpu.mem_used_mib) * 2**20) if gpu else None)
        if fit is None:
            log.warning("sweep: %s is not a model directory; starting without the memory check", self.model_dir)
            return
        log.info("sweep: %s", fit.check().describe())

    def _server_config(self, engine: str) -> ServerConfig:
        cfg = self.cfg
        room = cfg.max_loras_per_batch or len(self.configs) + 1
        return ServerConfig(engine=engine, model_path=self.model_dir, run_dir=str(self.run_dir),
                            max_lora_rank=cfg.lora.rank, lora_target_modules=cfg.lora.target_modules,
                            max_loras_per_batch=room, mem_fraction=getattr(self.plan, "server_mem_fraction", None),
                            gpu_plan=self.plan, api_key=cfg.api_key, extra_args=cfg.server_args,
                            prompt_warm_up=cfg.prompt_warm_up)

    def _lora_of(self, cfg: RunConfig) -> LoraSpec:
        """An experiment's LoRA: its rank and alpha on the sweep's target modules."""
        return LoraSpec(cfg.lora_rank, cfg.lora_alpha, self.cfg.lora.target_modules)

    def _add(self, name: str, cfg: RunConfig, task, external: bool = False) -> Experiment:
        archive_earlier_run(cfg.run_dir)  # a fresh start never mixes in an earlier run's steps
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(cfg.run_dir) / CONFIG_FILE, json.dumps(config_record(cfg), indent=2))
        self.multi.add(name, self._lora_of(cfg), learning_rate(cfg.learning_rate, self.model_dir), cfg.seed, grpo=replace(cfg.grpo, temperature=cfg.temperature))
        tol = 0.02 if self.multi.device.type == "cpu" else 0.25
        exp = self.experiments[name] = Experiment(name, cfg, task, self.multi, self.shared, tol, external)
        return exp

    def add(self, name: str, cfg: RunConfig) -> Experiment:
        """One more experiment on the running sweep (its memory checked with the others')."""
        return self._add_new(name, cfg, external=False)

    def attach(self, name: str, cfg: RunConfig) -> Experiment:
        """One more experiment whose rollouts come from outside (module docstring): its LoRA, learning
        rate, seed and loss from `cfg` (its task is not used), its run dir `<run_dir>/<name>`."""
        return self._add_new(name, cfg, external=True)

    def _add_new(self, name: str, cfg: RunConfig, external: bool) -> Experiment:
        self._started("attach" if external else "add")
        check_name(name)
        if name in self.experiments:
            raise ValueError(f"the sweep has an experiment {name!r} already; pick another name")
        self._lora_of(cfg).check_fits(self.cfg.lora, name)
        self.check_memory(len(self.experiments) + 1)
        cfg = replace(cfg, run_dir=str(self.run_dir / name))
        task = resolve_task(cfg.task)
        exp = self._add(name, cfg, task, external)
        self.configs[name] = cfg
        return exp

    def retry(self, name: str) -> None:
        """Let a failed experiment step again (after fixing its cause, e.g. its task): its failed
        step was undone, so its next step redoes it."""
        self.experiments[name].error = None

    async def remove(self, name: str) -> None:
        """Drop an experiment: its adapter versions unloaded from the server, its LoRA and optimizer
        from the trainer. Its run dir stays."""
        exp = self.experiments.pop(name)
        try:
            for version in exp.publisher.served:
                await exp.client.unload_adapter(version.name)
        except Exception as e:  # noqa: BLE001 — a server gone or restarting: the experiment goes all the same
            log.warning("sweep: could not unload experiment %s's adapters (%s: %s)", name, type(e).__name__, e)
        finally:
            exp.publisher.served.clear()
            self.shared.publishers.remove(exp.publisher)
            self.configs.pop(name, None)
            await asyncio.to_thread(self.multi.remove, name)  # waits for the trainer's lock and its checkpoint

    def stop(self) -> None:
        """Stop the server (by its process group) and release the sweep's lock; run dirs stay."""
        if _live.get(self.run_dir.resolve()) is self:
            del _live[self.run_dir.resolve()]
        try:
            if self.server is not None:
                self.server.stop()
        finally:
            try:
                if self.multi is not None:
                    self.multi.close()
            finally:
                self._lock.release()

    def __enter__(self) -> "Sweep":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- steps -----------------------------------------------------------------------------------
    @property
    def active(self) -> list[Experiment]:
        """The experiments the sweep steps: not failed, not attached from outside."""
        return [e for e in self.experiments.values() if e.error is None and not e.external]

    async def step(self, names: list[str] | None = None) -> dict[str, dict | None]:
        """One step of every active experiment (or of those in `names`), together; name → its row
        (None: it failed now)."""
        self._started("step")
        attached = [n for n in names or () if n in self.experiments and self.experiments[n].external]
        if attached:
            raise ValueError(f"{attached}: attached experiments are trained by their owner (sweep.train_on), not stepped")
        exps = [e for e in self.active if names is None or e.name in names]
        rows = await asyncio.gather(*(self._guarded(e) for e in exps))
        return dict(zip((e.name for e in exps), rows))

    async def run(self, n_steps: int, live: bool = False) -> pd.DataFrame:
        """`n_steps` more steps of each active experiment, each at its own pace; with `live` the
        curves of all of them redraw side by side after every step. Returns `table()`."""
        self._started("run")
        view = LiveSweep(n_steps * len(self.active), self) if live else None

        async def loop(exp: Experiment) -> None:
            for _ in range(n_steps):
                row = await self._guarded(exp)
                if view is not None:
                    view.step_done()
                if row is None:
                    return

        try:
            await asyncio.gather(*(loop(e) for e in self.active))
        except BaseException:
            if view is not None:
                view.finish(ok=False)
            raise
        if view is not None:
            view.finish(ok=not any(e.error for e in self.experiments.values()))
        return self.table()

    async def _guarded(self, exp: Experiment) -> dict | None:
        """`exp.step`, its failure recorded on it (the others go on); an interrupt goes up."""
        try:
            return await exp.step(self._trainer_turn())
        except Exception as e:  # noqa: BLE001 — one experiment failing never stops the others
            exp.fail(e)
            return None

    async def serve_initial(self, name: str) -> None:
        """Serve experiment `name`'s starting adapter `<name>-step-0`, once (an attached experiment's
        owner rolls out against it before its first train_on)."""
        self._started("serve_initial")
        await self.experiments[name].serve_initial(self._trainer_turn())

    async def train_on(self, name: str, groups) -> dict:
        """One step of attached experiment `name` on `groups` it rolled out against its served adapter
        (Experiment.train_on), taking its turn on the trainer; its row. An error goes up to the caller
        with the step undone; the experiment is not marked failed (its owner decides)."""
        self._started("train_on")
        exp = self.experiments[name]
        if not exp.external:
            raise ValueError(f"experiment {name!r} rolls out its own task (sweep.step / sweep.run step it); "
                             "train_on is for experiments attached with sweep.attach")
        return await exp.train_on(groups, self._trainer_turn())

    def _trainer_turn(self) -> asyncio.Lock:
        """The trainer's turn: one lock per event loop (a notebook's cells share one; asyncio.run makes new ones)."""
        loop = asyncio.get_running_loop()
        if self._turn is None or self._turn_loop is not loop:
            self._turn, self._turn_loop = asyncio.Lock(), loop
        return self._turn

    def _started(self, what: str) -> None:
        if self.multi is None:
            raise RuntimeError(f"call start() before {what}()")

    # ---- views -----------------------------------------------------------------------------------
    def table(self) -> pd.DataFrame:
        """One row per experiment: adapter, step, reward, hit rate, trainer share, status, error."""
        return sweep_table(self.experiments.values())

    def plot(self):
        """Every experiment's curves on one figure, one colour each (view.plots.compare_runs)."""
        from ..view.plots import compare_runs
        return compare_runs([e.run_dir for e in self.experiments.values()], list(self.experiments))
