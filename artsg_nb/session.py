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
if training fails meanwhile, the memory is taken back before the error goes up.

What it does not do: the loss (grpo.py), the optimizer (trainer.py), HTTP details (client.py),
or drawing (plots.py, widgets.py). The algorithm in one paragraph: for each step, sample
`groups_per_step` prompts, `group_size` completions each, reward them with the task, normalise
rewards within each group into advantages, and take one clipped policy-gradient step on the
LoRA weights (see grpo.py for the exact loss).
"""
from __future__ import annotations

import json
import logging
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from .engines import SamplingParams, ServerUnavailableError, memory_tags
from .gpus import apply_to_kernel, list_gpus, plan_gpus, require_gpu
from .history import History
from .lora import AdapterPublisher, AdapterSaveError, adapter_name, load_version, probe_served_adapter, save_adapter_atomic
from .metrics import HitRateTracker, cache_counters, hit_rate
from .rollout import collect_groups
from .run_config import CONFIG_FILE, RunConfig, check_resumable, config_record, resolve_schedule
from .server import ServerConfig, start_server
from .server_env import server_args
from .tasks import get_task
from .tiny_model import default_model_dir
from .trainer import CheckpointError, Trainer, TrainerConfig

log = logging.getLogger(__name__)


class ServerLostError(RuntimeError):
    """The server died and the restart policy is off or exhausted (message: the cause, what to
    do, the log tail). Completed steps stay in run_dir; continue with `resume=True`."""


class GRPORun:
    """One run: `start()`, then `await step()` per cell or `await run(n)`; `stop()` at the end."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.plan = self.server = self.client = self.trainer = self.publisher = self.tracker = None
        self.task = None
        self.history: History | None = None
        self.restarts = 0
        self.release = False  # resolved cfg.release_memory; may be toggled between steps

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "GRPORun":
        cfg = self.cfg
        self.task = get_task(cfg.task)
        self._save_config()
        self.plan = plan_gpus(list_gpus())
        engine = cfg.engine if cfg.engine != "auto" else ("cpu" if self.plan.mode == "cpu" else "sglang")
        self.release = _resolve_release(cfg, self.plan.mode)
        self.plan = replace(self.plan, release_server_memory=self.release)
        if engine != "cpu" and self.plan.mode == "cpu":
            require_gpu()
        apply_to_kernel(self.plan)
        model_path = cfg.model_path or str(default_model_dir())
        self.server, self.trainer = _in_parallel(lambda: self._start_server(engine, model_path),
                                                 lambda: self._make_trainer(model_path))
        self.client = self.server.client()
        self.tracker = HitRateTracker(engine=engine)
        self.history = History.load(self.run_dir) if cfg.resume else History(self.run_dir)
        self.publisher = AdapterPublisher(self.client, self.run_dir)
        adapters = self.run_dir / "adapters"
        # policy-step-0 is the untrained LoRA (B = 0, so it serves the base model's outputs).
        self._initial = self._restore_latest(adapters) if cfg.resume else save_adapter_atomic(self._save_fn, adapters, 0)
        self._published = False  # the first await (step/run) loads it into the server
        return self

    def _save_config(self) -> None:
        """Write run_dir/config.json; with resume=True first refuse a changed configuration."""
        path = self.run_dir / CONFIG_FILE
        if self.cfg.resume and path.exists():
            check_resumable(json.loads(path.read_text()), self.cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{CONFIG_FILE}.tmp")
        tmp.write_text(json.dumps(config_record(self.cfg), indent=2))
        tmp.replace(path)

    def stop(self) -> None:
        """Stop the server (by process group). Saved adapters and history stay in run_dir."""
        if self.server is not None:
            self.server.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def adapter(self) -> str | None:
        cur = self.publisher.current if self.publisher else None
        return cur.name if cur else None

    # ---- one GRPO step -----------------------------------------------------------------------
    async def step(self) -> dict:
        """Rollouts → rewards → loss → update → save + hot-reload → one history row."""
        if self.trainer is None:
            raise RuntimeError("call start() before step()")
        if not self._published:
            if self.release:  # a server that cannot release fails here, before any rollout
                await self.client.check_memory_saver(self.cfg.release_tags)
            await self._with_restarts(self._publish, self._initial)
            self._published = True
            # The dashboard's windows run from one step's rollouts to the next (the adapter probe
            # between them adds a few hundred prompt tokens); this is the first window's start.
            self.tracker.add_sample(await self.client.metrics_text())
        step = self.trainer.step + 1
        t0 = time.perf_counter()
        groups, hit_rate = await self._with_restarts(self._rollouts, step)
        rollout_s = time.perf_counter() - t0
        metrics, train_s, memory_s = await self._train(groups)
        version, reload_s, probe = await self._save_and_reload(groups)
        row = self._row(step, groups, metrics, hit_rate, rollout_s, train_s, reload_s, probe, memory_s)
        self.history.append(row)
        if self.cfg.verbose:
            print(self.history.format_row(row), flush=True)
        return row

    async def run(self, n_steps: int, on_step=None) -> History:
        """`n_steps` more steps; `on_step(row)` after each (e.g. a LivePlot update)."""
        for _ in range(n_steps):
            row = await self.step()
            if on_step is not None:
                on_step(row)
        return self.history

    async def rollouts(self, seeds, schedule: str | None = None, flush_cache: bool = True) -> list:
        """One group per env seed from the server under the current adapter, outside training:
        nothing is trained on them and the history is not touched. `schedule` defaults to the
        run's; with `flush_cache` the prefix cache is emptied first, so what is cached was cached
        by this batch (e.g. to compare schedules, bench.compare_schedules)."""
        if self.trainer is None:
            raise RuntimeError("call start() before rollouts()")
        if flush_cache:
            await self.client.flush_cache(timeout_s=30)
        return await self._collect(list(seeds), schedule or self.cfg.schedule)

    # ---- internals -----------------------------------------------------------------------------
    def _start_server(self, engine: str, model_path: str):
        cfg = self.cfg
        mem = getattr(self.plan, "server_mem_fraction", None)
        extra = server_args(engine, cfg.server_args)
        scfg = ServerConfig(engine=engine, model_path=model_path, run_dir=str(self.run_dir),
                            max_lora_rank=cfg.lora_rank, mem_fraction=mem, gpu_plan=self.plan,
                            api_key=cfg.api_key, extra_args=extra, enable_memory_saver=self.release,
                            enable_weights_cpu_backup=self.release and "weights" in cfg.release_tags)
        return start_server(scfg)

    def _make_trainer(self, model_path: str):
        cfg = self.cfg
        grpo = replace(cfg.grpo, temperature=cfg.temperature)
        return Trainer(TrainerConfig(model_path=model_path, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                     learning_rate=cfg.learning_rate, micro_batch_tokens=cfg.micro_batch_tokens,
                                     seed=cfg.seed, grpo=grpo))

    def _restore_latest(self, adapters: Path):
        # A step is complete once its history row is written: a checkpoint saved after the last
        # row (the server died while loading it) is redone, as it would have been without the loss.
        last_row = self.history.last["step"] if self.history.last else 0
        steps = sorted((int(p.name.rsplit("-", 1)[1]) for p in adapters.glob("policy-step-*")
                        if (p / "trainer_state.json").exists()), reverse=True)
        steps = [s for s in steps if s <= last_row]
        if not steps:
            raise CheckpointError(f"resume=True but {adapters} holds no complete checkpoint; "
                                  "start without resume or point run_dir at the run to continue")
        version = load_version(adapters, steps[0])
        self.trainer.load_checkpoint(version.path)
        self.history.truncate(self.trainer.step)
        log.info("resumed %s at step %d", self.run_dir, self.trainer.step)
        return version

    def _save_fn(self, tmp: Path) -> None:
        self.trainer.save_adapter(tmp)
        self.trainer.save_checkpoint(tmp)

    def _seeds(self, step: int) -> list[int]:
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        return [rng.randrange(1 << 30) for _ in range(self.cfg.groups_per_step)]

    def _sampling_seed_base(self, step: int) -> int:
        """Seeds every rollout request of `step` (rollout.request_seed): a redone step, or the
        same step of a resumed run, samples exactly what the first attempt did."""
        return self.cfg.seed * 1_000_003 + step

    async def _rollouts(self, step: int):
        before = cache_counters(await self.client.metrics_text(), self.tracker.engine)
        groups = await self._collect(self._seeds(step), self.cfg.schedule, self._sampling_seed_base(step))
        await self._raise_if_server_lost(groups)
        text = await self.client.metrics_text()
        self.tracker.add_sample(text)
        return groups, hit_rate(before, cache_counters(text, self.tracker.engine))

    async def _collect(self, seeds: list[int], schedule: str, sampling_seed_base: int | None = None):
        """The run's collect_groups call: its task, tokenizer, group size, sampling and budget."""
        cfg = self.cfg
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens or self.task.max_new_tokens,
                                temperature=cfg.temperature)
        return await collect_groups(self.client, self.task, self.trainer.tokenizer, seeds, cfg.group_size,
                                    params, adapter=self.adapter, concurrency=cfg.concurrency,
                                    schedule=resolve_schedule(schedule, self.task.max_turns),
                                    max_seq_tokens=cfg.max_seq_tokens, sampling_seed_base=sampling_seed_base)

    async def _train(self, groups) -> tuple[dict, float, tuple]:
        """trainer.train_step, with the server's memory released around it when `self.release`.

        A failed release raises before anything is trained (step() can run again); a server that
        died is restarted as in rollouts (a fresh one has nothing to resume). If training fails,
        the memory is taken back before the error goes up. Returns (metrics, train_s,
        (release_s, resume_s)), the pair (None, None) when off.
        """
        release = lambda: self.client.release_memory(self.cfg.release_tags)  # noqa: E731
        resume = lambda: self.client.resume_memory()  # noqa: E731  (self.client after a restart)
        release_s = await self._with_restarts(release) if self.release else None
        t0 = time.perf_counter()
        try:
            metrics = self.trainer.train_step(groups)
        except BaseException:
            if self.release:
                try:
                    await self._with_restarts(resume)
                except Exception as e:  # the training error is the one to report
                    log.error("could not resume the server's memory after a failed training step: %s", e)
            raise
        train_s = time.perf_counter() - t0
        resume_s = await self._with_restarts(resume) if self.release else None
        return metrics, train_s, (release_s, resume_s)

    async def _raise_if_server_lost(self, groups) -> None:
        """Failed rollouts and a server that exited (or no longer answers /health) are a server
        loss: the step is redone after a restart, never trained on the rollouts that survived."""
        errors = [t.error for g in groups for t in g.trajectories if t.error]
        if errors and not (self.server.alive() and await self.client.health()):
            raise ServerUnavailableError(f"{len(errors)} rollouts failed and the server is gone: {errors[0]}")

    async def _with_restarts(self, fn, *args):
        while True:
            try:
                if not self.server.alive():
                    raise ServerUnavailableError(f"{self.server.config.engine} server is not running")
                return await fn(*args)
            except ServerUnavailableError as e:
                await self._restart_or_raise(e)

    async def _restart_or_raise(self, err: Exception) -> None:
        if self.restarts >= self.cfg.max_restarts:
            policy = ("automatic restarts are off (max_restarts=0)" if self.cfg.max_restarts == 0 else
                      f"all {self.cfg.max_restarts} restarts allowed by max_restarts are used")
            raise ServerLostError(
                f"the {self.server.config.engine} server {_exit_status(self.server)} ({err}) and {policy}. "
                f"Completed steps (adapters, optimizer state, history) are saved in {self.run_dir}. Try: find "
                "the cause in the log below, then continue with GRPORun(replace(cfg, resume=True)).start(), "
                f"or allow more restarts with max_restarts. Last 20 lines of {self.server.log_path}:\n"
                f"{self.server.log_tail(20)}") from err
        self.restarts += 1
        log.warning("server lost (%s); restart %d/%d", err, self.restarts, self.cfg.max_restarts)
        await self.client.aclose()
        self.server.restart()
        self.client = self.server.client()
        self.publisher.client = self.client
        await self.publisher.republish()

    async def _save_and_reload(self, groups):
        previous = self.publisher.current
        probe = _probe_trajectory(groups)
        t0 = time.perf_counter()
        try:
            version = save_adapter_atomic(self._save_fn, self.run_dir / "adapters", self.trainer.step)
        except AdapterSaveError:
            # The update is dropped with its adapter: the trainer returns to the served version
            # (weights, optimizer, step, RNG), so the next step() redoes this step.
            self.trainer.load_checkpoint(previous.path)
            log.warning("adapter of step %d not saved; trainer rolled back to %s", self.trainer.step + 1,
                        previous.name)
            raise
        await self._with_restarts(self._publish, version)
        reload_s = time.perf_counter() - t0
        result = {}
        if self.cfg.verify_adapter and probe is not None:
            trainer_lp = self.trainer.score_tokens(probe.token_ids)
            prev_lp = probe.logprobs[1:] if previous else None
            mask = probe.completion_mask[1:]
            sel = lambda xs: [x for x, m in zip(xs, mask) if m]  # noqa: E731
            tol = 0.02 if self.trainer.device.type == "cpu" else 0.25
            result = await probe_served_adapter(_MaskedScorer(self.client, mask, self.cfg.temperature), version, probe.token_ids,
                                                sel(trainer_lp), sel(prev_lp) if prev_lp else None, tol)
        return version, reload_s, result

    async def _publish(self, version) -> None:
        """Load `version`, unless the republish after a restart already did (the server died
        while unloading the version before it): adapter names cannot be loaded twice."""
        if self.publisher.current is None or self.publisher.current.name != version.name:
            await self.publisher.publish(version)

    def _row(self, step, groups, metrics, hit_rate, rollout_s, train_s, reload_s, probe, memory_s) -> dict:
        trajs = [t for g in groups for t in g.trajectories]
        rewards = [t.reward for t in trajs if t.error is None and t.reward is not None]
        mean = sum(rewards) / len(rewards) if rewards else float("nan")
        std = (sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1)) ** 0.5 if rewards else float("nan")
        return {"step": step, "adapter": adapter_name(step), "reward_mean": mean, "reward_std": std,
                "loss": metrics.get("loss"), "kl": metrics.get("kl"), "clip_frac": metrics.get("clip_frac"),
                "is_ratio_mean": metrics.get("is_ratio_mean"), "is_ratio_min": metrics.get("is_ratio_min"),
                "is_ratio_max": metrics.get("is_ratio_max"), "grad_norm": metrics.get("grad_norm"),
                "tokens": metrics.get("tokens"), "completion_tokens": metrics.get("completion_tokens"),
                "rollout_s": rollout_s, "train_s": train_s, "reload_s": reload_s, "hit_rate": hit_rate,
                "release_s": memory_s[0], "resume_s": memory_s[1],
                "zero_adv_groups": metrics.get("zero_adv_groups"),
                "failed_rollouts": sum(t.error is not None for t in trajs),
                "truncated": sum(bool(t.truncated) for t in trajs), "restarts": self.restarts,
                "probe_mad": probe.get("probe_mad"), "probe_moved": probe.get("probe_moved"),
                "time": time.time()}


class _MaskedScorer:
    """Adapts `client.score` to return only the probe's model-token positions."""

    def __init__(self, client, mask, temperature):
        self.client, self.mask, self.temperature = client, mask, temperature

    async def score(self, ids, adapter=None):
        lps = await self.client.score(ids, adapter=adapter, temperature=self.temperature)
        return [x for x, m in zip(lps, self.mask) if m]


def _probe_trajectory(groups):
    for g in groups:
        for t in g.trajectories:
            if t.error is None and sum(t.completion_mask) > 0:
                return t
    return None


def _in_parallel(start_server, make_trainer):
    """(server, trainer): the server starts (launch, then /health) in a thread while the trainer
    loads here, so start-up costs the longer of the two, not their sum. If the trainer fails,
    the server is stopped once its start returns. When both fail the server's error is raised
    (it checks the model path and shows the log tail: the message written for the user)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="artsg-server-start") as pool:
        started = pool.submit(start_server)
        try:
            trainer = make_trainer()
        except BaseException as trainer_error:
            server_error = started.exception()
            if server_error is not None:
                raise server_error from trainer_error
            started.result().stop()
            raise
        return started.result(), trainer


def _resolve_release(cfg: RunConfig, mode: str) -> bool:
    """cfg.release_memory → bool ("auto": only when server and trainer share one GPU)."""
    memory_tags(cfg.release_tags)  # a typo fails before anything is launched
    if cfg.release_memory == "auto":
        return mode == "colocated"
    if not isinstance(cfg.release_memory, bool):
        raise ValueError(f"release_memory={cfg.release_memory!r}; use True, False or 'auto'")
    return cfg.release_memory


def _exit_status(server) -> str:
    """How the server process ended, for an error message ("was killed by SIGKILL", ...)."""
    code = server.proc.poll() if server.proc is not None else None
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


