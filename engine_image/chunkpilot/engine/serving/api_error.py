"""The server's errors, each answered in OpenAI's error body (`protocol.error_body`)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from chunkpilot.engine.serving.protocol import error_body


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, *, param: str | None = None, code: Any = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type_, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.type, param=self.param, code=self.code), self.status,
                            headers=self.headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param=param, code=400)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable", code=503)
