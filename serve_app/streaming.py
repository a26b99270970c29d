"""Server-sent events and OpenAI response bodies built from the engine replica's events.

An engine event is a dict: {"text": new text, "num_new_tokens", "finished", "finish_reason", "prompt_tokens",
"completion_tokens"}, or {"error": OpenAI error body fields, "status": HTTP status} when the replica refused it.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Literal

from pydantic import BaseModel

from serve_app.errors import OpenAIError
from serve_app.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                CompletionChoice, CompletionResponse, DeltaMessage, ResponseMessage, Usage)

SSE_DONE = "data: [DONE]\n\n"
Kind = Literal["completion", "chat"]
# Characters JSON leaves raw in strings that Python's line splitting (str.splitlines, httpx's aiter_lines) breaks a
# line at: generated text holding one would split an event's data line in such a client. Escaped, they stay in it.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body.translate(_LINE_BREAKS)}\n\n"


def raise_if_error(event: dict) -> None:
    if "error" in event:
        err = event["error"]
        status = event.get("status", 500)
        raise OpenAIError(status, err["message"], type=err.get("type", "server_error"), param=err.get("param"),
                          code=err.get("code"), headers={"Retry-After": "1"} if status in (429, 503) else None)


async def prepend(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    yield first
    async for event in rest:
        yield event


class ChunkFormatter:
    """Builds one stream's chunks, in the shape of `kind`'s OpenAI streaming response. With `usage_prompt_tokens`
    (stream_options.continuous_usage_stats), every chunk carries the usage so far: those prompt tokens and the
    completion tokens until then."""

    def __init__(self, kind: Kind, request_id: str, model: str, usage_prompt_tokens: int | None = None):
        self.kind, self.request_id, self.model = kind, request_id, model
        self.usage_prompt_tokens = usage_prompt_tokens

    @property
    def continuous_usage(self) -> bool:
        return self.usage_prompt_tokens is not None

    def opening(self) -> list[str]:
        if self.kind == "chat":
            choice = ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))
            return [sse(self._chat([choice], self._so_far(0)))]
        return []

    def delta(self, text: str, finish_reason: str | None, completion_tokens: int) -> str:
        usage = self._so_far(completion_tokens)
        if self.kind == "chat":
            delta = DeltaMessage(content=text or None)
            return sse(self._chat([ChatChunkChoice(delta=delta, finish_reason=finish_reason)], usage))
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return sse(CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage))

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        usage = Usage.of(prompt_tokens, completion_tokens)
        if self.kind == "chat":
            return sse(self._chat([], usage))
        return sse(CompletionResponse(id=self.request_id, model=self.model, choices=[], usage=usage))

    def _so_far(self, completion_tokens: int) -> Usage | None:
        return None if self.usage_prompt_tokens is None else Usage.of(self.usage_prompt_tokens, completion_tokens)

    def _chat(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=choices, usage=usage)


async def sse_stream(events: AsyncIterator[dict], fmt: ChunkFormatter, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: the chunks, the usage chunk if asked for, then [DONE]; an error mid-stream is sent as an
    OpenAI error event (the SDK raises it) before [DONE]. A chunk goes out for each event that brings text or ends
    the stream; with the formatter's continuous usage, also for each that brings tokens without text yet (part of a
    UTF-8 character, a model without a tokenizer), so that the usage counts every event's tokens when they come."""
    for line in fmt.opening():
        yield line
    try:
        async for event in events:
            raise_if_error(event)
            if event["text"] or event["finished"] or (fmt.continuous_usage and event["num_new_tokens"]):
                yield fmt.delta(event["text"], event["finish_reason"], event["completion_tokens"])
            if event["finished"] and include_usage:
                yield fmt.usage(event["prompt_tokens"], event["completion_tokens"])
    except OpenAIError as exc:
        yield sse(exc.body())
    yield SSE_DONE


async def collect(events: AsyncIterator[dict], kind: Kind, request_id: str, model: str) -> BaseModel:
    """The whole (non-streaming) response body."""
    parts, last = [], None
    async for event in events:
        raise_if_error(event)
        parts.append(event["text"])
        last = event
    if last is None:
        raise OpenAIError(500, "the engine ended the request without a result", type="server_error")
    text, usage = "".join(parts), Usage.of(last["prompt_tokens"], last["completion_tokens"])
    if kind == "chat":
        choice = ChatChoice(message=ResponseMessage(content=text), finish_reason=last["finish_reason"])
        return ChatCompletionResponse(id=request_id, model=model, choices=[choice], usage=usage)
    choice = CompletionChoice(text=text, finish_reason=last["finish_reason"])
    return CompletionResponse(id=request_id, model=model, choices=[choice], usage=usage)
