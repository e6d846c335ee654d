"""Where a run's trajectories come from: the served adapter, the run's task, its sampling.

What it does: `RolloutSource.rollouts(step)` plays `step`'s groups on the server under the
served adapter (checked first to be the trainer's: supervisor.check_served) with the step's
seeds, so a redone step, a resumed run or a pipelined one samples exactly what the first attempt
did; its hit rate is the server's own count per request (rollout.trajectory.rollout_stats), no
/metrics round trip. A server lost meanwhile raises for `with_restarts` (the caller's) to redo it.
`collect` is the same call on any seeds (GRPORun.rollouts), `evaluate` the held-out evaluation,
`chat` one reply (GRPORun.chat).

What it does not do: restart servers (supervisor.py), sample ahead (pipeline.py), train, or serve
versions (versions.py). `task` and `cfg` are plain attributes: a test or a notebook may swap them.
"""
from __future__ import annotations

from ..engines import SamplingParams
from ..rollout.evaluate import EvalResult, evaluate
from ..rollout.groups import collect_groups
from ..rollout.trajectory import rollout_stats
from .config import RunConfig, resolve_schedule
from .supervisor import ServerSupervisor


class RolloutSource:
    """The run's rollouts and evaluations on the server (module docstring)."""

    def __init__(self, cfg: RunConfig, task, trainer, supervisor: ServerSupervisor):
        self.cfg = cfg
        self.task = task
        self.trainer = trainer
        self.supervisor = supervisor

    def seeds(self, step: int) -> list[int]:
        """The env seeds of `step`'s groups."""
        return self.task.group_seeds(self.cfg.seed, step, self.cfg.groups_per_step)

    def sampling_seed_base(self, step: int) -> int:
        """Seeds every rollout request of `step` (rollout.request_seed): a redone step, or the
        same step of a resumed run, samples exactly what the first attempt did."""
        return self.cfg.seed * 1_000_003 + step

    async def rollouts(self, step: int) -> tuple[list, float | None]:
        """(groups, hit rate) of `step`'s rollouts, under the version the trainer's weights are."""
        await self.supervisor.check_served(self.trainer.step)
        groups = await self.collect(self.seeds(step), self.cfg.schedule, self.sampling_seed_base(step))
        await self.supervisor.raise_if_server_lost(groups)
        return groups, rollout_stats(groups)["hit_rate"]

    async def collect(self, seeds: list[int], schedule: str, sampling_seed_base: int | None = None) -> list:
        """collect_groups with the run's task, tokenizer, group size, sampling and budget."""
        cfg = self.cfg
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens or self.task.max_new_tokens,
                                temperature=cfg.temperature)
        return await collect_groups(self.supervisor.client, self.task, self.trainer.tokenizer, seeds, cfg.group_size,
                                    params, adapter=self.supervisor.adapter, concurrency=cfg.concurrency,
                                    schedule=resolve_schedule(schedule, self.task.max_turns),
                                    max_seq_tokens=cfg.max_seq_tokens, sampling_seed_base=sampling_seed_base,
                                    task_timeout_s=cfg.reward_timeout_s or None)

    async def chat(self, messages, base: bool = False, max_new_tokens: int | None = None,
                   temperature: float = 0.0) -> str:
        """The served adapter's (`base`: the base model's) reply to `messages` (a chat list, or one
        user message as a string); greedy unless `temperature`."""
        messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
        params = SamplingParams(max_new_tokens=max_new_tokens or self.cfg.max_new_tokens or self.task.max_new_tokens,
                                temperature=temperature)
        answer = await self.supervisor.client.chat(messages, params, adapter=None if base else self.supervisor.adapter,
                                                   logprobs=False)
        return answer["choices"][0]["message"]["content"]

    async def evaluate(self, split: str = "eval", n: int | None = None, k: int = 1,
                       greedy: bool = True) -> EvalResult:
        """Mean reward and pass@k of the served adapter on held-out prompts (rollout/evaluate.py)."""
        cfg = self.cfg
        return await evaluate(self.supervisor.client, self.task, self.trainer.tokenizer, self.supervisor.adapter,
                              split=split, n=n, k=k, greedy=greedy, temperature=cfg.temperature,
                              max_new_tokens=cfg.max_new_tokens, max_seq_tokens=cfg.max_seq_tokens,
                              concurrency=cfg.concurrency, default_n=cfg.eval_n,
                              task_timeout_s=cfg.reward_timeout_s or None)
