"""The trainer's update with the server's GPU memory released around it (RunConfig.release_memory).

What it does: `ReleasedTraining`, mixed into session.GRPORun, supplies `_train(groups)`: with
`release` on (one shared GPU) the server gives its memory back before trainer.train_step and
takes it again after, so the trainer gets the GPU. A failed release raises before anything is
trained (the step can run again); a server that died is restarted as in rollouts (a fresh one has
nothing to resume). If training fails, the memory is taken back before the error goes up. With
`release` off it is trainer.train_step, timed.

What it does not do: decide when a step trains (session.py, pipeline.py) or speak the release
routes (engines/). It uses the run's cfg, client, trainer, release, watchdog and _with_restarts.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class ReleasedTraining:
    """`_train`: trainer.train_step, with the server's memory released around it when `self.release`."""

    async def _train(self, groups) -> tuple[dict, float, tuple]:
        """(metrics, train_s, (release_s, resume_s)); the pair is (None, None) when release is off."""
        with self.watchdog.paused():  # no /health probes while the memory is released
            return await self._train_released(groups)

    async def _train_released(self, groups) -> tuple[dict, float, tuple]:
        release = lambda: self.client.release_memory(self.cfg.release_tags)  # noqa: E731
        resume = lambda: self.client.resume_memory()  # noqa: E731  (self.client after a restart)
        release_s = await self._with_restarts(release) if self.release else None
        t0 = time.perf_counter()
        try:
            metrics = self.trainer.train_step(groups)
        except BaseException:
            if self.release:
                try:
                    await self._with_restarts(resume)
                except Exception as e:  # the training error is the one to report
                    log.error("could not resume the server's memory after a failed training step: %s", e)
            raise
        train_s = time.perf_counter() - t0
        resume_s = await self._with_restarts(resume) if self.release else None
        return metrics, train_s, (release_s, resume_s)
