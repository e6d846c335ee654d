"""What a trainer checkpoint holds on disk besides the adapter: the optimizer state as
safetensors (tensors) plus JSON (param groups, scalars, step, RNG, config), the error a corrupt or
foreign checkpoint raises, naming the file and what to do, and the writer that puts a checkpoint on
disk off the step's critical path.

A version folder `policy-step-N/` holds the adapter the server loads and, in its `trainer/` folder,
the checkpoint: SGLang reads every `*.safetensors` file at the top of an adapter folder as weights
(DefaultModelLoader's glob), so the optimizer state beside the adapter was read, twice the adapter's
bytes, on every reload. Runs saved before 2026-12-05 have the checkpoint beside the adapter; they are
still read (`checkpoint_dir`). A checkpoint is complete when its `trainer_state.json` exists:
`write_checkpoint` writes the optimizer file first (fsynced) and the state file last, by rename, so
a write cut short (killed kernel, full disk) leaves a version that resume skips
(lora.latest_checkpoint).

`CheckpointWriter` (issue 26, reload <= 0.1 s): the server needs only the adapter, so the step
saves the adapter, hands one background thread the function that takes a `CheckpointSnapshot`
(the optimizer state copied into CPU memory, ~10 ms from a GPU), and goes on to reload; the copy
is made and the optimizer state, twice the adapter's size, written while the reload and the next
step's rollouts run. The trainer's next optimizer step waits until the copy is made
(`wait_taken`), and a copy that failed raises there. One write at a time, in order; a
failed write (a full disk: OSError, safetensors' error) is logged and its snapshot kept in memory, so
a rollback to that version still works; any other exception is a bug and is raised where the writer
is waited for.

What it does not do: decide what is saved when (trainer.py, lora.py, run/session.py).
"""
from __future__ import annotations

import copy
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError

from ..files import fsync_path, write_atomic
from .tensor_io import host_copies, save_tensors

log = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
TRAINER_DIR = "trainer"
"""A version's checkpoint folder (module docstring: why not beside the adapter)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or from a different configuration."""


def checkpoint_dir(version: str | Path) -> Path:
    """Where the checkpoint of the version folder `version` is: its `trainer/` folder, or the
    version folder itself for a run saved before the checkpoint moved there."""
    version = Path(version)
    legacy = not (version / TRAINER_DIR).is_dir() and (version / STATE_FILE).exists()
    return version if legacy else version / TRAINER_DIR


def is_complete(version: str | Path) -> bool:
    """Whether the version folder holds a complete checkpoint (its state file is written last)."""
    return (checkpoint_dir(version) / STATE_FILE).exists()


def read_checkpoint_file(file: Path, read, version: Path):
    """`read(file)`, a corrupt file (truncated, garbage: safetensors' "header too large",
    UnicodeDecodeError, bad JSON) turned into a CheckpointError naming it and what to do with its
    version folder `version`."""
    try:
        return read(file)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 — safetensors raises its own SafetensorError
        raise CheckpointError(
            f"checkpoint file {file} is corrupt and cannot be read ({type(e).__name__}: {e}). Nothing was "
            f"restored. Try: move {version} out of the run directory and resume again (resume=True "
            "continues from the newest complete checkpoint before it), or start a new run directory.") from e


def optimizer_state(opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(the optimizer's live state tensors, meta: its param groups and scalars, copied now): what
    optimizer.safetensors (once `host_copies` has copied the tensors: they change with the next
    optimizer step) and the state file's `optimizer` entry hold."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"state.{pid}.{k}"] = v
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, copy.deepcopy({"param_groups": sd["param_groups"], "scalars": scalars})


def optimizer_from_tensors(opt: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    state: dict = {}
    for name, v in tensors.items():
        if name.startswith("state."):
            _, pid, k = name.split(".", 2)
            state.setdefault(int(pid), {})[k] = v
    for key, v in meta["scalars"].items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


@dataclass(frozen=True)
class CheckpointSnapshot:
    """A trainer's resumable state besides its adapter, copied into CPU memory at one step."""

    tensors: dict[str, torch.Tensor]
    """optimizer.safetensors: the optimizer's tensors (`state.<param>.<name>`) and `rng.torch`."""
    state: dict
    """trainer_state.json: step, optimizer meta, Python RNG state, trainer config (JSON-ready)."""


def write_checkpoint(snapshot: CheckpointSnapshot, version: str | Path, before: Callable[[], None] | None = None) -> None:
    """`snapshot` into the `trainer/` folder of the version folder `version`, after `before()` (the
    adapter's checksum and flush to disk: lora.seal_version): the optimizer file, fsynced, then the
    state file by rename, so the state file exists only beside a complete optimizer file and a
    sealed adapter."""
    if before is not None:
        before()
    folder = Path(version) / TRAINER_DIR
    folder.mkdir(exist_ok=True)
    save_tensors(snapshot.tensors, folder / OPTIMIZER_FILE)
    fsync_path(folder / OPTIMIZER_FILE)
    write_atomic(folder / STATE_FILE, json.dumps(snapshot.state), durable=True)


class CheckpointWriter:
    """Writes one trainer's checkpoints in a background thread, one at a time (module docstring)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._newest: tuple[Path, CheckpointSnapshot | None, Callable[[], None] | None] | None = None  # kept until written
        self._taken: threading.Event | None = None  # set once the newest snapshot is copied (or its copy failed)
        self._closed = False
        self.failed: Path | None = None
        """The version folder whose checkpoint could not be written (its snapshot is kept)."""

    def submit(self, take: Callable[[], CheckpointSnapshot], version: str | Path,
               before: Callable[[], None] | None = None) -> None:
        """In the background, after the write before it: `take()` (the snapshot, copied into CPU
        memory: `wait_taken` tells when), then `before()` (the adapter's checksum and flush to
        disk: lora.seal_version), then the snapshot written into `version`, so the checkpoint is
        complete only once the seal is done. `before` failing for want of disk counts as a failed write."""
        if self._closed:
            raise CheckpointError(f"the checkpoint of {Path(version).name} was not written: its trainer is closed "
                                  "(GRPORun.stop()). Try: start() the run again, resume=True continues it")
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="artsg-checkpoint")
        self._newest, self.failed = (Path(version), None, before), None
        self._taken = threading.Event()
        self._pending = self._pool.submit(self._take_and_write, take, Path(version), before, self._taken)

    def _take_and_write(self, take: Callable[[], CheckpointSnapshot], version: Path,
                        before: Callable[[], None] | None, taken: threading.Event) -> None:
        try:
            snapshot = take()
            self._newest = (version, snapshot, before)
        finally:
            taken.set()
        write_checkpoint(snapshot, version, before)

    def wait_taken(self) -> None:
        """Block until the newest submitted snapshot has been copied (what it copies may change
        after). A copy that failed raises its error here, before the caller changes anything."""
        if self._taken is None:
            return
        self._taken.wait()
        if self._newest is not None and self._newest[1] is None:  # take() raised: wait() raises it
            self.wait()

    def wait(self) -> None:
        """Block until the newest checkpoint is on disk. A write that failed for want of disk is
        logged, not raised: the run goes on (its adapter is saved and served) and a resume starts
        from the checkpoint before it; its partial files are removed and its snapshot stays
        (`unwritten`). Any other exception is raised here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except (OSError, SafetensorError) as e:
            self._keep_unwritten(e)
        else:
            self._newest = None  # on disk: the copy in memory is not needed

    def _keep_unwritten(self, error: Exception) -> None:
        version = self.failed = self._newest[0]
        folder = version / TRAINER_DIR
        for name in (OPTIMIZER_FILE, STATE_FILE):  # write_atomic removes its own temporary file
            (folder / name).unlink(missing_ok=True)
        log.warning("the checkpoint of %s could not be written (%s: %s); the run goes on with its adapter "
                    "served, a resume would start from the checkpoint before it. Try: free disk space "
                    "under %s", version.name, type(error).__name__, error, version.parent)

    def unwritten(self, version: str | Path) -> CheckpointSnapshot | None:
        """The snapshot of `version` when its write failed (a rollback to that version restores it
        from memory), else None."""
        self.wait()
        if self.failed is not None and self._newest is not None and self.failed == Path(version):
            return self._newest[1]
        return None

    def persist(self, version: str | Path) -> None:
        """Write the unwritten checkpoint of `version` now, synchronously (raising if it fails
        again): for readers that only read disk, e.g. the other ranks of a RankedTrainer."""
        snapshot = self.unwritten(version)
        if snapshot is None:
            return
        try:
            write_checkpoint(snapshot, version, self._newest[2])  # the seal first, as on the first try
        except (OSError, SafetensorError) as e:
            raise CheckpointError(
                f"the checkpoint of {Path(version).name} is only in memory and cannot be written ({e}); the other "
                f"trainer ranks read it from disk. Try: free disk space under {Path(version).parent} and run the "
                "step again, or resume=True from the newest complete checkpoint") from e
        self.failed = self._newest = None

    def close(self) -> None:
        """Wait for the newest write, then stop the thread; later submits are refused."""
        self._closed = True
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
