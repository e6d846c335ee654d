"""What the CPU engine has released: SGLang's /release_memory_occupation and /resume_memory_occupation.

What SGLang 0.5.14 does (read from its source; the facts and line numbers are in
artsg_nb/engines/sglang.py): GET or POST with `{"tags": [...]}` (absent, null or [] = all of
kv_cache, weights, cuda_graph; unknown tags are accepted and do nothing), 200 with a `null`
body. Releasing kv_cache flushes the radix cache. With --enable-memory-saver the memory is
really given back and nothing may run until resume; without it both routes still answer 200,
the flush happens, and nothing is freed.

What this engine does (routes.py maps the routes onto Engine.release_memory and
Engine.resume_memory; this module holds the state, the tags and the error): the same routes,
bodies and flags (--enable-memory-saver, --enable-weights-cpu-backup, both reported by
/server_info). Releasing kv_cache drops the radix cache's KV tensors, which is real memory here;
weights and cuda_graph are bookkeeping only (the weights are the model in RAM, and there are no
CUDA graphs). With --enable-memory-saver,
generation is refused (400, or 503 for /health_generate) while anything is released: on SGLang
it would run on unmapped memory.

What it deliberately does differently: where SGLang's scheduler dies (a release while requests
run fails an assert; resuming a tag that is not released is a KeyError), this engine answers
400 `{"error": {"message"}}` with the same words and keeps serving, so the toolkit's guards can
be tested without losing the server.
"""
from __future__ import annotations

ALL_TAGS = ("kv_cache", "weights", "cuda_graph")
NOT_IDLE = "release_memory_occupation should be called only when server is idle."


class OccupationError(Exception):
    """A release or resume SGLang would not survive; answered with 400."""


class MemoryOccupation:
    """Which tags are released; `enabled` mirrors --enable-memory-saver."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.released: set[str] = set()

    def refusal(self) -> str | None:
        """Why generation is refused now, or None."""
        if self.enabled and self.released:
            return (f"GPU memory {sorted(self.released)} is released (/release_memory_occupation): "
                    "POST /resume_memory_occupation before generating")
        return None


def requested_tags(body: dict) -> list[str]:
    """The request's tags; all of them when absent, null or []."""
    tags = body.get("tags")
    if tags is None or tags == []:
        return list(ALL_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise OccupationError("tags must be a list of strings")
    return tags
