"""The CPU engine (artsg_nb.cpu_engine, a separate program): launch and environment.

What it does: SPEC runs `python -m artsg_nb.cpu_engine` in the kernel's own interpreter (it needs
only torch, transformers and PEFT, which the kernel has). The engine copies SGLang's native API,
routes, metric names and memory-release routes, so its client is SGLang's (named "cpu" by
engines.make_client) and its hit rate comes from the same counters.

What it does not do: implement the engine (artsg_nb/cpu_engine/), which imports nothing of this
package.
"""
from __future__ import annotations

from .spec import EngineSpec
from .sglang import SPEC as SGLANG
from .sglang import LORA_N_ISSUE, SGLangClient


def launch_args(cfg, port: int) -> list[str]:
    """The flags for a server.ServerConfig `cfg` listening on `port`."""
    args = ["--model-path", cfg.model_path, "--host", cfg.host, "--port", str(port),
            "--max-lora-rank", str(cfg.max_lora_rank),
            "--lora-target-modules", *cfg.lora_target_modules,
            "--max-loras-per-batch", str(cfg.max_loras_per_batch), "--enable-cache-report"]
    args += ["--enable-memory-saver"] if cfg.enable_memory_saver else []
    args += ["--enable-weights-cpu-backup"] if cfg.enable_weights_cpu_backup else []
    return args + (["--disable-radix-cache"] if cfg.disable_radix_cache else [])


def lora_n_problem(info: dict) -> str | None:
    """The CPU engine balances its references, unless started with `--fault lora-n-counter`, which
    reproduces SGLang's bug (sglang.lora_n_problem) for the tests."""
    if "lora-n-counter" in (info.get("faults") or ()):
        return f"the CPU engine emulates SGLang's LoRA reference miscount for n > 1 ({LORA_N_ISSUE})"
    return None


SPEC = EngineSpec(
    name="cpu", client_class=SGLangClient, entry="artsg_nb.cpu_engine", package="artsg_nb",
    launch_args=launch_args, api_key_env="ARTSG_CPU_ENGINE_API_KEY", auth_probe="/model_info",
    ignored_options=("schedule_policy", "mem_fraction"), startup_timeout_s=120.0, lora_n_problem=lora_n_problem,
    native_n="in order",  # the scheduler prefills a request's samples one after another
    chat_token_ids=SGLANG.chat_token_ids, raw=SGLANG.raw, metric_prefix=SGLANG.metric_prefix, prompt_counters=SGLANG.prompt_counters,
    cached_counters=SGLANG.cached_counters, progress_counters=SGLANG.progress_counters)
