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

What it does not do: the loss (grpo.py), the optimizer (trainer.py), HTTP details (engines/),
or drawing (plots.py, widgets.py). The algorithm in one paragraph: for each step, sample
`groups_per_step` prompts, `group_size` completions each, reward them with the task, normalise
rewards within each group into advantages, and take one clipped policy-gradient step on the
LoRA weights (see grpo.py for the exact loss).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

from ..files import write_atomic
from ..rl.distributed import make_trainer
from ..engines import SamplingParams
from ..rollout.evaluate import evaluate, history_fields
from ..rl.export import export_adapter, export_merged
from ..serving.gpus import apply_to_kernel, list_gpus, plan_gpus, require_gpu
from .history import History, step_row
from ..rl.lora import (AdapterPublisher, AdapterSaveError, AdapterVersion, MaskedScorer, latest_checkpoint,
                       probe_served_adapter, probe_trajectory, remove_stale_tmp, save_adapter_atomic,
                       seal_version)
from ..serving.metrics import HitRateTracker
from ..models.pretrained import base_model_id, built_model_dir
from .pipeline import SampleAhead
from ..view.plots import LiveTraining, load_rollouts, plot_training
from ..view.plots.sample_cards import full_text, show_samples
from ..serving.procs import RunDirLock
from .released import train_released
from .retention import prune_adapters
from .rundir import archive_earlier_run, resumed_line, stopped_line, take_over
from ..rollout.groups import collect_groups
from ..rollout.trajectory import require_rewards, rollout_stats
from .config import (CONFIG_FILE, REAL_MODEL_LEARNING_RATE, TINY_MODEL_LEARNING_RATE, RunConfig,
                     check_resumable, config_record, resolve_release, resolve_schedule)
from ..rollout.samples import constant_groups, read_samples, write_rollouts
from ..serving.inference import start_inference
from ..serving.server import ServerConfig, start_while
from ..tasks.registry import resolve_task
from ..models.tiny import default_model_dir, is_tiny_build
from .supervisor import ServerLostError, ServerSupervisor  # noqa: F401  (ServerLostError: public here too)
from .trackers import Trackers
from ..rl.trainer import TrainerConfig
from .watchdog import HealthWatchdog
from ..view.widgets import Dashboard

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
    that may sample a step ahead (pipeline.py), and the update with memory released around it
    (released.py). None of them calls back into the run."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.plan = self.trainer = self.tracker = None
        self.task = self.trackers = self.model_path = None
        self.history: History | None = None
        self.release = False  # resolved cfg.release_memory; may be toggled between steps
        self._unwritten_row: dict | None = None  # a completed step whose history write failed
        self._unpublished: AdapterVersion | None = None  # saved by a step of run(), served by the next (_serve_newest)
        self._publish_s = 0.0  # seconds _serve_newest took since the last row: that row's reload_s counts them
        self._scrape: asyncio.Future | None = None  # the /metrics scrape sent beside _serve_newest's publish
        self._adapter_lock: asyncio.Lock | None = None  # a step's: its _serve_newest and its _stage never interleave
        self._verified_on_server: int | None = None  # supervisor.restarts at the last adapter check
        self.watchdog = HealthWatchdog(lambda: supervisor.server, lambda: supervisor.client, cfg.hang_timeout_s)
        supervisor = self.supervisor = ServerSupervisor(self.watchdog, cfg.max_restarts, self.run_dir)
        self.sampler: SampleAhead | None = None  # the step's rollouts, maybe sampled ahead (after start)
        self._lock = RunDirLock(self.run_dir)
        self._dashboard: Dashboard | None = None

    # ---- the supervisor's state, as a notebook reads it ---------------------------------------
    server = _Supervised()
    """The inference server or fleet (serving.inference.InferenceServer), replaced at each restart."""
    client = _Supervised()
    """The server's client (a new one after each restart)."""
    publisher = _Supervised()
    """What saves, loads and verifies adapter versions on the server."""

    @property
    def restarts(self) -> int:
        """Server restarts so far in this run (bounded by cfg.max_restarts)."""
        return self.supervisor.restarts

    @property
    def _ahead(self):
        return self.sampler.ahead if self.sampler else None

    @property
    def _ahead_task(self):
        return self.sampler.ahead_task if self.sampler else None

    async def _with_restarts(self, fn, *args):
        return await self.supervisor.with_restarts(fn, *args)

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
        self._save_config()
        self.plan = plan_gpus(list_gpus(), num_servers=cfg.num_servers,
                              trainer_ranks=cfg.trainer_ranks if cfg.trainer_ranks > 1 else None)
        engine = cfg.engine if cfg.engine != "auto" else ("cpu" if self.plan.mode == "cpu" else "sglang")
        self.release = resolve_release(cfg, self.plan.mode)
        self.plan = replace(self.plan, release_server_memory=self.release)
        if engine != "cpu" and self.plan.mode == "cpu":
            require_gpu()
        apply_to_kernel(self.plan)
        # A registered real model's name (models.py) → its offline build; a directory or hub id as is.
        model_path = built_model_dir(cfg.model_path) if cfg.model_path else str(default_model_dir())
        self.model_path = base_model_id(cfg.model_path) if cfg.model_path else model_path
        self.server, self.trainer = start_while(lambda: self._start_server(engine, model_path),
                                                lambda: self._make_trainer(model_path))
        self.client = self.server.client()
        self.tracker = HitRateTracker(engine=engine)
        self.history = History.load(self.run_dir) if cfg.resume else History(self.run_dir)
        self.publisher = AdapterPublisher(self.client, self.run_dir)
        self.sampler = SampleAhead(cfg.pipeline, self.trainer, self.run_dir, self.supervisor,
                                   lambda step: self._rollouts(step), self._stage,
                                   lambda: self._serve_newest(scrape=True), lambda: self.weights_version)
        adapters = self.run_dir / "adapters"
        remove_stale_tmp(adapters)
        # policy-step-0 is the untrained LoRA (B = 0, so it serves the base model's outputs).
        self._initial = self._restore_latest(adapters) if cfg.resume else save_adapter_atomic(self._save_fn, adapters, 0)
        self._published = False  # the first await (step/run) loads it into the server
        self.trackers = Trackers(cfg.report_to, self.run_dir, self.run_dir.name, config_record(cfg))
        return self

    def _save_config(self) -> None:
        """Write run_dir/config.json; with resume=True first refuse a changed configuration."""
        path = self.run_dir / CONFIG_FILE
        if self.cfg.resume and path.exists():
            check_resumable(json.loads(path.read_text()), self.cfg)
        write_atomic(path, json.dumps(config_record(self.cfg), indent=2))

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

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def adapter(self) -> str | None:
        """The adapter version the server serves now (None before the first step)."""
        return self.supervisor.adapter

    @property
    def weights_version(self) -> str | None:
        """The adapter version the trainer's weights are: the served one, or one a step of `run()`
        saved and left to the next step to serve (`_serve_newest`)."""
        return self._unpublished.name if self._unpublished else self.supervisor.weights_version

    # ---- one GRPO step -----------------------------------------------------------------------
    async def step(self) -> dict:
        """Rollouts → rewards → loss → update → save + hot-reload → one history row.

        While it runs, the watchdog turns a server that stops answering for hang_timeout_s into
        a restart (its process group is killed, the step's server work redone)."""
        return await self._watched_step(publish=True)

    async def _watched_step(self, publish: bool) -> dict:
        """One step under the watchdog. publish=False (a step of `run()` followed by another): a
        pipelined step may leave its new version saved and unserved (`_leaves_unpublished`); the
        next step loads and serves it beside its own update (pipeline.SampleAhead)."""
        if self.trainer is None:
            raise RuntimeError("call start() before step()")
        self._write_unwritten_row()
        self._begin_step()
        self.watchdog.start()
        try:
            return await self._step(publish)
        finally:
            self._end_step()
            await self.watchdog.stop()

    def _begin_step(self) -> None:
        """A step's own lock and counters (each step may run in its own event loop: asyncio.run per cell)."""
        self._adapter_lock, self._publish_s, self._scrape = asyncio.Lock(), 0.0, None

    def _end_step(self) -> None:
        scrape, self._scrape, self._adapter_lock = self._scrape, None, None
        if scrape is not None and not scrape.done():  # a step that failed before its row awaited it
            scrape.cancel()

    async def train_on(self, groups) -> dict:
        """step()'s second half on groups rolled out elsewhere (artsg_nb.art: ART's rollouts, from
        the served adapter): update, save + reload + check, one row (no rollout_s / hit_rate)."""
        if self.trainer is None:
            raise RuntimeError("call start() before train_on()")
        self._write_unwritten_row()
        self._begin_step()
        self.watchdog.start()
        try:
            await self.serve_initial()
            await self._serve_newest()
            self.sampler.row = {}
            return await self._update(self.trainer.step + 1, groups, None, None,
                                      lambda gs, _step: self._train_unsaved(gs))
        finally:
            self._end_step()
            await self.watchdog.stop()

    async def serve_initial(self) -> None:
        """Load the starting adapter (policy-step-0, or the resumed one) into the server, once;
        step() and train_on() call it first, a caller rolling out on its own before that."""
        if self._published:
            return
        if self.release:  # a server that cannot release fails here, before any rollout
            await self.client.check_memory_saver(self.cfg.release_tags)
        await self.supervisor.with_restarts(self.supervisor.publish, self._initial)
        self._published = True
        # The dashboard's windows run from one step's reload to the next (the step's rollouts, and
        # the adapter probe or an evaluation beside them); this is the first window's start.
        await self._scrape_metrics()

    def _write_unwritten_row(self) -> None:
        if self._unwritten_row is not None:  # the last step completed but its row was not written
            row, self._unwritten_row = self._unwritten_row, None
            self._write_row(row)

    async def _step(self, publish: bool = True) -> dict:
        await self.serve_initial()
        step = self.trainer.step + 1
        log.info("step %d: rollouts under %s", step, self.weights_version)  # phases in the log: a stall names its phase
        groups, hit_rate, rollout_s = await self.sampler.rollouts(step)  # pipeline.py: maybe sampled ahead
        log.info("step %d: %d groups in %.2f s; update%s", step, len(groups), rollout_s,
                 " (server memory released around it)" if self.release else "")
        leave = not publish and self._leaves_unpublished(step)
        train = lambda gs, step: self.sampler.train(gs, step, self._train_unsaved, self.release,  # noqa: E731
                                                    self._save_ahead, leave_unpublished=leave)
        return await self._update(step, groups, hit_rate, rollout_s, train, leave)

    def _leaves_unpublished(self, step: int) -> bool:
        """Whether a step of `run()` leaves its new version to the next step to serve: pipelined
        steps do, unless this one's row needs it served (its served-adapter check or evaluation)."""
        cfg = self.cfg
        return cfg.pipeline and not self._verify_due(step) and not (cfg.eval_every and step % cfg.eval_every == 0)

    async def _update(self, step: int, groups, hit_rate, rollout_s, train, leave_unpublished: bool = False) -> dict:
        """Rewards → update (`train(groups, step)`) → save + reload → the step's history row. With
        `leave_unpublished` a version saved during the update (`saved`) is not loaded here: the
        next step serves it (`_serve_newest`)."""
        require_rewards(groups)
        write_rollouts(self.run_dir, step, groups)
        n_constant, no_signal = constant_groups(groups)
        if no_signal:  # every group has one reward: no gradient; see _skip_update
            metrics, train_s, memory_s, (version, reload_s, probe, waited_s) = self._skip_update(n_constant)
            if not leave_unpublished:  # no update to overlap with: the version before is served now
                await self._serve_newest()
            self._scrape_once()
        else:
            metrics, train_s, memory_s, saved = await train(groups, step)
            if leave_unpublished and saved is not None:  # served by the next step, beside its update
                log.info("step %d: update in %.2f s; %s served from the next step", step, train_s, saved[0].name)
                (version, reload_s), probe, waited_s = saved, {}, 0.0
                self._unpublished = version
                self._scrape_once()
            else:
                log.info("step %d: update in %.2f s; save and reload", step, train_s)
                self._scrape_once()  # sent while the reload waits on the server
                version, reload_s, probe, waited_s = await self._save_and_reload(groups, saved)
        if self._scrape is not None:  # the step's /metrics scrape, sent beside its reload or a serve
            await self._scrape
            self._scrape = None
        if self._publish_s:  # the publish of the version before, made in this step (_serve_newest)
            reload_s = (reload_s or 0.0) + self._publish_s
        self._publish_s = 0.0
        row = step_row(step, self.weights_version, groups, metrics, hit_rate, (rollout_s, train_s, reload_s), probe,
                       memory_s, self.restarts)
        row.update(self.sampler.row)  # staleness, ahead_wait_s, reload_wait_s when pipelining
        if row.get("reload_wait_s") is not None:  # the load's wait (pipeline.py), then the publish's
            row["reload_wait_s"] += waited_s
        if self.cfg.eval_every and step % self.cfg.eval_every == 0:
            row.update(history_fields(await self.evaluate(n=self.cfg.eval_n)))
        row.update(self.server.worker_stats())  # a fleet's per-worker hit rate and load since the last step's scrape
        self._write_row(row)
        self.trackers.log(row)
        prune_adapters(self.run_dir / "adapters", self.cfg.keep_adapters, self.cfg.keep_every,
                       protect=(self.publisher.current.step, version.step,
                                *([self._unpublished.step] if self._unpublished else [])))
        return row

    def _write_row(self, row: dict) -> None:
        """Append the row; if that fails the step stays complete (adapter saved and served) and
        the next step() writes this row before anything else, so history never has a gap."""
        try:
            self.history.append(row)
        except BaseException:
            self._unwritten_row = row
            log.error("history row of step %d not written; the next step() writes it first", row["step"])
            raise
        if self.cfg.verbose:
            print(self.history.format_row(row), flush=True)

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
                row = await self._watched_step(publish=i == n_steps - 1)
                if view is not None:
                    view.step_done(self.history.df)
                if self._dashboard is not None:
                    self._dashboard.refresh()
                if on_step is not None:
                    on_step(row)
        except BaseException:
            if view is not None:
                view.finish(ok=False)
            raise
        if view is not None:
            view.finish(ok=True)
        return self.history

    async def rollouts(self, seeds, schedule: str | None = None, flush_cache: bool = True) -> list:
        """One group per env seed from the server under the trainer's newest adapter (served first
        if a step of `run()` left it), outside training: nothing is trained on them and the history
        is not touched. `schedule` defaults to the
        run's; with `flush_cache` the prefix cache is emptied first, so what is cached was cached
        by this batch (e.g. to compare schedules, bench.compare_schedules)."""
        if self.trainer is None:
            raise RuntimeError("call start() before rollouts()")
        await self._serve_newest()
        if flush_cache:
            await self.client.flush_cache(timeout_s=30)
        return await self._collect(list(seeds), schedule or self.cfg.schedule)

    async def evaluate(self, split: str = "eval", n: int | None = None, k: int = 1, greedy: bool = True,
                       return_samples: bool = False):
        """Mean reward and pass@k of the trainer's newest adapter (served first if a step of `run()`
        left it) on held-out prompts (evaluate.py); nothing is trained. A dict, with return_samples a (dict, samples DataFrame) pair."""
        cfg = self.cfg
        await self._serve_newest()
        result = await evaluate(self.client, self.task, self.trainer.tokenizer, self.adapter, split=split, n=n, k=k,
                                greedy=greedy, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                max_seq_tokens=cfg.max_seq_tokens, concurrency=cfg.concurrency, default_n=cfg.eval_n)
        return (result.summary, result.samples) if return_samples else result.summary

    def samples(self, step: int | None = None, k: int | None = None):
        """Step `step`'s trajectories (None: the newest) as a DataFrame (samples.py), first k rows;
        its display shows each completion whole (view.plots.sample_cards.FullTextFrame)."""
        return full_text(read_samples(self.run_dir, step, k))

    def show_samples(self, k: int = 4, step: int | None = None, worst: bool = False) -> None:
        """Show k samples of `step` (None: the newest) whole, best reward first (`worst`: worst
        first): prompt, completion, reward and its parts, finish reason. HTML in a notebook, text elsewhere."""
        show_samples(read_samples(self.run_dir, step), k, worst)

    async def chat(self, messages, base: bool = False, max_new_tokens: int | None = None,
                   temperature: float = 0.0) -> str:
        """The reply of the trainer's newest adapter (served first if a step of `run()` left it;
        `base=True`: the base model's) to `messages` (a chat list, or one user message as a
        string); greedy unless `temperature`. Nothing is trained or recorded."""
        if self.trainer is None:
            raise RuntimeError("call start() before chat()")
        messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
        await self.serve_initial()
        await self._serve_newest()
        params = SamplingParams(max_new_tokens=max_new_tokens or self.cfg.max_new_tokens or self.task.max_new_tokens,
                                temperature=temperature)
        answer = await self.client.chat(messages, params, adapter=None if base else self.adapter, logprobs=False)
        return answer["choices"][0]["message"]["content"]

    def export(self, path, merge: bool = False) -> Path:
        """The trainer's newest adapter (the served one, or one a step of `run()` left to serve) as a
        PEFT adapter folder, or (merge=True) a merged model folder (export.py)."""
        # the trainer's newest version (a failed run() may have left it unserved); before the first step: the initial
        served = self._unpublished or self.publisher.current or self._initial
        load = {"load_from": self.trainer.cfg.model_path} if merge else {}  # the local build, never the hub id
        return (export_merged if merge else export_adapter)(served.path, path, self.model_path, self.trainer.tokenizer, **load)

    # ---- internals -----------------------------------------------------------------------------
    def _start_server(self, engine: str, model_path: str):
        cfg = self.cfg
        mem, backup = getattr(self.plan, "server_mem_fraction", None), "weights" in cfg.release_tags
        scfg = ServerConfig(engine=engine, model_path=model_path, run_dir=str(self.run_dir),
                            max_lora_rank=cfg.lora_rank, mem_fraction=mem, gpu_plan=self.plan,
                            api_key=cfg.api_key, extra_args=cfg.server_args, admin_timeout_s=cfg.admin_timeout_s,
                            prompt_warm_up=cfg.prompt_warm_up,
                            enable_memory_saver=self.release, enable_weights_cpu_backup=self.release and backup)
        return start_inference(scfg, self.plan, self.run_dir)  # N servers behind a router when the plan has N

    def _make_trainer(self, model_path: str):
        cfg = self.cfg
        # Pipelined rollouts are one version old: TRL's truncated IS corrects them unless is_mode is set.
        grpo = replace(cfg.grpo, temperature=cfg.temperature,
                       is_mode=cfg.grpo.is_mode or ("token_truncate" if cfg.pipeline else None))
        return make_trainer(TrainerConfig(model_path=model_path, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                          learning_rate=self.learning_rate(model_path), seed=cfg.seed, grpo=grpo,
                                          micro_batch_tokens=cfg.micro_batch_tokens), cfg.trainer_ranks, self.run_dir, self.plan)

    def learning_rate(self, model_path: str) -> float:
        """cfg.learning_rate, or when None the default for the model (run_config.RunConfig)."""
        tiny = self.cfg.model_path is None or is_tiny_build(model_path)
        default = TINY_MODEL_LEARNING_RATE if tiny else REAL_MODEL_LEARNING_RATE
        return self.cfg.learning_rate if self.cfg.learning_rate is not None else default

    def _restore_latest(self, adapters: Path):
        version = latest_checkpoint(adapters, self.history.last["step"] if self.history.last else 0)
        self.trainer.load_checkpoint(version.path)
        self.history.truncate(self.trainer.step)
        log.info("resumed %s at step %d", self.run_dir, self.trainer.step)
        if self.cfg.verbose:
            print(resumed_line(self.run_dir, self.trainer.step, version.name), flush=True)
        return version

    def _skip_update(self, n_constant: int):
        """No signal (each group's rewards identical: every advantage 0): no backward or optimizer
        step. The step counts and is checkpointed (resume); the served adapter (same weights) stays."""
        self.trainer.step += 1
        try:
            version = save_adapter_atomic(self._save_fn, self.run_dir / "adapters", self.trainer.step)
        except AdapterSaveError:
            self.trainer.step -= 1
            raise
        # no reload: (version, reload_s, probe result, waited_s) as _save_and_reload returns them
        return {"zero_adv_groups": n_constant, "update_skipped": True}, 0.0, (None, None), (version, None, {}, 0.0)

    def _save_fn(self, tmp: Path) -> None:
        """The adapter and its checkpoint, both written before the version is renamed into place."""
        self.trainer.save_adapter(tmp)
        self.trainer.save_checkpoint(tmp)

    def _save_served(self) -> AdapterVersion:
        """The trained adapter as a new version, its checkpoint written in the background: the
        server needs only the adapter, so its checksum and flush to disk (lora.seal_version) and
        the optimizer state (twice its size) go to disk while the step reloads and the next one
        rolls out (rl/checkpoint.CheckpointWriter). Until then the version has no
        trainer_state.json and a resume starts from the one before."""
        version = save_adapter_atomic(self.trainer.save_adapter, self.run_dir / "adapters", self.trainer.step,
                                      durable=False)
        self.trainer.save_checkpoint(version.path, wait=False, before=lambda: seal_version(version))
        return version

    def _seeds(self, step: int) -> list[int]:
        return self.task.group_seeds(self.cfg.seed, step, self.cfg.groups_per_step)

    def _sampling_seed_base(self, step: int) -> int:
        """Seeds every rollout request of `step` (rollout.request_seed): a redone step, or the
        same step of a resumed run, samples exactly what the first attempt did."""
        return self.cfg.seed * 1_000_003 + step

    async def _train(self, groups) -> tuple[dict, float, tuple]:
        """trainer.train_step, with the server's memory released around it when `self.release`."""
        return await train_released(self.trainer, groups, self.supervisor, self.release, self.cfg.release_tags)

    async def _train_unsaved(self, groups) -> tuple[dict, float, tuple, None]:
        """`_train`, as SampleAhead.train returns it (metrics, train_s, memory seconds, saved): nothing saved yet."""
        return (*await self._train(groups), None)

    async def _rollouts(self, step: int):
        """(groups, hit rate) of `step`'s rollouts; the rate is the server's own count per request
        (rollout.trajectory.rollout_stats): no /metrics round trip before or after them."""
        await self.supervisor.check_served(self.trainer.step)
        groups = await self._collect(self._seeds(step), self.cfg.schedule, self._sampling_seed_base(step))
        await self.supervisor.raise_if_server_lost(groups)
        return groups, rollout_stats(groups)["hit_rate"]

    async def _scrape_metrics(self) -> None:
        """One /metrics scrape for the dashboard's hit-rate windows and a fleet's per-worker
        figures (`worker_stats`); run beside the save and reload, off the step's path. A failed
        scrape leaves this window out: the step and its row do not depend on it."""
        try:
            self.tracker.add_sample(await self.client.metrics_text())
        except Exception as e:  # noqa: BLE001 — a server error, or text the parser refuses (ValueError)
            log.warning("/metrics scrape failed (%s: %s); the dashboard's hit-rate window skips it",
                        type(e).__name__, e)

    async def _collect(self, seeds: list[int], schedule: str, sampling_seed_base: int | None = None):
        """The run's collect_groups call: its task, tokenizer, group size, sampling and budget."""
        cfg = self.cfg
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens or self.task.max_new_tokens,
                                temperature=cfg.temperature)
        return await collect_groups(self.client, self.task, self.trainer.tokenizer, seeds, cfg.group_size,
                                    params, adapter=self.adapter, concurrency=cfg.concurrency,
                                    schedule=resolve_schedule(schedule, self.task.max_turns),
                                    max_seq_tokens=cfg.max_seq_tokens, sampling_seed_base=sampling_seed_base)

    def _save_ahead(self) -> tuple[AdapterVersion, float] | None:
        """`_save_new_version`, run by a pipelined step in its update's worker thread while the next
        rollouts still run; None (the save then comes after them, in `_save_and_reload`) while the
        served version's checkpoint is only in memory (its write failed for want of disk): a
        cancelled step rolls back to that version, and the next checkpoint would let it go."""
        t0 = time.perf_counter()
        self.trainer.wait_for_checkpoint()
        waited = time.perf_counter() - t0
        if waited > 0.005:  # the checkpoint writer is behind the steps: its disk, not the save, costs this
            log.info("step %d: waited %.3f s for the previous checkpoint's write before saving", self.trainer.step,
                     waited)
        if self.trainer.checkpoints.failed is not None:
            return None
        version, seconds = self._save_new_version()
        log.info("step %d: %s saved in %.3f s, in the update's thread", version.step, version.name, seconds)
        return version, seconds

    def _save_new_version(self) -> tuple[AdapterVersion, float]:
        """(version, seconds): the update's adapter saved as a new version (`_save_served`). A save
        that fails drops the update with it: the trainer returns to the served version (weights,
        optimizer, step, RNG), so the next step() redoes this step. A pipelined step runs this in
        its update's worker thread (pipeline.SampleAhead.train)."""
        previous = self._unpublished or self.publisher.current  # the version the trainer's weights are
        t0 = time.perf_counter()
        try:
            version = self._save_served()
        except AdapterSaveError:
            self.trainer.load_checkpoint(previous.path)
            log.warning("adapter of step %d not saved; trainer rolled back to %s", self.trainer.step + 1,
                        previous.name)
            raise
        return version, time.perf_counter() - t0

    async def _stage(self, saved: tuple[AdapterVersion, float]) -> tuple[AdapterVersion, float]:
        """`saved` (version, seconds) with its version loaded into the server, not served yet: a
        pipelined step's, while the rollouts ahead still run (AdapterPublisher.stage); the seconds
        then count the load too. A load that fails is logged, and the reload makes it (under
        `with_restarts`) once the rollouts are in."""
        version, save_s = saved
        t0 = None
        try:
            # after the serve of the version before, if it is still under way (its stage would be dropped)
            async with self._adapter_lock or contextlib.nullcontext():
                t0 = time.perf_counter()
                return version, save_s + await self.publisher.stage(version)
        except Exception as e:  # noqa: BLE001 — the reload loads it: its errors are raised there
            log.warning("loading %s beside the rollouts ahead failed (%s: %s); it is loaded after them",
                        version.name, type(e).__name__, e)
            return version, save_s + (time.perf_counter() - t0 if t0 is not None else 0.0)  # reload work too

    async def _save_and_reload(self, groups, saved: tuple[AdapterVersion, float] | None = None):
        """Save the update's adapter (unless `saved` already: (version, seconds)), load it into the
        server (unless staged: then only the older version is unloaded), check it when due;
        (version, reload_s, probe result, waited_s). reload_s is the save's and the load's seconds
        together, wherever they ran; waited_s the part of them made here."""
        previous = self.publisher.current
        probe = probe_trajectory(groups)
        t0 = time.perf_counter()
        version, save_s = saved or self._save_new_version()
        t1 = time.perf_counter()
        try:
            await self.supervisor.with_restarts(self.supervisor.publish, version)
        except BaseException:
            self.trainer.wait_for_checkpoint()  # the step stops here: its checkpoint on disk first
            raise
        self._unpublished = None  # a version a failed step left unserved is superseded by this one
        t2 = time.perf_counter()
        reload_s = save_s + t2 - t1
        result = {}
        if self._verify_due(version.step) and probe is not None:
            trainer_lp = self.trainer.score_tokens(probe.token_ids)
            prev_lp = probe.logprobs[1:] if previous else None
            mask = probe.completion_mask[1:]
            sel = lambda xs: [x for x, m in zip(xs, mask) if m]  # noqa: E731
            tol = 0.02 if self.trainer.device.type == "cpu" else 0.25
            # A server lost while scoring is restarted (the republish reloads `version`) and
            # scored again: the step is complete only with its row, so it must not stop here.
            verify = lambda: probe_served_adapter(  # noqa: E731  (self.client after a restart)
                MaskedScorer(self.client, mask, self.cfg.temperature), version, probe.token_ids,
                sel(trainer_lp), sel(prev_lp) if prev_lp else None, tol)
            result = await self.supervisor.with_restarts(verify)
            self._verified_on_server = self.supervisor.restarts
        return version, reload_s, result, t2 - t0

    async def _serve_newest(self, scrape: bool = False) -> None:
        """Serve the version a step of `run()` left unpublished (`_leaves_unpublished`), before any
        rollout from the server: the next step's rollouts ahead call it beside its update. Its
        seconds count in the next row's reload_s; with `scrape` (inside a step) the step's /metrics
        scrape goes beside it."""
        version = self._unpublished
        if version is None:
            return
        t0 = time.perf_counter()
        async with self._adapter_lock or contextlib.nullcontext():
            if self._unpublished is version:  # not served meanwhile (a stage waited for this serve)
                # a publish interrupted during its unload already serves it (supervisor.publish
                # goes on); the older version then stays loaded until a restart: a slot, never a request
                await self.supervisor.with_restarts(self.supervisor.publish, version)
                self._unpublished = None
        self._publish_s += time.perf_counter() - t0
        if scrape:
            self._scrape_once()

    def _scrape_once(self) -> None:
        """The step's one /metrics scrape, sent now unless sent already; awaited before its row."""
        if self._scrape is None:
            self._scrape = asyncio.ensure_future(self._scrape_metrics())

    def _verify_due(self, step: int) -> bool:
        """Whether this reload's served adapter is checked (RunConfig.verify_every): the first
        reload on a server (none checked since it started or restarted), then every verify_every steps."""
        cfg = self.cfg
        first_on_server = self._verified_on_server != self.supervisor.restarts
        return cfg.verify_adapter and (first_on_server or step % cfg.verify_every == 0)
