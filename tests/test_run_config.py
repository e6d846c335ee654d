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


# ---- mistakes refused when the config is built (issue 50, build item 3) --------------------
@pytest.mark.parametrize("fields, message", [
    (dict(engine="sglnag"), r"unknown engine 'sglnag'; did you mean 'sglang'\?"),
    (dict(learning_rate="1e-4"), r"learning_rate='1e-4' is a str, not a number.*Try: learning_rate=1e-4"),
    (dict(group_size=0), r"group_size=0 is out of range: use a whole number >= 1"),
    (dict(group_size=-4), r"group_size=-4 is out of range"),
    (dict(groups_per_step=2.5), r"groups_per_step=2.5 is a float, not a whole number"),
    (dict(max_new_tokens=0), r"max_new_tokens=0 is out of range.*None uses the task's own limit"),
    (dict(temperature=float("nan")), r"temperature=nan is out of range"),
    (dict(lora_rank=True), r"lora_rank=True is a bool"),
    (dict(schedule="prefx"), r"unknown schedule 'prefx'; did you mean 'prefix'\?"),
    (dict(report_to="wandb"), r"report_to='wandb': give a tuple of strings, e.g. report_to=\('wandb',\)"),
    (dict(pipeline="yes"), r"pipeline='yes' is a str; give True or False"),
    (dict(reward_timeout_s=-1), r"reward_timeout_s=-1 is out of range.*0 waits for ever"),
])
def test_a_config_that_cannot_work_is_refused_when_built(fields, message):
    from artsg_nb.run.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        RunConfig(**fields)
    with pytest.raises(ConfigError, match=message):  # a variant derived with replace is checked too
        replace(RunConfig(), **fields)


def test_group_size_one_is_warned_about():
    with pytest.warns(UserWarning, match="group_size=1: .*every advantage is 0"):
        RunConfig(group_size=1)


def test_eval_every_without_an_eval_split_fails_when_built():
    from artsg_nb.run.config import ConfigError
    from artsg_nb.tasks.registry import Task

    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(8)]
    reward = lambda prompts, completions, **kw: [0.0] * len(completions)  # noqa: E731
    task = Task.from_dataset(rows, reward_funcs=[reward])
    with pytest.raises(ConfigError, match=r"eval_every=2 .*split 'eval' has no rows.*eval_fraction=0.1"):
        RunConfig(task=task, eval_every=2)
    held = Task.from_dataset(rows, reward_funcs=[reward], eval_rows=[0, 1])
    assert RunConfig(task=held, eval_every=2).eval_every == 2
    assert RunConfig(task="addition", eval_every=2).eval_every == 2  # held-out seeds always exist


def test_a_reward_timeout_may_change_on_resume():
    saved = config_record(RunConfig())
    saved.pop("reward_timeout_s")  # a run saved before the field existed
    check_resumable(saved, replace(RunConfig(reward_timeout_s=5.0), resume=True))
