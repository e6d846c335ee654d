"""Which GPU does what: read the GPUs (nvidia-ml-py) and plan the server's and the trainer's roles.

What it does: `list_gpus()` reads every GPU this process may use (physical NVML indexes,
filtered by a `CUDA_VISIBLE_DEVICES` that was set before us); `plan_gpus()` turns that list
into a `GpuPlan`:

  - 2+ GPUs → "split":     the server owns GPU 0, the trainer (the notebook kernel) GPUs 1..n;
                           with `num_servers` N and `server_tp` T, N servers own T GPUs each
                           (`server_groups`) and the trainer the rest, or `trainer_ranks` of them
                           (num_servers="auto": half the GPUs serve, e.g. 8 GPUs → 4 + 4);
  - 1 GPU   → "colocated": both share it; the server takes `server_mem_fraction` (0.45) of its
                           memory and can give it back around training (session.RunConfig.
                           release_memory; SGLang's memory saver); N servers take 0.70 / N each;
  - none    → "cpu":       the CPU engine and a CPU trainer (N CPU engines).

`GpuPlan.server_env()` is the environment for the server subprocess; `apply_to_kernel(plan)`
sets the kernel's `CUDA_VISIBLE_DEVICES`, which only works before CUDA initialises in the kernel
(architecture fact 5), and says so loudly when it is too late.

`plan.for_server(i)` is the plan server i is started with (its own GPUs, its memory fraction).

What it does not: no CUDA calls of its own (NVML does not initialise CUDA), no MIG slices, no
launch flags (a tensor-parallel server's --tp-size is fleet.py's), no memory release itself (that
is an HTTP call, see client).
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

import pynvml  # nvidia-ml-py: loads libnvidia-ml only at nvmlInit, so it imports anywhere

log = logging.getLogger(__name__)

Mode = Literal["split", "colocated", "cpu"]
COLOCATED_MEM_FRACTION = 0.45
"""Server share of the one GPU in colocated mode; the trainer gets the rest."""
COLOCATED_FLEET_FRACTION = 0.70
"""All servers' share of the one GPU when several share it (0.35 each for two)."""

_MODES = ("split", "colocated", "cpu")
_original_visible: str | None = None   # CUDA_VISIBLE_DEVICES before apply_to_kernel changed it
_applied = False
_last_nvml_error = ""


class NoGpuError(RuntimeError):
    """A GPU was asked for and none is present (or none is visible to this process)."""


class CudaAlreadyInitializedError(RuntimeError):
    """The kernel initialised CUDA before the GPU plan could hide the server's GPUs from it."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it."""
    index: int
    """Physical NVML index (PCI bus order), the number `CUDA_VISIBLE_DEVICES` uses here."""
    name: str
    """Marketing name, e.g. "NVIDIA H200"."""
    uuid: str
    """"GPU-…" UUID, stable across reboots and index reorderings."""
    mem_total_mib: float
    """Total memory, MiB."""
    mem_used_mib: float
    """Memory in use by any process when read, MiB."""
    util_pct: float | None = None
    """Percent of the last sample period a kernel ran (NVML utilization.gpu); None if unread."""
    power_w: float | None = None
    """Power draw when read, watts; None where NVML does not report it."""
    power_limit_w: float | None = None
    """Enforced power limit, watts; None where NVML does not report it."""

    @property
    def mem_free_mib(self) -> float:
        return self.mem_total_mib - self.mem_used_mib


@dataclass(frozen=True)
class GpuPlan:
    """Roles of the GPUs: which ones the server gets, which ones the trainer gets."""
    mode: Mode
    """"split" (server and trainer on different GPUs), "colocated" (one shared GPU) or "cpu"."""
    server_gpus: tuple[int, ...] = ()
    """Physical indexes given to the server subprocess (empty in cpu mode)."""
    trainer_gpus: tuple[int, ...] = ()
    """Physical indexes left to the trainer in the kernel (empty in cpu mode)."""
    server_mem_fraction: float | None = None
    """Fraction of each server GPU the server may take (SGLang --mem-fraction-static, vLLM
    --gpu-memory-utilization); None leaves the engine's default (split and cpu modes)."""
    release_server_memory: bool = False
    """Colocated: release the server's GPU memory before each training step and resume it
    after (SGLang needs --enable-memory-saver; see engines/sglang.py). GRPORun sets it from
    RunConfig.release_memory, so the plan it shows says what the run does."""
    gpus: tuple[GpuInfo, ...] = field(default=(), compare=False)
    """The GPUs the plan was made from, for display."""
    server_groups: tuple[tuple[int, ...], ...] = ()
    """One tuple of physical indexes per server (several servers, or a tensor-parallel one);
    empty means one server on `server_gpus`. Colocated servers all name the one GPU."""
    server_tp: int = 1
    """GPUs per server (tensor parallel size)."""

    @property
    def num_servers(self) -> int:
        return len(self.server_groups) or 1

    def for_server(self, i: int) -> "GpuPlan":
        """The plan server `i` is started with: its own GPUs (server_env) and memory fraction."""
        if not self.server_groups:
            return self
        return replace(self, server_gpus=self.server_groups[i], server_groups=(self.server_groups[i],))

    @property
    def trainer_devices(self) -> list[str]:
        """Torch device names for the trainer in the kernel once `apply_to_kernel` ran
        (CUDA renumbers the visible GPUs from 0)."""
        return [f"cuda:{i}" for i in range(len(self.trainer_gpus))] or ["cpu"]

    def server_env(self) -> dict[str, str]:
        """Environment variables for the server subprocess (its GPUs, in NVML's order)."""
        return {"CUDA_VISIBLE_DEVICES": _join(self.server_gpus), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def kernel_env(self) -> dict[str, str]:
        """Environment variables `apply_to_kernel` sets in the notebook kernel."""
        return {"CUDA_VISIBLE_DEVICES": _join(self.trainer_gpus), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def describe(self) -> str:
        """A few lines for the notebook: mode, then one line per GPU with its role and memory."""
        n, tp = self.num_servers, f" (tensor parallel {self.server_tp})" if self.server_tp > 1 else ""
        servers = (f"{n} servers on GPU " + " | ".join(_join(g) for g in self.server_groups) if n > 1
                   else f"server on GPU {_join(self.server_gpus)}") + tp
        head = {"split": f"split: {servers}, trainer on GPU {_join(self.trainer_gpus)}",
                "colocated": f"colocated: {'%d servers' % n if n > 1 else 'server'} and trainer share "
                             f"GPU {_join(self.server_gpus)}",
                "cpu": f"cpu: no GPU, {f'{n} CPU engines serve' if n > 1 else 'the CPU engine serves'} "
                       "and the trainer runs on CPU"}[self.mode]
        if self.server_mem_fraction is not None:
            head += f"; server memory fraction {self.server_mem_fraction:.2f}{' each' if n > 1 else ''}"
        if self.release_server_memory:
            head += "; server memory released around training"
        lines = [f"GPU plan: {head}"]
        for g in self.gpus:
            which = [i for i, grp in enumerate(self.server_groups) if g.index in grp] if n > 1 else []
            server = f"server {','.join(map(str, which))}" if which and self.mode == "split" else (
                f"{n} servers" if which else "server")
            role = (f"{server}+trainer" if g.index in self.server_gpus and g.index in self.trainer_gpus
                    else server if g.index in self.server_gpus
                    else "trainer" if g.index in self.trainer_gpus else "idle")
            lines.append(f"  GPU {g.index}  {g.name:<22} {g.mem_used_mib / 1024:6.1f} / "
                         f"{g.mem_total_mib / 1024:6.1f} GiB used  → {role}")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.describe())


def list_gpus() -> list[GpuInfo]:
    """The GPUs this process may use, by physical index; [] (never an error) without a driver."""
    global _last_nvml_error
    try:
        pynvml.nvmlInit()
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
        _last_nvml_error = f"{type(e).__name__}: {e}"
        log.debug("no NVML: %s", _last_nvml_error)
        return []
    try:
        gpus = [_read(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as e:
        _last_nvml_error = f"{type(e).__name__}: {e}"
        log.warning("NVML could not read the GPUs: %s", e)
        return []
    finally:
        pynvml.nvmlShutdown()
    return _visible(gpus, _original_visible if _applied else os.environ.get("CUDA_VISIBLE_DEVICES"))


def process_memory_mib(index: int) -> dict[int, float]:
    """MiB held on GPU `index` (physical) by each compute process NVML names with a figure, by pid;
    {} (never an error) without a driver, or where NVML cannot list this GPU's processes. The pids
    are those NVML sees, which in a container may not be this process's own namespace."""
    try:
        pynvml.nvmlInit()
    except Exception as e:  # as list_gpus
        log.debug("no NVML: %s: %s", type(e).__name__, e)
        return {}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return {p.pid: p.usedGpuMemory / 2**20 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if p.usedGpuMemory is not None}
    except pynvml.NVMLError as e:
        log.debug("NVML could not list GPU %d's processes: %s", index, e)
        return {}
    finally:
        pynvml.nvmlShutdown()


def _read(pynvml, i: int) -> GpuInfo:
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    name, uuid = pynvml.nvmlDeviceGetName(h), pynvml.nvmlDeviceGetUUID(h)
    name, uuid = (s.decode() if isinstance(s, bytes) else s for s in (name, uuid))
    util = _optional(lambda: float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu))
    power = _optional(lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000)
    limit = _optional(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000)
    return GpuInfo(i, name, uuid, mem.total / 2**20, mem.used / 2**20, util, power, limit)


def _optional(read):
    """One NVML reading that some GPUs do not support (NVMLError_NotSupported): None then."""
    try:
        return read()
    except pynvml.NVMLError:
        return None


def _visible(gpus: list[GpuInfo], spec: str | None) -> list[GpuInfo]:
    """Keep the GPUs a pre-set CUDA_VISIBLE_DEVICES allows (indexes or UUID prefixes)."""
    if spec is None:
        return gpus
    keep = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        match = [g for g in gpus if (item.isdigit() and g.index == int(item))
                 or (item.startswith("GPU-") and g.uuid.startswith(item))]
        if not match:  # CUDA stops at the first invalid entry
            break
        keep += [g for g in match if g not in keep]
    return keep


def plan_gpus(gpus: Sequence[GpuInfo] | None = None, server_mem_fraction: float | None = None,
              prefer: Literal["auto", "split", "colocated", "cpu"] = "auto",
              release_server_memory: bool = False, num_servers: int | Literal["auto"] = 1,
              trainer_ranks: int | None = None, server_tp: int = 1) -> GpuPlan:
    """Plan roles for `gpus` (default: `list_gpus()`).

    prefer: "auto" picks by count (0 → cpu, 1 → colocated, 2+ → split); "colocated" shares
    GPU 0 even when there are more; "split" needs 2+ GPUs; "cpu" ignores the GPUs.
    server_mem_fraction: each server's share of its GPU; default 0.45 colocated (0.70 / N for
    N servers on the one GPU), else engine default.
    release_server_memory: what the plan shows for memory release; off by default, as
    RunConfig.release_memory is (GRPORun sets it from that setting).
    num_servers: inference servers (behind sglang-router when more than one); "auto" gives half
    the GPUs (in whole servers of `server_tp`) to servers when split, else 1.
    trainer_ranks: GPUs for the trainer when split (one DDP rank each); None: all the rest.
    server_tp: GPUs per server (tensor parallel), for a model one GPU cannot hold.
    """
    gpus = tuple(list_gpus() if gpus is None else gpus)
    if prefer not in ("auto", *_MODES):
        raise ValueError(f"prefer={prefer!r}; use one of 'auto', 'split', 'colocated', 'cpu'")
    if server_mem_fraction is not None and not 0 < server_mem_fraction < 1:
        raise ValueError(f"server_mem_fraction={server_mem_fraction} must be in (0, 1)")
    if server_tp < 1 or (trainer_ranks is not None and trainer_ranks < 1):
        raise ValueError(f"server_tp={server_tp} and trainer_ranks={trainer_ranks} must be ≥ 1")
    mode = prefer
    if prefer == "auto":
        mode = "cpu" if not gpus else "colocated" if len(gpus) == 1 and server_tp == 1 else "split"
    if mode != "cpu" and not gpus:
        require_gpu(gpus)
    if mode == "split" and len(gpus) < 2:
        raise ValueError(f"prefer='split' needs 2+ GPUs, found {len(gpus)}; use 'colocated' or 'auto'")
    if num_servers == "auto":
        num_servers = max(1, len(gpus) // 2 // server_tp) if mode == "split" else 1
    if not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(f"num_servers={num_servers!r}; use an integer ≥ 1 or 'auto'")
    if mode == "cpu":
        return GpuPlan("cpu", gpus=gpus, server_groups=((),) * num_servers if num_servers > 1 else ())
    first = gpus[0].index
    if mode == "colocated":
        if server_tp > 1:
            raise ValueError(f"server_tp={server_tp} needs {server_tp} GPUs per server; colocated shares one")
        share = server_mem_fraction or (COLOCATED_MEM_FRACTION if num_servers == 1
                                        else round(COLOCATED_FLEET_FRACTION / num_servers, 3))
        return GpuPlan("colocated", (first,), (first,), share, release_server_memory, gpus,
                       server_groups=((first,),) * num_servers if num_servers > 1 else ())
    serving = num_servers * server_tp
    ranks = len(gpus) - serving if trainer_ranks is None else trainer_ranks
    if ranks < 1 or serving + ranks > len(gpus):
        raise ValueError(
            f"{num_servers} server(s) × {server_tp} GPU(s) + {ranks} trainer rank(s) do not fit on "
            f"{len(gpus)} GPUs. Try: fewer servers (num_servers), trainer_ranks=None, or prefer='colocated'.")
    idx = [g.index for g in gpus]
    groups = tuple(tuple(idx[i * server_tp:(i + 1) * server_tp]) for i in range(num_servers))
    return GpuPlan("split", tuple(idx[:serving]), tuple(idx[serving:serving + ranks]), server_mem_fraction,
                   release_server_memory, gpus,
                   server_groups=groups if num_servers > 1 or server_tp > 1 else (), server_tp=server_tp)


LAUNCH_RESERVE_MIB = 6 * 1024
"""Free memory a server launched by launch_mem_fraction always leaves outside its static share: what
SGLang allocates beyond --mem-fraction-static (CUDA graphs, activations; NCCL buffers when tensor
parallel), from the same free memory as the trainer's growth."""


def launch_mem_fraction(share: float, server_gpus: Sequence[int], gpus: Sequence[GpuInfo] | None = None) -> float:
    """`share` of the total memory of `server_gpus`, as a fraction of what is free on them now.

    For an engine whose flag counts from the memory free at its start (SGLang 0.5.14,
    EngineSpec.mem_fraction_of == "free"): on a GPU that already holds another server (a colocated
    fleet; a worker restarted beside a live one) share x free would leave that server less than the
    plan gives it, and 0.35 for the second of two servers leaves SGLang no KV cache at all
    ("Loaded weights leave no GPU memory for the KV cache", H200 at 7de1b1f). Across several GPUs
    the one with the least free memory decides; GPUs NVML does not show leave `share` unchanged.
    Where the share no longer fits beside LAUNCH_RESERVE_MIB (a restart beside a trainer holding more
    than its part), the server gets what fits, never less than `share` of what is free (what it got
    before), with a warning that says how to give it its share.

    NVML is read here, before the launch; SGLang reads it again after its imports. Memory taken in
    between (the trainer loading beside it) makes the server smaller, the safe direction; memory
    freed in between (another server on the GPU stopping) makes it larger than planned (likely why
    a 0.3 share held 46.8 GiB of an 80 GiB H100 beside the smoke's other parts, 2026-12-07)."""
    by_index = {g.index: g for g in (list_gpus() if gpus is None else gpus)}
    mine = [by_index[i] for i in server_gpus if i in by_index and by_index[i].mem_total_mib > 0]
    if not mine:
        return share
    tightest = min(mine, key=lambda g: g.mem_free_mib / g.mem_total_mib)
    need_mib, free_mib = share * tightest.mem_total_mib, tightest.mem_free_mib
    if free_mib <= 0:
        return share
    got_mib = need_mib
    if need_mib > free_mib - LAUNCH_RESERVE_MIB:
        got_mib = max(free_mib - LAUNCH_RESERVE_MIB, share * free_mib)
        log.warning("GPU %d has %.1f GiB free of %.1f GiB; a server planned at %.2f of it needs %.1f GiB (+ %.0f GiB "
                    "outside its share), so it starts with %.1f GiB. Try: torch.cuda.empty_cache() in the kernel, a "
                    "smaller server_mem_fraction or fewer num_servers, or free the GPU (nvidia-smi shows who holds it).",
                    tightest.index, free_mib / 1024, tightest.mem_total_mib / 1024, share, need_mib / 1024,
                    LAUNCH_RESERVE_MIB / 1024, got_mib / 1024)
    return round(max(share, got_mib / free_mib), 4)


def require_gpu(gpus: Sequence[GpuInfo] | None = None) -> list[GpuInfo]:
    """Return the GPUs, or raise `NoGpuError` saying why none were found and what to do."""
    gpus = list(list_gpus() if gpus is None else gpus)
    if gpus:
        return gpus
    why = _last_nvml_error or "NVML reported no devices"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None:
        why += f"; CUDA_VISIBLE_DEVICES={hidden!r} is set"
    raise NoGpuError(
        f"a GPU was asked for (engine sglang/vllm or a GPU plan) but none is present ({why}). "
        "Try: `nvidia-smi` to check the driver, run on a GPU host, or use engine='cpu' "
        "(the CPU engine) on this machine.")


def apply_to_kernel(plan: GpuPlan) -> dict[str, str]:
    """Set this process's CUDA_VISIBLE_DEVICES to the trainer's GPUs; returns what was set.

    Must run before anything initialises CUDA in the kernel. Raises
    `CudaAlreadyInitializedError` when CUDA is already up on GPUs the plan gives the server.
    """
    global _original_visible, _applied
    env = plan.kernel_env()
    current = _original_visible if _applied else os.environ.get("CUDA_VISIBLE_DEVICES")
    if _cuda_initialized() and os.environ.get("CUDA_VISIBLE_DEVICES") != env["CUDA_VISIBLE_DEVICES"]:
        seen = _seen_by_kernel(plan)
        clash = sorted(set(seen) & set(plan.server_gpus) - set(plan.trainer_gpus))
        if clash:
            raise CudaAlreadyInitializedError(
                f"CUDA is already initialised in this kernel (pid {os.getpid()}) with GPU(s) "
                f"{_join(clash)} visible, and the plan gives those to the server; "
                "CUDA_VISIBLE_DEVICES cannot change once CUDA is up. Try: restart the kernel and "
                "run the GPU-plan cell before anything touches CUDA (torch.cuda, model.to('cuda')).")
        log.warning("CUDA already initialised; the kernel keeps seeing GPU(s) %s, which does not "
                    "clash with the server's", _join(seen))
    if not _applied:
        _original_visible, _applied = current, True
    os.environ.update(env)
    return env


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")  # never import torch here: that alone costs seconds
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def _seen_by_kernel(plan: GpuPlan) -> list[int]:
    """Physical indexes visible to the kernel right now."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    everything = list(plan.gpus) or [GpuInfo(i, "?", "", 0, 0)
                                     for i in set(plan.server_gpus) | set(plan.trainer_gpus)]
    return [g.index for g in _visible(everything, spec)]


def _join(indexes: Sequence[int]) -> str:
    return ",".join(str(i) for i in indexes)
