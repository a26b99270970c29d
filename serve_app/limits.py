"""Per-request limits the operator sets (beyond the model's context length): prompt tokens, max_tokens, and a
deadline after which the engine request is aborted and the client gets a clean 408 (a body, or an error event)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from serve_app.errors import OpenAIError, error_event, invalid_field


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_tokens: int | None = None  # None: only the context length bounds it
    max_tokens: int | None = None
    request_timeout_s: float = 600.0

    def check_request(self, request) -> None:
        """Before tokenizing: the asked-for max_tokens."""
        asked = getattr(request, "requested_max_tokens", request.max_tokens)
        if self.max_tokens is not None and asked is not None and asked > self.max_tokens:
            raise invalid_field("max_tokens", f"max_tokens: at most {self.max_tokens} on this service, got {asked}")

    def check_prompt(self, num_tokens: int) -> None:
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise OpenAIError(400, f"prompt: {num_tokens} tokens, more than the {self.max_prompt_tokens} this "
                                   "service accepts", param="prompt", code="prompt_too_long")


def timed_out(timeout_s: float) -> dict:
    return error_event(408, f"The request did not finish within this service's deadline ({timeout_s:g} s); it "
                            "was stopped.", type="timeout_error", code="request_timeout")


async def until_deadline(events: AsyncIterator[dict], deadline: float) -> AsyncIterator[dict]:
    """`events` until the monotonic `deadline`; then TimeoutError (the caller cancels what produced them)."""
    iterator = aiter(events)
    while True:
        try:
            event = await asyncio.wait_for(anext(iterator), timeout=max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            return
        yield event
