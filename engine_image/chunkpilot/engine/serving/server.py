"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /ready, /metrics.

The model loads in a background thread after the port opens. /ready turns true when the engine can serve (the
startup and readiness probes wait on it); /health is liveness: it fails only when a restart would help (the load
failed, the step loop died or hangs). Every error leaves in OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunkpilot.contract.engine_settings import FIRST_TOKEN_MODES, KV_TRANSPORTS, LIVE_ROLES, ROLES
from chunkpilot.contract.knobs import knobs_object
from chunkpilot.contract.slo import IMPLICIT_CLASS
from chunkpilot.contract.engine_settings import default as setting_default
from chunkpilot.engine.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError
from chunkpilot.engine.config import EngineConfig
from chunkpilot.engine.core.knobs_file import KnobsFileWatcher
from chunkpilot.engine.metrics import EngineMetrics
from chunkpilot.engine.serving.api_error import ApiError, bad_request, unavailable
from chunkpilot.engine.serving.auth import CEILING, TENANT, ApiKeyMiddleware, parse_api_keys, parse_key_ceilings
from chunkpilot.engine.serving.slo_class import choose as choose_slo_class
from chunkpilot.engine.serving.body_limit import BodyLimitMiddleware
from chunkpilot.engine.serving.protocol import ChatCompletionRequest, CompletionRequest, error_body
from chunkpilot.engine.serving.responses import chat_chunks, chat_full, completion_chunks, completion_full
from chunkpilot.engine.serving.streaming import ABORTED, sse_response
from chunkpilot.engine.kv_transfer.decode_side import RemotePrefill
from chunkpilot.engine.kv_transfer.peers import PrefillPeers
from chunkpilot.engine.kv_transfer.factory import make_transport
from chunkpilot.engine.serving.kv_routes import DrainGate, PrefillSide, add_kv_routes

log = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    engine: EngineConfig
    served_model_name: str | None = setting_default("served_model_name")
    # one key, or several separated by commas (one per tenant; see auth.py)
    api_key: str | None = setting_default("api_key")
    knobs_file: str | None = setting_default("knobs_file")
    knobs_poll_interval: float = setting_default("knobs_poll_interval")
    # The knobs admin endpoint (engine/serving/admin.py): its own port, and the file holding its bearer token. Off when
    # either is None (local runs follow the knobs file alone).
    admin_port: int | None = setting_default("admin_port")
    admin_token_file: str | None = setting_default("admin_token_file")
    max_waiting: int = setting_default("max_waiting")
    retry_after_seconds: int = 1
    grace_period: float = setting_default("grace_period")
    # None: 64 bytes per token of max_model_len, at least 1 MiB (a whole-context prompt as JSON token ids or
    # escaped text fits with room to spare)
    max_request_bytes: int | None = setting_default("max_request_bytes")
    # a stream whose client reads nothing for this long is aborted
    stream_write_timeout: float = setting_default("stream_write_timeout")
    # /health fails when the step loop has not come round for this long
    stall_timeout: float = setting_default("stall_timeout")
    # `usage.prompt_tokens_details.cached_tokens` in responses
    prompt_tokens_details: bool = setting_default("prompt_tokens_details")
    # In a pod: a model that fails to load ends the process (status 1) with the error as its last log line, so
    # the kubelet restarts it at once and reports it (the operator sets terminationMessagePolicy
    # FallbackToLogsOnError and shows it in the resource's conditions), instead of the start-up probe failing
    # for its whole timeout. Locally the server stays up and says why on /ready and /health.
    exit_on_load_failure: bool = setting_default("exit_on_load_failure")
    # Prefill/decode disaggregation (docs/disaggregation.md, engine/kv_transfer/)
    role: str = setting_default("role")
    live_roles: bool = setting_default("live_roles")
    prefill_peers: str | None = setting_default("prefill_peers")
    disagg_threshold: int = setting_default("disagg_threshold")
    kv_transport: str = setting_default("kv_transport")
    kv_lease_seconds: float = setting_default("kv_lease_seconds")
    prefill_max_waiting: int = setting_default("prefill_max_waiting")
    first_token: str = setting_default("first_token")
    prefill_retries: int = setting_default("prefill_retries")
    pull_share: float = setting_default("pull_share")
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.api_keys = parse_api_keys(self.api_key)
        self.key_ceilings = parse_key_ceilings(self.api_key)
        classes = self.engine.slo_classes if self.engine is not None else None
        for ceiling in self.key_ceilings.values():
            if classes is None or classes.get(ceiling) is None:
                raise ValueError(f"an API key's SLO class {ceiling!r} is not one of --slo-classes' "
                                 f"({', '.join(classes.names) if classes else 'none defined'})")
        for name in ("stream_write_timeout", "stall_timeout", "grace_period"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1024:
            raise ValueError(f"max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.first_token not in FIRST_TOKEN_MODES:
            raise ValueError(f"first-token must be one of {', '.join(FIRST_TOKEN_MODES)}, got {self.first_token!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv-transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}")
        if self.live_roles and (self.role not in LIVE_ROLES or not self.prefill_peers):
            raise ValueError("--live-roles needs --role prefill or decode (the role it starts in) and "
                             "--prefill-peers (where its prompts go while it is a decode engine), got role "
                             f"{self.role!r} and prefill-peers {self.prefill_peers!r}")
        if self.role == "decode" and not self.prefill_peers:
            raise ValueError("role decode needs --prefill-peers (host:port of the prefill pods, or their headless "
                             "Service's name:port)")
        if self.role == "prefill" and self.prefill_peers and not self.live_roles:
            raise ValueError("role prefill computes prompts for decode pods and sends none on: drop --prefill-peers")
        if self.disagg_threshold < 0:
            raise ValueError(f"disagg-threshold must be >= 0 uncached tokens, got {self.disagg_threshold}")
        if not self.kv_lease_seconds > 0 or self.prefill_max_waiting < 0:
            raise ValueError("kv-lease-seconds must be > 0 and prefill-max-waiting >= 0, got "
                             f"{self.kv_lease_seconds} and {self.prefill_max_waiting}")
        if not 0 < self.pull_share <= 1:
            raise ValueError(f"pull-share must be > 0 and <= 1 (a share of the wall time), got {self.pull_share}")
        if self.prefill_retries < 0:
            raise ValueError(f"prefill-retries must be >= 0 other prefill pods, got {self.prefill_retries}")

    @property
    def model_name(self) -> str:
        from pathlib import Path

        return self.served_model_name or Path(self.engine.model).name


class ServerState:
    """What the routes share: set up by the lifespan, filled in when the model has loaded."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: AsyncEngine | None = None
        self.metrics: EngineMetrics | None = None
        self.load_error: str | None = None
        self.watcher: KnobsFileWatcher | None = None
        self.started = time.time()
        self.on_fatal = None  # set by serve(): stops the server (exit_on_load_failure)
        # disaggregation: the prefill role's leases and transport, or a decode engine's remote prefill
        self.prefill_side: PrefillSide | None = None
        self.remote = None
        self.loaded = threading.Event()  # load() ended, either way

    def load(self) -> None:
        from chunkpilot.engine.llm_engine import LLMEngine

        try:
            s = self.settings
            disaggregated = s.role != "both" or bool(s.prefill_peers)
            if disaggregated:
                check_disaggregation(s.engine)
            llm_engine = LLMEngine(s.engine)
            classes = s.engine.slo_classes
            metrics = EngineMetrics(s.model_name, llm_engine.max_model_len,
                                    slo_classes=tuple(classes.names) if classes else (IMPLICIT_CLASS,))
            metrics.publish_ranks(llm_engine.rank_memory)
            metrics.publish_cache_shape(llm_engine.cache_shape)
            metrics.publish_role(s.role)
            if s.prefill_peers:
                self.remote = self._remote_prefill(llm_engine, metrics)
            if s.live_roles:  # before the engine publishes its knobs: they carry the role from the start
                llm_engine.knobs.enable_roles(s.role)
            engine = AsyncEngine(llm_engine, metrics, max_waiting=s.max_waiting, retry_after=s.retry_after_seconds,
                                 remote=self.remote)
            if s.live_roles:
                # one transport for both sides: the pool is registered once, read from and read into alike; the
                # prefill side answers decode pods only while the role is prefill (the leases it granted before a
                # switch are still settled)
                holder = llm_engine.knobs
                gate = DrainGate(lambda: holder.role, lambda: engine.num_client_requests, s.grace_period)
                self.prefill_side = PrefillSide(engine, self.remote.transport, llm_engine.kv_fingerprint(),
                                                s.kv_lease_seconds, refusal=gate)
            elif s.role == "prefill":
                transport = make_transport(s.kv_transport, "prefill", llm_engine.kv_pool, s.engine.block_size)
                self.prefill_side = PrefillSide(engine, transport, llm_engine.kv_fingerprint(), s.kv_lease_seconds)
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
            if self.settings.exit_on_load_failure and self.on_fatal is not None:
                self.on_fatal()
        finally:
            self.loaded.set()

    def _remote_prefill(self, llm_engine, metrics):
        import httpx

        s = self.settings
        fp = llm_engine.kv_fingerprint()
        # this pod's own key for the prefill pods' /kv/load, /kv/agent and /kv/release (all pods share the keys)
        headers = {"Authorization": f"Bearer {s.api_keys[0]}"} if s.api_keys else {}
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=256))
        peers = PrefillPeers(s.prefill_peers, client, fingerprint=fp, max_waiting=s.prefill_max_waiting,
                             headers=headers, on_refresh=metrics.prefill_peers_ready.set)
        transport = make_transport(s.kv_transport, "pod" if s.live_roles else "decode", llm_engine.kv_pool,
                                   s.engine.block_size)
        return RemotePrefill(llm_engine, transport, peers, client, threshold=s.disagg_threshold, fingerprint=fp,
                             headers=headers, retries=s.prefill_retries,
                             first_token_with_kv=s.first_token == "with-kv", pull_share=s.pull_share)

    async def run_disaggregation(self) -> None:
        """After the model loaded: poll the prefill pods (decode side), sweep expired leases (prefill side)."""
        await asyncio.get_running_loop().run_in_executor(None, self.loaded.wait)
        tasks = []
        if self.remote is not None:
            self.remote.peers.start()
        if self.prefill_side is not None:
            tasks.append(asyncio.ensure_future(self.prefill_side.sweep()))
        try:
            await asyncio.Event().wait()  # until cancelled at shutdown
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.remote is not None:
                await self.remote.peers.stop()
                await self.remote.client.aclose()

    def knob_holder(self):
        return self.engine.knobs if self.engine is not None else None

    def knobs_pushed(self, _knobs) -> None:
        """A push is the newer word from here on: stop following the file (see engine/serving/admin.py)."""
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
            log.info("knobs are pushed by the operator now; the knobs file is read again only at the next start")
        if self.engine is not None:
            self.engine.publish_knobs()

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise unavailable(f"model failed to load: {self.load_error}" if self.load_error
                              else "the model is still loading")
        return self.engine

    def max_request_bytes(self) -> int:
        if self.settings.max_request_bytes is not None:
            return self.settings.max_request_bytes
        max_len = self.engine.max_model_len if self.engine is not None else 8192
        return max(2**20, 64 * max_len)

    def liveness_failure(self) -> str | None:
        """Why a restart would help, or None. Loading, draining and busy are all alive."""
        if self.load_error:
            return f"model failed to load: {self.load_error}"
        eng = self.engine
        if eng is not None and eng.error is not None:
            return f"step loop died: {eng.error!r}"
        if eng is not None and eng.stalled(self.settings.stall_timeout):
            return f"step loop has not come round for over {self.settings.stall_timeout:.0f} s (--stall-timeout)"
        return None


def build_app(settings: ServerSettings) -> FastAPI:
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = threading.Thread(target=state.load, name="model-loader", daemon=True)
        loader.start()
        disaggregation = asyncio.ensure_future(state.run_disaggregation())
        yield
        disaggregation.cancel()
        await asyncio.gather(disaggregation, return_exceptions=True)
        # uvicorn has stopped accepting and waited for open connections (its graceful timeout); whatever is
        # still in flight now is aborted.
        if state.engine is not None:
            await state.engine.drain(0)
            state.engine.stop()
        if state.remote is not None:
            state.remote.close()  # and its transport, which a live-roles engine's prefill side shares
        if state.prefill_side is not None and (state.remote is None or
                                               state.prefill_side.transport is not state.remote.transport):
            state.prefill_side.transport.close()
        if state.watcher is not None:
            state.watcher.stop()

    app = FastAPI(title="chunkpilot engine", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    app.state.admin = None
    if settings.admin_port is not None and settings.admin_token_file:
        from chunkpilot.engine.serving.admin import build_admin_app

        app.state.admin = build_admin_app(settings.admin_token_file, state.knob_holder, state.knobs_pushed)

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

    # Starlette runs the last added middleware first: keys are checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, limit=state.max_request_bytes)
    if settings.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=settings.api_keys, ceilings=settings.key_ceilings)

    add_kv_routes(app, lambda: state.prefill_side, _salt)

    # ---- probes and metrics -----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        """Liveness: fails when the model failed to load or the step loop died or hangs, so Kubernetes restarts
        the pod. It stays 200 while loading and while draining for shutdown."""
        failure = state.liveness_failure()
        if failure:
            return JSONResponse({"status": "failed", "reason": failure}, 503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        """The model is loaded and the step loop is alive (readiness)."""
        eng = state.engine
        if eng is None or not eng.alive or eng.draining:
            reason = state.load_error or ("draining" if eng and eng.draining else "loading" if eng is None else "step loop stopped")
            return JSONResponse({"status": "unavailable", "reason": reason}, 503)
        return {"status": "ready", "model": settings.model_name, "knobs": knobs_object(eng.knobs.get())}

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": int(state.started), "owned_by": "chunkpilot",
            "max_model_len": state.engine.max_model_len if state.engine else None,
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
        slo = _slo_class(settings, request, body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = await _start(engine, rid, params, request, prompt=prompt, cache_salt=_salt(request, body),
                              slo_class=slo)
        tok, details = engine.tokenizer, settings.prompt_tokens_details
        if body.stream:
            return sse_response(_tiered(completion_chunks(stream, rid, settings.model_name, body, tok, details), slo),
                                settings.stream_write_timeout)
        return _tier(await _until_done(completion_full(stream, rid, settings.model_name, tok, details), request), slo)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        engine = _check(state, body.model)
        max_len = engine.max_model_len
        params = _params(lambda: body.sampling_params(default_max_tokens=max_len))
        slo = _slo_class(settings, request, body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await _start(engine, rid, params, request, messages=body.template_messages(),
                              cache_salt=_salt(request, body), slo_class=slo)
        tok, details = engine.tokenizer, settings.prompt_tokens_details
        if body.stream:
            return sse_response(_tiered(chat_chunks(stream, rid, settings.model_name, body, tok, details), slo),
                                settings.stream_write_timeout)
        return _tier(await _until_done(chat_full(stream, rid, settings.model_name, tok, details), request), slo)

    return app


# ---- helpers ------------------------------------------------------------------------------------------------
def check_disaggregation(config: EngineConfig) -> None:
    """What disaggregation cannot do yet, said before the model loads."""
    if config.tensor_parallel_size > 1:
        raise ValueError("disaggregation (--role prefill/decode, --prefill-peers) needs --tensor-parallel-size 1 "
                         "for now: a prefill pod's blocks are split across its ranks")
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ValueError("disaggregation does not work with a draft model yet (its own KV cache would need the "
                         "prompt too): use the ngram method or no speculative decoding")


def _check(state: ServerState, model: str) -> AsyncEngine:
    engine = state.ready_engine()
    if model != state.settings.model_name:
        raise ApiError(400, f"model {model!r} is not served here; this server serves {state.settings.model_name!r}",
                       "invalid_request_error", param="model", code="model_not_found")
    return engine


def _salt(request: Request, body) -> bytes:
    """The prefix-cache salt: the caller's tenant (its API key, when there are several) and the request's own
    `cache_salt`."""
    tenant = request.scope.get("state", {}).get(TENANT, b"")
    return tenant + (b"|" + body.cache_salt.encode() if body.cache_salt else b"")


def _slo_class(settings: ServerSettings, request: Request, body):
    """The request's SLO class (serving/slo_class.py); None without classes."""
    ceiling = request.scope.get("state", {}).get(CEILING)
    return choose_slo_class(settings.engine.slo_classes, request.headers, body.service_tier, ceiling)


def _tier(result, slo_class):
    """OpenAI echoes the service tier a request was served in: here its SLO class."""
    if slo_class is not None and isinstance(result, dict):
        result["service_tier"] = slo_class.name
    return result


async def _tiered(chunks, slo_class):
    async for chunk in chunks:
        yield _tier(chunk, slo_class)


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
        raise unavailable(str(e)) from None
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
        result = task.result()
    except EngineUnavailableError as e:
        raise unavailable(str(e)) from None
    if result["choices"][0]["finish_reason"] == "abort":  # shutdown outlived the grace period
        raise unavailable(ABORTED)
    return result


# After the grace period, how long aborted streams get to send their error event and [DONE] before uvicorn
# closes the connections.
FLUSH_SECONDS = 5.0
# How long an idle keep-alive connection stays open. Longer than the proxies in front of the engines keep theirs
# idle (Envoy's upstream idle timeout is set to 60 s in the gateway docs/routing.md shows): a proxy that sends a
# request on a connection the engine closes at that moment gets a reset before any header and answers 503 (seen
# with uvicorn's default of 5 s behind Envoy, bench/routing.py).
KEEP_ALIVE_SECONDS = 75


def serve(settings: ServerSettings, host: str = "0.0.0.0", port: int = 8000, log_level: str = "info") -> None:
    """Run the server until SIGTERM/SIGINT. SIGTERM drains: the port stays open, /health stays 200, /ready turns
    503 (the pod leaves its Service's endpoints) and new requests get 503, while in-flight requests may finish
    for up to `grace_period` seconds. Whatever is left is then aborted with an error event and [DONE], and the
    process exits 0. A second signal exits at once."""
    import uvicorn

    app = build_app(settings)
    state: ServerState = app.state.server

    class AdminServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield  # the main server handles SIGTERM and stops this one

    class DrainingServer(uvicorn.Server):
        draining = False

        async def serve(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            admin = None
            if app.state.admin is not None:  # same loop and process; our signal handling stays the main server's
                admin = AdminServer(uvicorn.Config(app.state.admin, host=host, port=settings.admin_port,
                                                   log_level=log_level, access_log=False, lifespan="off"))
                admin_task = asyncio.ensure_future(admin.serve())
            try:
                await super().serve(sockets)
            finally:
                if admin is not None:
                    admin.should_exit = True
                    await admin_task

        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGTERM and not self.draining and state.engine is not None:
                self.draining = True  # runs in a signal handler: hand the work to the event loop

                def start() -> None:
                    self.drain_task = asyncio.ensure_future(self._drain_then_exit(sig, frame))
                self.loop.call_soon_threadsafe(start)
                return
            self._exit(sig, frame)

        async def _drain_then_exit(self, sig, frame) -> None:
            engine = state.engine
            try:
                log.info("SIGTERM: draining %d requests for up to %.0f s", engine.num_in_flight,
                         settings.grace_period)
                started = time.monotonic()
                await engine.drain(settings.grace_period)
                # a prefill pod: the decode pods still reading blocks it holds get what is left of the grace period
                # to finish and release them (a lease that expires first is theirs to fall back from)
                side = state.prefill_side
                while side is not None and len(side.leases) and time.monotonic() < started + settings.grace_period:
                    await asyncio.sleep(0.05)
                deadline = time.monotonic() + FLUSH_SECONDS
                while engine.num_in_flight and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            finally:  # whatever happened while draining, the process must still exit
                self._exit(sig, frame)

        def _exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises a caught signal after shutting down, so the process would die "by SIGTERM"; a
            # drained SIGTERM shutdown is a clean exit, status 0.
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and captured and captured[-1] == sig:
                captured.pop()

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn's own graceful wait comes after our drain; it only lets the last writes go out.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=KEEP_ALIVE_SECONDS,
                            timeout_graceful_shutdown=int(FLUSH_SECONDS), access_log=False)
    server = DrainingServer(config)
    state.on_fatal = lambda: setattr(server, "should_exit", True)  # uvicorn polls it; the loader thread sets it
    server.run()
    if settings.exit_on_load_failure and state.load_error:
        # after uvicorn's shutdown lines: the log's last line, which the pod's termination message ends with
        log.error("model failed to load from %s: %s; exiting", settings.engine.model, state.load_error)
        raise SystemExit(1)
