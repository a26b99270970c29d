"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}, and the FastAPI handlers that
turn validation failures and our own refusals into it."""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("ray.serve")
# A message that names its field first: "tools: ...", "tool_choice.function.name: ..."
_FIELD_PREFIX = re.compile(r"^(\w+(?:\.\w+)*):")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "is_instance"}


class OpenAIError(Exception):
    """A refusal the client should see as-is: HTTP status, OpenAI error type and code, optional extra headers."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_event(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                code: str | None = None) -> dict:
    """An engine event carrying an OpenAI error body; `param` defaults to the field the engine's message names."""
    if param is None and status == 400:
        named = _FIELD_PREFIX.match(message)
        param = named.group(1) if named else None
    return {"error": {"message": message, "type": type, "param": param, "code": code}, "status": status}


def invalid_field(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def context_length_exceeded(prompt_tokens: int, max_tokens: int, max_model_len: int) -> OpenAIError:
    message = (f"This model's maximum context length is {max_model_len} tokens; the request asks for "
               f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} to generate).")
    return OpenAIError(400, message, param="max_tokens", code="context_length_exceeded")


def over_capacity(retry_after_s: float) -> OpenAIError:
    seconds = max(1, round(retry_after_s))
    return OpenAIError(429, "The service is at capacity: no replica has room for this request now; retry later.",
                       type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(seconds)})


def not_ready(reason: str) -> OpenAIError:
    return OpenAIError(503, f"The service is not ready: {reason}", type="service_unavailable",
                       code="no_replica_ready", headers={"Retry-After": "1"})


def _field_path(loc: tuple) -> str | None:
    """pydantic's error location -> the field's path ("messages.0.content"), without the schema's internals
    (union members such as `function-after[...]` or `list[int]`, and the type tags pydantic puts beside them)."""
    parts = []
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int) or (isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS):
            parts.append(str(part))
        else:
            break
    return ".".join(parts) or None


def _validation_param(exc: RequestValidationError) -> tuple[str | None, str]:
    first = exc.errors()[0] if exc.errors() else {}
    path = _field_path(tuple(first.get("loc", ())))
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    named = _FIELD_PREFIX.match(message)
    if named:  # a check of a whole object (the body, a message) names the offending field inside it first
        param = ".".join(part for part in (path, named.group(1)) if part)
        return param, param + message[named.end(1):]
    return path, message if path is None else f"{path}: {message}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        param, message = _validation_param(exc)
        return OpenAIError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return OpenAIError(exc.status_code, str(exc.detail), type=type_).response()

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return OpenAIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()
