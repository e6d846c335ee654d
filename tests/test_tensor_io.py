"""rl/tensor_io.py: CPU copies of the trainer's tensors and their safetensors files (issue 26).

Checked by behaviour: the copies hold their sources' values and do not move with them; the reused
buffers hold the latest call's values, in the same memory while the sources keep their layout;
the fast write is save_file's file byte for byte and leaves what it refuses to save_file.
"""
import pytest
import torch

from artsg_nb.rl import tensor_io


def test_host_copies_are_separate_tensors_of_the_same_values_that_safetensors_writes(tmp_path):
    from safetensors.torch import load_file, save_file
    src = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
           "step": torch.tensor(7.0), "c": torch.arange(3.0).reshape(3, 1).t()}  # a non-contiguous one
    copies = tensor_io.host_copies(src)
    assert list(copies) == list(src)
    for k, v in src.items():
        assert copies[k].device.type == "cpu" and copies[k].dtype == v.dtype and copies[k].shape == v.shape
        assert torch.equal(copies[k], v)
    for v in src.values():
        v.add_(100)  # the snapshot does not move with its source
    assert copies["a"][0, 0] == 0 and copies["step"] == 7 and copies["b"][0] == 1
    save_file(copies, str(tmp_path / "x.safetensors"))
    back = load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(back[k], copies[k]) for k in copies)


def test_save_tensors_writes_save_files_bytes_and_leaves_what_it_refuses_to_it(tmp_path, monkeypatch):
    """The fast path (safetensors' serializer by address) must write exactly what save_file
    writes, for every dtype a checkpoint holds; what save_file refuses is still refused."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    src = {"lora_A": torch.randn(16, 24, generator=g), "lora_B": torch.randn(40, 16, generator=g),
           "half": torch.randn(5, dtype=torch.bfloat16, generator=g), "step": torch.tensor(3.0),
           "rng": torch.arange(9, dtype=torch.uint8), "count": torch.tensor([7], dtype=torch.int64)}
    copies = tensor_io.host_copies(src)  # views of one buffer per dtype
    meta = {"format": "pt"}
    with monkeypatch.context() as m:  # the fast path, not save_file, writes this one
        m.setattr(tensor_io, "save_file", lambda *a, **k: pytest.fail("save_file was called"))
        tensor_io.save_tensors(copies, tmp_path / "fast.safetensors", metadata=meta)
    save_file(copies, str(tmp_path / "reference.safetensors"), metadata=meta)
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    base = torch.arange(10.0)
    with pytest.raises(RuntimeError, match="share memory"):  # overlapping views: save_file's own refusal
        tensor_io.save_tensors({"a": base[:6], "b": base[4:]}, tmp_path / "overlap.safetensors")
    with pytest.raises(ValueError, match="non contiguous"):
        tensor_io.save_tensors({"t": torch.ones(3, 2).t()}, tmp_path / "strided.safetensors")


def test_host_staging_reuses_its_buffers_and_holds_the_latest_values():
    """The served adapter's copy at every step goes into the same memory while the sources keep
    their layout, into new buffers when it changes, and always holds the latest call's values."""
    src = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16), "c": torch.zeros(2)}
    staging = tensor_io.HostStaging()
    first = staging.copies(src)
    assert list(first) == list(src) and all(torch.equal(first[k], v) for k, v in src.items())
    addresses = {k: v.data_ptr() for k, v in first.items()}
    for v in src.values():
        v.add_(5)
    second = staging.copies(src)
    assert all(torch.equal(second[k], v) for k, v in src.items())
    assert {k: v.data_ptr() for k, v in second.items()} == addresses, "the buffers are reused"
    assert all(v.data_ptr() not in {t.data_ptr() for t in src.values()} for v in second.values()), "copies"
    src["c"] = torch.arange(3.0)  # another shape: new buffers
    third = staging.copies(src)
    assert third["c"].shape == (3,) and all(torch.equal(third[k], v) for k, v in src.items())


def test_host_staging_writes_what_save_file_writes_at_every_call(tmp_path, monkeypatch):
    """Through every change a trainer's adapter can see: new values, new storage of the same
    layout (a rollback), a new shape, a same-size reshape, a new dtype: the file is save_file's."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    src = {"lora_A": torch.randn(16, 24, generator=g), "lora_B": torch.randn(40, 16, generator=g),
           "half": torch.randn(6, dtype=torch.bfloat16, generator=g)}
    changes = [lambda s: s.update({k: v * -2 for k, v in s.items()}),  # new storage, same layout
               lambda s: s["lora_A"].add_(1.5),  # new values in place
               lambda s: s.update(lora_B=torch.randn(48, 16, generator=g)),  # new shape
               lambda s: s.update(half=s["half"].reshape(2, 3) + 1),  # same size, new shape
               lambda s: s.update(half=s["half"].float()),  # new dtype
               lambda s: None]
    staging = tensor_io.HostStaging()
    for step, change in enumerate(changes):
        with monkeypatch.context() as m:  # the fast path, with the specs of the current buffers
            m.setattr(tensor_io, "save_file", lambda *a, **k: pytest.fail("save_file was called"))
            staging.save(src, tmp_path / f"{step}.safetensors", {"format": "pt"})
        save_file(src, str(tmp_path / f"ref{step}.safetensors"), metadata={"format": "pt"})
        assert (tmp_path / f"{step}.safetensors").read_bytes() == (tmp_path / f"ref{step}.safetensors").read_bytes(), step
        change(src)


def test_a_failed_build_leaves_no_stale_copy_behind(tmp_path, monkeypatch):
    """Out of (page-locked) memory while new buffers are made: the next call builds them again
    rather than filling half-built ones and writing the old copies."""
    from safetensors.torch import load_file
    src = {"a": torch.ones(4), "b": torch.ones(3, dtype=torch.bfloat16)}
    staging = tensor_io.HostStaging()
    staging.save(src, tmp_path / "0.safetensors")
    other = {"a": torch.full((5,), 2.0), "b": torch.full((2,), 3.0, dtype=torch.bfloat16)}
    real_empty, made = torch.empty, []

    def empty_then_out_of_memory(*args, **kwargs):
        if made:
            raise RuntimeError("out of memory (simulated)")
        made.append(1)
        return real_empty(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(tensor_io.torch, "empty", empty_then_out_of_memory)
        with pytest.raises(RuntimeError, match="simulated"):
            staging.save(other, tmp_path / "1.safetensors")
    for v in src.values():
        v.add_(7)  # the first layout again, new values
    staging.save(src, tmp_path / "2.safetensors")
    back = load_file(str(tmp_path / "2.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in src.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_staging_of_gpu_tensors_lands_in_page_locked_memory(tmp_path):
    from safetensors.torch import load_file
    src = {"a": torch.randn(16, 576, device="cuda"), "b": torch.randn(576, 16, device="cuda"),
           "c": torch.randn(8, device="cuda", dtype=torch.bfloat16)}
    staging = tensor_io.HostStaging()
    for step in range(2):
        copies = staging.copies(src)
        assert all(c.device.type == "cpu" and c.is_pinned() for c in copies.values())
        staging.save(src, tmp_path / f"{step}.safetensors")
        back = load_file(str(tmp_path / f"{step}.safetensors"))
        assert back.keys() == src.keys() and all(torch.equal(back[k], v.cpu()) for k, v in src.items())
        for v in src.values():
            v.mul_(2)
