"""bench.schedules: compare_schedules on a stand-in for a started GRPORun (its `rollouts` and
`cfg`), so the table's shape and the seeds each schedule gets are checked without a server."""
import asyncio
from types import SimpleNamespace

from artsg_nb.bench import compare_schedules
from artsg_nb.bench.schedules import HELD_OUT_SEED
from artsg_nb.serving.metrics import TURN_COLUMNS
from artsg_nb.rollout.trajectory import Trajectory, TrajectoryGroup


class FakeRun:
    def __init__(self, groups_per_step=2):
        self.cfg = SimpleNamespace(groups_per_step=groups_per_step)
        self.calls = []

    async def rollouts(self, seeds, schedule=None, flush_cache=True):
        self.calls.append((list(seeds), schedule, flush_cache))
        mask = [0, 0, 1, 1]
        traj = Trajectory(messages=[], token_ids=[1, 2, 3, 4], completion_mask=mask, logprobs=[0.0] * 4,
                          turn_stats=[{"prompt_tokens": 2, "cached_tokens": 1}])
        return [TrajectoryGroup(seed, [traj]) for seed in seeds]


def test_compare_schedules_same_held_out_seeds_cache_flushed_each():
    run = FakeRun()
    table = asyncio.run(compare_schedules(run, ("naive", "prefix")))
    seeds = [HELD_OUT_SEED, HELD_OUT_SEED + 1]
    assert run.calls == [(seeds, "naive", True), (seeds, "prefix", True)]
    assert list(table.columns) == ["schedule", *TURN_COLUMNS, "rollout_s"]
    assert table["schedule"].tolist() == ["naive", "prefix"] and (table["hit_rate"] == 0.5).all()
    assert table["theoretical"].tolist() == [0.5, 0.5]  # the second group's identical opening
