"""tools/gpu/adopt_time.py on the CPU engine: the tool the H200 runs for issue 26 item 4 works end to
end here (two real kernel subprocesses; the second adopts the first's server after it is SIGKILLed)."""
import json

import pytest

from gpu_tools import load_gpu_tool


@pytest.mark.slow
def test_a_killed_kernels_server_is_adopted_and_both_starts_are_timed(tmp_path, capsys):
    tool = load_gpu_tool("adopt_time")
    out = tmp_path / "adopt.json"
    assert tool.main(["--engine", "cpu", "--run-dir", str(tmp_path / "run"), "--timeout-s", "180",
                      "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    cold, adopted = record["cold"], record["adopted"]
    assert record["pass"] and not cold["adopted"] and adopted["adopted"]
    assert adopted["server_pid"] == cold["server_pid"] and (cold["step"], adopted["step"]) == (1, 2)
    for r in (cold, adopted):
        assert 0 < r["trainer_s"] <= r["start_s"] and r["first_step_s"] > 0 and r["warm_up_s"] > 0
    printed = capsys.readouterr().out
    assert "PASS adopt" in printed and printed.count("first step") == 2
