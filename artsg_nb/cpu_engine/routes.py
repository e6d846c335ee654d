"""HTTP routes of the CPU engine: SGLang's paths, status codes and error shapes over FastAPI.

What it does: maps each route the toolkit uses onto the Engine (engine.py): readiness
(/health 503 until the model is loaded and warmed up), info (/model_info, /server_info,
/v1/models and their deprecated get_* aliases), generation (/generate, streaming as SSE
`data: {...}` chunks ending with `data: [DONE]`; /v1/chat/completions), adapters
(/load_lora_adapter, /unload_lora_adapter with SGLang's LoRAUpdateOutput body), /flush_cache
(plain text, 400 while requests run), /release_memory_occupation and /resume_memory_occupation
(null body; Engine.release_memory and resume_memory), /metrics (Prometheus text) and the API
key check (as SGLang: every route but /health and /metrics needs `Authorization: Bearer <key>`). It receives the Engine object from __main__ and only calls it; engine.py never
imports this module.

Error shapes follow SGLang: generic 400s are {"error": {"message"}}, a broken sampling_params
contract is {"error": "<message>"}, chat errors are OpenAI's {"object": "error", ...}, adapter
errors are LoRAUpdateOutput with success=false.

What it deliberately does not do: any model, cache or scheduling work (the Engine does), and
SGLang's other routes (/pause_generation, weight updates, /v1/completions, ...), which get 404.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .engine import Engine
from .memory import OccupationError, requested_tags
from .model import AdapterError
from .protocol import BadRequest, chat_requests, chat_response, generate_requests, generate_response
from .request import Request
from .sampling import RequestSampling, RequestSamplingError

FLUSH_NOTE = ("Please check backend logs for more details. "
              "(When there are running or waiting requests, the operation will not be performed.)\n")
HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT


def create_app(engine: Engine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=engine.boot, name="cpu-engine-boot", daemon=True).start()
        yield
        if engine.scheduler is not None:
            engine.scheduler.stop()

    app = FastAPI(title="artsg_nb CPU engine", lifespan=lifespan)
    _add_auth(app, engine.args.api_key)
    _add_info_routes(app, engine)
    _add_generate_routes(app, engine)
    _add_control_routes(app, engine)
    return app


OPEN_ROUTES = frozenset({"/health", "/metrics"})
"""Answered without the key, as on SGLang with --api-key (liveness and Prometheus scrapes)."""


def _add_auth(app: FastAPI, api_key: str | None) -> None:
    if not api_key:
        return
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request: HttpRequest, call_next):
        given = request.headers.get("authorization", "").encode()
        if request.url.path not in OPEN_ROUTES and not hmac.compare_digest(given, expected):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


async def _json_body(request: HttpRequest) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise BadRequest(f"malformed JSON body: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("the JSON body must be an object")
    return body


def _not_ready() -> JSONResponse:
    return _error("the server is still starting (poll /health until 200)", 503)


# ---- info ----------------------------------------------------------------------------------
def _add_info_routes(app: FastAPI, engine: Engine) -> None:
    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.healthy() else 503)

    @app.get("/health_generate")
    async def health_generate():
        if not engine.healthy() or engine.memory.refusal():
            return Response(status_code=503)
        req = Request(input_ids=[0], params=RequestSampling(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(engine.run([req]), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200 if req.error is None else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        config = engine.runner.config if engine.runner else None
        return {
            "model_path": engine.args.model_path,
            "tokenizer_path": engine.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
            "served_model_name": engine.served_model_name,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return engine.server_info()

    @app.get("/v1/models")
    async def models():
        created = int(engine.started_ts)
        card = {"object": "model", "created": created, "owned_by": "sglang"}
        base = {"id": engine.served_model_name, **card, "root": engine.args.model_path, "parent": None,
                "max_model_len": engine.runner.context_len if engine.runner else None}
        adapters = [{"id": a.name, **card, "root": a.path, "parent": engine.served_model_name, "max_model_len": None}
                    for a in engine.adapters.values()]
        return {"object": "list", "data": [base, *adapters]}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ---- generation ----------------------------------------------------------------------------
def _add_generate_routes(app: FastAPI, engine: Engine) -> None:
    @app.post("/generate")
    async def generate(request: HttpRequest):
        if not engine.healthy():
            return _not_ready()
        try:
            body = await _json_body(request)
            # In a thread: tokenising a long text prompt (~0.7 s for 1e6 characters) must not
            # stall every other client of the event loop.
            reqs, is_batch = await asyncio.to_thread(generate_requests, body, engine.runner, engine.resolve_adapter)
        except RequestSamplingError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        except BadRequest as e:
            return _error(str(e))
        if refused := engine.memory.refusal():
            return _error(refused)
        with_text = bool(body.get("return_text_in_logprobs"))
        if body.get("stream"):
            return StreamingResponse(_sse(engine, reqs, is_batch, with_text), media_type="text/event-stream")
        await engine.run(reqs)
        failed = [r.error for r in reqs if r.error]
        if failed:
            return _error(f"generation failed: {failed[0]}", 500)
        outs = [generate_response(r, engine.runner, with_text) for r in reqs]
        return outs if is_batch else outs[0]

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        if not engine.healthy():
            return _not_ready()
        try:
            body = await _json_body(request)
            reqs = await asyncio.to_thread(chat_requests, body, engine.runner, engine.resolve_adapter,
                                           engine.served_model_name)
            if refused := engine.memory.refusal():
                raise BadRequest(refused)
        except (BadRequest, RequestSamplingError) as e:
            return JSONResponse({"object": "error", "message": str(e), "type": "BadRequestError",
                                 "param": None, "code": 400}, status_code=400)
        await engine.run(reqs)
        failed = [r.error for r in reqs if r.error]
        if failed:
            return JSONResponse({"object": "error", "message": f"generation failed: {failed[0]}",
                                 "type": "InternalServerError", "param": None, "code": 500}, status_code=500)
        return chat_response(body, reqs, engine.runner, engine.served_model_name, engine.args.enable_cache_report)


async def _sse(engine: Engine, reqs: list[Request], is_batch: bool, with_text: bool):
    """SGLang's stream: one `data: {...}` per new token (cumulative text/output_ids), then [DONE]."""
    index = {id(r): i for i, r in enumerate(reqs)}
    async for req, n, finished in engine.events(reqs):
        if req.error:
            chunk = {"error": {"message": f"generation failed: {req.error}"}}
        else:
            chunk = generate_response(req, engine.runner, with_text, n_tokens=n, finished=finished)
            if is_batch:
                chunk["index"] = index[id(req)]
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


# ---- control -------------------------------------------------------------------------------
def _add_control_routes(app: FastAPI, engine: Engine) -> None:
    def lora_output(success: bool, message: str = "", status: int = 200) -> JSONResponse:
        return JSONResponse({"rid": None, "http_worker_ipc": None, "success": success, "error_message": message,
                             "loaded_adapters": engine.loaded_adapters()}, status_code=status)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: HttpRequest):
        if not engine.healthy():
            return _not_ready()
        try:
            body = await _json_body(request)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise BadRequest("lora_name and lora_path (non-empty strings) are required")
            await engine.load_adapter(name, path, bool(body.get("pinned", False)))
        except (BadRequest, AdapterError) as e:
            return lora_output(False, str(e), 400)
        return lora_output(True)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: HttpRequest):
        if not engine.healthy():
            return _not_ready()
        try:
            body = await _json_body(request)
            name = body.get("lora_name")
            if not isinstance(name, str) or not name:
                raise BadRequest("lora_name (a non-empty string) is required")
            await engine.unload_adapter(name)
        except (BadRequest, AdapterError) as e:
            return lora_output(False, str(e), 400)
        return lora_output(True)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0):
        if not engine.healthy():
            return PlainTextResponse("Cache not flushed: the server is still starting.\n", status_code=503)
        deadline = time.monotonic() + timeout
        while not await engine.flush_cache():
            if time.monotonic() >= deadline:
                text = "Timed out waiting for idle state.\n" if timeout > 0 else "Cache not flushed.\n" + FLUSH_NOTE
                return PlainTextResponse(text, status_code=400)
            await asyncio.sleep(0.05)
        return PlainTextResponse("Cache flushed.\n" + FLUSH_NOTE)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: HttpRequest):
        return await _memory_call(engine, request, engine.release_memory)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: HttpRequest):
        return await _memory_call(engine, request, engine.resume_memory)


async def _memory_call(engine: Engine, request: HttpRequest, action) -> JSONResponse:
    """SGLang's shape: 200 with a null body, 400 {"error": {"message"}}."""
    if not engine.healthy():
        return _not_ready()
    try:
        await action(requested_tags(await _json_body(request)))
    except (BadRequest, OccupationError) as e:
        return _error(str(e))
    return JSONResponse(None)
