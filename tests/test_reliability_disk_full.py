"""An adapter save that fails inside safetensors (a real write error, not a simulated OSError).

safetensors raises its own SafetensorError ("Error while serializing: I/O error: ..."), not
OSError. The write error here is real: the process's file-size limit (RLIMIT_FSIZE, with SIGXFSZ
ignored) makes the kernel refuse the write, as a full disk does (EFBIG instead of ENOSPC, the same
path through safetensors). Checked: save_adapter_atomic turns it into AdapterSaveError and leaves
nothing under the final name; a run's step whose save fails rolls the trainer back to the served
version, and running the step again gives history [1, 2] (before: the error escaped the rollback,
history went on [1, 3], and step 3 trained on policy-step-1's rollouts with step 2's update held).
"""
from __future__ import annotations

import asyncio
import errno
import resource
import signal
import threading
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import save_file

from artsg_nb.rl.lora import AdapterSaveError, save_adapter_atomic
from artsg_nb.run.session import GRPORun, RunConfig
from scripted_tasks import SCRIPTED


@contextmanager
def file_size_limit(n_bytes: int):
    """Writes past `n_bytes` fail with EFBIG in this process (a real write error)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def test_safetensors_write_error_is_an_adapter_save_error(tmp_path):
    def save_fn(tmp):
        tmp.mkdir()
        with file_size_limit(4096):
            save_file({"w": torch.zeros(100_000)}, str(tmp / "adapter_model.safetensors"))

    with pytest.raises(AdapterSaveError, match="could not save adapter policy-step-2") as err:
        save_adapter_atomic(save_fn, tmp_path / "adapters", 2)
    assert type(err.value.__cause__).__name__ == "SafetensorError"
    assert list((tmp_path / "adapters").iterdir()) == []  # no final name, no half-written tmp


@pytest.mark.parametrize("pipeline", [False, True], ids=["sync", "pipelined"])
def test_step_whose_save_fails_in_safetensors_is_rolled_back(tmp_path, tiny_model_dir, pipeline):
    # pipelined: the save runs in the update's worker thread while the next rollouts are sampled
    cfg = RunConfig(task=SCRIPTED, engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"),
                    group_size=2, groups_per_step=2, lora_rank=4, lora_alpha=8, seed=5, verbose=False,
                    pipeline=pipeline)
    with GRPORun(cfg) as run:
        asyncio.run(run.step())
        save = run.trainer.save_adapter

        def save_on_full_disk(path):
            if threading.current_thread() is not threading.main_thread():  # no signal handler there
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            with file_size_limit(4096):
                save(path)

        rollbacks, load = [], run.trainer.load_checkpoint
        run.trainer.save_adapter = save_on_full_disk
        run.trainer.load_checkpoint = lambda path: (rollbacks.append(path), load(path))[1]
        with pytest.raises(AdapterSaveError):
            asyncio.run(run.step())
        run.trainer.save_adapter, run.trainer.load_checkpoint = save, load
        assert run.trainer.step == 1 and run.adapter == "policy-step-1"  # rolled back to the served version
        assert len(rollbacks) == 1, f"one rollback (the step's), not one by the save and one by the step: {rollbacks}"
        assert run.sampler.ahead_task is None and run.sampler.ahead is None  # the rollouts sampled ahead were cancelled
        row = asyncio.run(run.step())
        assert row["step"] == 2 and row["adapter"] == "policy-step-2"
        assert [int(s) for s in run.history.df["step"]] == [1, 2]


def test_a_history_row_cut_by_a_full_disk_is_cut_back_and_a_resume_reads_every_row(tmp_path, tiny_model_dir):
    """Step 2's row meets a real write error half way (the file-size limit: the kernel writes what
    fits, then refuses the rest, as a full disk does): the file is cut back to row 1, the next
    step writes row 2 then row 3, and a new kernel's resume reads [1, 2, 3] (before: the torn half
    row stayed, the retry appended after it, and resume refused a corrupt middle line)."""
    from artsg_nb.run.history import HISTORY_FILE
    cfg = RunConfig(task=SCRIPTED, engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"),
                    group_size=2, groups_per_step=2, lora_rank=4, lora_alpha=8, seed=5, verbose=False)
    path = tmp_path / "run" / HISTORY_FILE
    with GRPORun(cfg) as run:
        asyncio.run(run.step())
        size, append = path.stat().st_size, run.history.append

        def full_disk_append(row):
            with file_size_limit(size + 40):  # room for the first 40 bytes of the row
                return append(row)

        run.history.append = full_disk_append
        with pytest.raises(OSError):
            asyncio.run(run.step())
        assert path.stat().st_size == size, "the torn row was left in the file"
        run.history.append = append
        assert asyncio.run(run.step())["step"] == 3
    from dataclasses import replace
    with GRPORun(replace(cfg, resume=True)) as resumed:
        assert [r["step"] for r in resumed.history.rows] == [1, 2, 3] and resumed.trainer.step == 3
