"""Adapter versions: save atomically, hot-reload into the server, retire old ones, verify.

What it does: after each GRPO step the trainer's adapter is written to a temporary directory and
renamed to `<run_dir>/adapters/policy-step-N` (so a half-written adapter is never visible under a
final name), its checksum is stored beside it, it is loaded into the server under the immutable
name `policy-step-N` (SGLang refuses to reload an existing name; vLLM's in-place reload from one
path reuses stale KV), and earlier versions are unloaded (they hold server memory). `verify`
checks the served adapter is the one just trained: the stored checksum matches the file, and the
server's logprobs of fixed probe tokens agree with the trainer's and moved from the previous
version's.

A pipelined step stages its version first (`AdapterPublisher.stage`: loaded while the rollouts
ahead still sample from the served one, not yet served); a staged version that is not then
published (its step cancelled, its load unanswered) is unloaded before the next load, on every
worker of a fleet, so a name never holds two contents.

What it does not do: train, or decide when to reload (the session does, between steps, when no
rollout is in flight, so an unload never waits).
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import SafetensorError

from ..files import fsync_path, write_atomic
from .checkpoint import ADAPTER_FILE, CheckpointError, is_complete
from ..engines import UnknownAdapterError

log = logging.getLogger(__name__)

STALE_TMP_S = 600.0  # a half-written adapter directory untouched this long is left from a crash


@dataclass
class AdapterVersion:
    """One trained adapter on disk."""

    name: str
    """Served name, `policy-step-N`."""
    path: Path
    """Final directory (inside the run directory)."""
    step: int
    """GRPO steps applied to it."""
    sha256: str | None
    """Checksum of adapter_model.safetensors, stored in `sha256.txt` beside it; None for a version
    saved with durable=False until `seal_version` has run."""


class AdapterSaveError(RuntimeError):
    """Saving an adapter failed; nothing was published under the final name."""


class AdapterMismatchError(RuntimeError):
    """The server does not serve the adapter that was just trained."""


def adapter_name(step: int) -> str:
    return f"policy-step-{step}"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_adapter_atomic(save_fn, adapters_dir: str | Path, step: int, durable: bool = True) -> AdapterVersion:
    """`save_fn(tmp_dir)` writes a PEFT adapter; publish it as `policy-step-<step>` by rename.

    durable=False leaves the checksum and the flush to disk to `seal_version`, which the step runs
    off its critical path (the trainer's checkpoint writer, before the checkpoint): the server reads
    the files from the page cache either way, and a version counts for a resume only once its
    checkpoint is complete, which is written after the seal (lora.latest_checkpoint)."""
    adapters_dir = Path(adapters_dir)
    final = adapters_dir / adapter_name(step)
    tmp = adapters_dir / f".tmp-{adapter_name(step)}-{uuid.uuid4().hex[:8]}"
    try:
        adapters_dir.mkdir(parents=True, exist_ok=True)
        save_fn(tmp)
        if not (tmp / ADAPTER_FILE).exists():
            raise AdapterSaveError(f"the trainer wrote no {ADAPTER_FILE} into {tmp}")
        digest = _write_checksum(tmp) if durable else None
        if final.exists():  # a re-run of a step after a crash: replace the stale copy
            shutil.rmtree(final)
        os.rename(tmp, final)
        if durable:
            fsync_path(adapters_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written version behind
        # safetensors reports a failed write (disk full) as SafetensorError, not OSError.
        if not isinstance(e, (OSError, SafetensorError)):
            raise
        raise AdapterSaveError(
            f"could not save adapter {adapter_name(step)} under {adapters_dir}: {e}. "
            "Free disk space or point run_dir at a writable disk; the previous adapter is still served."
        ) from e
    return AdapterVersion(adapter_name(step), final, step, digest)


def seal_version(version: AdapterVersion) -> None:
    """What save_adapter_atomic(durable=False) left out: the checksum file, and the version's files
    and its rename flushed to disk. Raises OSError (a full disk); the checkpoint writer keeps it
    off the step's critical path (rl/checkpoint.CheckpointWriter)."""
    version.sha256 = _write_checksum(version.path)
    fsync_path(version.path.parent)


def _write_checksum(folder: Path) -> str:
    """sha256 of the folder's adapter file into sha256.txt, every file of the folder and the
    folder itself flushed to disk; the digest."""
    digest = file_sha256(folder / ADAPTER_FILE)
    write_atomic(folder / "sha256.txt", digest + "\n", durable=True)  # never half a checksum on a full disk
    for file in folder.iterdir():
        if file.is_file():
            fsync_path(file)
    fsync_path(folder)
    return digest


def remove_stale_tmp(adapters_dir: str | Path, older_than_s: float = STALE_TMP_S) -> list[str]:
    """Remove `.tmp-policy-step-*` directories left by a save that crashed (killed kernel, power
    loss) and not touched for `older_than_s`: a save in progress writes into its directory, and a
    run directory has one writer. Returns the names removed."""
    removed, now = [], time.time()
    for tmp in Path(adapters_dir).glob(".tmp-policy-step-*"):
        try:
            newest = max([tmp.stat().st_mtime] + [p.stat().st_mtime for p in tmp.rglob("*")])
        except FileNotFoundError:
            continue
        if now - newest >= older_than_s:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp.name)
    if removed:
        log.warning("removed half-written adapter directories of an earlier crash: %s", sorted(removed))
    return removed


def load_version(adapters_dir: str | Path, step: int) -> AdapterVersion:
    """The saved adapter of `step`, its checksum checked against the file."""
    path = Path(adapters_dir) / adapter_name(step)
    try:
        stored = (path / "sha256.txt").read_text().strip() if (path / "sha256.txt").exists() else None
    except UnicodeDecodeError as e:
        raise AdapterMismatchError(f"{path / 'sha256.txt'} is corrupt ({e}); move {path} out of the run "
                                   "directory and resume from the checkpoint before it") from e
    if stored is None or not (path / ADAPTER_FILE).exists():
        raise AdapterSaveError(f"{path} is not a complete adapter (no {ADAPTER_FILE} or sha256.txt)")
    actual = file_sha256(path / ADAPTER_FILE)
    if actual != stored:
        raise AdapterMismatchError(f"{path}: checksum {actual[:12]} differs from the stored {stored[:12]}: "
                                   f"{path / ADAPTER_FILE} is corrupt. Move {path} out of the run directory and "
                                   "resume from the checkpoint before it (resume=True)")
    return AdapterVersion(path.name, path, step, stored)


def version_steps(adapters_dir: str | Path) -> list[int]:
    """Steps with a `policy-step-N` folder, ascending."""
    folder = Path(adapters_dir)
    steps = []
    for p in folder.glob("policy-step-*") if folder.exists() else []:
        tail = p.name.rsplit("-", 1)[1]
        if p.is_dir() and tail.isdigit():
            steps.append(int(tail))
    return sorted(steps)


def checkpoint_steps(adapters_dir: str | Path) -> list[int]:
    """Steps whose version folder holds a complete trainer checkpoint and a sealed adapter (its
    checksum file: lora.seal_version runs before the checkpoint is written), ascending."""
    folder = Path(adapters_dir)
    return [s for s in version_steps(folder)
            if is_complete(folder / adapter_name(s)) and (folder / adapter_name(s) / "sha256.txt").exists()]


def latest_checkpoint(adapters_dir: str | Path, last_step: int) -> AdapterVersion:
    """The newest adapter with a trainer checkpoint at or before `last_step` (the newest step
    with a history row: a checkpoint saved after it is redone, as it would have been without a
    loss), its checksum checked."""
    adapters = Path(adapters_dir)
    steps = [s for s in checkpoint_steps(adapters) if s <= last_step]
    if not steps:
        raise CheckpointError(f"resume=True but {adapters} holds no complete checkpoint; "
                              "start without resume or point run_dir at the run to continue")
    return load_version(adapters, max(steps))


def check_inside(path: Path, run_dir: Path) -> None:
    """Adapters are only ever loaded from inside the run directory."""
    if not Path(path).resolve().is_relative_to(Path(run_dir).resolve()):
        raise ValueError(f"refusing to load adapter {path}: it is outside the run directory {run_dir}")


@dataclass
class AdapterPublisher:
    """Keeps the server serving the newest adapter and only that (plus `keep - 1` older)."""

    client: object
    run_dir: Path
    keep: int = 1
    served: list[AdapterVersion] = field(default_factory=list)
    staged: AdapterVersion | None = None
    """A version `stage` sent to the server and no publish has served yet: the server may hold it."""
    staged_loaded: bool = False
    """Whether the server answered that it loaded `staged`."""

    @property
    def current(self) -> AdapterVersion | None:
        return self.served[-1] if self.served else None

    async def publish(self, version: AdapterVersion) -> float:
        """Load `version` into the server (unless `stage` did), then unload older versions;
        seconds taken. The load goes through `stage`, so a publish cut short during it leaves
        the version marked for unloading before the next load (a name cannot be loaded twice)."""
        t0 = time.perf_counter()
        if not (self.staged is version and self.staged_loaded):
            await self.stage(version)
        self.staged, self.staged_loaded = None, False
        self.served.append(version)
        while len(self.served) > self.keep:
            old = self.served.pop(0)
            await self._unload(old.name)
        return time.perf_counter() - t0

    async def stage(self, version: AdapterVersion) -> float:
        """Load `version` into the server without serving it yet (a pipelined step, while the
        rollouts ahead still sample from the current version): its `publish` then only unloads
        the older ones. Requests name their adapter, so nothing samples from it before then.
        Seconds taken."""
        t0 = time.perf_counter()
        await self._drop_staged()
        self.staged, self.staged_loaded = version, False  # from the request on, the server may hold it
        client = self.client
        await self._load(version, client)
        # loaded on the server that is there now, not one a restart replaced meanwhile
        self.staged_loaded = self.staged is version and self.client is client
        return time.perf_counter() - t0

    async def _drop_staged(self) -> None:
        """Unload what the server may hold staged: a version a cancelled step saved and rolled
        back (its redo saves another under the same name, and a name cannot be loaded twice), or
        one whose load failed or went unanswered (the server may have made it)."""
        if self.staged is not None:
            await self._unload(self.staged.name, quiet=True)
            self.staged, self.staged_loaded = None, False  # only now: an interrupted unload is made again

    async def clear(self) -> list[str]:
        """Unload every adapter the server holds that this publisher did not load; the names
        unloaded. A server adopted after a kernel restart (or reused by a re-run cell) still
        holds what the earlier run loaded (policy-step-K, and K+1 if it died after the load), and
        a name cannot be loaded twice: the run's first publish of that name would fail. With
        several servers each worker is cleared (they may hold different sets)."""
        mine = {v.name for v in self.served}
        cleared = []
        for client in getattr(self.client, "workers", None) or [self.client]:  # fleet.FleetClient
            for name in await client.list_adapters():
                if name not in mine:
                    try:
                        await client.unload_adapter(name)
                    except UnknownAdapterError:
                        pass
                    cleared.append(name)
        if cleared:
            log.warning("unloaded adapters an earlier run left on the server: %s", sorted(set(cleared)))
        return cleared

    async def republish(self) -> None:
        """After a server restart: load the newest version again (the server lost it).

        The newest version is remembered until a load of it succeeds: a server that dies during
        this load leaves `served` as it was, so the next restart loads it again (forgetting it
        would make the next rollouts sample from the base model)."""
        # The staged version stays marked for unloading: a fleet restarts only its dead workers,
        # and the live ones still hold it (a new server answers its unload as unknown).
        self.staged_loaded = False
        if not self.served:
            return
        newest = self.served[-1]
        await self._load(newest, self.client)
        self.served = [newest]

    async def _load(self, version: AdapterVersion, client) -> None:
        """Load `version` through `client`, only from inside the run directory."""
        check_inside(version.path, self.run_dir)
        await client.load_adapter(version.name, str(version.path.resolve()))

    async def _unload(self, name: str, quiet: bool = False) -> None:
        """Unload `name`; one the server does not hold is no error (`quiet`: a staged version,
        which a failed load or a restarted server may never have held)."""
        try:
            await self.client.unload_adapter(name)
        except UnknownAdapterError:
            log.log(logging.DEBUG if quiet else logging.WARNING, "adapter %s was already gone from the server", name)


async def probe_served_adapter(client, version: AdapterVersion, probe_ids: list[int], trainer_logps: list[float],
                               previous_logps: list[float] | None, tol: float) -> dict:
    """Compare the server's logprobs of `probe_ids` under `version` with the trainer's.

    The adapter is the one just trained when the server agrees with the trainer (mean absolute
    difference below `tol`) and, if a previous version was probed, the logprobs moved.
    """
    served = await client.score(probe_ids, adapter=version.name)
    diffs = [abs(a - b) for a, b in zip(served, trainer_logps) if a is not None and math.isfinite(a)]
    mad = sum(diffs) / max(len(diffs), 1)
    moved = None
    if previous_logps is not None:
        moved = sum(abs(a - b) for a, b in zip(trainer_logps, previous_logps)) / max(len(trainer_logps), 1)
    result = {"probe_mad": mad, "probe_moved": moved}
    if mad > tol:
        raise AdapterMismatchError(
            f"the server's logprobs under {version.name} differ from the trainer's by {mad:.4f} on average "
            f"(tolerance {tol}): the served adapter is not the one just trained. Check that requests select the "
            "adapter (SGLang: lora_path or model 'base:adapter') and that the server's LoRA target modules "
            "match the trainer's.")
    return result


class MaskedScorer:
    """Adapts `client.score` to return only the probe's model-token positions."""

    def __init__(self, client, mask, temperature):
        self.client, self.mask, self.temperature = client, mask, temperature

    async def score(self, ids, adapter=None):
        lps = await self.client.score(ids, adapter=adapter, temperature=self.temperature)
        return [x for x, m in zip(lps, self.mask) if m]


def probe_trajectory(groups):
    """The first trajectory of a step with model tokens: what the served adapter is checked on."""
    for g in groups:
        for t in g.trajectories:
            if t.error is None and sum(t.completion_mask) > 0:
                return t
    return None
