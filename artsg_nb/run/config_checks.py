"""The checks a `RunConfig` passes when it is built: names, types, ranges and settings that
cannot work together, each refused with what to write instead, before any server starts.

What it does: `check_config(cfg)` (called by `RunConfig.__post_init__`, so `dataclasses.replace`
checks too) raises ConfigError for an unknown engine or schedule (with the closest name), a value
of the wrong type (`learning_rate="1e-4"`), one out of range (`group_size=0`, `max_new_tokens=0`),
and `eval_every` on a task that has no held-out prompts to evaluate; it warns (UserWarning) on
`group_size=1`, where GRPO has nothing to compare.

What it does not: check what only the machine can tell (GPUs, the server environment, a model
directory's files: session start and server.py), or the model name (models.pretrained.check_model_name,
which may ask the network and runs at start).
"""
from __future__ import annotations

import difflib
import numbers
import os
import warnings

from .. import engines
from ..rl.grpo import GRPOConfig
from ..rollout.evaluate import eval_task_and_seeds
from ..rollout.groups import SCHEDULES
from ..tasks.registry import Task, UnknownTaskError, resolve_task


class ConfigError(ValueError):
    """A RunConfig field that cannot work (the message names it and says what to write)."""


_INT, _REAL = "a whole number", "a number"
_NUMBERS = {
    "group_size": (_INT, 1, False), "groups_per_step": (_INT, 1, False), "max_new_tokens": (_INT, 1, True),
    "temperature": (_REAL, 0, False), "learning_rate": (_REAL, None, True), "lora_rank": (_INT, 1, False),
    "lora_alpha": (_REAL, None, False), "concurrency": (_INT, 1, False), "max_seq_tokens": (_INT, 2, False),
    "micro_batch_tokens": (_INT, 1, True), "seed": (_INT, 0, False), "max_restarts": (_INT, 0, False),
    "hang_timeout_s": (_REAL, 0, False), "admin_timeout_s": (_REAL, 0, False), "reward_timeout_s": (_REAL, 0, False),
    "num_servers": (_INT, 1, False), "trainer_ranks": (_INT, 1, False), "eval_every": (_INT, 0, False),
    "eval_n": (_INT, 1, False), "print_samples": (_INT, 0, False), "keep_adapters": (_INT, 0, False), "keep_every": (_INT, 0, False),
}
"""Numeric fields: (kind, minimum (None: above 0), None allowed)."""
_BOOLS = ("resume", "verify_adapter", "verbose", "pipeline")
_STRING_TUPLES = ("release_tags", "server_args", "report_to")
_HINTS = {
    "max_new_tokens": "None uses the task's own limit",
    "learning_rate": "None picks one for the model (RunConfig.learning_rate)",
    "group_size": "GRPO compares the completions of one prompt; 8 is usual",
    "eval_every": "0 never evaluates",
    "hang_timeout_s": "0 turns the watchdog off",
    "reward_timeout_s": "0 waits for ever",
}


def check_config(cfg) -> None:
    """Raise ConfigError for the first field of `cfg` that cannot work; warn on group_size=1."""
    _check_names(cfg)
    for name, (kind, low, optional) in _NUMBERS.items():
        _check_number(name, getattr(cfg, name), kind, low, optional)
    for name in _BOOLS:
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name}={getattr(cfg, name)!r} is a {type(getattr(cfg, name)).__name__}; give True or False")
    for name in _STRING_TUPLES:
        value = getattr(cfg, name)
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}={value!r}: give a tuple of strings, e.g. {name}=({value!r},)"
                              if isinstance(value, str) else f"{name}={value!r}: give a tuple of strings")
    if not isinstance(cfg.grpo, GRPOConfig):
        raise ConfigError(f"grpo={cfg.grpo!r} is a {type(cfg.grpo).__name__}; give a GRPOConfig(...)")
    if cfg.release_memory not in (True, False, "auto", "if_needed"):
        raise ConfigError(f"release_memory={cfg.release_memory!r}; use True, False or 'auto' (or 'if_needed', the "
                          "default: only where the model would not fit one shared GPU without it)")
    if cfg.prompt_warm_up not in engines.PROMPT_WARM_UPS:
        raise ConfigError(f"prompt_warm_up={cfg.prompt_warm_up!r}; use one of {', '.join(map(repr, engines.PROMPT_WARM_UPS))}"
                          f"{closest(cfg.prompt_warm_up, engines.PROMPT_WARM_UPS)}")
    engines.memory_tags(cfg.release_tags)  # a typo in a tag names the known ones
    if cfg.group_size == 1:
        warnings.warn("group_size=1: GRPO scores each completion against the others of its prompt; with one "
                      "there are no others, every advantage is 0 and nothing is learned. Try: group_size >= 2 "
                      "(8 is usual).", UserWarning, stacklevel=4)
    _check_eval(cfg)


def closest(name: str, known) -> str:
    """" did you mean 'x'?" for the known name closest to `name`, or ""."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_names(cfg) -> None:
    known = ("auto", *engines.ENGINES)
    if cfg.engine not in known:
        raise ConfigError(f"unknown engine {cfg.engine!r}{closest(cfg.engine, known)} (known: {', '.join(known)})")
    schedules = ("auto", *SCHEDULES)
    if cfg.schedule not in schedules:
        raise ConfigError(f"unknown schedule {cfg.schedule!r}{closest(cfg.schedule, schedules)} "
                          f"(known: {', '.join(schedules)})")
    if not isinstance(cfg.task, (str, Task)):
        raise ConfigError(f"task={cfg.task!r} is a {type(cfg.task).__name__}; give a Task, a registered name or "
                          "\"package.module:ATTR\"")
    for name in ("model_path", "run_dir"):
        value = getattr(cfg, name)
        if not (isinstance(value, (str, os.PathLike)) or (value is None and name == "model_path")):
            raise ConfigError(f"{name}={value!r} is a {type(value).__name__}; give a path or a name as a string")


def _check_number(name: str, value, kind: str, low, optional: bool) -> None:
    if value is None and optional:
        return
    wanted = numbers.Integral if kind == _INT else numbers.Real
    hint = f" ({_HINTS[name]})" if name in _HINTS else ""
    if isinstance(value, bool) or not isinstance(value, wanted):
        example = f"{name}={value.strip()}" if isinstance(value, str) and _parses(value) else f"{name}=<{kind}>"
        raise ConfigError(f"{name}={value!r} is a {type(value).__name__}, not {kind}{hint}. Try: {example}")
    if value != value or (low is None and not value > 0) or (low is not None and value < low):
        bound = "above 0" if low is None else f">= {low}"
        raise ConfigError(f"{name}={value!r} is out of range: use {kind} {bound}{hint}")


def _parses(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _check_eval(cfg) -> None:
    """eval_every needs held-out prompts: a dataset task's eval split must have rows (tasks without splits evaluate on held-out seeds, which always exist). A task that does not
    resolve yet is left to GRPORun.start, which names what is wrong with it."""
    if not cfg.eval_every:
        return
    try:
        task = resolve_task(cfg.task)
    except UnknownTaskError:
        return
    try:
        eval_task_and_seeds(task, "eval", cfg.eval_n, cfg.eval_n)
    except ValueError as e:
        raise ConfigError(f"eval_every={cfg.eval_every} evaluates task {task.name!r} on held-out prompts, but: {e}. "
                          "Try: hold rows out with Task.from_dataset(..., eval_fraction=0.1) or eval_rows=[...], "
                          "or eval_every=0.") from None
