"""The errors every engine's client raises, and how a server's answer maps onto them.

What it does: `EngineError` (with `.status` and `.body`) and its kinds — an adapter name taken or
unknown, an adapter that does not fit the server's LoRA pool, no answer at all, no memory saver —
plus `server_message` (the message inside any engine's error body) and `classify_error`. Each
kind carries a hint of what to try, which EngineClient appends to the server's own message.

What it does not do: send requests (base.py) or know which engine answered.
"""
from __future__ import annotations

import re
from typing import Any


class EngineError(RuntimeError):
    """The server refused or failed a request. `.status` is the HTTP status, `.body` its body."""

    def __init__(self, message: str, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status, self.body = status, body
        self.retried = False  # the request went out twice (a connection dropped under the first)


class AdapterExistsError(EngineError):
    """An adapter of that name is already loaded (names are immutable on SGLang)."""


class UnknownAdapterError(EngineError):
    """The server holds no adapter of that name."""


class AdapterRankError(EngineError):
    """The adapter's rank or target modules do not fit the server's LoRA memory pool."""


class ServerUnavailableError(EngineError):
    """No HTTP answer: the server is down, still starting, or too slow."""


class AdminTimeoutError(ServerUnavailableError):
    """An admin call (adapter load/unload, memory release/resume, flush, info) hung past its own
    timeout while the server may still answer /health (e.g. SGLang 0.5.14's stuck unload,
    sglang#36894). A ServerUnavailableError, so a run restarts the server and redoes the step."""

    def __init__(self, message: str, operation: str = "", status: int | None = None, body: Any = None):
        super().__init__(message, status, body)
        self.operation = operation


class MemorySaverError(EngineError):
    """The server cannot release its memory as asked: started without the memory saver (SGLang
    --enable-memory-saver, vLLM --enable-sleep-mode), or "weights" asked without a weights backup."""


_EXISTS = ("already loaded", "already been loaded", "already exists")
_UNKNOWN = ("does not exist", "never been loaded", "cannot be found", "not found")
# Whole words: a path such as /home/frank/... in the message must not read as a rank problem.
_RANK = re.compile(r"\brank\b|target[ _-]modules?")
_HINTS = {
    AdapterExistsError: "Adapter names are immutable: load each version under a new name "
                        "(policy-step-N) from a new directory, or unload the old one first.",
    UnknownAdapterError: "Load it first with load_adapter(name, path); list_adapters() shows what "
                         "the server holds.",
    AdapterRankError: "Restart the server with --max-lora-rank at least the adapter's r and "
                      "--lora-target-modules covering its target_modules (or train a matching adapter).",
}


def server_message(body: Any) -> str:
    """The human-readable message inside any of the engines' error bodies."""
    if isinstance(body, dict):
        err = body.get("error")
        for msg in (body.get("error_message"), err.get("message") if isinstance(err, dict) else err,
                    body.get("detail"), body.get("message")):
            if msg:
                return str(msg)
    return str(body).strip() or "(empty body)"


def classify_error(status: int, message: str, op: str) -> type[EngineError]:
    """Which EngineError a failure is; `op` is "load", "unload", "use" (a request naming an
    adapter) or "other"."""
    low = message.lower()
    if op == "load" and any(s in low for s in _EXISTS):
        return AdapterExistsError
    if op == "load" and _RANK.search(low):
        return AdapterRankError
    if op in ("unload", "use") and (status == 404 or any(s in low for s in _UNKNOWN)):
        return UnknownAdapterError
    return EngineError


def hint_for(cls: type[EngineError]) -> str:
    """What to try after an error of kind `cls` (empty for a plain EngineError)."""
    return _HINTS.get(cls, "")
