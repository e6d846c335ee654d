"""What a new run does with a run directory that an earlier run, or a live one, already uses.

What it does: `archive_earlier_run(run_dir)` moves everything an earlier run left there (history,
rollouts, adapters and their checkpoints, plots, tracker logs, config) into a dated folder
`<run_dir>/archive/<YYYYmmdd-HHMMSS>/` and prints one line saying so, so that a fresh start
(`resume=False`) never mixes the earlier run's steps into the new one's samples, plots or
adapters. What stays in place is what belongs to the directory rather than to one run: the
one-writer lock, the server records (a live server may be adopted or reused) and the append-only
logs (each start writes its own header). `take_over(run)` lets a notebook re-run its start cell:
a run of the same directory that this kernel started and never stopped is stopped first (its
single server kept when the configuration is the same, so the new run reuses it) instead of the
lock refusing the new one.
`stopped_line` / `resumed_line` are the one line a run prints when it stops or resumes.

What it does not do: lock the directory (serving.procs.RunDirLock), resume a run
(`resume=True`: session.GRPORun), or delete anything: archives are left for the user to remove.
"""
from __future__ import annotations

import contextlib
import io
import time
import weakref
from dataclasses import fields
from pathlib import Path

from ..serving.procs import RunDirBusyError
from ..serving.server import Server

ARCHIVE_DIR = "archive"
LOCK_FILE = ".lock"
RUN_MARKERS = ("history.jsonl", "adapters", "rollouts")
"""A directory holding one of these holds an earlier run's steps (an empty history does not count)."""

_live_runs: "weakref.WeakValueDictionary[Path, object]" = weakref.WeakValueDictionary()
"""run_dir (resolved) -> the run this process started on it last (see take_over)."""


RUN_ENTRIES = frozenset({"adapters", "rollouts", "checkpoints", "config.json", "history.jsonl", "training.png",
                         "tensorboard", "mlruns", "wandb", "trackio"})
"""What a run writes into its directory (besides `history.<stamp>.jsonl` set aside by History and an
executed notebook, `*.executed.ipynb`): what a fresh start moves into the archive."""


def stays_in_place(path: Path) -> bool:
    """Whether `path` (an entry of a run dir) stays where it is at a fresh start: everything that
    is not one run's (RUN_ENTRIES) — the archive itself, the lock, the server records and the
    server/trainer logs (appended to), and whatever else the user keeps in that folder (a run dir
    may be a notebook's own folder: its notebooks and data are never moved)."""
    name = path.name
    return not (name in RUN_ENTRIES or (name.startswith("history.") and name.endswith(".jsonl"))
                or name.endswith(".executed.ipynb"))


def holds_earlier_run(run_dir: str | Path) -> bool:
    """Whether `run_dir` holds steps of an earlier run (a non-empty history, a saved adapter version
    or rollouts). Half-written `.tmp-*` adapter folders alone are no run: a crashed save leaves them,
    and the start removes the stale ones (lora.remove_stale_tmp) instead of archiving them."""
    run_dir = Path(run_dir)
    history = run_dir / "history.jsonl"
    adapters = run_dir / "adapters"
    saved = adapters.is_dir() and any(not p.name.startswith(".tmp-") for p in adapters.iterdir())
    return (history.exists() and history.stat().st_size > 0) or saved or (run_dir / "rollouts").is_dir()


def archive_earlier_run(run_dir: str | Path, stamp: str | None = None) -> Path | None:
    """Move an earlier run out of `run_dir` into `run_dir/archive/<stamp>/` and print where; the
    archive folder, or None when there was no earlier run (nothing is moved then). `stamp`
    defaults to the local time, YYYYmmdd-HHMMSS; a second archive in the same second gets "-1"."""
    run_dir = Path(run_dir)
    if not holds_earlier_run(run_dir):
        return None
    target = _free_name(run_dir / ARCHIVE_DIR, stamp or time.strftime("%Y%m%d-%H%M%S"))
    target.mkdir(parents=True)
    moved = [p for p in sorted(run_dir.iterdir()) if not stays_in_place(p)]
    for path in moved:
        path.rename(target / path.name)
    print(f"{run_dir} held an earlier run: moved it ({len(moved)} entries: history, rollouts, adapters, ...) "
          f"to {target}. To continue a run instead, start it with resume=True.", flush=True)
    return target


def _free_name(parent: Path, stamp: str) -> Path:
    target, n = parent / stamp, 1
    while target.exists():  # two fresh starts within one second
        target, n = parent / f"{stamp}-{n}", n + 1
    return target


def take_over(run) -> None:
    """Before `run` (a GRPORun) takes its directory's lock: stop the run of the same directory
    that this process started and has not stopped (a re-run start cell), keeping its server when
    it is a single one and the configuration is the same (start_server then hands that live
    server to the new run); then remember `run` as the directory's run. A run in the middle of a step is
    not stopped under it: RunDirBusyError says how to go on."""
    key = Path(run.run_dir).resolve()
    old = _live_runs.get(key)
    if old is not None and old is not run and _holds_lock(old):
        if getattr(old, "in_step", False):  # from a step's start to its end (session.GRPORun.in_step)
            raise RunDirBusyError(
                f"{run.run_dir} is used by a run of this kernel that is in the middle of a step. "
                "Try: wait for that step (or interrupt it), then start again; or use another run_dir.")
        server = old.server
        kept = isinstance(server, Server) and server.alive() and _same_config(old.cfg, run.cfg)
        if kept:
            old.server = None  # old.stop() leaves it running; start_server gives it to the new run
        step = getattr(getattr(old, "trainer", None), "step", None)
        with contextlib.redirect_stdout(io.StringIO()):  # its own "stopped ..." line: this one says it
            old.stop()
        at = f" at step {step}" if step is not None else ""
        print(f"{run.run_dir}: took over from the run this kernel started there earlier (stopped it{at}"
              f"{', kept its server' if kept else ''}).", flush=True)
    _live_runs[key] = run


def _same_config(a, b) -> bool:
    """Whether two RunConfigs would start the same server and run (resume aside): only then is
    the old run's server kept for the new one (a changed one would be left running unused)."""
    return ({f.name: getattr(a, f.name) for f in fields(a) if f.name != "resume"}
            == {f.name: getattr(b, f.name) for f in fields(b) if f.name != "resume"})


def _holds_lock(run) -> bool:
    lock = getattr(run, "_lock", None)
    return bool(lock is not None and lock.held)


def stopped_line(run_dir: str | Path, step: int, server_stopped: bool) -> str:
    """The one line a run prints when it stops: where it stopped and how to go on."""
    server = "server stopped; " if server_stopped else ""
    return (f"stopped {run_dir} at step {step}: {server}adapters and history stay there. "
            "To go on: RunConfig(..., resume=True).")


def resumed_line(run_dir: str | Path, step: int, adapter: str) -> str:
    """The one line a resumed run prints: which step it continues from."""
    return f"resumed {run_dir} at step {step} ({adapter}): the next step is {step + 1}."
