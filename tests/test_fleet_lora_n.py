"""The n > 1 LoRA reference bug (sglang#36894) behind sglang-router: 2 CPU engines emulating it
(`--fault lora-n-counter`), the default schedule, two steps with reloads. The router's own
/server_info names no engine, so the client asks a worker; the router takes no per-sample
sampling_params list, so the n samples go as single requests after the warm-up. Before: the first
unload on a worker waited forever. Marked slow (~1 min on 2 cores)."""
import asyncio

import pytest

from artsg_nb.run.session import GRPORun, RunConfig

pytest.importorskip("sglang_router", reason="needs the sglang-router package (environment-train.yml)")
pytestmark = pytest.mark.slow


def test_default_schedule_through_a_router_to_engines_with_the_counter_bug(tiny_model_dir, tmp_path):
    cfg = RunConfig(task="addition", engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"),
                    group_size=3, groups_per_step=2, num_servers=2, admin_timeout_s=10, verbose=False,
                    server_args=("--fault", "lora-n-counter"))
    with GRPORun(cfg) as run:
        assert "sglang#36894" in asyncio.run(run.client.front.native_n_problem())

        async def steps():
            return [await run.step() for _ in range(2)]
        rows = asyncio.run(asyncio.wait_for(steps(), timeout=180))
        assert [r["step"] for r in rows] == [1, 2] and run.restarts == 0
        assert all(r["failed_rollouts"] == 0 for r in rows)
