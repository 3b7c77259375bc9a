"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status."""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from forerun.engine.async_llm import EngineDeadError

logger = logging.getLogger(__name__)

_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*):\s")


class APIError(Exception):
    """An error the client caused or must know about, with the status and OpenAI error type to send."""

    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to what the client sees; bad input (ValueError) is the client's fault."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "service_unavailable", code="engine_down")
    if isinstance(exc, ValueError):
        m = _FIELD_PREFIX.match(str(exc))
        return APIError(HTTPStatus.BAD_REQUEST, str(exc), param=m.group(1) if m else None)
    logger.exception("internal error", exc_info=exc)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc!r}", "internal_error")


class ErrorJSONResponse(JSONResponse):
    """An error body rendered with `ensure_ascii`: a message may quote the client's text, and text with a
    lone surrogate has no UTF-8 form (the default rendering would fail, turning a 400 into a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(exc: BaseException) -> JSONResponse:
    err = to_api_error(exc)
    return ErrorJSONResponse(error_body(err.message, err.err_type, err.param, err.code), status_code=int(err.status))


def sse_error(exc: BaseException) -> str:
    """An error inside an already started stream: one data event carrying the error body."""
    err = to_api_error(exc)
    return f"data: {json.dumps(error_body(err.message, err.err_type, err.param, err.code))}\n\n"


# Fields clients send that forerun refuses (every unknown field is refused), with why and what instead.
_UNSUPPORTED_HINTS = {
    "functions": "the deprecated function calling is not supported; use tools and tool_choice",
    "function_call": "the deprecated function calling is not supported; use tools and tool_choice",
    "guided_json": "use structured_outputs: {\"json\": ...} (vLLM's current name)",
    "guided_regex": "use structured_outputs: {\"regex\": ...} (vLLM's current name)",
    "guided_choice": "use structured_outputs: {\"choice\": [...]} (vLLM's current name)",
    "guided_grammar": "use structured_outputs: {\"grammar\": ...} (vLLM's current name)",
}


def _field_path(loc: tuple[Any, ...]) -> str:
    """("body", "messages", 0, "role") -> "messages[0].role", the spelling forerun's own errors use."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # Unknown fields first: "messages: field required" is less useful than naming the stray field.
    first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    param = _field_path(tuple(first.get("loc", ()))) or None
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {first.get('msg')}", None
    if first.get("type") == "extra_forbidden":
        name = str(first.get("loc", ("",))[-1])
        why = _UNSUPPORTED_HINTS.get(name, "unknown field; forerun does not support it")
        return f"{param}: {why}", param
    return f"{param or 'body'}: {first.get('msg')}", param


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return ErrorJSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    async def on_any(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ErrorJSONResponse(error_body(str(exc.detail), err_type), status_code=exc.status_code)

    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, on_any)  # type: ignore[arg-type]
    app.add_exception_handler(ValueError, on_any)  # type: ignore[arg-type]
    app.add_exception_handler(EngineDeadError, on_any)  # type: ignore[arg-type]
    # Engine errors (a failed step before a stream's first chunk) are RuntimeErrors: answered here, the
    # connection stays usable; the `Exception` handler below runs in Starlette's outer middleware,
    # which re-raises after answering and so drops the client's keep-alive connection.
    app.add_exception_handler(RuntimeError, on_any)  # type: ignore[arg-type]
    # Anything else (an engine error before a stream's first chunk, a bug) still gets an OpenAI-style
    # body: clients parse `error.message`, and Starlette's default is a plain-text 500.
    app.add_exception_handler(Exception, on_any)
