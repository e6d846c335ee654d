"""The trainer's update with the server's GPU memory released around it (RunConfig.release_memory).

What it does: `train_released(trainer, groups, supervisor, release, tags)` runs
trainer.train_step: with `release` on (one shared GPU) the server gives its memory back before
and takes it again after, so the trainer gets the GPU. A failed release raises before anything is
trained (the step can run again); a server that died is restarted as in rollouts (a fresh one has
nothing to resume). If training fails, the memory is taken back before the error goes up. With
`release` off it is trainer.train_step, timed. The watchdog sends no /health probe meanwhile.

What it does not do: decide when a step trains (session.py, pipeline.py) or speak the release
routes (engines/). It is handed the trainer and the supervisor (the server's client, restarts and
watchdog); it knows nothing of the run above it.
"""
from __future__ import annotations

import logging
import time

from .supervisor import ServerSupervisor

log = logging.getLogger(__name__)


async def _resume(trainer, supervisor: ServerSupervisor, take_again) -> float:
    """The server takes its memory back; the trainer's cached GPU memory (it sized its micro-batches
    from what the server gave back) is returned to the device first, and a failure there does not
    keep the server from resuming."""
    try:
        trainer.release_cached_memory()
    except Exception as e:
        log.error("could not empty the trainer's GPU memory cache before the server resumes: %s", e)
    return await supervisor.with_restarts(take_again)


async def train_released(trainer, groups, supervisor: ServerSupervisor, release: bool,
                         tags) -> tuple[dict, float, tuple]:
    """(metrics, train_s, (release_s, resume_s)); the pair is (None, None) when release is off."""
    with supervisor.watchdog.paused():  # no /health probes while the memory is released
        return await _train(trainer, groups, supervisor, release, tags)


async def _train(trainer, groups, supervisor: ServerSupervisor, release: bool, tags) -> tuple[dict, float, tuple]:
    give_back = lambda: supervisor.client.release_memory(tags)  # noqa: E731  (the client after a restart)
    take_again = lambda: supervisor.client.resume_memory()  # noqa: E731
    release_s = await supervisor.with_restarts(give_back) if release else None
    t0 = time.perf_counter()
    try:
        metrics = trainer.train_step(groups)
    except BaseException:
        if release:
            try:
                await _resume(trainer, supervisor, take_again)
            except Exception as e:  # the training error is the one to report
                log.error("could not resume the server's memory after a failed training step: %s", e)
        raise
    train_s = time.perf_counter() - t0
    resume_s = await _resume(trainer, supervisor, take_again) if release else None
    return metrics, train_s, (release_s, resume_s)
