"""The trainer's update with the server's GPU memory released around it (RunConfig.release_memory).

What it does: `train_released(trainer, groups, supervisor, release, tags)` runs
trainer.train_step: with `release` on (one shared GPU) the server gives its memory back before
and takes it again after, so the trainer gets the GPU. A failed release raises before anything is
trained (the step can run again); a server that died is restarted as in rollouts (a fresh one has
nothing to resume). If training fails, the failed update's tensors are freed and the memory taken
back before the error goes up. With
`release` off it is trainer.train_step, timed (the run's PhaseClock: phases release, train,
resume). The watchdog sends no /health probe meanwhile.

What it does not do: decide when a step trains (step.py, pipeline.py) or speak the release
routes (engines/). It is handed the trainer and the supervisor (the server's client, restarts and
watchdog); it knows nothing of the run above it.
"""
from __future__ import annotations

import logging
import traceback

from .clock import PhaseClock
from .results import Update
from .supervisor import ServerSupervisor

log = logging.getLogger(__name__)


async def _resume(trainer, supervisor: ServerSupervisor, take_again, clock: PhaseClock) -> float:
    """The server takes its memory back; the trainer's cached GPU memory (it sized its micro-batches
    from what the server gave back) is returned to the device first, and a failure there does not
    keep the server from resuming."""
    try:
        trainer.release_cached_memory()
    except Exception as e:
        log.error("could not empty the trainer's GPU memory cache before the server resumes: %s", e)
    with clock.phase("resume"):
        return await supervisor.with_restarts(take_again)  # the engine client's own seconds


async def train_released(trainer, groups, supervisor: ServerSupervisor, release: bool, tags,
                         clock: PhaseClock) -> Update:
    """The update (nothing saved yet); release_s and resume_s are None when release is off."""
    with supervisor.watchdog.paused():  # no /health probes while the memory is released
        return await _train(trainer, groups, supervisor, release, tags, clock)


async def _train(trainer, groups, supervisor: ServerSupervisor, release: bool, tags, clock: PhaseClock) -> Update:
    give_back = lambda: supervisor.client.release_memory(tags)  # noqa: E731  (the client after a restart)
    take_again = lambda: supervisor.client.resume_memory()  # noqa: E731
    release_s = None
    if release:
        with clock.phase("release"):
            release_s = await supervisor.with_restarts(give_back)  # the engine client's own seconds
    try:
        with clock.phase("train") as lap:
            metrics = trainer.train_step(groups)
    except BaseException as e:
        failed = e
    else:
        failed = None
    if failed is not None:
        if release:
            await _resume_after_failure(trainer, supervisor, take_again, clock, failed)
        raise failed
    resume_s = await _resume(trainer, supervisor, take_again, clock) if release else None
    return Update(metrics, lap.seconds, release_s, resume_s)


async def _resume_after_failure(trainer, supervisor: ServerSupervisor, take_again, clock: PhaseClock,
                                failed: BaseException) -> None:
    """The server takes its memory back after a failed update. The failure's traceback holds the
    update's frames, and they its activations (at 14B on an H100, 25 GiB that the server's resume
    then did not find: it died, and so did its restart): their locals are dropped first, outside
    the except block (the traceback's lines stay)."""
    seen = failed
    while seen is not None:  # and those of the errors it was raised from or during
        traceback.clear_frames(seen.__traceback__)
        seen = seen.__cause__ or seen.__context__
    try:
        await _resume(trainer, supervisor, take_again, clock)
    except Exception as e:  # the training error is the one to report
        log.error("could not resume the server's memory after a failed training step: %s", e)
