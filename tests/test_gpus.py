"""GPU planning on described device lists (no GPU needed), NVML reading through a fake pynvml,
and the kernel-side CUDA_VISIBLE_DEVICES rules."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from artsg_nb.serving import gpus
from artsg_nb.serving.gpus import (CudaAlreadyInitializedError, GpuInfo, NoGpuError, apply_to_kernel,
                           plan_gpus, require_gpu)


def h200s(n: int) -> list[GpuInfo]:
    return [GpuInfo(i, "NVIDIA H200", f"GPU-{i:04d}", 143771.0, 512.0) for i in range(n)]


@pytest.fixture(autouse=True)
def kernel_env(monkeypatch):
    """Each test starts as a fresh kernel: no CUDA_VISIBLE_DEVICES, no plan applied, no torch CUDA."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setattr(gpus, "_applied", False)
    monkeypatch.setattr(gpus, "_original_visible", None)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: False)))


# ---- plan_gpus ------------------------------------------------------------------------------
def test_no_gpu_is_cpu():
    plan = plan_gpus([])
    assert (plan.mode, plan.server_gpus, plan.trainer_gpus) == ("cpu", (), ())
    assert plan.trainer_devices == ["cpu"] and plan.server_mem_fraction is None
    assert plan.server_env()["CUDA_VISIBLE_DEVICES"] == ""


def test_one_gpu_is_colocated():
    plan = plan_gpus(h200s(1))
    assert (plan.mode, plan.server_gpus, plan.trainer_gpus) == ("colocated", (0,), (0,))
    assert plan.server_mem_fraction == 0.45
    assert not plan.release_server_memory  # GRPORun sets it from RunConfig.release_memory
    assert "released" not in plan.describe()
    assert "released around training" in plan_gpus(h200s(1), release_server_memory=True).describe()
    assert plan.trainer_devices == ["cuda:0"]
    assert plan.server_env() == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_two_or_more_gpus_split(n):
    plan = plan_gpus(h200s(n))
    assert plan.mode == "split" and plan.server_gpus == (0,)
    assert plan.trainer_gpus == tuple(range(1, n))
    assert plan.trainer_devices == [f"cuda:{i}" for i in range(n - 1)]  # renumbered in the kernel
    assert plan.server_env()["CUDA_VISIBLE_DEVICES"] == "0"
    assert plan.kernel_env()["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(1, n)))
    assert plan.server_mem_fraction is None and not plan.release_server_memory


def test_split_uses_physical_indexes_of_visible_gpus():
    plan = plan_gpus([GpuInfo(2, "A", "GPU-2", 1, 0), GpuInfo(5, "A", "GPU-5", 1, 0)])
    assert (plan.server_gpus, plan.trainer_gpus) == ((2,), (5,))


def test_overrides():
    assert plan_gpus(h200s(4), prefer="colocated").server_gpus == (0,)
    assert plan_gpus(h200s(4), prefer="cpu").mode == "cpu"
    assert plan_gpus(h200s(2), server_mem_fraction=0.8).server_mem_fraction == 0.8
    plan = plan_gpus(h200s(1), server_mem_fraction=0.3, release_server_memory=False)
    assert plan.server_mem_fraction == 0.3 and not plan.release_server_memory
    with pytest.raises(ValueError, match="needs 2\\+ GPUs"):
        plan_gpus(h200s(1), prefer="split")
    with pytest.raises(NoGpuError):
        plan_gpus([], prefer="colocated")
    with pytest.raises(ValueError, match="prefer="):
        plan_gpus(h200s(1), prefer="fast")
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        plan_gpus(h200s(1), server_mem_fraction=1.0)


def test_describe_names_roles():
    text = plan_gpus(h200s(3)).describe()
    assert text.splitlines()[0] == "GPU plan: split: server on GPU 0, trainer on GPU 1,2"
    assert "→ server" in text.splitlines()[1] and "→ trainer" in text.splitlines()[3]
    assert "server+trainer" in plan_gpus(h200s(1)).describe()
    assert "CPU engine" in plan_gpus([]).describe()


# ---- list_gpus / require_gpu ----------------------------------------------------------------
class FakeNVMLError(Exception):
    pass


def fake_pynvml(devices: list[tuple[str, str, int, int]], fail: bool = False):
    def init():
        if fail:
            raise FakeNVMLError("Driver Not Loaded")
    return SimpleNamespace(
        NVMLError=FakeNVMLError, nvmlInit=init, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda i: devices[i],
        nvmlDeviceGetName=lambda h: h[0].encode(), nvmlDeviceGetUUID=lambda h: h[1],
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=h[2] * 2**20, used=h[3] * 2**20),
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=h[4] if len(h) > 4 else 0, memory=0),
        nvmlDeviceGetPowerUsage=lambda h: h[5] if len(h) > 5 else _unsupported(),  # milliwatts
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetComputeRunningProcesses=lambda h: h[6] if len(h) > 6 else _unsupported())


def _unsupported():
    raise FakeNVMLError("Not Supported")


def test_list_gpus_reads_nvml(monkeypatch):
    monkeypatch.setattr(gpus, "pynvml", fake_pynvml([("H200", "GPU-aa", 1000, 10), ("H200", "GPU-bb", 1000, 20)]))
    assert gpus.list_gpus() == [GpuInfo(0, "H200", "GPU-aa", 1000.0, 10.0, 0.0, None, 700.0),
                                GpuInfo(1, "H200", "GPU-bb", 1000.0, 20.0, 0.0, None, 700.0)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bb")  # set before us (a shared host): respected
    assert [g.index for g in gpus.list_gpus()] == [1]


def test_list_gpus_reads_utilisation_and_power_where_supported(monkeypatch):
    """The dashboard's time series: utilisation %, power and its limit in watts; a reading the
    GPU does not support (NVMLError_NotSupported) is None, not an error."""
    monkeypatch.setattr(gpus, "pynvml", fake_pynvml([("H200", "GPU-aa", 1000, 10, 93, 654_321),
                                                     ("H200", "GPU-bb", 1000, 20, 5)]))
    first, second = gpus.list_gpus()
    assert (first.util_pct, first.power_w, first.power_limit_w) == (93.0, 654.321, 700.0)
    assert (second.util_pct, second.power_w) == (5.0, None)


def test_process_memory_is_read_per_pid_where_nvml_gives_it(monkeypatch):
    """Per-process figures (a server's own memory beside other GPU users); a process without a figure
    is left out, and a GPU whose processes NVML cannot list, or no driver, gives {}, not an error."""
    procs = [SimpleNamespace(pid=11, usedGpuMemory=3 * 2**30), SimpleNamespace(pid=12, usedGpuMemory=None)]
    monkeypatch.setattr(gpus, "pynvml", fake_pynvml([("H200", "GPU-aa", 1000, 10, 0, None, procs),
                                                     ("H200", "GPU-bb", 1000, 20)]))
    assert gpus.process_memory_mib(0) == {11: 3072.0}
    assert gpus.process_memory_mib(1) == {}
    monkeypatch.setattr(gpus, "pynvml", fake_pynvml([], fail=True))
    assert gpus.process_memory_mib(0) == {}


def test_no_driver_is_an_empty_list_and_require_gpu_explains(monkeypatch):
    monkeypatch.setattr(gpus, "pynvml", fake_pynvml([], fail=True))
    assert gpus.list_gpus() == []
    with pytest.raises(NoGpuError, match="Driver Not Loaded.*engine='cpu'"):
        require_gpu()
    assert require_gpu(h200s(1)) == h200s(1)


def test_visible_filter():
    assert [g.index for g in gpus._visible(h200s(4), "3,1")] == [3, 1]
    assert gpus._visible(h200s(4), "") == []
    assert [g.index for g in gpus._visible(h200s(4), "1,7,2")] == [1]  # CUDA stops at an invalid id
    assert len(gpus._visible(h200s(4), None)) == 4


# ---- apply_to_kernel ------------------------------------------------------------------------
def test_apply_sets_trainer_devices_and_remembers_the_original(monkeypatch):
    monkeypatch.setattr(gpus, "pynvml", fake_pynvml([("H200", f"GPU-{i}", 1000, 0) for i in range(4)]))
    plan = plan_gpus(gpus.list_gpus())
    assert apply_to_kernel(plan)["CUDA_VISIBLE_DEVICES"] == "1,2,3"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,2,3" and os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert len(gpus.list_gpus()) == 4  # re-planning still sees every GPU, not just the trainer's
    assert plan_gpus(gpus.list_gpus()) == plan
    apply_to_kernel(plan)  # idempotent


def test_cuda_already_initialised_on_server_gpu_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True)))
    with pytest.raises(CudaAlreadyInitializedError, match="restart the kernel and run the GPU-plan cell"):
        apply_to_kernel(plan_gpus(h200s(2)))
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_cuda_initialised_without_clash_is_allowed(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the kernel only ever saw the trainer's GPU
    apply_to_kernel(plan_gpus(h200s(2)))
    apply_to_kernel(plan_gpus(h200s(1)))  # colocated: sharing GPU 0 is the plan


# ---- several servers, trainer ranks, tensor parallel (scale-out) ------------------------------
@pytest.mark.parametrize("n, servers, trainer", [(2, ((0,),), (1,)), (4, ((0,), (1,)), (2, 3)),
                                                 (8, ((0,), (1,), (2,), (3,)), (4, 5, 6, 7))])
def test_auto_servers_take_half_the_gpus(n, servers, trainer):
    plan = plan_gpus(h200s(n), num_servers="auto")
    assert plan.mode == "split" and plan.num_servers == len(servers) and plan.trainer_gpus == trainer
    assert tuple(plan.for_server(i).server_gpus for i in range(plan.num_servers)) == servers
    for i, group in enumerate(servers):  # each server process sees only its own GPU
        assert plan.for_server(i).server_env()["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, group))
    assert plan.kernel_env()["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, trainer))
    if len(servers) > 1:
        assert f"{len(servers)} servers on GPU 0 | 1" in plan.describe()
        assert "→ server 1" in plan.describe()


def test_one_gpu_shares_memory_between_servers():
    plan = plan_gpus(h200s(1), num_servers=2)
    assert plan.mode == "colocated" and plan.num_servers == 2 and plan.server_mem_fraction == 0.35
    assert [plan.for_server(i).server_env()["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["0", "0"]
    assert "2 servers and trainer share GPU 0; server memory fraction 0.35 each" in plan.describe()
    assert plan_gpus(h200s(1), num_servers=2, server_mem_fraction=0.3).for_server(1).server_mem_fraction == 0.3
    assert plan_gpus(h200s(1), num_servers="auto").num_servers == 1
    assert plan_gpus([], num_servers=3).num_servers == 3 and "3 CPU engines" in plan_gpus([], num_servers=3).describe()


def test_explicit_servers_ranks_and_tensor_parallel():
    plan = plan_gpus(h200s(8), num_servers=2, server_tp=2, trainer_ranks=2)
    assert [plan.for_server(i).server_gpus for i in range(2)] == [(0, 1), (2, 3)]
    assert plan.trainer_gpus == (4, 5) and plan.server_tp == 2
    assert "(tensor parallel 2)" in plan.describe() and "GPU 6" in plan.describe()  # idle ones listed
    assert plan_gpus(h200s(4), server_tp=2).for_server(0).server_gpus == (0, 1)  # one TP server, 2 trainer GPUs
    with pytest.raises(ValueError, match="do not fit on 4 GPUs"):
        plan_gpus(h200s(4), num_servers=3, trainer_ranks=2)
    with pytest.raises(ValueError, match="colocated shares one"):
        plan_gpus(h200s(1), server_tp=2, prefer="colocated")
    with pytest.raises(ValueError, match="num_servers"):
        plan_gpus(h200s(2), num_servers=0)
    # the single-server plans stay as they were: server_groups empty, for_server is the plan itself
    one = plan_gpus(h200s(4))
    assert one.server_groups == () and one.for_server(0) is one and one.num_servers == 1


# ---- launch_mem_fraction: a share of the total, re-expressed over what is free ---------------
def test_a_second_server_on_one_gpu_gets_its_share_of_the_total_not_of_what_is_left():
    """SGLang 0.5.14 sizes its KV cache as free-after-load - (1 - f) x free-at-start: the second of
    two servers planned at 0.35 of an H200 gets f over the ~65 % left, and its budget is then the
    planned 0.35 x total (at raw 0.35 it had none on the H200 at 7de1b1f)."""
    total = 143771.0
    empty, first = h200s(1), [GpuInfo(0, "NVIDIA H200", "GPU-0000", total, 512.0 + 0.35 * total)]
    assert gpus.launch_mem_fraction(0.35, (0,), empty) == pytest.approx(0.35 * total / (total - 512), abs=1e-4)
    f = gpus.launch_mem_fraction(0.35, (0,), first)
    free_at_start = first[0].mem_free_mib
    assert f == pytest.approx(0.5414, abs=1e-4) and free_at_start * f == pytest.approx(0.35 * total, rel=1e-3)
    assert free_at_start * 0.35 < 0.35 * total * 0.66  # what the raw share would have left it


def test_a_share_that_no_longer_fits_gets_what_fits_and_says_how_to_free_memory(caplog):
    """A restart beside a live worker (0.35) and a trainer (0.28): 51.9 GiB free, 49.1 GiB planned;
    beside the 6 GiB reserve it gets 45.9 GiB, not 0.35 of what is free (18 GiB); with less free than
    the reserve needs it gets 0.35 of the free memory, as before, never refused."""
    total = 143771.0
    crowded = [GpuInfo(0, "NVIDIA H200", "GPU-0000", total, 0.63 * total)]
    f = gpus.launch_mem_fraction(0.35, (0,), crowded)
    free = crowded[0].mem_free_mib
    assert f * free == pytest.approx(free - gpus.LAUNCH_RESERVE_MIB, rel=1e-3) and f * free > 0.35 * free * 2
    assert "GPU 0 has 51.9 GiB free of 140.4 GiB" in caplog.text and "starts with 45.9 GiB" in caplog.text
    assert "torch.cuda.empty_cache()" in caplog.text
    nearly_full = [GpuInfo(0, "NVIDIA H200", "GPU-0000", total, total - 6.5 * 1024)]  # less than the reserve + share x free
    assert gpus.launch_mem_fraction(0.35, (0,), nearly_full) == 0.35  # what it got before, never refused
    assert gpus.launch_mem_fraction(0.35, (0,), [GpuInfo(0, "x", "u", total, total)]) == 0.35  # nothing free


def test_the_tightest_gpu_decides_and_unknown_gpus_leave_the_share():
    gib = 1024.0
    pair = [GpuInfo(0, "NVIDIA H200", "GPU-0000", 100 * gib, 0.0), GpuInfo(1, "NVIDIA H200", "GPU-0001", 100 * gib, 50 * gib)]
    assert gpus.launch_mem_fraction(0.3, (0, 1), pair) == 0.6
    assert gpus.launch_mem_fraction(0.3, (7,), pair) == 0.3
