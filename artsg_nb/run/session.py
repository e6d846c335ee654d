"""A GRPO run as a notebook drives it: start, step, step, ..., stop.

What it does: plans the GPUs, starts the inference server kernel-side (SGLang, vLLM or the CPU
engine) while the trainer loads (a thread waits for the server), and runs GRPO steps — rollouts from the server under the current
adapter, one update, the new adapter saved atomically and hot-reloaded under `policy-step-N`,
one history row. If the server dies mid-step it is restarted (bounded by `max_restarts`), the
newest adapter reloaded, and the step's rollouts redone with the same sampling seeds; completed
steps are never lost. An adapter that cannot be saved (disk full) rolls the trainer back to the
served version, so the step can simply be run again. `resume=True` continues a run from its
newest completed step (a checkpoint with its history row); with the same seed it draws the same
samples an uninterrupted run would. With `release_memory` (one shared GPU) the server's memory is
given back after the rollouts and taken again before the reload, so the trainer gets the GPU;
if training fails meanwhile, the memory is taken back before the error goes up. With
`trainer_ranks` > 1 the trainer is data-parallel over processes (distributed.RankedTrainer).

The step itself, top to bottom, is run/step.py; the adapter versions' owner is run/versions.py,
the rollout source run/source.py, every timing comes from one PhaseClock (`run.clock`, clock.py).

What it does not do: the loss (grpo.py), the optimizer (trainer.py), HTTP details (engines/),
or drawing (plots.py, widgets.py). The algorithm in one paragraph: for each step, sample
`groups_per_step` prompts, `group_size` completions each, reward them with the task, normalise
rewards within each group into advantages, and take one clipped policy-gradient step on the
LoRA weights (see grpo.py for the exact loss).
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from pathlib import Path

from ..files import write_atomic
from ..models.pretrained import base_model_id, built_model_dir
from ..rl.distributed import make_trainer
from ..rl.export import export_adapter, export_merged
from ..rl.lora import AdapterPublisher
from ..rl.trainer import TrainerConfig
from ..rollout.samples import read_samples
from ..serving.gpus import apply_to_kernel, list_gpus, plan_gpus, require_gpu
from ..serving.inference import start_inference
from ..serving.metrics import HitRateTracker
from ..serving.procs import RunDirLock
from ..serving.server import ServerConfig, start_while
from ..tasks.registry import resolve_task
from ..view.plots import LiveTraining, load_rollouts, plot_training
from ..view.plots.sample_cards import full_text, show_samples
from ..view.widgets import Dashboard
from .clock import PhaseClock
from .config import CONFIG_FILE, RunConfig, check_resumable, config_record, learning_rate, resolve_release
from .history import History
from .rundir import archive_earlier_run, resumed_line, stopped_line, take_over
from .pipeline import SampleAhead
from .scrape import MetricsScrape
from .source import RolloutSource
from .step import GRPOStep
from .supervisor import ServerLostError, ServerSupervisor  # noqa: F401  (ServerLostError: public here too)
from .trackers import Trackers
from .versions import AdapterVersions, VerifyPolicy
from .watchdog import HealthWatchdog

log = logging.getLogger(__name__)


class _Supervised:
    """An attribute of the run that its ServerSupervisor holds, read and set through the run."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, run, owner=None):
        return self if run is None else getattr(run.supervisor, self.name)

    def __set__(self, run, value) -> None:
        setattr(run.supervisor, self.name, value)


class GRPORun:
    """One run: `start()`, then `await step()` per cell or `await run(n)`; `stop()` at the end.

    Composed of parts, each handed what it needs: the supervisor (server, client, publisher,
    restarts; supervisor.py), the health watchdog on the supervisor's server, the rollout source
    (source.py), the adapter versions (versions.py), the rollout side that may sample a step ahead
    (pipeline.py), the step that runs them in order (step.py) and the clock that times it
    (clock.py). None of them calls back into the run."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.plan = self.trainer = self.tracker = self.trackers = self.model_path = None
        self.history: History | None = None
        self.release = False  # resolved cfg.release_memory; may be toggled between steps
        self.clock = PhaseClock()
        """Every timing of the run's steps, kept as spans (a profiler reads `clock.since(t0)`)."""
        self.watchdog = HealthWatchdog(lambda: supervisor.server, lambda: supervisor.client, cfg.hang_timeout_s)
        supervisor = self.supervisor = ServerSupervisor(self.watchdog, cfg.max_restarts, self.run_dir)
        self.source = RolloutSource(cfg, None, None, supervisor)  # task and trainer at start()
        self.versions: AdapterVersions | None = None  # the parts below come with the trainer (start)
        self.sampler: SampleAhead | None = None
        self.steps: GRPOStep | None = None
        self._lock = RunDirLock(self.run_dir)
        self._dashboard: Dashboard | None = None

    # ---- the parts' state, as a notebook reads it ----------------------------------------------
    server = _Supervised()
    """The inference server or fleet (serving.inference.InferenceServer), replaced at each restart."""
    client = _Supervised()
    """The server's client (a new one after each restart)."""
    publisher = _Supervised()
    """What loads and unloads adapter versions on the server."""

    @property
    def cfg(self) -> RunConfig:
        """The run's configuration. A notebook may replace it between steps
        (`run.cfg = dataclasses.replace(run.cfg, schedule="prefix")`): what each step reads — the
        schedule, sampling, sizes, max_new_tokens, evaluation, retention — follows the new one;
        what the parts were built with at start (pipeline, verify_adapter/verify_every, the
        server, the trainer) does not."""
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: RunConfig) -> None:
        self._cfg = cfg
        for part in (getattr(self, "source", None), getattr(self, "steps", None)):
            if part is not None:
                part.cfg = cfg

    @property
    def task(self):
        """The run's task (tasks.registry.Task), resolved at start(); the rollouts use it."""
        return self.source.task

    @task.setter
    def task(self, task) -> None:
        self.source.task = task

    @property
    def restarts(self) -> int:
        """Server restarts so far in this run (bounded by cfg.max_restarts)."""
        return self.supervisor.restarts

    @property
    def adapter(self) -> str | None:
        """The adapter version the server serves now (None before the first step)."""
        return self.supervisor.adapter

    @property
    def in_step(self) -> bool:
        """Whether a step is under way (from its start to its end, failed or not)."""
        return self.versions is not None and self.versions.in_step

    @property
    def weights_version(self) -> str | None:
        """The adapter version the trainer's weights are: the served one, or one a step of `run()`
        saved and left to the next step to serve."""
        return self.versions.weights_version if self.versions else self.supervisor.weights_version

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "GRPORun":
        """Lock run_dir (one writer: procs.RunDirLock), start or adopt the server, build the
        trainer, load history and the latest adapter. A failure stops the server it started and
        releases the lock before the error goes up."""
        self.task = resolve_task(self.cfg.task)  # a typo fails before run_dir (and its lock) exists
        take_over(self)  # a re-run start cell: this kernel's earlier run of run_dir stopped, its server kept
        self._lock.acquire()
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> "GRPORun":
        cfg = self.cfg
        if not cfg.resume:
            archive_earlier_run(self.run_dir)  # a fresh start never mixes in an earlier run's steps
        path = self.run_dir / CONFIG_FILE  # with resume=True a changed configuration is refused first
        if cfg.resume and path.exists():
            check_resumable(json.loads(path.read_text()), cfg)
        self.plan = plan_gpus(list_gpus(), num_servers=cfg.num_servers,
                              trainer_ranks=cfg.trainer_ranks if cfg.trainer_ranks > 1 else None)
        engine = cfg.engine if cfg.engine != "auto" else ("cpu" if self.plan.mode == "cpu" else "sglang")
        release = resolve_release(cfg, self.plan.mode)
        if "weights" in release.tags and "weights" not in cfg.release_tags:  # the default adds them where only that fits
            self.cfg = cfg = replace(cfg, release_tags=release.tags)
            log.warning("release_memory: the server's weights are released around each update too: %s", release.why)
        self.release = release.on
        self.plan = replace(self.plan, release_server_memory=self.release)
        write_atomic(path, json.dumps(config_record(cfg), indent=2))
        if engine != "cpu" and self.plan.mode == "cpu":
            require_gpu()
        apply_to_kernel(self.plan)
        # A registered real model's name (models.py) → its offline build; a directory or hub id as is.
        model_path = built_model_dir(cfg.model_path)
        self.model_path = base_model_id(cfg.model_path) if cfg.model_path else model_path
        timed = self.clock.call  # the start's two halves, side by side, each a span on the run's clock
        self.server, self.trainer = start_while(lambda: timed("server_start", start_servers, cfg, self.plan, self.run_dir, engine, model_path),
                                                lambda: timed("trainer_build", self._make_trainer, model_path))
        self.client = self.server.client()
        self.tracker = HitRateTracker(engine=engine)
        self.history = History.load(self.run_dir) if cfg.resume else History(self.run_dir)
        self.publisher = AdapterPublisher(self.client, self.run_dir)
        self.trackers = Trackers(cfg.report_to, self.run_dir, self.run_dir.name, config_record(cfg))
        self._build_parts()
        last = self.history.last
        self.versions.begin((last["step"] if last else 0) if cfg.resume else None)
        if cfg.resume:
            self.history.truncate(self.trainer.step)
            log.info("resumed %s at step %d", self.run_dir, self.trainer.step)
            if cfg.verbose:
                print(resumed_line(self.run_dir, self.trainer.step, self.versions.initial.name), flush=True)
        return self

    def _build_parts(self) -> None:
        """The parts that need the trainer, each handed what it needs."""
        cfg, sup, clock = self.cfg, self.supervisor, self.clock
        self.source.trainer = self.trainer
        scrape = MetricsScrape(self.tracker, sup)
        self.versions = AdapterVersions(self.trainer, self.run_dir, sup, clock, scrape,
                                        VerifyPolicy(cfg.verify_adapter, cfg.verify_every, cfg.temperature))
        self.sampler = SampleAhead(cfg.pipeline, self.trainer, sup, self.source, self.versions, clock)
        self.steps = GRPOStep(cfg, self.trainer, sup, self.source, self.sampler, self.versions, scrape,
                              self.history, self.trackers, clock)

    def stop(self) -> None:
        """Stop the server (by process group), then the dashboard after one last refresh, so it
        says "stopped"; release run_dir's lock. Saved adapters and history stay in run_dir."""
        say = self.cfg.verbose and self._lock.held and self.trainer is not None  # once, for a started run
        server_stopped = self.server is not None
        try:
            if self.sampler is not None:
                self.sampler.cancel_now()  # rollouts sampled ahead (pipeline.py) must not outlive the server
            if self.trackers is not None:
                self.trackers.close()
            if self.server is not None:
                self.server.stop()
            if self._dashboard is not None:
                self._dashboard.stop(reason="run stopped")
            if say:
                print(stopped_line(self.run_dir, self.trainer.step, server_stopped), flush=True)
        finally:
            try:  # whatever failed above: the checkpoint being written lands before the lock goes
                if self.trainer is not None:
                    self.trainer.close()  # and a RankedTrainer's rank processes stop
            finally:
                self._lock.release()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- views ----------------------------------------------------------------------------------
    def dashboard(self, refresh_s: float | None = 2.0) -> Dashboard:
        """Show the live dashboard of this run (GPUs, server, adapter, hit rate); it refreshes
        after each step of `run()` and once more when the run stops."""
        if self._dashboard is not None:
            self._dashboard.stop(reason="replaced by a new dashboard")
        self._dashboard = Dashboard(self.plan, self.server, self.tracker, refresh_s=refresh_s,
                                    adapter_fn=lambda: self.adapter, rows_fn=lambda: self.history.rows)
        return self._dashboard.show()

    def plot(self, theoretical_hit_rate: float | None = None):
        """The training curves so far as a figure (the last line of a cell shows it)."""
        return plot_training(self.history.df, theoretical_hit_rate=theoretical_hit_rate,
                             samples=load_rollouts(self.run_dir) if (self.run_dir / "rollouts").is_dir() else None)

    def samples(self, step: int | None = None, k: int | None = None):
        """Step `step`'s trajectories (None: the newest) as a DataFrame (samples.py), first k rows;
        its display shows each completion whole (view.plots.sample_cards.FullTextFrame)."""
        return full_text(read_samples(self.run_dir, step, k))

    def show_samples(self, k: int = 4, step: int | None = None, worst: bool = False) -> None:
        """Show k samples of `step` (None: the newest) whole, best reward first (`worst`: worst
        first): prompt, completion, reward and its parts, finish reason. HTML in a notebook, text elsewhere."""
        show_samples(read_samples(self.run_dir, step), k, worst)

    # ---- steps ----------------------------------------------------------------------------------
    async def step(self) -> dict:
        """Rollouts → rewards → loss → update → save + hot-reload → one history row (step.py).

        While it runs, the watchdog turns a server that stops answering for hang_timeout_s into
        a restart (its process group is killed, the step's server work redone)."""
        return await self._started("step").step(self.release)

    async def train_on(self, groups) -> dict:
        """step()'s second half on groups rolled out elsewhere (artsg_nb.art: ART's rollouts, from
        the served adapter): update, save + reload + check, one row (no rollout_s / hit_rate)."""
        return await self._started("train_on").train_on(groups, self.release)

    async def serve_initial(self) -> None:
        """Load the starting adapter (policy-step-0, or the resumed one) into the server, once;
        step() and train_on() call it first, a caller rolling out on its own before that."""
        await self.versions.serve_initial(self.cfg.release_tags if self.release else None)

    async def run(self, n_steps: int, on_step=None, live: bool = False) -> History:
        """`n_steps` more steps; `on_step(row)` after each. With `live` the curves and an ETA bar
        redraw in this cell's output after each step (plots.LiveTraining).

        With pipeline=True a step followed by another leaves its new version to that one, which
        loads and serves it beside its own update (a step's period is then about its update, its
        save and its rollouts' share, not the update plus the reload after it); the last step
        serves its own, so the run ends with the newest version served. A `row["adapter"]` names
        the version the step trained either way."""
        view = LiveTraining(n_steps, run_dir=self.run_dir) if live else None
        try:
            for i in range(n_steps):
                row = await self._started("run").step(self.release, publish=i == n_steps - 1)
                if view is not None:
                    view.step_done(self.history.df)
                if self._dashboard is not None:
                    self._dashboard.refresh()
                if on_step is not None:
                    on_step(row)
        except (asyncio.CancelledError, KeyboardInterrupt):
            if view is not None:
                view.finish(ok=False, state="interrupted")
            raise
        except BaseException:
            if view is not None:
                view.finish(ok=False)
            raise
        if view is not None:
            view.finish(ok=True)
        return self.history

    def _started(self, what: str) -> GRPOStep:
        if self.steps is None:
            raise RuntimeError(f"call start() before {what}()")
        return self.steps

    # ---- outside training -----------------------------------------------------------------------
    async def rollouts(self, seeds, schedule: str | None = None, flush_cache: bool = True) -> list:
        """One group per env seed from the server under the trainer's newest adapter (served first
        if a step of `run()` left it), outside training: nothing is trained on them and the history
        is not touched. `schedule` defaults to the
        run's; with `flush_cache` the prefix cache is emptied first, so what is cached was cached
        by this batch (e.g. to compare schedules, bench.compare_schedules)."""
        self._started("rollouts")
        await self.versions.serve_newest()
        if flush_cache:
            await self.client.flush_cache(timeout_s=30)
        return await self.source.collect(list(seeds), schedule or self.cfg.schedule)

    async def chat(self, messages, base: bool = False, max_new_tokens: int | None = None,
                   temperature: float = 0.0) -> str:
        """The reply of the trainer's newest adapter (served first if a step of `run()` left it;
        `base=True`: the base model's) to `messages` (a chat list, or one user message as a
        string); greedy unless `temperature`. Nothing is trained or recorded."""
        self._started("chat")
        await self.serve_initial()
        await self.versions.serve_newest()
        return await self.source.chat(messages, base, max_new_tokens, temperature)

    async def evaluate(self, split: str = "eval", n: int | None = None, k: int = 1, greedy: bool = True,
                       return_samples: bool = False):
        """Mean reward and pass@k of the trainer's newest adapter (served first if a step of `run()`
        left it) on held-out prompts (evaluate.py); nothing is trained. A dict, with return_samples a (dict, samples DataFrame) pair."""
        await self.versions.serve_newest()
        result = await self.source.evaluate(split=split, n=n, k=k, greedy=greedy)
        return (result.summary, result.samples) if return_samples else result.summary

    def export(self, path, merge: bool = False) -> Path:
        """The trainer's newest adapter (the served one, or one a step of `run()` left to serve) as a
        PEFT adapter folder, or (merge=True) a merged model folder (export.py)."""
        load = {"load_from": self.trainer.cfg.model_path} if merge else {}  # the local build, never the hub id
        return (export_merged if merge else export_adapter)(self.versions.newest.path, path, self.model_path,
                                                            self.trainer.tokenizer, **load)

    # ---- internals -----------------------------------------------------------------------------
    def _make_trainer(self, model_path: str):
        cfg = self.cfg
        # Pipelined rollouts are one version old: TRL's truncated IS corrects them unless is_mode is set.
        grpo = replace(cfg.grpo, temperature=cfg.temperature,
                       is_mode=cfg.grpo.is_mode or ("token_truncate" if cfg.pipeline else None))
        return make_trainer(TrainerConfig(model_path=model_path, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                          learning_rate=learning_rate(cfg.learning_rate, model_path), seed=cfg.seed, grpo=grpo,
                                          micro_batch_tokens=cfg.micro_batch_tokens), cfg.trainer_ranks, self.run_dir, self.plan)


def start_servers(cfg: RunConfig, plan, run_dir: Path, engine: str, model_path: str):
    """The run's inference: one server, or N behind a router when the plan has N."""
    release = plan.release_server_memory
    mem, backup = getattr(plan, "server_mem_fraction", None), "weights" in cfg.release_tags
    scfg = ServerConfig(engine=engine, model_path=model_path, run_dir=str(run_dir),
                        max_lora_rank=cfg.lora_rank, mem_fraction=mem, gpu_plan=plan,
                        api_key=cfg.api_key, extra_args=cfg.server_args, admin_timeout_s=cfg.admin_timeout_s,
                        prompt_warm_up=cfg.prompt_warm_up,
                        enable_memory_saver=release, enable_weights_cpu_backup=release and backup)
    return start_inference(scfg, plan, run_dir)
