"""A cap on request body size, answered with HTTP 413 in OpenAI's error body before anything parses the body.

Without it a 21 MB prompt was read, parsed and tokenized before its length was checked; the server's memory grew
by 2.6 GB and /health stalled for 15 s, past the liveness probe's timeout. The cap holds both for a declared
Content-Length and for the bytes a chunked upload actually streams.
"""

from __future__ import annotations

from collections.abc import Callable

from chunkpilot.engine.serving.api_error import ApiError


# What the API's callers can change; a listener with another kind of body (the admin port's knobs) says its own.
API_ADVICE = "the most this server accepts (--max-request-bytes): shorten the prompt or the messages"


def too_large(limit: int, advice: str = API_ADVICE) -> ApiError:
    """413 in OpenAI's error body; `advice` follows the limit and says what to change."""
    return ApiError(413, f"request body is larger than {limit} bytes, {advice}", "invalid_request_error",
                    code=413)


class BodyLimitMiddleware:
    """Reads the whole body up to `limit()` bytes, then replays it to the app; `limit` is a callable because the
    default follows the model's max_model_len, known once the model has loaded. `advice` ends the 413's message."""

    def __init__(self, app, limit: Callable[[], int], advice: str = API_ADVICE) -> None:
        self.app, self.limit, self.advice = app, limit, advice

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await too_large(limit, self.advice).response()(scope, receive, send)
            return
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nobody to answer
            size += len(message.get("body", b""))
            if size > limit:
                await too_large(limit, self.advice).response()(scope, receive, send)
                return
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: http.disconnect, which request.is_disconnected() waits for

        await self.app(scope, replay, send)
