"""artsg_nb: GRPO of LoRA adapters from a notebook, with rollouts served by SGLang.

The names a notebook needs are re-exported here (imported lazily, so `import artsg_nb` stays
cheap and touches no CUDA); everything else is reachable by module. Inside IPython, the toolkit's
own errors are shown as their message and hint, not the whole traceback (notebook_errors.py).
"""
from importlib import import_module as _import_module

from . import notebook_errors as _notebook_errors

__version__ = "0.1.0"

_EXPORTS = {
    "RunConfig": "run.config", "GRPORun": "run.session",
    "Sweep": "multi.runtime", "SweepConfig": "multi.runtime", "LoraSpec": "multi.trainer",
    "GRPOConfig": "rl.grpo",
    "ServerConfig": "serving.server", "start_server": "serving.server",
    "list_gpus": "serving.gpus", "plan_gpus": "serving.gpus",
    "Dashboard": "view.widgets",
    "LivePlot": "view.plots", "plot_training": "view.plots", "plot_engine_comparison": "view.plots",
    "compare_runs": "view.plots", "sample_table": "view.plots", "plot_step_benchmark": "view.plots",
    "get_task": "tasks.registry", "list_tasks": "tasks.registry", "register_task": "tasks.registry",
    "resolve_task": "tasks.registry", "Task": "tasks.registry", "Env": "tasks.registry", "StepResult": "tasks.registry",
    "default_model_dir": "models.tiny",
    "list_servers": "serving.leftovers", "stop_servers": "serving.leftovers",
}

__all__ = sorted(_EXPORTS)


def __dir__() -> list[str]:
    """Tab completion on `ag.` lists the exported names (they are imported on first use)."""
    return sorted({n for n in globals() if not n.startswith("_")} | set(_EXPORTS))


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(_import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'artsg_nb' has no attribute {name!r}")


_notebook_errors.register()
