"""Start, watch and stop the inference server — SGLang, vLLM or the CPU engine — from the kernel.

What it does: `start_server(ServerConfig(...))` launches the engine with its own environment's
interpreter (server_env.py) as a subprocess of the notebook kernel, in its own process group, bound
to 127.0.0.1 on a free port, output to `<run_dir>/<engine>.log`; it polls GET /health and the
engine's authenticated route (with a tqdm bar) while watching the process, and calls it ready only
when the answer comes from that process (the socket on the port is its own; another process on
the port is never sent the key and ends the start with PortInUseError). It raises with the log tail
when start-up fails. A re-run cell with the same config gets the same live server back; a changed config replaces it.
Each server is recorded on disk (procs.py); after a kernel restart, starting the same config
adopts the dead kernel's live server (its key read from the 0600 record, checked on an
authenticated route) instead of a cold start, and other orphans of dead kernels are stopped.
Servers this process started or adopted are stopped by `stop()`; at a clean exit without it they
are kept for a grace period for the next kernel to adopt (leftovers.py), then stopped.

Security (docs/security.md): every server requires a random API key by default
(`api_key="auto"`, a fresh `secrets.token_urlsafe(32)` per start); `api_key=None` turns it off,
with a warning. The key goes to the server by environment variable (EngineSpec.api_key_env),
never on the command line, which every local user can read. Extra flags from
$ARTSG_SGLANG_ARGS / $ARTSG_VLLM_ARGS are applied here (`with_env_args`), for every caller. `build_command` / `build_env` are pure, so
the engines' command lines are unit-tested without launching anything.

What it does not: talk the engines' APIs (engines/, via `Server.client()`), including the
memory release/resume around training in colocated mode (`client.release_memory`, which needs the
server started with `enable_memory_saver=True`) — those are client calls.
"""
from __future__ import annotations

import copy
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
from tqdm.auto import tqdm

from .. import engines
from . import gpus, leftovers, managed, procs
from ..engines import EngineClient
from .procs import reap_orphans  # noqa: F401  (public here too)
from .server_config import (TARGET_MODULES, ModelPathError, ServerConfig, ServerError, ignored_options,
                            server_url, build_command, build_env, check_model_path, config_hash, CLIENT_OPTIONS,
                            resolve_api_key, with_env_args)
from .managed import ManagedProcess
from .server_env import ServerEnv, find_server_env

log = logging.getLogger(__name__)

_HINTS = [
    (("address already in use", "errno 98", "eaddrinuse"),
     "another process holds the port: leave port=None to get a free one"),
    (("torch-memory-saver is not installed", "no module named 'torch_memory_saver'"),
     "enable_memory_saver=True needs the torch_memory_saver package in the server environment "
     "(offline GPU bundle: .whl-tms, tools/gpu/README.md); or start without it"),
    (("out of memory", "outofmemoryerror", "not enough memory"),
     "lower mem_fraction, or free GPU memory (nvidia-smi shows who holds it; `python -m artsg_nb.servers list` "
     "shows servers kept after a kernel exit or left by a killed one, `... stop` stops them)"),
    (("no module named", "modulenotfounderror", "importerror"),
     "the server environment lacks a package: check find_server_env() and ARTSG_SERVER_PYTHONPATH"),
    (("unrecognized arguments", "ambiguous option", "invalid choice", "error: argument"),
     "this engine version rejects a flag: compare extra_args with `python -m <engine> --help`"),
    (("no cuda gpus are available", "found no nvidia driver", "cuda driver"),
     "the server sees no GPU: check the GPU plan (CUDA_VISIBLE_DEVICES) and nvidia-smi"),
]


class ServerStartError(ServerError):
    """The server process exited during start-up (message: exit code, what to try, log tail)."""


class ServerNotReady(ServerStartError):
    """No 200 from /health before the start-up timeout; the process was stopped."""


class PortInUseError(ServerStartError):
    """The port is another process's: seen before launch, listening there while the server
    started (a lost race), or the server's own bind failed (in its log)."""


class Server(ManagedProcess):
    """One server process: `start()`, `stop()`, `restart()`, `alive()`, `log_tail()`, `client()`.

    A context manager: `with start_server(cfg) as server: ...` stops it on exit. The process's
    lifecycle (spawn, record, live set, ready-wait, log tail, stop) is managed.ManagedProcess's.
    """

    def __init__(self, config: ServerConfig, api_key: str | None = None):
        config = self.config = with_env_args(config)
        self.proc = None
        self.port: int | None = config.port
        self.record: procs.ProcessRecord | None = None
        self.api_key: str | None = None
        """The key of the running server (cfg.api_key resolved); the client sends it."""
        self.launch_key = api_key
        """The key every launch of this server uses instead of cfg.api_key's (the workers of a
        fleet share the router's); only a server started with it is adopted. None: cfg's."""
        self.server_env: ServerEnv | None = None
        self.log_path = Path(config.run_dir).resolve() / f"{config.engine}.log"
        self.config_hash = config_hash(config)
        self._log_offset = 0
        self._listener: str | None = None

    @property
    def label(self) -> str:
        return f"{self.config.engine} server"

    @property
    def adopted(self) -> bool:
        """Started by a kernel that died, taken over by this one (no Popen handle)."""
        return self.record is not None and self.proc is None

    @property
    def url(self) -> str:
        return server_url(self.config.host, self.port)

    def start(self, reap: bool = True) -> "Server":
        """Adopt the dead kernel's server of this config, or launch and wait for /health;
        returns self. A no-op when already running. `reap=False`: the caller stops the servers
        of dead kernels itself (a fleet, once each worker had its chance to be adopted)."""
        if self.alive():
            return self
        self.stop(timeout_s=5)  # after a crash: workers it left behind, its records
        cfg = self.config
        if self.adopt(reap=reap):
            return self
        if not cfg._command_override:
            check_model_path(cfg.model_path)
        if reap:
            reap_orphans()
        self._check_run_dir_record()
        self.api_key = self.launch_key or resolve_api_key(cfg)
        for name in ignored_options(cfg):
            log.warning("%s has no equivalent on engine %r; ignored", name, cfg.engine)
        self.server_env = (ServerEnv(cfg.python or sys.executable, cfg.engine, "test", {}, "override")
                           if cfg._command_override else find_server_env(cfg.spec, cfg.python))
        for attempt in range(3):
            self.port = self._choose_port()
            self._launch()
            try:
                self._wait_ready()
                return self
            except PortInUseError:
                if cfg.port is not None or attempt == 2:
                    raise
                log.info("port %d was taken while starting; retrying on another", self.port)
                self.port = None
            except BaseException:  # includes an interrupted cell: never leave a half-started server
                self.stop(timeout_s=5)
                raise
        raise AssertionError("unreachable")

    def restart(self) -> "Server":
        """Stop and start again with the same config (and the same port when it is free)."""
        self.stop()
        return self.start()

    def client(self) -> EngineClient:
        """An async client for this engine (engines.make_client)."""
        return engines.make_client(self.config.spec, self.url, self.config.model_path, api_key=self.api_key,
                                   admin_timeout_s=self.config.admin_timeout_s,
                                   prompt_warm_up=self.config.prompt_warm_up)

    def drop_dead(self) -> bool:
        """A fleet's way on without its dead workers (serving.inference): one server has none."""
        return False

    def worker_stats(self) -> dict[str, list]:
        """A fleet's per-worker columns (serving.inference): one server has none."""
        return {}

    def at_exit(self) -> None:
        """A clean exit (a kernel restart) keeps the server for the next kernel to adopt, for
        leftovers.exit_grace_s() (then a watcher stops it); with a grace of 0 it stops now."""
        grace = leftovers.exit_grace_s()
        if grace > 0 and self.alive():
            self.record = leftovers.keep_for_next_kernel(self.record, grace)
        else:
            self.stop(timeout_s=5)

    def __repr__(self) -> str:
        state = f"pid {self.pid}, up" if self.alive() else "stopped"
        return f"<Server {self.config.engine} {self.url} ({state}), log {self.log_path}>"

    # ---- start-up steps ------------------------------------------------------------------
    def _choose_port(self) -> int:
        """The port to launch on. A given port already taken fails here at once (naming its
        owner); that check is only a fast answer: the server binds the port itself, and
        `_wait_ready` catches a port someone took after this check."""
        host, port = self.config.host, self.config.port
        if port is not None:
            if not procs.port_is_free(host, port):
                owner = procs.port_owner(port)
                raise PortInUseError(
                    f"port {port} on {host} is already in use{f' by {owner}' if owner else ''}. "
                    "Try: port=None to get a free port, stop the other server, or "
                    "artsg_nb.serving.server.reap_orphans() if a dead kernel left it running.")
            return port
        if self.port is not None and procs.port_is_free(host, self.port):
            return self.port  # a restart keeps the URL the client knows
        return procs.pick_free_port(host)

    def _launch_config(self) -> ServerConfig:
        """The config this launch runs: the planned memory share re-expressed over the memory free
        on the server's GPUs now, for an engine that counts its fraction from there (SGLang)."""
        cfg = self.config
        share, server_gpus = cfg.resolved_mem_fraction(), getattr(cfg.gpu_plan, "server_gpus", ())
        if share is None or not server_gpus or cfg.spec.mem_fraction_of != "free":
            return cfg
        fraction = gpus.launch_mem_fraction(share, server_gpus)
        if fraction != share:
            log.info("%s: memory share %.2f of GPU %s is %.4f of its free memory now", cfg.engine, share,
                     ",".join(map(str, server_gpus)), fraction)
        launch = copy.copy(cfg)  # not dataclasses.replace: __post_init__ would warn about the key again
        launch.mem_fraction = fraction
        return launch

    def _launch(self) -> None:
        cfg = self._launch_config()
        cmd = build_command(cfg, self.server_env.python, self.port)
        self._spawn(cmd, build_env(cfg, self.server_env.extra_env, self.api_key), port=self.port, host=cfg.host,
                    engine=cfg.engine, config_hash=self.config_hash, record_key=self.api_key)
        log.info("started %s (%s %s) pid %d on %s, log %s", cfg.engine, self.server_env.python,
                 self.server_env.version, self.proc.pid, self.url, self.log_path)

    def _wait_ready(self) -> None:
        """Wait until the process this call started answers: it is alive, the socket listening on
        the port is its own (or a worker's), and /health and the authenticated probe accept its
        key. Another process on the port (a second notebook that won the race for it, or any
        local user) is never probed, so it never receives the key, and it ends the wait with
        PortInUseError naming the port."""
        cfg = self.config
        bar = tqdm(total=round(cfg.timeout_s), desc=f"{cfg.engine} starting on {self.url}",
                   unit="s", leave=True, bar_format="{desc}: {n:.0f}/{total} s")
        self._listener, self._started_at = None, time.monotonic()
        with bar:
            try:
                self._poll_ready(cfg.timeout_s, tick=lambda s: bar.update(min(round(s), bar.total) - bar.n))
            except BaseException:
                _end_bar(bar, ok=False)
                raise
            _end_bar(bar, ok=True)

    def _ready(self, http: httpx.Client) -> bool:
        """Its own socket listens on the port and it answers with this start's key."""
        if self._listener != "ours":  # once it listens, the port is its own while it lives (polled before)
            self._listener = procs.listener_of(self.proc.pid, self.config.host, self.port)
        if self._listener == "foreign":
            raise self._port_taken_error(time.monotonic() - self._started_at)
        # None: this OS hides sockets' owners; the process being alive and its key
        # accepted are then all there is to go on.
        return self._listener in ("ours", None) and self._answers(http)

    def _not_ready_error(self, timeout_s: float) -> ServerNotReady:
        cfg, tail = self.config, self.log_tail(20)
        self.stop()
        return ServerNotReady(
            f"no /health on {cfg.host}:{self.port} after {timeout_s:.0f} s; the "
            f"{cfg.engine} process (still running) was stopped. Try: a larger "
            f"startup_timeout_s (a first start compiles kernels), or read the log. "
            f"Last 20 lines of {self.log_path}:\n{tail}")

    def _answers(self, http: httpx.Client) -> bool:
        """/health and the engine's authenticated route both 200 with this start's key. A server
        of ours that refuses its own key is an error, not a wait (the key did not reach it)."""
        try:
            if http.get(f"{self.url}/health").status_code != 200:
                return False
            code = http.get(f"{self.url}{self.config.spec.auth_probe}").status_code
        except httpx.HTTPError:
            return False  # not listening yet, or accepted but not answering (vLLM while loading)
        if code in (401, 403):
            tail = self.log_tail(20)
            self.stop(timeout_s=5)
            raise ServerStartError(
                f"the {self.config.engine} server on {self.config.host}:{self.port} refuses its own API "
                f"key ({code} on {self.config.spec.auth_probe}); it was stopped. Try: check that this "
                f"engine reads its key from ${self.config.spec.api_key_env}, or api_key=None. "
                f"Last 20 lines of {self.log_path}:\n{tail}")
        return code == 200

    def _port_taken_error(self, elapsed_s: float) -> PortInUseError:
        """Another process listens on the port this start launched on: stop ours (it cannot bind)."""
        owner = procs.port_owner(self.port)
        self.stop(timeout_s=5)
        return PortInUseError(
            f"port {self.port} on {self.config.host} was taken by another process"
            f"{f' ({owner})' if owner else ''} while the {self.config.engine} server was starting "
            f"({elapsed_s:.1f} s in): this start lost the race for the port and was stopped; nothing was "
            "sent to the other process. Try: port=None to get a free port, or stop the other server.")

    def _exit_error(self, code: int, elapsed_s: float) -> ServerStartError:
        tail = self.log_tail(20)
        self.stop(timeout_s=5)  # workers it forked may still be alive
        hint, cls = "read the log, or run the command by hand (first line of the log)", ServerStartError
        for i, (needles, what) in enumerate(_HINTS):
            if any(s in tail.lower() for s in needles):
                hint, cls = what, (PortInUseError if i == 0 else ServerStartError)
                break
        return cls(f"{self.config.engine} server exited with code {code} {elapsed_s:.1f} s into "
                   f"start-up on {self.config.host}:{self.port}. Try: {hint}. "
                   f"Last 20 lines of {self.log_path}:\n{tail}")

    def _check_run_dir_record(self) -> None:
        """Refuse to start over a live server of another kernel in the same run_dir; stop one
        that this process (after a module reload) or a dead one left there."""
        path = self.log_path.parent / f"{self.config.engine}.server.json"
        rec = procs.ProcessRecord.load(path)
        if rec is None or not rec.found_in(path) or not rec.server_alive():
            return
        if rec.owner_alive() and rec.owner_pid != os.getpid():
            raise ServerStartError(
                f"a {rec.engine} server (pid {rec.pid}, port {rec.port}) already runs for "
                f"{rec.run_dir}, started by another live process (pid {rec.owner_pid}). "
                "Try: stop it from there, or use another run_dir.")
        log.warning("stopping the %s server pid %d left in %s", rec.engine, rec.pid, rec.run_dir)
        procs.stop_group(rec.pgid)
        rec.remove()


    def adopt(self, reap: bool = True) -> bool:
        """Take over the live server a dead kernel started in this run_dir with this config
        (and `launch_key`, when set): its key from the 0600 record must open an authenticated
        route. Else False (the caller starts a new server; reaping stops the orphan). `reap`:
        stop the other dead kernels' servers once adopted."""
        path = self.log_path.parent / f"{self.config.engine}.server.json"
        rec = procs.ProcessRecord.load(path)
        if (rec is None or not rec.found_in(path) or rec.config_hash != self.config_hash
                or rec.owner_alive() or not rec.server_alive()
                or (self.config.port is not None and rec.port != self.config.port)
                or (self.launch_key is not None and rec.api_key != self.launch_key)):
            return False
        claimed = leftovers.claim(path, rec)  # first: another kernel, or the watcher, may be taking it too
        if claimed is None:
            return False
        headers = {"Authorization": f"Bearer {rec.api_key}"} if rec.api_key else {}
        base = server_url(self.config.host, rec.port)
        try:
            with httpx.Client(timeout=httpx.Timeout(10.0, connect=2.0), headers=headers) as http:
                ok = (http.get(f"{base}/health").status_code == 200
                      and http.get(f"{base}{self.config.spec.auth_probe}").status_code == 200)
        except httpx.HTTPError:
            ok = False
        if not ok:  # claimed, so the start that follows stops it (_check_run_dir_record)
            log.warning("not adopting the %s server pid %d on port %d: it does not answer, or its "
                        "recorded key is refused", rec.engine, rec.pid, rec.port)
            return False
        self.port, self.api_key = rec.port, rec.api_key
        self._own(claimed)  # the record, claimed above, saved again as this Server's
        log.info("adopted the %s server pid %d on %s that a dead kernel (pid %d) started",
                 rec.engine, rec.pid, self.url, rec.owner_pid)
        if reap:
            reap_orphans()  # the others of dead kernels; this one's owner is now alive
        return True


_REGISTRY: dict[tuple[str, str], Server] = {}   # (run_dir, engine) → the server start_server gave


def start_server(cfg: ServerConfig | None = None, **overrides) -> Server:
    """Start a server for `cfg`, or return the live one a previous call started with the same
    config (a re-run cell). A different config for the same run_dir/engine replaces it.
    Keyword arguments build the config, or replace fields of `cfg`."""
    cfg = with_env_args(replace(cfg, **overrides) if cfg is not None else ServerConfig(**overrides))
    key = (str(Path(cfg.run_dir).resolve()), cfg.engine)
    old = _REGISTRY.get(key)
    if old is not None and old.alive() and old.config_hash == config_hash(cfg):
        log.info("reusing %s server pid %d on %s", cfg.engine, old.pid, old.url)
        old.config = replace(old.config, **{name: getattr(cfg, name) for name in CLIENT_OPTIONS})
        return old
    if old is not None:
        log.info("config changed for %s; stopping the old %s server", key[0], cfg.engine)
        old.stop()
    server = _REGISTRY[key] = Server(cfg)
    return server.start()


def exit_status(server) -> str:
    """How a server's process ended, for an error message ("was killed by SIGKILL", ...)."""
    code = server.proc.poll() if server.proc is not None else None
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def start_while(start_server, work):
    """(server, work's result): `start_server()` (launch, then /health) runs in a thread while
    `work()` (e.g. loading the trainer) runs here, so start-up costs the longer of the two, not
    their sum. If `work` fails, the server is stopped once its start returns; if the server fails,
    work's result is closed (when it has `close`). When both fail the server's error is raised (it
    checks the model path and shows the log tail)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="artsg-server-start") as pool:
        started = pool.submit(start_server)
        try:
            result = work()
        except BaseException as work_error:
            server_error = started.exception()
            if server_error is not None:
                raise server_error from work_error
            started.result().stop()
            raise
        try:
            return started.result(), result
        except BaseException:
            getattr(result, "close", lambda: None)()  # e.g. a RankedTrainer's rank processes
            raise


def stop_all() -> None:
    """Stop every server this process started."""
    managed.stop_all(Server)


def live_servers() -> list[Server]:
    """The servers this process started or adopted and has not stopped."""
    return managed.live(Server)


def _end_bar(bar, ok: bool) -> None:
    """End the start-up bar green on success, red on failure: tqdm.notebook paints a bar closed
    short of its total red, one at its total green (the text bar just says what happened)."""
    elapsed = round(bar.n)
    if ok:
        bar.bar_format = "{desc}: ready after {n:.0f} s"
        bar.total = max(elapsed, 1)
        bar.update(bar.total - bar.n)
    else:
        bar.bar_format = "{desc}: failed after {n:.0f} s"
        bar.total = elapsed + 1
