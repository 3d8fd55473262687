"""Server-sent events for streamed completions, with a write timeout.

A client that stops reading makes every write wait on its full socket. Without a timeout such a stream lived
forever, holding its connection and its output in memory; 32 of them had filled the admission queue of an idle
engine. A write blocked for longer than `write_timeout` ends the stream: the request is aborted (closing the
body aborts it in the engine) and uvicorn closes the connection, because the response never completed. (asyncio
finishes that close only once the socket's buffer drains or the client leaves, so the socket and up to its buffer
linger until then; the request's engine slot and outputs do not.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from chunkpilot.engine.async_engine import EngineUnavailableError
from chunkpilot.engine.serving.protocol import error_body

log = logging.getLogger(__name__)

ABORTED = "the server is shutting down and aborted the request before it finished: retry it"


_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+; wait_for (a task per call) before


class _Stalled(Exception):
    pass


def _event(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def sse_events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Each chunk as an SSE event, then `[DONE]`. A request the engine aborted (shutdown past the grace period)
    or an engine failure ends with an error event first, so clients learn why, in OpenAI's error body."""
    aborted = False
    try:
        async for chunk in chunks:
            choices = chunk.get("choices") or ()
            aborted = aborted or any(c.get("finish_reason") == "abort" for c in choices)
            yield _event(chunk)
        if aborted:
            yield _event(error_body(ABORTED, "service_unavailable", code=503))
    except EngineUnavailableError as e:
        yield _event(error_body(str(e), "service_unavailable", code=503))
    finally:
        await chunks.aclose()
    yield _event("[DONE]")


class TimedStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], *, write_timeout: float, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.write_timeout = write_timeout

    async def stream_response(self, send) -> None:
        async def timed_send(message) -> None:
            try:
                if _timeout is not None:  # a deadline on this task: no new task for every streamed token
                    async with _timeout(self.write_timeout):
                        await send(message)
                else:
                    await asyncio.wait_for(send(message), self.write_timeout)
            except (TimeoutError, asyncio.TimeoutError):  # distinct types before Python 3.11
                raise _Stalled from None

        try:
            await super().stream_response(timed_send)
        except _Stalled:
            log.warning("a client read nothing for %.0f s (--stream-write-timeout): its stream is aborted",
                        self.write_timeout)
        finally:
            await self.body_iterator.aclose()


def sse_response(chunks: AsyncIterator[dict], write_timeout: float) -> TimedStreamingResponse:
    return TimedStreamingResponse(sse_events(chunks), write_timeout=write_timeout, media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache"})
