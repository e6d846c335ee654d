"""Tensors copied out of the trainer into CPU memory and written as safetensors files, fast:
a LoRA adapter is hundreds of small tensors, and what costs per tensor (a transfer, a Python
object, a scan) adds up on a pipelined step's critical path (issue 26).

- `host_copies`: a snapshot in CPU memory of its own, in one transfer per device and dtype (the
  checkpoint writer's optimizer state).
- `HostStaging`: the same copy into buffers reused from step to step, page-locked for a GPU's
  tensors, with the file's layout worked out once (the adapter the server loads next:
  Trainer.save_adapter). Its copies hold their values only until its next call.
- `save_tensors`: safetensors' `save_file`, the same bytes, handed to its serializer by address.

What it does not do: decide what is saved, when or where (checkpoint.py, trainer.py, lora.py).
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import safetensors
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file


def host_copies(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor copied into CPU memory (a copy on a CPU trainer too: a snapshot must not move
    with the next optimizer step), in one transfer per device and dtype: a LoRA adapter is
    hundreds of small tensors, and copied one by one from a GPU each paid a synchronous transfer
    (SmolLM2 r16, 420 tensors: 84 ms for the adapter alone on an H100, 2026-12-06). The copies
    are views of one buffer; safetensors writes them as separate tensors."""
    out: dict[str, torch.Tensor] = {}
    for names in _by_device_and_dtype(named).values():
        flat = torch.cat(_flat_parts(named, names)).to("cpu")  # torch.cat copies: a CPU tensor is copied too
        out.update(_views(flat, names, named))
    return {name: out[name] for name in named}


class HostStaging:
    """`host_copies` into buffers kept from one call to the next, for a copy taken at every step
    and written before the next one (the served adapter). Per call it only joins the sources on
    their device and copies the result into its buffer: the buffers (page-locked for a GPU's
    tensors, so the transfer runs at the link's speed and no new 20 MB are faulted in), the
    copies' views of them and the file's tensor specs are built again only when the sources'
    names, shapes, dtypes or devices change. `save` holds a lock, so saves from two threads take
    turns on the buffers; `copies` alone is for one thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layout: tuple | None = None
        """(name, shape, dtype, device) of each source the buffers were built for."""
        self._groups: list[tuple[list[str], torch.Tensor]] = []
        """Per device and dtype: the sources' names, in buffer order, and their CPU buffer."""
        self._copies: dict[str, torch.Tensor] = {}
        self._specs: dict | None = None

    def copies(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What `host_copies(named)` returns, in this staging's buffers: valid until its next call."""
        layout = tuple((name, t.shape, t.dtype, t.device) for name, t in named.items())
        if layout != self._layout:
            self._build(named, layout)
        for names, buffer in self._groups:
            parts = _flat_parts(named, names)
            if parts[0].device.type == "cpu":
                torch.cat(parts, out=buffer)
            else:
                buffer.copy_(torch.cat(parts))  # one transfer into page-locked memory, waited for
        return dict(self._copies)

    def save(self, named: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
        """`save_tensors(host_copies(named), path, metadata)`, the same file, through the buffers."""
        with self._lock:
            copies = self.copies(named)  # first: a new layout has new buffers, whose specs these are
            save_tensors(copies, path, metadata, specs=self._specs)

    def _build(self, named: dict[str, torch.Tensor], layout: tuple) -> None:
        """New buffers, views and specs for `layout`, kept only once all are made (a failed
        allocation leaves none half-built behind: the next call builds again)."""
        self._layout = None
        groups, copies = [], {}
        for (device, dtype), names in _by_device_and_dtype(named).items():
            numel = sum(named[n].numel() for n in names)
            buffer = torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")
            groups.append((names, buffer))
            copies.update(_views(buffer, names, named))
        self._copies = {name: copies[name] for name in named}
        self._groups, self._specs, self._layout = groups, tensor_specs(self._copies), layout


def _by_device_and_dtype(named: dict[str, torch.Tensor]) -> dict[tuple, list[str]]:
    groups: dict[tuple, list[str]] = {}
    for name, tensor in named.items():
        groups.setdefault((tensor.device, tensor.dtype), []).append(name)
    return groups


def _flat_parts(named: dict[str, torch.Tensor], names: list[str]) -> list[torch.Tensor]:
    return [named[n].detach().reshape(-1) for n in names]


def _views(flat: torch.Tensor, names: list[str], named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`flat` cut into one view per name, each in its source's shape."""
    pieces = torch.split(flat, [named[n].numel() for n in names])
    return {name: piece.view(named[name].shape) for name, piece in zip(names, pieces)}


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None,
                 specs: dict | None = None) -> None:
    """safetensors' `save_file(tensors, path, metadata)`, the same bytes, for the CPU tensors
    `host_copies` returns: handed to safetensors' own serializer by address (`TensorSpec`),
    without save_file's per-tensor numpy view and its shared-memory scan, which hold the GIL. For
    SmolLM2's r16 adapter (420 tensors) they were 13 of save_file's 31 ms on 2 CPU cores
    (2026-12-06), in the update's thread on a pipelined step's critical path, and the optimizer
    state's twice as many held the GIL from the checkpoint writer while the next update ran; the
    write itself releases it. Anything else goes to save_file, which checks and refuses what it
    must: a tensor not contiguous in CPU memory, an empty one, tensors that overlap, a dtype
    safetensors does not know, a big-endian machine, a safetensors without TensorSpec (before 0.8).
    specs: `tensor_specs(tensors)` worked out before, for tensors whose memory has not moved since
    (HostStaging's)."""
    specs = tensor_specs(tensors) if specs is None else specs
    if specs is None:
        save_file(tensors, str(path), metadata=metadata)
    else:
        safetensors.serialize_file(specs, str(path), metadata=metadata)  # `tensors` holds the memory meanwhile


def tensor_specs(tensors: dict[str, torch.Tensor]) -> dict | None:
    """Each tensor's TensorSpec (dtype, shape, address, bytes), or None where save_tensors leaves
    the write to save_file (its docstring)."""
    spec = getattr(safetensors, "TensorSpec", None)
    if spec is None or sys.byteorder != "little" or not _separate_cpu_tensors(tensors.values()):
        return None
    try:
        return {name: spec(dtype=str(t.dtype).removeprefix("torch."), shape=t.shape, data_ptr=t.data_ptr(),
                           data_len=t.numel() * t.element_size())
                for name, t in tensors.items()}
    except (SafetensorError, ValueError, TypeError):  # a dtype it does not know: save_file says which
        return None


def _separate_cpu_tensors(tensors) -> bool:
    """Whether every tensor is contiguous in CPU memory, not empty, and overlaps no other."""
    spans = []
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous() or t.numel() == 0:
            return False
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
