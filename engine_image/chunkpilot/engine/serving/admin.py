"""The knobs admin endpoint: the operator pushes the knobs straight to a ready pod and reads back what it applied.

Why a push and not only the mounted ConfigMap: the kubelet rewrites a ConfigMap volume only at its periodic pod
sync, so a knob change waited about a minute (66 s median on the local cluster) before any pod saw it. The
ConfigMap stays the durable copy a (re)started pod begins from; the push makes a change land in the time of one
HTTP request, and its answer is the acknowledgement the operator records in status.

It listens on a port of its own so that a NetworkPolicy can admit the operator alone to it, and it takes a bearer
token read from a file (a Secret volume the operator fills) on every request, so a rotated token is used as soon as
the kubelet has written it. Once a push has been applied the knobs file is no longer followed: the kubelet may
still write an older copy of the ConfigMap into the volume after a newer push, which must not undo it.

The token is checked by an ASGI middleware before anything reads the body, and the body is capped at
`MAX_BODY_BYTES`: this listener shares the event loop with the API's streams and /health, so a caller without the
token must not get a 500 MB body read and parsed on it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunkpilot.contract.knobs import ADMIN_PATH, SchedulerKnobs, knobs_object, parse_knobs
from chunkpilot.engine.core.knobs import KnobHolder
from chunkpilot.engine.serving.api_error import ApiError, bad_request, unavailable
from chunkpilot.engine.serving.body_limit import BodyLimitMiddleware
from chunkpilot.engine.serving.protocol import error_body

log = logging.getLogger(__name__)
KNOBS_PATH = ADMIN_PATH
# The knobs body is about 70 bytes; anything much larger is not a push.
MAX_BODY_BYTES = 4096
TOO_LARGE_ADVICE = "the most the admin endpoint accepts: send only the knobs (token_budget, max_chunk, generation)"


def _read_token(path: Path) -> str | None:
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    return token or None


def _refusal(token_path: Path, authorization: bytes) -> ApiError | None:
    """Why a request with this `Authorization` header may not use the admin endpoint; None when it may."""
    expected = _read_token(token_path)
    if expected is None:  # fail closed: no token file, no admin
        return ApiError(503, f"the admin token file {token_path} is missing or empty", "service_unavailable",
                        code=503, headers={"Connection": "close"})
    scheme, _, given = authorization.partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), expected.encode()):
        return ApiError(401, "a valid bearer token is required for the admin endpoint", "authentication_error",
                        code=401, headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
    return None


class TokenMiddleware:
    """Answers a request without the admin token before its body is read: `receive` is never called for it.
    `Connection: close` on the refusal, because the only way to stop a client from sending the rest of a body
    nobody will read is to hang up. The token file is read on every request, so a rotated token counts at once."""

    def __init__(self, app, token_path: Path) -> None:
        self.app, self.token_path = app, token_path

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = _refusal(self.token_path, dict(scope["headers"]).get(b"authorization", b""))
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_admin_app(token_file: str | Path, holder: Callable[[], KnobHolder | None],
                    on_push: Callable[[SchedulerKnobs], None]) -> FastAPI:
    """`holder()` is the engine's knob holder, None while the model loads; `on_push` runs after a pushed change
    was installed (publish the metrics, stop following the file)."""
    token_path = Path(token_file)
    app = FastAPI(title="chunkpilot engine admin", version="0.1.0", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in exc.errors()[:5])
        return bad_request(f"{msg}; nothing was changed", None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", code=exc.status_code),
                            exc.status_code)

    # Starlette runs the last added middleware first: the token is checked before the body limit reads anything.
    app.add_middleware(BodyLimitMiddleware, limit=lambda: MAX_BODY_BYTES, advice=TOO_LARGE_ADVICE)
    app.add_middleware(TokenMiddleware, token_path=token_path)

    def ready_holder() -> KnobHolder:
        h = holder()
        if h is None:
            raise unavailable("the model is still loading; the knobs file is applied when it is ready")
        return h

    answer = knobs_object

    @app.get(KNOBS_PATH)
    async def get_knobs() -> dict:
        return answer(ready_holder().get())

    @app.put(KNOBS_PATH)
    async def put_knobs(request: Request) -> dict:
        h = ready_holder()
        try:
            # the knobs file's own parser and validation: the same three fields, integers, nothing else
            knobs = parse_knobs(await request.body()).validated()
            changed = knobs != h.get()
            if changed:
                h.set(knobs)  # validates against the engine's limits; a bad value raises and the last good knobs stay
        except ValueError as e:
            raise bad_request(f"{e}; keeping {answer(h.get())}", None) from None
        if changed:
            log.info("applied pushed knobs %s", knobs)
        # off the event loop: stopping the file watcher joins its thread (up to one poll), and this loop serves
        # the API's streams too
        await asyncio.to_thread(on_push, knobs)
        return answer(h.get())

    return app
