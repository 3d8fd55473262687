"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /ready, /metrics.

The model loads in a background thread after the port opens, so /health answers at once and /ready turns true
when the engine can serve (a Kubernetes startup probe waits on it). Every error leaves in OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunkpilot.engine.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError
from chunkpilot.engine.config import EngineConfig
from chunkpilot.engine.knobs_file import KnobsFileWatcher
from chunkpilot.engine.metrics import EngineMetrics
from chunkpilot.engine.protocol import ChatCompletionRequest, CompletionRequest, error_body
from chunkpilot.engine.responses import chat_chunks, chat_full, completion_chunks, completion_full

log = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    engine: EngineConfig
    served_model_name: str | None = None
    api_key: str | None = None
    knobs_file: str | None = None
    knobs_poll_interval: float = 0.2
    max_waiting: int = 256
    retry_after_seconds: int = 1
    grace_period: float = 30.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        from pathlib import Path

        return self.served_model_name or Path(self.engine.model).name


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, *, param: str | None = None, code: Any = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type_, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.type, param=self.param, code=self.code), self.status,
                            headers=self.headers)


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on /v1/*. A plain ASGI middleware on purpose: Starlette's
    BaseHTTPMiddleware (`@app.middleware("http")`) wraps `receive`, and then `request.is_disconnected()` never
    sees a client leave, so queued requests of vanished clients would not be aborted."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given.lower().startswith(b"bearer ") else b""
            if not hmac.compare_digest(token, self.key):
                response = ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                                    "authentication_error", code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param=param, code=400)


class ServerState:
    """What the routes share: set up by the lifespan, filled in when the model has loaded."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: AsyncEngine | None = None
        self.metrics: EngineMetrics | None = None
        self.load_error: str | None = None
        self.watcher: KnobsFileWatcher | None = None
        self.started = time.time()

    def load(self) -> None:
        from chunkpilot.engine.llm_engine import LLMEngine

        try:
            s = self.settings
            llm_engine = LLMEngine(s.engine)
            metrics = EngineMetrics(s.model_name, llm_engine.max_model_len)
            engine = AsyncEngine(llm_engine, metrics, max_waiting=s.max_waiting, retry_after=s.retry_after_seconds)
            if s.knobs_file:
                self.watcher = KnobsFileWatcher(
                    s.knobs_file, llm_engine.knobs, poll_interval=s.knobs_poll_interval,
                    on_error=lambda _msg: metrics.knob_errors.inc(),
                    on_apply=lambda _k: engine.publish_knobs(),
                )
                self.watcher.start()
            engine.start()
            self.metrics, self.engine = metrics, engine
            log.info("model %s loaded; serving as %r", s.engine.model, s.model_name)
        except Exception as e:  # a bad model folder must not kill /health: report it on /ready
            log.exception("model load failed")
            self.load_error = f"{type(e).__name__}: {e}"

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None:
            msg = f"model failed to load: {self.load_error}" if self.load_error else "the model is still loading"
            raise ApiError(503, msg, "service_unavailable", code=503)
        return self.engine


def build_app(settings: ServerSettings) -> FastAPI:
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = threading.Thread(target=state.load, name="model-loader", daemon=True)
        loader.start()
        yield
        # uvicorn has stopped accepting and waited for open connections (its graceful timeout); whatever is
        # still in flight now is aborted.
        if state.engine is not None:
            await state.engine.drain(0)
            state.engine.stop()
        if state.watcher is not None:
            state.watcher.stop()

    app = FastAPI(title="chunkpilot engine", version="0.1.0", lifespan=lifespan)
    app.state.server = state

    # ---- errors, all in OpenAI's body ---------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            msg = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            param = None
        else:
            msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                            for e in errors[:5])
        return bad_request(msg, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException):
        type_ = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return JSONResponse(error_body(str(exc.detail), type_, code=exc.status_code), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_req: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "internal_error", code=500), 500)

    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key)

    # ---- probes and metrics -----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        """The process is alive (liveness). Fails once the step loop has died, so Kubernetes restarts the pod."""
        if state.engine is not None and state.engine.error is not None:
            return JSONResponse({"status": "failed", "reason": f"step loop died: {state.engine.error!r}"}, 503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        """The model is loaded and the step loop is alive (readiness)."""
        eng = state.engine
        if eng is None or not eng.alive or eng.draining:
            reason = state.load_error or ("draining" if eng and eng.draining else "loading" if eng is None else "step loop stopped")
            return JSONResponse({"status": "unavailable", "reason": reason}, 503)
        return {"status": "ready", "model": settings.model_name, "knobs": eng.engine.knobs.get().__dict__}

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": int(state.started), "owned_by": "chunkpilot",
            "max_model_len": state.engine.engine.max_model_len if state.engine else None,
        }]}

    # ---- generation -------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        engine = _check(state, body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise bad_request("only one prompt per request is supported; send one request per prompt", "prompt")
            prompt = prompt[0]
        params = _params(body.sampling_params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = await _start(engine, rid, params, request, prompt=prompt)
        if body.stream:
            return _sse(completion_chunks(stream, rid, settings.model_name, body, engine.engine.tokenizer), request)
        return await _until_done(completion_full(stream, rid, settings.model_name, engine.engine.tokenizer), request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        engine = _check(state, body.model)
        max_len = engine.engine.max_model_len
        params = _params(lambda: body.sampling_params(default_max_tokens=max_len))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await _start(engine, rid, params, request, messages=body.template_messages())
        if body.stream:
            return _sse(chat_chunks(stream, rid, settings.model_name, body, engine.engine.tokenizer), request)
        return await _until_done(chat_full(stream, rid, settings.model_name, engine.engine.tokenizer), request)

    return app


# ---- helpers ------------------------------------------------------------------------------------------------
def _check(state: ServerState, model: str) -> AsyncEngine:
    engine = state.ready_engine()
    if model != state.settings.model_name:
        raise ApiError(400, f"model {model!r} is not served here; this server serves {state.settings.model_name!r}",
                       "invalid_request_error", param="model", code="model_not_found")
    return engine


def _params(make):
    try:
        return make()
    except ValueError as e:
        raise bad_request(str(e)) from None


async def _start(engine: AsyncEngine, rid: str, params, request: Request, **prompt):
    """Start the request and wait for its first output, so input errors, a full queue or a draining engine
    become proper HTTP errors instead of a broken stream. A client that leaves while queued is aborted."""
    gen = engine.generate(rid, params=params, **prompt)
    first_output = asyncio.ensure_future(gen.__anext__())
    try:
        while not first_output.done():
            await asyncio.wait({first_output}, timeout=0.25)
            if not first_output.done() and await request.is_disconnected():
                first_output.cancel()
                await asyncio.gather(first_output, return_exceptions=True)
                await gen.aclose()
                raise ApiError(499, "client closed the request", "client_closed_request", code=499)
        first = first_output.result()
    except ValueError as e:
        raise bad_request(str(e), "prompt" if "prompt" in str(e) else None) from None
    except QueueFullError as e:
        raise ApiError(429, f"server overloaded: {e}; retry later", "rate_limit_error", code="engine_overloaded",
                       headers={"Retry-After": str(engine.retry_after)}) from None
    except EngineUnavailableError as e:
        raise ApiError(503, str(e), "service_unavailable", code=503) from None
    return first, gen


async def _until_done(coro, request: Request):
    """Run a non-streaming request, aborting it if the client disconnects meanwhile."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)
    try:
        return task.result()
    except EngineUnavailableError as e:
        raise ApiError(503, str(e), "service_unavailable", code=503) from None


def _sse(chunks, request: Request) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except EngineUnavailableError as e:
            yield f"data: {json.dumps(error_body(str(e), 'service_unavailable', code=503))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def serve(settings: ServerSettings, host: str = "0.0.0.0", port: int = 8000, log_level: str = "info") -> None:
    """Run the server until SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight requests finish for up to
    `grace_period` seconds, then the lifespan aborts what is left; the process exits 0."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises a caught signal after shutting down, so the process would die "by SIGTERM"; a
            # drained SIGTERM shutdown is a clean exit, status 0.
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and captured and captured[-1] == sig:
                captured.pop()

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(build_app(settings), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(settings.grace_period), access_log=False)
    GracefulServer(config).run()
