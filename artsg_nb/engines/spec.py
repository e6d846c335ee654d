"""The record each engine module fills in: how to launch it, where its environment is found,
which metrics hold its prefix-cache counters, which client speaks to it.

What it does not do: act on any of it (server.py launches, server_env.py finds environments,
metrics.py reads counters).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class RawDialect:
    """One generate request and its answer as plain HTTP: what bench.raw's baseline sends and
    reads (no client, no chat template, nothing parsed beyond ids and token counts)."""

    payload: Callable[[list[int], int, Any, str], tuple[str, dict]]
    """(prompt ids, n, sampling params, served model name) → (path, JSON body)."""
    merge_chunks: Callable[[list[dict]], Any]
    """A streamed answer's data chunks, in order → the answer an unstreamed request gets."""
    samples: Callable[[Any, int], list[tuple[list[int], int, int]]]
    """(the answer, the prompt's length) → per sample, by index: (output ids, prompt tokens,
    cached tokens)."""
    stream_fields: Mapping[str, Any] = field(default_factory=dict)
    """Added to the body of a streamed request (vLLM: the usage in its last chunk)."""


@dataclass(frozen=True)
class EngineSpec:
    """Everything engine-specific that is not the HTTP dialect: launch, environment, metrics.

    server.py, server_env.py and metrics.py read these fields instead of keeping tables keyed by
    engine name; `engines.get(name)` returns one.
    """

    name: str
    """"sglang", "vllm" or "cpu"."""
    client_class: type
    """The EngineClient subclass that speaks this engine's API."""
    entry: str
    """Module the server runs as (`python -m <entry> ...`)."""
    package: str
    """Package imported to check a server environment (its __version__ is reported)."""
    launch_args: Callable[[Any, int], list[str]]
    """(ServerConfig, port) → the engine's flags, before ServerConfig.extra_args."""
    validate: Callable[[Any], None] = lambda cfg: None
    """Raise ValueError for a ServerConfig this engine cannot run (e.g. vLLM's LoRA ranks)."""
    server_env: Mapping[str, str] = field(default_factory=dict)
    """Variables every server of this engine needs (vLLM: runtime LoRA loading, dev routes)."""
    ignored_options: tuple[str, ...] = ()
    """ServerConfig fields the engine has no flag for (logged when set, not fatal)."""
    startup_timeout_s: float = 600.0
    """Default seconds to wait for /health (a first GPU start compiles kernels)."""
    tp_flag: str | None = None
    """The tensor-parallel flag (a server over several GPUs, gpus.plan_gpus(server_tp=)); None:
    the engine has none (the CPU engine)."""
    api_key_env: str | None = None
    """Variable the server reads its API key from. The key never goes on the command line:
    /proc/<pid>/cmdline is readable by every local user. None: the engine cannot take a key."""
    launcher: str | None = None
    """Python code run as `python -c <launcher> <flags>` instead of `python -m <entry>` (SGLang:
    moves the key from `api_key_env` into the parsed flags inside the process)."""
    auth_probe: str = "/model_info"
    """A GET route that needs the key: adopting a server checks the recorded key opens it."""
    python_var: str | None = None
    """Variable naming the server environment's interpreter; None: the kernel's own."""
    pythonpath_var: str | None = None
    """Variable holding PYTHONPATH entries for the server process only (offline bundles)."""
    env_var: str | None = None
    """Variable holding KEY=VALUE pairs for the server process only."""
    conda_env: str | None = None
    """Conda environment searched by name."""
    venv_dir: str | None = None
    """Virtual environment searched at the repository root and the working directory."""
    create_commands: tuple[str, str] | None = None
    """(conda command, make target) that create the server environment."""
    metric_prefix: str = "sglang:"
    """Prefix of this engine's Prometheus metrics."""
    prompt_counters: tuple[str, ...] = ()
    """Prompt-token counter sample names, first present wins (see metrics.py)."""
    cached_counters: tuple[str, ...] = ()
    """Cached-token counter sample names, first present wins."""
    progress_counters: tuple[str, ...] = ()
    """Counter sample names that grow with every scheduler round while the engine works (summed):
    the watchdog's sign that requests in flight make progress."""
    raw: RawDialect | None = None
    """Its generate request as plain HTTP, for the bench's raw baseline."""
    chat_token_ids: Mapping[str, Any] = field(default_factory=dict)
    """Chat-completion request fields that make each choice carry the server's own token ids (an
    OpenAI client's `extra_body`; art.convert reads them back). SGLang 0.5.14: `return_meta_info`
    (`meta_info.output_token_logprobs` as [logprob, id, text] when logprobs are asked for) and
    `return_prompt_token_ids`; both refused on streamed requests. vLLM: `return_token_ids`."""
    mem_fraction_of: str = "total"
    """What the memory-fraction flag is a fraction of: "total" (vLLM's --gpu-memory-utilization) or
    "free" (SGLang 0.5.14's --mem-fraction-static: KV budget = memory free after loading the weights
    minus (1 - f) x the memory free when the process started, model_runner_kv_cache_mixin.py
    `_profile_available_bytes`). With "free", a server sharing its GPU is launched with the plan's
    share of the total re-expressed over what is free at that moment (gpus.launch_mem_fraction)."""
    lora_n_problem: Callable[[dict], str | None] = lambda info: None
    """(the server's /server_info) → why native `n > 1` sampling under a LoRA adapter is unsafe on
    that server, or None. SGLang up to at least 0.5.14 miscounts the adapter's references for such a
    request and its next unload never returns (sglang#36894); its client then sends the same work
    in a shape whose references balance (sglang.SGLangClient)."""
    native_n: str | None = None
    """How the engine runs one request with n > 1 samples, which decides what its prefix cache can
    serve them (engines.sglang.native_n_submission): "warm-up", "in order", or None (unknown)."""
    warm_up_from_flop: float = 0.0
    """For n > 1 under an adapter sent as n copies of the prompt (`lora_n_problem`): the prefill
    work the copies would redo, (n - 1) x prompt tokens x 2 FLOPs per weight, from which the prompt
    is first sent alone to fill the prefix cache (what SGLang's native n > 1 always does). Below it
    the copies are prefilled together, a round trip fewer. 0: always send it."""

    @property
    def args_var(self) -> str:
        """$ARTSG_<ENGINE>_ARGS: extra server flags (e.g. an offline GPU bundle's backends)."""
        return f"ARTSG_{self.name.upper()}_ARGS"


def key_launcher(module: str, key_env: str) -> str:
    """`python -c` code that runs `module` as __main__ with `--api-key=<key>` appended to its
    sys.argv inside the process, the key taken (and removed) from the environment variable
    `key_env`. /proc/<pid>/cmdline, readable by every local user, shows the argv the process was
    started with, so it never holds the key. For programs that parse sys.argv in-process (SGLang's
    launch_server, sglang_router) and offer no key variable or file; plain code, so the target
    environment needs nothing of ours. One `=` argument, not two: argparse reads a separate value
    that starts with '-' (one "auto" key in 64) as a missing one and the program exits 2."""
    return (f"import os, runpy, sys\nkey = os.environ.pop({key_env!r}, '')\n"
            f"if key:\n    sys.argv.append('--api-key=' + key)\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
