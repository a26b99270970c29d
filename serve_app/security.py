"""The ingress's guard: optional API keys and the request body size limit, checked before a route reads anything.

Keys come from SHADOWKV_API_KEYS (comma-separated) and/or SHADOWKV_API_KEY_FILE (one key a line, `#` comments); with
none set the service is open. With keys set, every path but /health and /metrics (a scraper's; unless the config
sets `metrics_need_api_key`) needs `Authorization: Bearer <key>`; a missing or wrong key is a 401 in OpenAI's shape. Keys are compared in constant time and never logged.
"""
from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from starlette.exceptions import HTTPException

from serve_app.errors import OpenAIError

KEYS_ENV = "SHADOWKV_API_KEYS"
KEY_FILE_ENV = "SHADOWKV_API_KEY_FILE"
OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"


def load_api_keys(env: Mapping[str, str] = os.environ) -> tuple[bytes, ...]:
    """The configured keys; an unreadable key file fails at start-up rather than leaving the service open."""
    keys = [k.strip() for k in env.get(KEYS_ENV, "").split(",")]
    if env.get(KEY_FILE_ENV):
        lines = Path(env[KEY_FILE_ENV]).read_text().splitlines()
        keys += [line.strip() for line in lines if not line.lstrip().startswith("#")]
    return tuple(k.encode() for k in keys if k)


def key_matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    """Compares against every key in constant time (no early exit), so timing reveals neither key nor position."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key)
    return matched


def unauthorized(message: str) -> OpenAIError:
    return OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than this service accepts ({limit} bytes).",
                       code="request_too_large")


@dataclass
class GuardSettings:
    """Set by the Ingress when it starts (the guard is installed on the app before that)."""

    api_keys: tuple[bytes, ...] = ()
    max_body_bytes: int = 8 << 20
    open_paths: frozenset[str] = OPEN_PATHS | {METRICS_PATH}


@dataclass
class RequestGuard:
    """ASGI middleware: refuses a request without a valid key, or whose body (declared or as it streams in) is
    larger than the limit, before the route sees it."""

    app: object
    settings: GuardSettings = field(default_factory=GuardSettings)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        return await self.app(scope, self._bounded(receive), send)

    def _refusal(self, scope) -> OpenAIError | None:
        headers = dict(scope["headers"])
        if self.settings.api_keys and scope["path"] not in self.settings.open_paths:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not token:
                return unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'.")
            if not key_matches(token.strip(), self.settings.api_keys):
                return unauthorized("Incorrect API key provided.")
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.settings.max_body_bytes:
            return body_too_large(self.settings.max_body_bytes)
        return None

    def _bounded(self, receive):
        """`receive` that stops a chunked body once it grows past the limit."""
        seen = 0

        async def bounded_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.settings.max_body_bytes:  # FastAPI passes an HTTPException through to its handler
                raise HTTPException(413, body_too_large(self.settings.max_body_bytes).message)
            return message

        return bounded_receive
