"""The Tinker API over HTTP: the routes the `tinker` client calls, on 127.0.0.1 behind an API key.

What it does: `make_app(service, api_key)` is a FastAPI app with the client's routes under
/api/v1 — handshake (client/config, client/dynamic_config, healthz, get_server_capabilities,
telemetry), sessions (create_session, session_heartbeat, sessions/{id}/finish), training
(create_model, get_info, forward_backward, optim_step, save_weights_for_sampler, save_weights),
sampling (create_sampling_session, samplers/{id}, asample) and futures (retrieve_future, which
long-polls up to `poll_s`). A session that sends nothing, not even the client's 10-second
heartbeat, for `session_idle_s` is finished (a client that died): its models leave the trainer.
Every request must carry the key (`X-API-Key`, which the client sends,
or `Authorization: Bearer`); a call this server does not have answers 404 with the list of those
it has, a request it cannot serve 400 saying why (the client raises both at once, without retries).
`TinkerServer` runs the app with uvicorn in a thread of this process (the trainer lives here):
`with TinkerServer(service) as srv:` then `tinker.ServiceClient(base_url=srv.base_url,
api_key=srv.api_key)`.

Flags the handshake sets for the client: no JWT exchange, httpx transport, forward_backward
chunks sent one after another (each model's requests then arrive in order), no zstd bodies.

What it does not do: the operations themselves (service.py) or listen beyond 127.0.0.1 unless
told (`host`); it is one user's local server, not a multi-tenant service.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from .futures import Outcome
from .service import TinkerService
from .wire import (PROTO_CONTENT_TYPE, CreateModel, CreateSamplingSession, CreateSession, ModelRef, OptimStep,
                   RetrieveFuture, Sample, SaveWeights, SessionRef, WireError, fwdbwd_from_json, fwdbwd_from_proto)

log = logging.getLogger(__name__)

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
"""The client's feature flags (tinker.types.ClientConfigResponse), see the module docstring."""
ROUTES = ("create_session", "session_heartbeat", "sessions/{id}/finish", "create_model", "get_info",
          "forward_backward", "optim_step", "save_weights_for_sampler", "save_weights", "create_sampling_session",
          "samplers/{id}", "asample", "retrieve_future", "get_server_capabilities", "healthz", "client/config",
          "client/dynamic_config", "telemetry")


def make_app(service: TinkerService, api_key: str, poll_s: float = 20.0, session_idle_s: float = 120.0) -> FastAPI:
    """The Tinker routes over `service`; requests without `api_key` are refused (401). A session
    that sends nothing (not even its 10-second heartbeat) for `session_idle_s` is finished."""
    @asynccontextmanager
    async def lifespan(app):
        reaper = asyncio.create_task(_finish_idle_sessions(service, session_idle_s))
        yield
        reaper.cancel()
        await service.futures.close()  # in the server's loop, as it stops

    app = FastAPI(title="artsg_nb Tinker-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        sent = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        if not secrets.compare_digest(sent.encode(), api_key.encode()):
            return JSONResponse({"detail": "missing or wrong API key: pass api_key= (or TINKER_API_KEY) as the "
                                           "server printed it"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(WireError)
    async def bad_request(request: Request, e: WireError):
        return JSONResponse({"detail": str(e)}, status_code=400)

    @app.exception_handler(KeyError)
    async def not_found(request: Request, e: KeyError):
        return JSONResponse({"detail": str(e.args[0]) if e.args else "not found"}, status_code=404)

    _handshake_routes(app, service)
    _training_routes(app, service)
    _sampling_routes(app, service, poll_s)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def unsupported(path: str):
        raise HTTPException(404, f"/{path} is not supported by artsg_nb's Tinker server; supported under /api/v1: "
                                 f"{', '.join(ROUTES)}")

    return app


async def _finish_idle_sessions(service: TinkerService, idle_s: float) -> None:
    while True:
        await asyncio.sleep(min(idle_s / 4, 30.0))
        try:
            await service.finish_idle_sessions(idle_s)
        except Exception:  # the next round tries again; serving goes on
            log.exception("finishing idle Tinker sessions failed")


def _handshake_routes(app: FastAPI, service: TinkerService) -> None:
    @app.post("/api/v1/client/config")
    async def client_config():
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": service.base_model, "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.post("/api/v1/create_session")
    async def create_session(body: CreateSession):
        return {"type": "create_session", "session_id": service.create_session()}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(body: SessionRef):
        service.check_session(body.session_id)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str):
        await service.finish_session(session_id)
        return None


def _training_routes(app: FastAPI, service: TinkerService) -> None:
    @app.post("/api/v1/create_model")
    async def create_model(body: CreateModel):
        return {"request_id": service.create_model(body)}

    @app.post("/api/v1/get_info")
    async def get_info(body: ModelRef):
        return service.info(body.model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        body = await request.body()
        if request.headers.get("content-encoding", "").lower() == "zstd":
            raise WireError("zstd-compressed bodies are not supported (the handshake turned them off)")
        proto = PROTO_CONTENT_TYPE in request.headers.get("content-type", "")
        req = fwdbwd_from_proto(body) if proto else fwdbwd_from_json(body)
        return {"request_id": service.forward_backward(req), "model_id": req.model_id}

    @app.post("/api/v1/optim_step")
    async def optim_step(body: OptimStep):
        return {"request_id": service.optim_step(body), "model_id": body.model_id}

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(body: SaveWeights):
        return {"request_id": service.save_weights(body, "sampler_weights"), "model_id": body.model_id}

    @app.post("/api/v1/save_weights")
    async def save_weights(body: SaveWeights):
        return {"request_id": service.save_weights(body, "weights"), "model_id": body.model_id}

    @app.post("/api/v1/load_weights")
    async def load_weights():
        raise WireError("load_weights (create_training_client_from_state, load_state) is not supported: a model "
                        "cannot be resumed from saved state here; saved adapters are PEFT folders under the server's "
                        "root directory")


def _sampling_routes(app: FastAPI, service: TinkerService, poll_s: float) -> None:
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(body: CreateSamplingSession):
        return {"type": "create_sampling_session", "sampling_session_id": service.create_sampling_session(body)}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str):
        return service.sampler_info(sampler_id)

    @app.post("/api/v1/asample")
    async def asample(body: Sample):
        request_id, sequence_ids = service.sample(body)
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(body: RetrieveFuture):
        outcome = await service.futures.wait(body.request_id, poll_s)
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"},
                                status_code=408)
        return _outcome_response(outcome)


def _outcome_response(outcome: Outcome) -> Response:
    if outcome.error is not None:
        return JSONResponse({"error": outcome.error, "category": outcome.category})
    if isinstance(outcome.result, bytes):
        return Response(outcome.result, media_type=PROTO_CONTENT_TYPE)
    return JSONResponse(outcome.result)


class TinkerServer:
    """`make_app` served by uvicorn in a daemon thread of this process; a context manager."""

    def __init__(self, service: TinkerService, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 poll_s: float = 20.0, session_idle_s: float = 120.0, startup_timeout_s: float = 30.0):
        """`port` 0 picks a free one; `api_key` None makes a random one (read it from .api_key;
        the client accepts only keys that start with "tml-")."""
        self.service, self.host, self.port = service, host, port
        self.api_key = api_key or "tml-" + secrets.token_urlsafe(24)
        self.poll_s, self.session_idle_s, self.startup_timeout_s = poll_s, session_idle_s, startup_timeout_s
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "TinkerServer":
        import uvicorn

        config = uvicorn.Config(make_app(self.service, self.api_key, self.poll_s, self.session_idle_s), host=self.host, port=self.port,
                                log_level="warning", timeout_keep_alive=75)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="tinker-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Tinker API did not start on {self.host}:{self.port} within "
                                   f"{self.startup_timeout_s:.0f} s (port taken? see the log above)")
            time.sleep(0.05)  # uvicorn offers no event to wait on; this polls its flag with a deadline
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        log.info("Tinker-compatible API on %s", self.base_url)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving (idempotent); futures still running are cancelled."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> "TinkerServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
