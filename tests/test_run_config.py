"""run_config: the "auto" rollout schedule, and that a schedule change does not block resume."""
from __future__ import annotations

from dataclasses import replace

import pytest

from artsg_nb.run.config import ConfigMismatchError, RunConfig, check_resumable, config_record, resolve_schedule
from artsg_nb.tasks.registry import get_task


def test_auto_schedule_is_n_for_single_turn_and_prefix_for_multi_turn():
    assert RunConfig().schedule == "auto"
    assert resolve_schedule("auto", get_task("addition").max_turns) == "n"
    assert resolve_schedule("auto", get_task("price_lookup").max_turns) == "prefix"
    assert resolve_schedule("naive", 1) == "naive"


def test_schedule_may_change_on_resume():
    # every schedule draws the same samples (rollout.request_seed), so it is operational
    saved = config_record(RunConfig(schedule="prefix"))
    check_resumable(saved, replace(RunConfig(), resume=True))


def test_verify_every_below_one_is_refused_with_the_way_to_turn_the_check_off():
    import pytest

    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"verify_every=.*>= 1.*verify_adapter=False"):
            RunConfig(verify_every=bad)
    assert RunConfig(verify_every=1).verify_every == 1


def test_a_run_saved_with_the_old_micro_batch_default_resumes():
    """micro_batch_tokens was 8192 by default before it became None (sized from free memory): the
    update is the same in any micro-batches, so a run saved with 8192 resumes (it raised before)."""
    saved = config_record(RunConfig(micro_batch_tokens=8192))
    check_resumable(saved, replace(RunConfig(), resume=True))
    assert RunConfig().micro_batch_tokens is None


def test_the_package_task_registered_outside_the_registry_is_recorded_by_name():
    from artsg_nb.tasks.chat import ADDITION_CHAT

    record = config_record(RunConfig(task=ADDITION_CHAT))
    assert record["task"] == "addition_chat" and "task_note" not in record
    assert get_task(record["task"]) is ADDITION_CHAT


def test_a_run_of_a_notebook_task_saved_before_the_importability_note_resumes():
    """config.json of runs saved before "task_note" existed has no note. For a task no package
    task is named like, the note is the only difference: resume (it refused: "task_note: None →
    'not importable'"). The task itself still counts."""
    from artsg_nb import Task

    local = Task("in_a_cell", "defined in a notebook", max_turns=1, max_new_tokens=4, factory=lambda s: None)
    saved = config_record(RunConfig(task=local))
    assert saved.pop("task_note") == "not importable"  # as an older run dir has it
    check_resumable(saved, replace(RunConfig(task=local), resume=True))
    with pytest.raises(ConfigMismatchError, match="task: 'in_a_cell' → 'addition'"):
        check_resumable(saved, replace(RunConfig(task="addition"), resume=True))


def test_a_notebook_task_named_like_a_package_task_never_resumes_the_other():
    """A notebook's own "addition" is another task than the package's: neither run resumes as the
    other, whichever was saved first, with or without the note."""
    from artsg_nb import Task

    mine = Task("addition", "my own addition, another reward", max_turns=1, max_new_tokens=4, factory=lambda s: None)
    builtin_run, my_run = config_record(RunConfig(task="addition")), config_record(RunConfig(task=mine))
    assert "task_note" not in builtin_run and my_run["task_note"] == "not importable"
    with pytest.raises(ConfigMismatchError, match="task_note: None → 'not importable'"):
        check_resumable(builtin_run, replace(RunConfig(task=mine), resume=True))
    with pytest.raises(ConfigMismatchError, match="task_note: 'not importable' → None"):
        check_resumable(my_run, replace(RunConfig(task="addition"), resume=True))
    check_resumable(my_run, replace(RunConfig(task=mine), resume=True))
