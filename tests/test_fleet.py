"""GRPO steps through 2 CPU engines behind the real sglang-router (RunConfig.num_servers=2).

Checks what scale-out promises a run: both workers get rollouts (prompt tokens on each, in the
history's worker_prompt_tokens), the prefix cache still pays (the step's hit rate within 0.8 of
the batch's theoretical rate, metrics.theoretical_hit_rate), every adapter version is served by
both workers, and a worker SIGKILLed (its whole process group) in the middle of a step's
rollouts is restarted and the step completes. Marked slow (~1 min on 2 cores).
"""
import asyncio
import os
import signal

import pytest

from artsg_nb.serving.fleet import Fleet, FleetClient
from artsg_nb.run.session import GRPORun, RunConfig
from scripted_tasks import ADDITION_WITH_SIGNAL

pytest.importorskip("sglang_router", reason="needs the sglang-router package (environment-train.yml)")
pytestmark = pytest.mark.slow


def _served(run) -> list[set[str]]:
    async def ask():
        return [set(await c.list_adapters()) for c in run.client.workers]
    return asyncio.run(ask())


def test_steps_through_two_engines_keep_hits_and_survive_a_killed_worker(tiny_model_dir, tmp_path):
    # scripted reward: every step has a signal, so every step publishes a new adapter
    cfg = RunConfig(task=ADDITION_WITH_SIGNAL, engine="cpu", model_path=str(tiny_model_dir),
                    run_dir=str(tmp_path / "run"), group_size=4, groups_per_step=4, num_servers=2, max_restarts=2,
                    verbose=False)
    with GRPORun(cfg) as run:
        assert isinstance(run.server, Fleet) and isinstance(run.client, FleetClient)
        assert run.server.router is not None and len(run.server.servers) == 2
        row = asyncio.run(run.step())
        tokens, rates = row["worker_prompt_tokens"], row["worker_hit_rates"]
        assert len(tokens) == 2 and all(t > 0 for t in tokens), f"a worker got no rollouts: {tokens}"
        theory = row["theoretical_hit_rate"]
        assert row["hit_rate"] >= 0.8 * theory, f"hit rate {row['hit_rate']:.3f} vs theoretical {theory:.3f} ({rates})"
        assert _served(run) == [{"policy-step-1"}] * 2
        assert row["probe_mad"] < 0.02  # the probe went through the router to a worker serving step 1

        # Step 2: SIGKILL worker 1's process group once a few rollouts have been answered.
        victim = run.server.servers[1]
        front, calls = run.client.front, []
        real_generate = front.generate

        async def generate_then_kill(*args, **kwargs):
            out = await real_generate(*args, **kwargs)
            calls.append(1)
            if len(calls) == 3:
                os.killpg(victim.record.pgid, signal.SIGKILL)
            return out

        front.generate = generate_then_kill
        row = asyncio.run(run.step())
        assert len(calls) >= 3 and row["step"] == 2 and row["restarts"] == 1
        assert run.server.alive() and len(run.server.servers) == 2 and victim.alive()
        assert row["failed_rollouts"] == 0
        assert _served(run) == [{"policy-step-2"}] * 2
        assert list(run.history.df["step"]) == [1, 2]


def test_the_health_watchdog_watches_a_fleet_and_kills_a_stopped_worker(tiny_model_dir, tmp_path):
    """With num_servers=2 the watchdog polls the fleet (it read a single server's pid and raised
    AttributeError on the first poll), and a worker SIGSTOPped mid-rollout is killed and restarted."""
    from dataclasses import replace

    cfg = RunConfig(task="addition", engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"),
                    group_size=4, groups_per_step=4, num_servers=2, max_restarts=2, verbose=False, hang_timeout_s=2.0)
    with GRPORun(cfg) as run:
        assert asyncio.run(run.step())["step"] == 1  # polls every 0.33 s through the step
        victim, make_env, stopped = run.server.servers[1], run.task.factory, []

        def factory(seed):
            env = make_env(seed)
            reply_to = env.step

            def step_env(reply):
                if not stopped:
                    stopped.append(victim.pid)
                    os.killpg(victim.pid, signal.SIGSTOP)
                return reply_to(reply)

            env.step = step_env
            return env

        run.task = replace(run.task, factory=factory)
        row = asyncio.run(run.step())
        assert stopped and run.watchdog.fired >= 1 and row["step"] == 2 and row["failed_rollouts"] == 0
        assert run.server.alive() and victim.alive() and victim.pid != stopped[0]
