"""Fleet logic without processes: counters summed and kept monotonic across a worker's restart,
per-worker windows, adapter loads on every worker, restart of only the dead worker (dropped when
it will not start), router restarted when a worker's URL changed, and one config per server."""
import asyncio

import pytest

from artsg_nb.engines import AdapterExistsError, UnknownAdapterError
from artsg_nb.serving import fleet as fleet_module
from artsg_nb.serving.fleet import Fleet, FleetClient, _Counters, fleet_configs, gpu_lanes
from artsg_nb.serving.gpus import GpuInfo, plan_gpus
from artsg_nb.serving.server import ServerConfig, ServerStartError


class FakeWorker:
    def __init__(self, prompt=0.0, cached=0.0):
        self.prompt, self.cached, self.loaded, self.engine = prompt, cached, [], "cpu"

    async def metrics_text(self):
        return f"sglang:prompt_tokens_total {self.prompt}\nsglang:cached_tokens_total {self.cached}\n"

    async def load_adapter(self, name, path):
        if name in self.loaded:
            raise AdapterExistsError(f"{name} exists")
        self.loaded.append(name)
        return 0.1

    async def unload_adapter(self, name):
        if name not in self.loaded:
            raise UnknownAdapterError(name)
        self.loaded.remove(name)


class FakeServer:
    def __init__(self, port, alive=True, fails=False):
        self.port, self._alive, self.fails, self.restarts, self.stopped = port, alive, fails, 0, False

    url = property(lambda self: f"http://127.0.0.1:{self.port}")
    log_path = "fake.log"

    def alive(self):
        return self._alive

    def restart(self):
        self.restarts += 1
        if self.fails:
            raise ServerStartError("will not start")
        self._alive = True
        self.port += 1000  # the old port was taken meanwhile: a new URL
        return self

    def stop(self, timeout_s=10.0):
        self.stopped, self._alive = True, False

    def log_tail(self, n=20):
        return "tail"


class FakeRouter:
    def __init__(self, workers):
        self.workers, self.stopped = workers, False

    def alive(self):
        return not self.stopped

    def stop(self, timeout_s=10.0):
        self.stopped = True


def make_fleet(tmp_path, monkeypatch, servers):
    fleet = Fleet([ServerConfig(engine="cpu", model_path=str(tmp_path), run_dir=str(tmp_path))] * len(servers), tmp_path)
    fleet.servers = servers
    fleet._counters = {id(s): _Counters() for s in servers}
    started = []

    def start_router():  # what Fleet._start_router does, without a process
        started.append(FakeRouter([s.url for s in fleet.servers]))
        fleet.router = started[-1]

    monkeypatch.setattr(fleet, "_start_router", start_router)
    start_router()
    return fleet, started


def test_counters_are_summed_per_worker_and_survive_a_restart(tmp_path, monkeypatch):
    fleet, _ = make_fleet(tmp_path, monkeypatch, [FakeServer(1), FakeServer(2)])
    w = [FakeWorker(100, 50), FakeWorker(10, 0)]
    client = FleetClient(fleet, front=w[0], workers=w)
    assert "sglang:prompt_tokens_total 110.0" in asyncio.run(client.metrics_text())
    w[0].prompt, w[0].cached, w[1].prompt, w[1].cached = 200, 140, 30, 15
    asyncio.run(client.metrics_text())
    assert fleet.worker_stats() == {"worker_hit_rates": [0.9, 0.75], "worker_prompt_tokens": [100, 20]}
    w[1].prompt, w[1].cached = 8, 4  # worker 1 restarted: its counters began again at 0
    text = asyncio.run(client.metrics_text())
    assert "sglang:prompt_tokens_total 238.0" in text and "sglang:cached_tokens_total 159.0" in text
    assert fleet.worker_stats()["worker_prompt_tokens"] == [0, 8]


def test_adapter_loads_reach_every_worker(tmp_path, monkeypatch):
    fleet, _ = make_fleet(tmp_path, monkeypatch, [FakeServer(1), FakeServer(2)])
    w = [FakeWorker(), FakeWorker()]
    w[1].loaded.append("policy-step-1")  # kept through a restart of the other worker
    client = FleetClient(fleet, front=w[0], workers=w)
    asyncio.run(client.load_adapter("policy-step-1", "/x"))
    assert [x.loaded for x in w] == [["policy-step-1"]] * 2
    asyncio.run(client.unload_adapter("policy-step-1"))
    assert [x.loaded for x in w] == [[], []]
    with pytest.raises(UnknownAdapterError):
        asyncio.run(client.unload_adapter("policy-step-9"))


def test_restart_only_the_dead_worker_and_reroute(tmp_path, monkeypatch):
    a, b = FakeServer(1), FakeServer(2, alive=False)
    fleet, routers = make_fleet(tmp_path, monkeypatch, [a, b])
    assert not fleet.alive() and fleet.dead() == [b]
    fleet.restart()
    assert (a.restarts, b.restarts) == (0, 1) and fleet.alive()
    assert routers[0].stopped and routers[-1].workers == [a.url, b.url]  # b's new URL is routed


def test_a_worker_that_will_not_start_is_dropped_while_one_remains(tmp_path, monkeypatch):
    a, b = FakeServer(1), FakeServer(2, alive=False, fails=True)
    fleet, routers = make_fleet(tmp_path, monkeypatch, [a, b])
    fleet.restart()
    assert fleet.servers == [a] and fleet.dropped == [b] and routers[-1].workers == [a.url]
    c = FakeServer(3, alive=False)
    fleet2, _ = make_fleet(tmp_path, monkeypatch, [FakeServer(4), c])
    assert fleet2.drop_dead() and fleet2.servers[0].port == 4 and fleet2.alive()
    lone = FakeServer(5, alive=False, fails=True)
    fleet3, _ = make_fleet(tmp_path, monkeypatch, [lone])
    assert not fleet3.drop_dead()  # never drop the last worker
    with pytest.raises(ServerStartError):
        fleet3.restart()


def test_one_config_per_server_with_its_gpu_and_tp_flag(tmp_path):
    base = ServerConfig(engine="sglang", model_path=str(tmp_path), run_dir=str(tmp_path / "run"), extra_args=("--x",))
    gpus = [GpuInfo(i, "H200", f"GPU-{i}", 1.0, 0.0) for i in range(8)]
    configs = fleet_configs(base, plan_gpus(gpus, num_servers=2, server_tp=2))
    assert [c.run_dir for c in configs] == [str(tmp_path / "run" / "servers" / str(i)) for i in range(2)]
    assert [c.gpu_plan.server_env()["CUDA_VISIBLE_DEVICES"] for c in configs] == ["0,1", "2,3"]
    assert configs[1].extra_args == ("--x", "--tp-size", "2")
    shared = fleet_configs(base, plan_gpus(gpus[:1], num_servers=2))
    assert [c.resolved_mem_fraction() for c in shared] == [0.35, 0.35] and shared[0].extra_args == ("--x",)


# ---- start order: workers sharing a GPU start in turn ----------------------------------------
class TimedStart:
    """A worker whose start takes a while and records when it ran; `meet` (a Barrier) makes the
    workers wait for each other inside start, so started one after another they cannot pass it."""

    def __init__(self, config, log, meet=None):
        self.config, self.log, self.meet = config, log, meet

    def start(self, reap=True):
        import time

        t0 = time.monotonic()
        if self.meet is not None:
            self.meet.wait()
        else:
            time.sleep(0.3)  # started together, two such starts would overlap
        self.log.append((self, t0, time.monotonic()))
        return self

    def stop(self, timeout_s=10.0):
        pass


def timed_fleet(tmp_path, monkeypatch, plan, meet=None, engine="sglang"):
    configs = fleet_configs(ServerConfig(engine=engine, model_path=str(tmp_path), run_dir=str(tmp_path)), plan)
    fleet, log = Fleet(configs, tmp_path), []
    fleet.servers = [TimedStart(c, log, meet) for c in configs]
    monkeypatch.setattr(fleet, "_adopt_workers", lambda: None)
    monkeypatch.setattr(fleet, "_start_router", lambda: None)
    monkeypatch.setattr(fleet_module.procs, "reap_orphans", lambda: None)
    return fleet, log


def overlap(a, b) -> bool:
    return a[1] < b[2] and b[1] < a[2]


def test_workers_sharing_a_gpu_start_one_after_another(tmp_path, monkeypatch):
    """Started together, two SGLang servers on one GPU each counted the other's memory as free
    and the second found no room for its KV cache (the colocated fleet fault test, H200 at 7de1b1f)."""
    fleet, log = timed_fleet(tmp_path, monkeypatch, plan_gpus([h200(0)], num_servers=2))
    assert [len(lane) for lane in gpu_lanes(fleet.servers)] == [2]
    fleet.start()
    assert len(log) == 2 and not overlap(*log) and [e[0] for e in log] == fleet.servers


def test_workers_on_their_own_gpus_still_start_side_by_side(tmp_path, monkeypatch):
    import threading

    both_inside = threading.Barrier(2, timeout=10)  # broken (an error) if one waited for the other's end
    fleet, log = timed_fleet(tmp_path, monkeypatch, plan_gpus([h200(i) for i in range(4)], num_servers=2), both_inside)
    assert [len(lane) for lane in gpu_lanes(fleet.servers)] == [1, 1]
    fleet.start()
    assert len(log) == 2


def test_cpu_engines_have_a_lane_each_and_planless_gpu_workers_share_one(tmp_path):
    configs = fleet_configs(ServerConfig(engine="cpu", model_path=str(tmp_path), run_dir=str(tmp_path)),
                            plan_gpus([], num_servers=3))
    assert [len(lane) for lane in gpu_lanes(Fleet(configs, tmp_path).servers)] == [1, 1, 1]
    inherited = [ServerConfig(engine="sglang", model_path=str(tmp_path), run_dir=str(tmp_path / str(i))) for i in range(2)]
    assert [len(lane) for lane in gpu_lanes(Fleet(inherited, tmp_path).servers)] == [2]  # the kernel's GPU, shared


def h200(i: int) -> GpuInfo:
    return GpuInfo(i, "NVIDIA H200", f"GPU-{i}", 143771.0, 512.0)


def test_every_client_implements_the_declared_interface_itself():
    """A run holds its client as an engines.InferenceClient: each engine's client and the fleet's
    have every member of it written out (FleetClient forwarded through __getattr__ before)."""
    from artsg_nb import engines
    from artsg_nb.engines.interface import CLIENT_MEMBERS, InferenceClient

    clients = [engines.make_client(name, "http://127.0.0.1:1", "m") for name in engines.ENGINES]
    clients.append(FleetClient(object(), front=clients[0], workers=clients[:1]))
    for client in clients:
        assert "__getattr__" not in dir(type(client)), type(client).__name__  # no implicit forwarding
        missing = [name for name in CLIENT_MEMBERS if not hasattr(client, name)]
        assert not missing and isinstance(client, InferenceClient), (type(client).__name__, missing)
    assert set(CLIENT_MEMBERS) == {n for n in dir(InferenceClient) if not n.startswith("_")} | set(
        InferenceClient.__annotations__)
