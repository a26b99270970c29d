"""One request's stream inside the engine replica: the step loop pushes the newest cumulative `RequestOutput`, the
`generate` generator turns it into events holding only what is new since the last one it yielded.

Bounded by construction: a stream holds one output, however far its consumer falls behind.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from serve_app.errors import error_event
from shadowkv_core import RequestOutput

class RequestStream:
    def __init__(self):
        self._latest: RequestOutput | None = None
        self._error: dict | None = None
        self._ready = asyncio.Event()
        self.finished = False

    def push(self, output: RequestOutput) -> None:
        self._latest = output
        self._ready.set()

    def fail(self, status: int, message: str) -> None:
        kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
        self._error = error_event(status, message, type=kind)
        self._ready.set()

    async def events(self) -> AsyncIterator[dict]:
        sent_text, sent_tokens = "", 0
        while not self.finished:
            await self._ready.wait()
            self._ready.clear()
            if self._error is not None:
                self.finished = True
                yield self._error
                return
            output = self._latest
            if output.finish_reason == "error":
                self.finished = True
                yield error_event(500, f"the engine failed this request: {output.error}", type="server_error")
                return
            self.finished = output.finished
            text = output.text[len(sent_text):] if output.text.startswith(sent_text) else ""
            event = {"text": text, "num_new_tokens": len(output.token_ids) - sent_tokens,
                     "finished": output.finished, "finish_reason": output.finish_reason,
                     "prompt_tokens": len(output.prompt_token_ids), "completion_tokens": len(output.token_ids),
                     "cached_tokens": output.num_cached_tokens}
            if output.logprobs is not None:
                event.update(token_ids=output.token_ids[sent_tokens:], logprobs=output.logprobs[sent_tokens:],
                             cumulative_logprob=output.cumulative_logprob)
            if output.prompt_logprobs is not None and not sent_tokens:
                event.update(prompt_token_ids=output.prompt_token_ids, prompt_logprobs=output.prompt_logprobs)
            yield event
            sent_text, sent_tokens = sent_text + text, len(output.token_ids)
