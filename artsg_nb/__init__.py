"""artsg_nb: GRPO of LoRA adapters from a notebook, with rollouts served by SGLang.

The names a notebook needs are re-exported here (imported lazily, so `import artsg_nb` stays
cheap and touches no CUDA); everything else is reachable by module.
"""
from importlib import import_module as _import_module

__version__ = "0.1.0"

_EXPORTS = {
    "RunConfig": "run_config", "GRPORun": "session",
    "GRPOConfig": "grpo",
    "ServerConfig": "server", "start_server": "server",
    "list_gpus": "gpus", "plan_gpus": "gpus",
    "Dashboard": "widgets",
    "LivePlot": "plots", "plot_training": "plots", "plot_engine_comparison": "plots",
    "compare_runs": "plots", "sample_table": "plots",
    "get_task": "tasks", "list_tasks": "tasks", "register_task": "tasks", "resolve_task": "tasks",
    "Task": "tasks", "Env": "tasks", "StepResult": "tasks",
    "default_model_dir": "tiny_model",
}

__all__ = sorted(_EXPORTS)


def __dir__() -> list[str]:
    """Tab completion on `ag.` lists the exported names (they are imported on first use)."""
    return sorted({n for n in globals() if not n.startswith("_")} | set(_EXPORTS))


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(_import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'artsg_nb' has no attribute {name!r}")
