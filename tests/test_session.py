"""Four GRPO steps through the CPU engine subprocess, the way the quickstart runs them: each step
loads a new adapter, unloads the old one, and the next rollouts are served by the new one (the
fourth with a /metrics scrape the parser refuses: it costs the dashboard one window, not the
step); then rollouts outside training (GRPORun.rollouts) under the newest adapter. The served adapter is checked
against the trainer at the first reload on the server and then every verify_every steps. (That
GRPO learns with the default settings is checked by test_pipeline.py's synchronous leg.)"""
import asyncio
from dataclasses import replace

from artsg_nb.run.clock import PhaseClock
from artsg_nb.run.session import GRPORun, RunConfig
from artsg_nb.run.supervisor import ServerSupervisor
from artsg_nb.run.versions import AdapterVersions, VerifyPolicy
from scripted_tasks import ADDITION_WITH_SIGNAL


def test_steps_reload_and_serve_the_new_adapter(tiny_model_dir, tmp_path):
    # scripted reward: every step has a signal, so every step publishes a new adapter
    cfg = RunConfig(task=ADDITION_WITH_SIGNAL, engine="cpu", model_path=str(tiny_model_dir),
                    run_dir=str(tmp_path / "run"), group_size=4, groups_per_step=2, verbose=False, verify_every=2)
    seen, scrapes, rolling = [], [], []
    with GRPORun(cfg) as run:
        real_collect, real_metrics = run.source.rollouts, run.client.metrics_text

        async def recording(step):
            rolling.append(True)
            groups, hit = await real_collect(step)
            rolling.clear()
            seen.append({t.adapter for g in groups for t in g.trajectories})
            trajs = [t for g in groups for t in g.trajectories]
            assert hit == sum(t.cached_tokens for t in trajs) / sum(t.prompt_tokens for t in trajs)
            return groups, hit

        async def counted_metrics():
            scrapes.append("during rollouts" if rolling else "beside the reload")
            return await real_metrics()

        run.source.rollouts, run.client.metrics_text = recording, counted_metrics
        assert run.trainer.cfg.grpo.is_mode is None, "a synchronous run is on-policy: no IS correction"
        for step in (1, 2, 3):
            row = asyncio.run(run.step())
            assert not {"staleness", "ahead_wait_s", "reload_wait_s"} & set(row), "pipelining's columns only"
            loaded = asyncio.run(run.client.list_adapters())
            assert set(loaded) == {f"policy-step-{step}"}, f"after step {step} the server holds {sorted(loaded)}"
            assert row["adapter"] == f"policy-step-{step}"
            if step in (1, 2):  # 1: the first reload on this server; 2: every verify_every=2 steps
                assert row["probe_mad"] < 0.02 and (step == 1 or row["probe_moved"] > 0)
            else:
                assert row["probe_mad"] is None and row["probe_moved"] is None, "step 3's check was not due"
            assert (tmp_path / "run" / "adapters" / f"policy-step-{step}" / "adapter_model.safetensors").exists()

        # A scrape the parser refuses (a body cut mid-line: prometheus_client raises ValueError)
        # costs the dashboard one window, not the step.
        async def cut_short():
            text = await counted_metrics()
            return text[:text.index("\nsglang:prompt_tokens_total") + 40]

        run.client.metrics_text = cut_short
        row = asyncio.run(run.step())
        run.client.metrics_text = counted_metrics
        assert row["step"] == 4 and run.adapter == "policy-step-4"
        df = run.history.df
        # Rollouts outside training: served by the newest adapter, nothing trained or recorded.
        extra = asyncio.run(run.rollouts([11, 12], schedule="n"))
        assert [g.seed for g in extra] == [11, 12] and all(len(g.trajectories) == 4 for g in extra)
        assert {t.adapter for g in extra for t in g.trajectories} == {"policy-step-4"}
        assert run.trainer.step == 4 and len(run.history.df) == 4
    # The step's hit rate is what the server reported per request; the dashboard's one scrape a
    # step (and the first window's start) goes beside the reload, none on the rollouts' path.
    assert scrapes == ["beside the reload"] * 5, scrapes
    # Step N's rollouts come from the adapter published after step N-1.
    assert seen == [{"policy-step-0"}, {"policy-step-1"}, {"policy-step-2"}, {"policy-step-3"}]
    assert list(df["step"]) == [1, 2, 3, 4]
    assert df["reload_s"].notna().all() and df["hit_rate"].between(0, 1).all()
    assert (df["is_raw_ratio_mean"] - 1).abs().max() < 1e-3, "on-policy IS ratio should be 1 on the CPU engine"


def test_the_served_adapter_is_checked_first_on_each_server_then_every_verify_every_steps(tmp_path):
    supervisor = ServerSupervisor(watchdog=None, max_restarts=2, run_dir=tmp_path)
    versions = AdapterVersions(None, tmp_path, supervisor, PhaseClock(), None, VerifyPolicy(verify_every=5))
    due = lambda: [s for s in range(1, 13) if versions.verify_due(s)]  # noqa: E731
    assert due() == list(range(1, 13)), "no check yet on this server: the next reload is checked"
    versions.verified_on_server = supervisor.restarts  # checked on this server
    assert due() == [5, 10]
    supervisor.restarts += 1  # a restarted server: its first reload is checked whatever the step
    assert due() == list(range(1, 13))
    versions.policy = replace(versions.policy, verify_every=1)
    versions.verified_on_server = supervisor.restarts
    assert due() == list(range(1, 13))
    versions.policy = replace(versions.policy, verify_adapter=False)
    versions.verified_on_server = None
    assert due() == []
