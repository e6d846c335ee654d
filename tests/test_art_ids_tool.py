"""tools/gpu/art_ids.py on the CPU engine: the check the GPU host runs for issue 27 works end to end
(ART's managed client, the server's ids in each choice, trajectories built from exactly them)."""
import pytest

from gpu_tools import load_gpu_tool

pytest.importorskip("art")


@pytest.mark.slow
def test_the_managed_clients_choices_carry_the_ids_the_trajectory_uses(tiny_model_dir, capsys):
    tool = load_gpu_tool("art_ids")
    assert tool.main(["--engine", "cpu", "--model-path", str(tiny_model_dir), "--requests", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 of 3 choices carried the server's ids; 3 trajectories used exactly those ids" in out
    assert "PASS art-ids (cpu)" in out
