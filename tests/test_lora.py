"""Adapter versions: atomic save, checksums, run-dir confinement, publish/unload order."""
import asyncio
import errno
from pathlib import Path

import pytest

from artsg_nb.rl.lora import (AdapterMismatchError, AdapterPublisher, AdapterSaveError, check_inside,
                           load_version, save_adapter_atomic, seal_version)


def _fake_save(tmp):
    tmp.mkdir(parents=True)
    (tmp / "adapter_config.json").write_text("{}")
    (tmp / "adapter_model.safetensors").write_bytes(b"weights")


def test_save_is_atomic_and_checksummed(tmp_path):
    v = save_adapter_atomic(_fake_save, tmp_path / "adapters", 3)
    assert v.name == "policy-step-3" and v.path.name == "policy-step-3"
    assert (v.path / "sha256.txt").read_text().strip() == v.sha256
    assert load_version(tmp_path / "adapters", 3).sha256 == v.sha256
    assert not [p for p in (tmp_path / "adapters").iterdir() if p.name.startswith(".tmp")]


def test_a_version_saved_for_the_server_first_is_checksummed_when_sealed(tmp_path):
    """durable=False (the step's reload): the files under the final name at once, the checksum and
    the flush to disk later (seal_version, in the checkpoint writer's thread); until then the version
    is not complete for a resume."""
    v = save_adapter_atomic(_fake_save, tmp_path / "adapters", 4, durable=False)
    assert (v.path / "adapter_model.safetensors").read_bytes() == b"weights" and v.sha256 is None
    assert not (v.path / "sha256.txt").exists()
    with pytest.raises(AdapterSaveError, match="not a complete adapter"):
        load_version(tmp_path / "adapters", 4)
    seal_version(v)
    assert v.sha256 and load_version(tmp_path / "adapters", 4).sha256 == v.sha256


def test_disk_error_leaves_no_adapter_behind(tmp_path):
    def failing(tmp):
        tmp.mkdir(parents=True)
        (tmp / "adapter_model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(AdapterSaveError, match="No space left.*Free disk space"):
        save_adapter_atomic(failing, tmp_path / "adapters", 1)
    assert list((tmp_path / "adapters").iterdir()) == []


def test_corrupted_adapter_is_refused(tmp_path):
    v = save_adapter_atomic(_fake_save, tmp_path, 2)
    (v.path / "adapter_model.safetensors").write_bytes(b"tampered")
    with pytest.raises(AdapterMismatchError, match="checksum"):
        load_version(tmp_path, 2)


def test_adapters_only_from_inside_the_run_dir(tmp_path):
    check_inside(tmp_path / "a" / "b", tmp_path)
    with pytest.raises(ValueError, match="outside the run directory"):
        check_inside(tmp_path.parent / "elsewhere", tmp_path)


class _RecordingClient:
    def __init__(self):
        self.calls = []

    async def load_adapter(self, name, path):
        self.calls.append(("load", name))
        return 0.01

    async def unload_adapter(self, name):
        self.calls.append(("unload", name))


def test_publish_loads_new_then_unloads_old(tmp_path):
    client = _RecordingClient()
    pub = AdapterPublisher(client, tmp_path)
    for step in range(3):
        asyncio.run(pub.publish(save_adapter_atomic(_fake_save, tmp_path / "adapters", step)))
    assert client.calls == [("load", "policy-step-0"), ("load", "policy-step-1"), ("unload", "policy-step-0"),
                            ("load", "policy-step-2"), ("unload", "policy-step-1")]
    assert pub.current.name == "policy-step-2"
    asyncio.run(pub.republish())  # after a server restart only the newest comes back
    assert client.calls[-1] == ("load", "policy-step-2")


def test_a_failed_republish_keeps_the_version(tmp_path):
    """A server that dies during the republish: the version stays current, so the next restart
    loads it again (forgetting it made the next rollouts sample from the base model)."""
    client = _RecordingClient()
    pub = AdapterPublisher(client, tmp_path)
    asyncio.run(pub.publish(save_adapter_atomic(_fake_save, tmp_path / "adapters", 1)))

    async def dead(name, path):
        raise ConnectionError("the server died again")

    client.load_adapter = dead
    with pytest.raises(ConnectionError):
        asyncio.run(pub.republish())
    assert pub.current is not None and pub.current.name == "policy-step-1"


def test_a_staged_version_is_loaded_before_and_only_served_at_its_publish(tmp_path):
    """A pipelined step stages its new version (loaded while the rollouts ahead still sample from
    the served one); the publish then only unloads the older version."""
    client = _RecordingClient()
    pub = AdapterPublisher(client, tmp_path)
    v0, v1 = (save_adapter_atomic(_fake_save, tmp_path / "adapters", s) for s in (0, 1))
    asyncio.run(pub.publish(v0))
    asyncio.run(pub.stage(v1))
    assert client.calls[-1] == ("load", "policy-step-1") and pub.current is v0, "staged, not served"
    asyncio.run(pub.publish(v1))
    assert client.calls == [("load", "policy-step-0"), ("load", "policy-step-1"), ("unload", "policy-step-0")]
    assert pub.current is v1 and pub.staged is None


def test_a_staged_version_left_by_a_cancelled_step_is_unloaded_before_its_redo(tmp_path):
    """A step cancelled after staging rolls back; its redo saves a new version under the same name,
    which the server refuses while it holds the old one."""
    client = _RecordingClient()
    pub = AdapterPublisher(client, tmp_path)
    asyncio.run(pub.publish(save_adapter_atomic(_fake_save, tmp_path / "adapters", 0)))
    asyncio.run(pub.stage(save_adapter_atomic(_fake_save, tmp_path / "adapters", 1)))
    redo = save_adapter_atomic(_fake_save, tmp_path / "adapters", 1)
    asyncio.run(pub.stage(redo))
    assert client.calls[-2:] == [("unload", "policy-step-1"), ("load", "policy-step-1")]
    asyncio.run(pub.publish(redo))
    assert client.calls[-1] == ("unload", "policy-step-0") and pub.current is redo


def test_a_staging_that_failed_is_unloaded_before_the_publish_loads_it(tmp_path):
    """A load whose answer was lost may still have been made: the publish unloads the name
    first, so the server never keeps an unknown version under it."""
    client = _RecordingClient()
    pub = AdapterPublisher(client, tmp_path)
    v1 = save_adapter_atomic(_fake_save, tmp_path / "adapters", 1)
    recording = client.load_adapter

    async def lost(name, path):
        await recording(name, path)
        raise TimeoutError("the answer was lost")

    asyncio.run(pub.publish(save_adapter_atomic(_fake_save, tmp_path / "adapters", 0)))
    client.load_adapter = lost
    with pytest.raises(TimeoutError):
        asyncio.run(pub.stage(v1))
    client.load_adapter = recording
    asyncio.run(pub.publish(v1))
    assert client.calls[1:] == [("load", "policy-step-1"), ("unload", "policy-step-1"), ("load", "policy-step-1"),
                                ("unload", "policy-step-0")]
    assert pub.current is v1


def test_a_restart_leaves_the_staged_version_to_be_unloaded(tmp_path):
    """A restarted server holds nothing staged, but a fleet restarts only its dead workers: the
    live ones still hold it, so its name is unloaded (on every worker) before it is loaded again."""
    client = _RecordingClient()
    pub = AdapterPublisher(client, tmp_path)
    asyncio.run(pub.publish(save_adapter_atomic(_fake_save, tmp_path / "adapters", 0)))
    v1 = save_adapter_atomic(_fake_save, tmp_path / "adapters", 1)
    asyncio.run(pub.stage(v1))
    asyncio.run(pub.republish())
    asyncio.run(pub.publish(v1))
    assert client.calls[-4:] == [("load", "policy-step-0"), ("unload", "policy-step-1"), ("load", "policy-step-1"),
                                 ("unload", "policy-step-0")]


class _ImmutableWorker:
    """A fleet worker: a name loaded twice is refused; what each name holds is kept."""

    engine = "sglang"

    def __init__(self):
        self.held = {}

    async def load_adapter(self, name, path):
        from artsg_nb.engines import AdapterExistsError
        if name in self.held:
            raise AdapterExistsError(f"{name} is already loaded")
        self.held[name] = (Path(path) / "adapter_model.safetensors").read_bytes()
        return 0.01

    async def unload_adapter(self, name):
        from artsg_nb.engines import UnknownAdapterError
        if self.held.pop(name, None) is None:
            raise UnknownAdapterError(f"{name} is not loaded")


def test_a_fleet_serves_the_redo_not_a_cancelled_step_staged_before_a_worker_restarted(tmp_path):
    """Step 1 is staged on both workers, then cancelled (the trainer rolls back); worker B dies and
    is restarted; the redo's version, under the same name, must replace the cancelled one on A."""
    from artsg_nb.serving.fleet import FleetClient

    def save(weights):
        def write(tmp):
            tmp.mkdir(parents=True)
            (tmp / "adapter_model.safetensors").write_bytes(weights)
        return write

    a, b = _ImmutableWorker(), _ImmutableWorker()
    pub = AdapterPublisher(FleetClient(None, front=a, workers=[a, b]), tmp_path)
    adapters = tmp_path / "adapters"
    asyncio.run(pub.publish(save_adapter_atomic(save(b"w0"), adapters, 0)))
    asyncio.run(pub.stage(save_adapter_atomic(save(b"cancelled"), adapters, 1)))
    b.held.clear()  # B died and was restarted; A lives on
    asyncio.run(pub.republish())
    redo = save_adapter_atomic(save(b"redo"), adapters, 1)
    asyncio.run(pub.stage(redo))
    asyncio.run(pub.publish(redo))
    assert a.held == b.held == {"policy-step-1": b"redo"}


def test_a_fleet_unload_waits_for_every_worker_and_only_a_name_none_holds_is_unknown(tmp_path):
    from artsg_nb.engines import UnknownAdapterError
    from artsg_nb.serving.fleet import FleetClient
    a, b = _ImmutableWorker(), _ImmutableWorker()
    a.held["x"] = b"w"
    client = FleetClient(None, front=a, workers=[a, b])
    asyncio.run(client.unload_adapter("x"))  # B never held it
    assert a.held == {}
    with pytest.raises(UnknownAdapterError):
        asyncio.run(client.unload_adapter("x"))


def test_an_interrupted_unload_of_a_staged_version_is_made_again(tmp_path):
    client = _RecordingClient()
    pub = AdapterPublisher(client, tmp_path)
    asyncio.run(pub.publish(save_adapter_atomic(_fake_save, tmp_path / "adapters", 0)))
    asyncio.run(pub.stage(save_adapter_atomic(_fake_save, tmp_path / "adapters", 1)))  # then the step is cancelled
    recording = client.unload_adapter

    async def interrupted(name):
        raise asyncio.CancelledError  # the redo interrupted while it unloads the cancelled version

    client.unload_adapter = interrupted
    redo = save_adapter_atomic(_fake_save, tmp_path / "adapters", 1)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(pub.stage(redo))
    client.unload_adapter = recording
    asyncio.run(pub.stage(redo))
    assert client.calls[-2:] == [("unload", "policy-step-1"), ("load", "policy-step-1")]
