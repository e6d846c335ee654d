"""Run the CPU engine: `python -m artsg_nb.cpu_engine --model-path DIR [flags]`.

    python -m artsg_nb.cpu_engine --model-path DIR --host 127.0.0.1 --port 30000 \\
        [--max-lora-rank 16] [--lora-target-modules all|q_proj ...] [--max-loras-per-batch 8] \\
        [--lora-paths name=path ...] [--cache-budget-tokens 65536] [--disable-radix-cache] \\
        [--enable-cache-report] [--enable-memory-saver [--enable-weights-cpu-backup]] \\
        [--random-seed S] [--log-level info]      # key: $ARTSG_CPU_ENGINE_API_KEY

What it does: parses SGLang's flag names into EngineArgs, configures logging to stdout (the
launcher's log file) and serves the app with uvicorn until SIGTERM. GPU-only SGLang flags
(--enable-lora, --enable-metrics, --mem-fraction-static) are accepted and ignored, so a shared
launcher can pass them. The API key comes from $ARTSG_CPU_ENGINE_API_KEY (removed from the
environment once read): a flag would show it in /proc/<pid>/cmdline, which every local user can
read. `--api-key` still works for a server started by hand. What it does not do: anything but start the program (engine.py and
routes.py do the work).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from .engine import FAULTS, Engine, EngineArgs
from .model import ALL_TARGET_MODULES
from .routes import create_app

log = logging.getLogger("artsg_nb.cpu_engine")

API_KEY_ENV = "ARTSG_CPU_ENGINE_API_KEY"
"""The variable the key is read from (artsg_nb.engines.cpu.SPEC.api_key_env names it too)."""

DESCRIPTION = "The CPU engine: a real inference server that speaks the subset of SGLang's HTTP API artsg_nb uses."


def parse_args(argv: list[str] | None = None) -> EngineArgs:
    p = argparse.ArgumentParser(prog="python -m artsg_nb.cpu_engine", description=DESCRIPTION)
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--lora-target-modules", nargs="*", default=["all"])
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--lora-paths", nargs="*", default=[])
    p.add_argument("--cache-budget-tokens", type=int, default=65536)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--enable-cache-report", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-weights-cpu-backup", action="store_true")
    p.add_argument("--api-key", help=f"prefer ${API_KEY_ENV}: a flag is visible to every local user")
    p.add_argument("--random-seed", type=int)
    p.add_argument("--log-level", default="info")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--num-threads", type=int)
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--fault", action="append", default=[], choices=sorted(FAULTS),
                   help="reproduce a real engine's failure, for fault tests: " +
                        "; ".join(f"{k}: {v}" for k, v in FAULTS.items()))
    p.add_argument("--fault-marker", help="a fault fires once: it writes this file, and not again while it exists")
    # SGLang flags that are meaningless here; accepted so a shared launcher can pass them.
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--mem-fraction-static", type=float)
    a = p.parse_args(argv)
    targets = tuple(a.lora_target_modules or ["all"])
    targets = ALL_TARGET_MODULES if "all" in targets else targets
    unknown = sorted(set(targets) - set(ALL_TARGET_MODULES))
    if unknown:
        p.error(f"--lora-target-modules {unknown} not supported; choose from {list(ALL_TARGET_MODULES)} or all")
    return EngineArgs(
        model_path=a.model_path, host=a.host, port=a.port, served_model_name=a.served_model_name,
        max_lora_rank=a.max_lora_rank, lora_target_modules=targets, max_loras_per_batch=a.max_loras_per_batch,
        lora_paths=tuple(a.lora_paths), cache_budget_tokens=a.cache_budget_tokens,
        disable_radix_cache=a.disable_radix_cache, enable_cache_report=a.enable_cache_report,
        enable_memory_saver=a.enable_memory_saver, enable_weights_cpu_backup=a.enable_weights_cpu_backup,
        api_key=a.api_key or os.environ.pop(API_KEY_ENV, None) or None, random_seed=a.random_seed, log_level=a.log_level,
        max_running_requests=a.max_running_requests, max_prefill_tokens=a.max_prefill_tokens,
        num_threads=a.num_threads, skip_server_warmup=a.skip_server_warmup,
        faults=tuple(a.fault), fault_marker=a.fault_marker,
        ignored={k: v for k, v in (("enable_lora", a.enable_lora), ("enable_metrics", a.enable_metrics),
                                   ("mem_fraction_static", a.mem_fraction_static)) if v})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stdout,
                        format="[%(asctime)s] %(name)s %(levelname)s: %(message)s")
    if args.ignored:
        log.info("ignoring GPU-only flags on the CPU engine: %s", args.ignored)
    engine = Engine(args)
    app = create_app(engine)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=args.log_level.lower() == "debug")
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
