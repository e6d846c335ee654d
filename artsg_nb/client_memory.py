"""Give the server's GPU memory back while the trainer runs, and take it again before the reload.

What it does: `SGLangMemoryMixin` adds `release_memory(tags)` and `resume_memory()` to
`SGLangClient` (also the CPU engine's client: it copies the routes). They POST
/release_memory_occupation and /resume_memory_occupation with `{"tags": [...]}`; both answer
200 with a `null` body. What they guard against, read in SGLang 0.5.14's source (paths under
`sglang/srt/`):

* Without `--enable-memory-saver` both routes still answer 200 and free nothing: a no-op saver
  is swapped in (`utils/torch_memory_saver_adapter.py:19-29, 87-108`). So the client reads the
  server's flags from /server_info first and raises `MemorySaverError` rather than pretend.
  With the flag but no `torch_memory_saver` package the server does not start at all (`:20-26`).
* The server must be idle. The scheduler *asserts* it
  (`managers/scheduler_components/weight_updater.py:180-183`), and a failed assert ends the
  scheduler and with it the server (`managers/scheduler.py:4229-4232`), not a 400. Release
  therefore first waits for idle through `/flush_cache?timeout=`, which refuses with a 400.
* Releasing "kv_cache" flushes the radix cache (`weight_updater.py:193-209`). That costs no
  hits here: the cache is keyed by adapter load and every step serves a new adapter.
* "weights" without `--enable-weights-cpu-backup` throws the base weights away: only the
  module buffers are stashed (`weight_updater.py:211-217, 311-323`) and resume maps fresh,
  uninitialised memory (RL frameworks push new weights after it; LoRA training does not). The
  LoRA buffers live outside the weights region (`model_executor/model_runner.py:1415-1429`
  loads the model inside it, `:777-779` builds the LoRA manager after), so adapters survive a
  weights release that has the backup. The default tags leave the weights alone.
* Resuming a tag that is not released is a KeyError in the scheduler (`weight_updater.py:231-232`),
  which again ends the server; so `resume_memory()` sends exactly the tags this client released.
* Nothing stops generation while memory is released: a request would run on unmapped memory.
  Generate nothing, and do not probe /health (it generates one token), until resume.

What it does not do: decide when to release (session.py does, around `trainer.train_step`),
or vLLM's equivalent (/sleep and /wake_up in client_vllm.py).
"""
from __future__ import annotations

import logging
import time
from typing import Iterable

log = logging.getLogger(__name__)

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""What SGLang can release (`sglang/srt/constants.py:2-10`)."""
DEFAULT_TAGS = ("kv_cache", "cuda_graph")
"""Safe with LoRA and without a weights backup; the KV cache is most of the server's share."""
_START_WITH = ("Start the server with ServerConfig(enable_memory_saver=True) (SGLang --enable-memory-saver, "
               "vLLM --enable-sleep-mode) and install torch_memory_saver in the server environment "
               "(offline GPU bundle: .whl-tms, see tools/gpu/README.md), or train without release_memory.")


def memory_tags(tags: Iterable[str]) -> tuple[str, ...]:
    """`tags` checked against MEMORY_TAGS, duplicates dropped; ValueError names the valid ones."""
    tags = (tags,) if isinstance(tags, str) else tuple(dict.fromkeys(tags))
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown or not tags:
        raise ValueError(f"memory tags {list(tags)}: choose one or more of {list(MEMORY_TAGS)} "
                         "(SGLang ignores unknown tags silently, so they are refused here)")
    return tags


def saver_problem(info: dict, tags: tuple[str, ...], engine: str = "sglang",
                  flag: str = "--enable-memory-saver") -> str | None:
    """Why a server with these resolved flags cannot release `tags`; None when it can."""
    if not info.get("enable_memory_saver"):
        return (f"{engine} was started without {flag}, so it cannot release its memory (SGLang would "
                f"answer 200 and free nothing). {_START_WITH}")
    if "weights" in tags and not info.get("enable_weights_cpu_backup"):
        return (f"{engine} was started without --enable-weights-cpu-backup, so releasing 'weights' would "
                "discard the base model (resume maps uninitialised memory). Release only "
                f"{list(DEFAULT_TAGS)}, or start it with ServerConfig(enable_weights_cpu_backup=True).")
    return None


class SGLangMemoryMixin:
    """release_memory / resume_memory for a client that has `_request`, `flush_cache` and `server_info`."""

    released_tags: tuple[str, ...] = ()
    """What this client released and has not resumed yet."""
    _saver_flags: dict | None = None

    async def check_memory_saver(self, tags: Iterable[str] = DEFAULT_TAGS) -> None:
        """Raise MemorySaverError unless the server can release `tags` (its flags are read once)."""
        from .client import MemorySaverError

        tags = memory_tags(tags)
        if self._saver_flags is None:
            info = await self.server_info()
            self._saver_flags = {k: bool(info.get(k)) for k in ("enable_memory_saver", "enable_weights_cpu_backup")}
        problem = saver_problem(self._saver_flags, tags, self.engine)
        if problem:
            raise MemorySaverError(problem, body=self._saver_flags)

    async def release_memory(self, tags: Iterable[str] = DEFAULT_TAGS, idle_timeout_s: float = 60.0) -> float:
        """Release `tags` of the server's GPU memory once it is idle; seconds taken (idle wait included).

        Raises MemorySaverError when the server cannot (see `check_memory_saver`), EngineError when
        it is not idle within `idle_timeout_s` or this client already released (resume first).
        """
        from .client import EngineError

        tags = memory_tags(tags)
        if self.released_tags:
            raise EngineError(f"{self.engine}: memory {list(self.released_tags)} is already released; "
                              "call resume_memory() first")
        await self.check_memory_saver(tags)
        t0 = time.perf_counter()
        try:
            await self.flush_cache(timeout_s=idle_timeout_s)  # waits for idle, or refuses with 400
        except EngineError as e:
            if e.status is None or e.status >= 500:
                raise
            raise EngineError(f"{self.engine} did not become idle within {idle_timeout_s:g} s, so its memory was "
                              "not released (SGLang asserts idle; its scheduler would exit). Let every "
                              f"request finish first, or pass a larger idle_timeout_s. ({e})", e.status, e.body) from e
        await self._request("POST", "/release_memory_occupation", json={"tags": list(tags)})
        self.released_tags = tags
        log.debug("%s released %s in %.3f s", self.engine, tags, time.perf_counter() - t0)
        return time.perf_counter() - t0

    async def resume_memory(self) -> float:
        """Take back what `release_memory` gave; seconds taken. Nothing released: returns 0.0."""
        if not self.released_tags:
            return 0.0
        t0 = time.perf_counter()
        await self._request("POST", "/resume_memory_occupation", json={"tags": list(self.released_tags)})
        self.released_tags = ()
        return time.perf_counter() - t0
