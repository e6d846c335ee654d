"""One experiment of a sweep: its config, run dir, history, served adapter versions, and its step.

What it does: an `Experiment` is one GRPO run on the sweep's shared server and MultiTrainer. Its
`step(turn)` reads top to bottom as the single run's (run/step.py), phase by phase:

  rollouts  its step's groups from the server under its own served adapter, with the seeds a lone
            GRPORun of the same RunConfig draws (run.source.RolloutSource: same env seeds, same
            sampling seeds), beside the other experiments' rollouts (their requests are batched
            together on the server, each naming its adapter)
  rewards   written to its run_dir/rollouts, required, groups without signal counted
  update    when the trainer's `turn` (an asyncio.Lock the experiments share) comes: its GRPO
            update (MultiTrainer.train_step, in a worker thread) and its adapter saved as
            `<run_dir>/adapters/policy-step-N` (its checkpoint written in the background)
  reload    served under `<name>-step-N`; only its own older version is unloaded
            (rl.lora.AdapterPublisher, keep=1), and its first reload is checked against the trainer
            (the served adapter's logprobs on a probe trajectory: rl.lora.probe_served_adapter)
  row       one history.jsonl row (run.history.step_row) with the seconds it waited for the trainer

`train_on(groups, turn)` is the same step from `rewards` on, for groups rolled out elsewhere: an
ART model attached to the sweep (Sweep.attach; artsg_nb.art.SGLangBackend(sweep=...)) rolls out
against its served adapter with ART's own rollout function and trains through it.

Adapter names carry the experiment (`<name>-step-N`), so the server's prefix cache, keyed by
adapter, never mixes two experiments or two versions.

Its server phases (rollouts, reload, check) go through the sweep's SharedServer (serving.py): a
lost server is restarted and the phase redone, the rollouts with the same seeds.

What it does not do: start the server or the trainer, or decide when steps run (runtime.py). A step
that fails otherwise marks the experiment failed (its error kept and shown) and the sweep goes on
without it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path

from ..engines import ServerUnavailableError, UnknownAdapterError
from ..rl.lora import (AdapterMismatchError, AdapterPublisher, AdapterVersion, MaskedScorer, probe_served_adapter,
                       probe_trajectory, save_adapter_atomic, seal_version)
from ..rollout.samples import constant_groups, write_rollouts
from ..rollout.trajectory import require_rewards
from ..run.config import RunConfig
from ..run.history import History, step_row
from ..run.source import RolloutSource
from .serving import SharedServer
from .trainer import MultiTrainer

log = logging.getLogger(__name__)


def served_name(experiment: str, step: int) -> str:
    """The adapter name version `step` of `experiment` is served under."""
    return f"{experiment}-step-{step}"


class _TrainerView:
    """What RolloutSource reads of a trainer (tokenizer, step), for one experiment of a MultiTrainer."""

    def __init__(self, multi: MultiTrainer, name: str):
        self.multi, self.name = multi, name

    @property
    def tokenizer(self):
        return self.multi.tokenizer

    @property
    def step(self) -> int:
        return self.multi.step_of(self.name)


class Experiment:
    """One experiment on the sweep's server and trainer (module docstring)."""

    def __init__(self, name: str, cfg: RunConfig, task, multi: MultiTrainer, shared: SharedServer, verify_tol: float,
                 external: bool = False):
        self.name, self.cfg, self.multi, self.shared = name, cfg, multi, shared
        self.external = external
        """Its rollouts come from outside (an ART model's, through `train_on`): the sweep never steps it."""
        self.run_dir = Path(cfg.run_dir)
        self.history = History(self.run_dir)
        self.publisher = AdapterPublisher(shared.client, self.run_dir, keep=1)
        shared.publishers.append(self.publisher)  # a restart gives it the new client and republishes it
        self.initial: AdapterVersion | None = None
        self.source = RolloutSource(cfg, task, _TrainerView(multi, name), self)  # self: its serving side
        self.verify_tol = verify_tol
        self.verified = not cfg.verify_adapter
        self.error: str | None = None
        """Why the experiment stopped (its failed step's error), None while it steps."""
        self.train_s = 0.0
        """Seconds the trainer spent on this experiment's updates and saves (its share of the trainer)."""

    # ---- what RolloutSource reads of its serving side (run/source.py) -----------------------------
    @property
    def client(self):
        return self.publisher.client

    @property
    def adapter(self) -> str | None:
        """The adapter version served now (None before the first step)."""
        return self.publisher.current.name if self.publisher.current else None

    async def check_served(self, trainer_step: int) -> None:
        """Roll out only under this experiment's own newest version, held by the server (never the
        base model in its place, never another experiment's adapter)."""
        held = await self.client.list_adapters()
        if self.adapter is None or self.adapter not in held:
            raise AdapterMismatchError(f"experiment {self.name!r} (trainer step {trainer_step}) expects rollouts "
                                       f"from {self.adapter}, but the server holds {sorted(held)}; no rollout was run")

    async def raise_if_server_lost(self, groups) -> None:
        """Rollouts that failed with the server gone are no step: raise instead of training on the rest."""
        errors = [t.error for g in groups for t in g.trajectories if t.error]
        if errors and not (self.shared.server.alive() and await self.client.health()):
            raise ServerUnavailableError(f"experiment {self.name!r}: {len(errors)} rollouts failed and the server is "
                                         f"gone: {errors[0]}")

    # ---- state -----------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        if self.error:
            return "failed"
        if self.external:
            return "external"
        return "stepping" if self.publisher.current else "ready"

    @property
    def step_count(self) -> int:
        return self.multi.step_of(self.name)

    def fail(self, error: BaseException) -> None:
        """Stop this experiment with `error` recorded (the others go on)."""
        self.error = f"{type(error).__name__}: {error}"
        log.error("experiment %s stopped at step %d: %s", self.name, self.step_count + 1, self.error)

    # ---- the step --------------------------------------------------------------------------------
    async def serve_initial(self, turn: asyncio.Lock) -> None:
        """Save and serve `<name>-step-0` (the untrained LoRA: B = 0, the base model's outputs), once;
        adapters of this name an earlier sweep left on the server are unloaded first."""
        if self.publisher.current is not None:
            return
        if self.initial is None:
            async with turn:
                self.initial = await asyncio.to_thread(self._save, 0, True)
        await self.shared.with_restarts(self._publish_initial)

    async def _publish_initial(self) -> None:
        for held in await self.client.list_adapters():
            if held.startswith(f"{self.name}-step-"):
                try:
                    await self.client.unload_adapter(held)
                except UnknownAdapterError:
                    pass
        await self.publisher.publish(self.initial)

    async def step(self, turn: asyncio.Lock) -> dict:
        """One GRPO step (module docstring); its history row. Stopped before its version is served
        (an error, or an interrupt) the trainer is rolled back to the served version, so the next
        step redoes this one."""
        await self.serve_initial(turn)
        step = self.step_count + 1
        t0 = time.perf_counter()
        groups, hit_rate = await self.shared.with_restarts(self.source.rollouts, step)  # same seeds when redone
        return await self._train_on(step, groups, turn, hit_rate, time.perf_counter() - t0)

    async def train_on(self, groups, turn: asyncio.Lock) -> dict:
        """step()'s second half on groups rolled out elsewhere (an ART model's, from this
        experiment's served adapter): update, save + reload + check, one row (no rollout_s or
        hit_rate). Stopped before its version is served, it is undone as step() is."""
        await self.serve_initial(turn)
        return await self._train_on(self.step_count + 1, groups, turn)

    async def _train_on(self, step: int, groups, turn: asyncio.Lock, hit_rate: float | None = None,
                        rollout_s: float | None = None) -> dict:
        write_rollouts(self.run_dir, step, groups)  # first: a step without rewards leaves its completions to read
        require_rewards(groups)
        served = self.publisher.current
        try:
            return await self._train_and_serve(step, groups, hit_rate, rollout_s, turn)
        except BaseException:
            self._roll_back(step - 1, served)
            raise

    async def _train_and_serve(self, step: int, groups, hit_rate: float | None, rollout_s: float | None,
                               turn: asyncio.Lock) -> dict:
        """update (the trainer's turn) → reload → check → row."""
        zero_adv, no_signal = constant_groups(groups)
        t_wait = time.perf_counter()
        async with turn:
            wait_s = time.perf_counter() - t_wait
            t_train = time.perf_counter()
            update = asyncio.ensure_future(asyncio.to_thread(self._update, step, groups, no_signal))
            try:
                metrics, version = await asyncio.shield(update)
            except BaseException:  # interrupted: the update's thread runs to its end before anything is undone
                await asyncio.wait([update])
                raise
            train_s = time.perf_counter() - t_train
        self.train_s += train_s
        metrics["zero_adv_groups"] = zero_adv
        reload_s, probe = None, None
        if version is not None:
            t_reload = time.perf_counter()
            await self.shared.with_restarts(self._publish, version)
            reload_s = time.perf_counter() - t_reload
            probe = await self._verify(groups, turn)
        row = step_row(step, self.adapter, groups, metrics, hit_rate=hit_rate, rollout_s=rollout_s, train_s=train_s,
                       reload_s=reload_s, probe=probe).as_dict()
        row = self.history.append({**row, "experiment": self.name, "trainer_wait_s": wait_s})
        if self.cfg.verbose:
            print(f"{self.name}: {History.format_row(row)}", flush=True)
        return row

    def _roll_back(self, before: int, served: AdapterVersion | None) -> None:
        """The trainer back to step `before` and the `served` version's weights and optimizer, unless
        the step's own version is served already (then the step is done, its row aside)."""
        if self.step_count == before or served is None or self.adapter == served_name(self.name, self.step_count):
            return
        try:
            with self.multi.using(self.name) as trainer:
                rates = [g["lr"] for g in trainer.optimizer.param_groups]
                trainer.load_checkpoint(served.path)
                trainer.step = before  # a skipped update's step counts without a version of its own
                for group, rate in zip(trainer.optimizer.param_groups, rates):  # its checkpoint may hold one
                    group["lr"] = rate  # call's learning rate (art.runs.overrides), not the experiment's
            log.warning("experiment %s: step %d undone, the trainer is back at %s", self.name, before + 1, served.name)
        except Exception as e:  # noqa: BLE001 — the step's own error is the one to report
            log.error("experiment %s: could not roll the trainer back to %s (%s: %s)", self.name, served.name,
                      type(e).__name__, e)

    async def _publish(self, version: AdapterVersion) -> None:
        """Serve `version`, unless a restart's republish already did (the server died while unloading
        the version before it): a name cannot be loaded twice."""
        if self.adapter != version.name:
            await self.publisher.publish(version)

    def _update(self, step: int, groups, no_signal: bool) -> tuple[dict, AdapterVersion | None]:
        """The update and its saved version (worker thread, the trainer's turn held). No signal
        (every group's rewards equal): no update, the step counts, the served version stays."""
        if no_signal:
            with self.multi.using(self.name) as trainer:
                trainer.step += 1
            return {"update_skipped": True}, None
        metrics = self.multi.train_step(self.name, groups)
        return metrics, self._save(step, durable=False)

    def _save(self, step: int, durable: bool) -> AdapterVersion:
        """The adapter as `adapters/policy-step-<step>` (atomic), served as `<name>-step-<step>`; its
        optimizer checkpoint written in the background (the first one at once)."""
        with self.multi.using(self.name) as trainer:
            version = save_adapter_atomic(trainer.save_adapter, self.run_dir / "adapters", step, durable=durable)
            trainer.save_checkpoint(version.path, wait=durable, before=None if durable else lambda: seal_version(version))
        return replace(version, name=served_name(self.name, step))

    async def _verify(self, groups, turn: asyncio.Lock) -> dict | None:
        """The served adapter's logprobs on a probe trajectory against this experiment's trainer, at
        its first reload (a server answering with another adapter raises AdapterMismatchError)."""
        probe = probe_trajectory(groups)
        if self.verified or probe is None:
            return None
        async with turn:
            trainer_lp = await asyncio.to_thread(self.multi.score, self.name, probe.token_ids)
        mask = probe.completion_mask[1:]
        mine = [x for x, m in zip(trainer_lp, mask) if m]
        result = await self.shared.with_restarts(lambda: probe_served_adapter(  # the client after a restart
            MaskedScorer(self.client, mask, self.cfg.temperature), self.publisher.current, probe.token_ids, mine,
            None, self.verify_tol))
        self.verified = True
        return result
