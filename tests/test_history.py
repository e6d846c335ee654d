"""History: append, the jsonl mirror, resume with a truncated last line, the progress line."""

import errno
import json
import math

import pytest

from artsg_nb.run.history import COLUMNS, HISTORY_FILE, History


def row(step, **extra):
    return {"step": step, "adapter": f"policy-step-{step}", "reward_mean": 0.1 * step,
            "reward_std": 0.05, "loss": 0.01, **extra}


def test_append_writes_one_flushed_json_line_per_step(tmp_path):
    history = History(tmp_path)
    history.append(row(0))
    history.append(row(1, hit_rate=0.86))
    lines = (tmp_path / HISTORY_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    assert len(history) == 2
    assert history.last["hit_rate"] == 0.86


def test_df_has_contract_columns_and_nan_for_missing(tmp_path):
    history = History(tmp_path)
    history.append(row(0, custom=3))
    history.append({"reward_mean": 0.5, "kl": float("nan")})  # step defaults to previous + 1
    df = history.df
    assert list(df.columns[: len(COLUMNS)]) == list(COLUMNS)
    assert "custom" in df.columns
    assert df["step"].tolist() == [0, 1]
    assert math.isnan(df.loc[0, "hit_rate"]) and math.isnan(df.loc[1, "kl"])
    assert df["reward_mean"].dtype == float


def test_empty_history(tmp_path):
    history = History(tmp_path)
    assert len(history) == 0 and history.last is None
    assert list(history.df.columns) == list(COLUMNS) and len(history.df) == 0


def test_numpy_scalars_and_nan_are_stored_as_plain_json(tmp_path):
    np = pytest.importorskip("numpy")
    History(tmp_path).append({"step": 0, "loss": np.float32(0.5), "kl": np.nan})
    stored = json.loads((tmp_path / HISTORY_FILE).read_text())
    assert stored == {"step": 0, "loss": 0.5, "kl": None}


def test_load_drops_truncated_last_line_and_appends_cleanly(tmp_path):
    history = History(tmp_path)
    for step in range(3):
        history.append(row(step))
    with open(tmp_path / HISTORY_FILE, "a") as f:
        f.write('{"step": 3, "reward_me')  # the kernel died mid-write
    resumed = History.load(tmp_path)
    assert len(resumed) == 3 and resumed.last["step"] == 2
    resumed.append(row(3))
    again = History.load(tmp_path)
    assert again.df["step"].tolist() == [0, 1, 2, 3]


def test_load_of_missing_file_is_empty_and_corrupt_middle_raises(tmp_path):
    assert len(History.load(tmp_path / "new")) == 0
    (tmp_path / HISTORY_FILE).write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        History.load(tmp_path)


def test_truncate_drops_later_steps_in_memory_and_on_disk(tmp_path):
    history = History(tmp_path)
    for step in range(1, 6):
        history.append(row(step))
    assert history.truncate(3) == 2 and history.last["step"] == 3
    assert History.load(tmp_path).df["step"].tolist() == [1, 2, 3]
    assert history.truncate(3) == 0


def test_new_history_moves_an_earlier_run_aside(tmp_path):
    History(tmp_path).append(row(0))
    History(tmp_path).append(row(0))
    assert len(list(tmp_path.glob("history.*.jsonl"))) == 1
    assert len(History.load(tmp_path)) == 1


def test_format_row():
    line = History.format_row({"step": 12, "reward_mean": 0.41, "reward_std": 0.1, "loss": 0.012,
                               "hit_rate": 0.86, "rollout_s": 3.1, "train_s": 2.0,
                               "reload_s": 0.04, "failed_rollouts": 0})
    assert line == ("step 12 | reward 0.41 ± 0.10 | loss 0.012 | hit 0.86 | rollout 3.1 s | "
                    "train 2.0 s | reload 0.04 s")


def test_format_row_skips_missing_and_shows_failures():
    line = History.format_row({"step": 3, "reward_mean": 0.5, "loss": float("nan"),
                               "failed_rollouts": 2})
    assert line == "step 3 | reward 0.50 | failed 2"


def test_docs_list_the_columns_of_the_one_row_schema():
    """docs/internals.md's "History columns" list is StepRow's columns (History.COLUMNS), in order."""
    import re
    from pathlib import Path

    from artsg_nb.run.row import StepRow

    text = (Path(__file__).resolve().parents[1] / "docs" / "internals.md").read_text()
    section = text[text.index("## History columns"):]
    listed = re.search(r"`(step, adapter, [^`]+)`", section).group(1)
    assert [c.strip() for c in listed.split(",")] == list(COLUMNS) == list(History.COLUMNS)
    assert {"memory", "pipeline", "eval", "fleet"} <= set(StepRow.__dataclass_fields__)


def test_a_step_row_writes_its_groups_in_place_and_leaves_absent_ones_out(tmp_path):
    from artsg_nb.run.row import FleetFields, MemoryFields, PipelineFields, step_row

    sync = step_row(1, "policy-step-1", [], {"loss": 0.5}).as_dict()
    assert sync["release_s"] is None and sync["resume_s"] is None, "the memory group is in every row"
    assert not {"staleness", "eval_reward", "worker_hit_rates", "trainer_ranks"} & set(sync)
    assert list(sync) == [c for c in COLUMNS if c in sync], "the row's keys in the schema's order"
    full = step_row(2, "policy-step-2", [], {"ranks": 2}, memory=MemoryFields(0.1, 0.2),
                    pipeline=PipelineFields(1, 0.3, 0.4), fleet=FleetFields([0.5, None], [10, None])).as_dict()
    assert (full["release_s"], full["staleness"], full["reload_wait_s"], full["trainer_ranks"]) == (0.1, 1, 0.4, 2)
    history = History(tmp_path)
    history.append(full)
    df = history.df  # per-worker lists stay lists; the other columns are floats
    assert df.loc[0, "worker_hit_rates"] == [0.5, None] and df.loc[0, "staleness"] == 1.0


class _FullDisk:
    """A history file whose disk fills up mid-row: the first write stores half its bytes, then
    ENOSPC (a short write, as a real full disk gives); later writes are refused whole."""

    def __init__(self, f):
        self._f, self.failures = f, 0

    def write(self, data):
        self.failures += 1
        if self.failures == 1:
            self._f.write(data[: len(data) // 2])
            self._f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_a_row_written_to_a_full_disk_leaves_no_torn_line_and_its_retry_resumes(tmp_path, monkeypatch):
    """ENOSPC in the middle of a row: the file is cut back to the rows before it, the retry writes
    the row whole, and a new kernel's resume reads every row (before: the torn half stayed, the
    retry appended after it, and the load refused the file for a corrupt middle line)."""
    import builtins
    import artsg_nb.run.history as history_module

    history = History(tmp_path)
    history.append(row(1))
    size = (tmp_path / HISTORY_FILE).stat().st_size
    monkeypatch.setattr(history_module, "open", lambda *a, **kw: _FullDisk(builtins.open(*a, **kw)), raising=False)
    with pytest.raises(OSError, match="No space"):
        history.append(row(2))
    assert (tmp_path / HISTORY_FILE).stat().st_size == size, "the torn half row was left in the file"
    monkeypatch.undo()
    history.append(row(2))  # the step's retry (GRPOStep.write_unwritten_row)
    history.append(row(3))
    assert History.load(tmp_path).df["step"].tolist() == [1, 2, 3]


def test_a_torn_last_line_is_dropped_but_a_torn_middle_line_is_refused_by_its_number(tmp_path):
    history = History(tmp_path)
    history.append(row(1))
    line = (json.dumps(row(2)) + "\n").encode()
    with open(tmp_path / HISTORY_FILE, "ab") as f:
        f.write(line[:30])  # the kernel died mid-write
    assert History.load(tmp_path).df["step"].tolist() == [1]
    assert (tmp_path / HISTORY_FILE).read_bytes().endswith(b"}\n"), "the torn line is trimmed from the file"
    with open(tmp_path / HISTORY_FILE, "ab") as f:
        f.write(line[:20] + b"\n" + (json.dumps(row(3)) + "\n").encode())  # damaged, then more rows
    with pytest.raises(ValueError, match="unreadable line 2 in the middle"):
        History.load(tmp_path)


def test_a_huge_finite_reward_gives_a_row_with_its_statistics_null(tmp_path, caplog):
    """Rewards of 1e200 train, save and serve: the row is still built (before: OverflowError while
    squaring them for reward_std, the step's row lost). reward_mean stays finite; reward_std
    overflows float64 and is recorded as null, with a warning."""
    from types import SimpleNamespace

    from artsg_nb.rollout.trajectory import Trajectory
    from artsg_nb.run.row import step_row

    trajs = [Trajectory(messages=[], token_ids=[1, 2], completion_mask=[0, 1], logprobs=[0.0, -1.0], reward=r)
             for r in (1e200, -1e200, 0.0, 1.0)]
    groups = [SimpleNamespace(trajectories=trajs[:2]), SimpleNamespace(trajectories=trajs[2:])]
    with caplog.at_level("WARNING"):
        r = step_row(3, "policy-step-3", groups, {"loss": 0.5}).as_dict()
    assert r["step"] == 3 and r["reward_mean"] == pytest.approx(0.25) and math.isnan(r["reward_std"])
    assert "reward_std not finite" in caplog.text
    History(tmp_path).append(r)
    assert json.loads((tmp_path / HISTORY_FILE).read_text())["reward_std"] is None
    huge = step_row(4, "policy-step-4", [SimpleNamespace(trajectories=trajs[:1] * 3)], {}).as_dict()
    assert huge["reward_mean"] == pytest.approx(1e200) and huge["reward_std"] == 0.0
