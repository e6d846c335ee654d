"""The sweep bench runs end to end on the CPU engine: both phases, the split, the first-step check."""
import json

from artsg_nb.multi import bench


def test_bench_writes_both_phases_and_the_first_step_check(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["--experiments", "2", "--steps", "1", "--warm-steps", "1", "--group-size", "4",
                     "--groups-per-step", "2", "--max-new-tokens", "8", "--engine", "cpu",
                     "--run-dir", str(tmp_path / "runs"), "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    for phase in ("together", "one_after_another"):
        assert result[phase]["steps"] == 2 and result[phase]["steps_per_s"] > 0
        assert set(result[phase]["split_s"]) == {"rollout_s", "train_s", "reload_s", "trainer_wait_s"}
    assert result["first_step_rewards_equal"] is True and len(result["first_step_rewards"]) == 2
    assert result["speedup"] == result["together"]["steps_per_s"] / result["one_after_another"]["steps_per_s"]
    assert "2 experiments x 1 steps" in capsys.readouterr().out
