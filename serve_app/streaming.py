"""Server-sent events and OpenAI response bodies built from the engine replica's events.

An engine event is a dict: {"text": new text, "num_new_tokens", "finished", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens"}, with, when the request asks for logprobs, the new "token_ids", their
"logprobs" and the "cumulative_logprob" so far, and in the first event "prompt_logprobs" when asked for; or
{"error": OpenAI error body fields, "status": HTTP status} when the replica refused it.
A request of several choices (a batch of prompts, n > 1) merges its choices' events, each tagged with its "index".
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Iterable, Literal

from pydantic import BaseModel

from serve_app.errors import OpenAIError
from serve_app.logprobs import LogprobFormatter
from serve_app.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                CompletionChoice, CompletionResponse, DeltaMessage, ResponseMessage, Usage)
from serve_app.tools import ToolStream, parse

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


async def merge(firsts: list[dict], streams: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """Several choices' events, each tagged with its choice's index: first events `firsts` (already read from
    `streams`), then the rest as they come. On any exit every stream is closed, which cancels its engine request."""
    pending = {}
    try:
        for index, first in enumerate(firsts):
            yield {**first, "index": index}
        pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                index = pending.pop(task)
                try:
                    event = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield {**event, "index": index}
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def per_prompt(counts: Iterable[int], n: int) -> int:
    """A count summed over choices that share their prompt `n` at a time, with each prompt counted once: its prompt
    tokens, or its cached tokens as a mean over those n."""
    return sum(counts) // n


class ChoiceTotals:
    """A request's usage over its choices: each prompt counted once (its n choices share it), and its cached tokens
    as a mean over those n; completion tokens summed."""

    def __init__(self, n: int):
        self.n, self.prompt, self.completion, self.cached, self.finished = n, {}, {}, {}, set()

    def add(self, event: dict) -> None:
        index = event.get("index", 0)
        self.prompt[index], self.completion[index] = event["prompt_tokens"], event["completion_tokens"]
        self.cached[index] = event["cached_tokens"]
        if event["finished"]:
            self.finished.add(index)

    @property
    def completion_tokens(self) -> int:
        return sum(self.completion.values())

    def usage(self, kept: Iterable[int] | None = None) -> Usage:
        """The usage of the choices of index in `kept` (default all), n of them per prompt."""
        kept = list(self.prompt) if kept is None else kept
        return Usage.of(per_prompt((self.prompt[i] for i in kept), self.n), sum(self.completion[i] for i in kept),
                        per_prompt((self.cached[i] for i in kept), self.n))


class ChunkFormatter:
    """Builds one stream's chunks, in the shape of `kind`'s OpenAI streaming response. With `usage_prompt_tokens`
    (stream_options.continuous_usage_stats), every chunk carries the usage so far: those prompt tokens and the
    completion tokens until then. With `tool_family` (chat with tools), each choice's text goes through a ToolStream:
    its tool calls come as tool_calls deltas, and a choice that called a tool finishes with "tool_calls"."""

    def __init__(self, kind: Kind, request_id: str, model: str, usage_prompt_tokens: int | None = None,
                 logprobs: LogprobFormatter | None = None, tool_family: str | None = None):
        self.kind, self.request_id, self.model = kind, request_id, model
        self.usage_prompt_tokens = usage_prompt_tokens
        self.logprobs = logprobs
        self.tool_family, self.tool_streams = tool_family, {}

    @property
    def continuous_usage(self) -> bool:
        return self.usage_prompt_tokens is not None

    def opening(self, num_choices: int = 1) -> list[str]:
        if self.kind == "chat":
            return [sse(self._chat([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
                                   self._so_far(0))) for i in range(num_choices)]
        return []

    def wants_logprobs(self, event: dict) -> bool:
        """Whether the event brings tokens whose logprobs the request asks for (each chunk carries its tokens')."""
        return self.logprobs is not None and self.logprobs.top is not None and bool(event.get("token_ids"))

    def delta(self, text: str, finish_reason: str | None, completion_tokens: int, index: int = 0,
              event: dict | None = None) -> str:
        usage = self._so_far(completion_tokens)
        logprobs = None if self.logprobs is None or event is None else self.logprobs.of_event(event)
        if self.kind == "chat" and self.tool_family is not None:
            return self._tool_deltas(text, finish_reason, usage, index, logprobs)
        if self.kind == "chat":
            delta = DeltaMessage(content=text or None)
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            return sse(self._chat([choice], usage))
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
        return sse(CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage))

    def _tool_deltas(self, text: str, finish_reason: str | None, usage: Usage | None, index: int,
                     logprobs=None) -> str:
        """The chunks of one event of a chat with tools: its content and whole tool calls so far, the first chunk
        carrying the event's tokens' logprobs (an empty delta if the text is held back, and for the usage so far when
        every chunk carries it), the last the finish reason (and the usage so far)."""
        stream = self.tool_streams.setdefault(index, ToolStream(self.tool_family))
        fields = stream.feed(text) + (stream.finish() if finish_reason else [])
        if finish_reason and stream.num_calls:
            finish_reason = "tool_calls"
        if not fields and (finish_reason or logprobs or self.continuous_usage):
            fields = [{}]
        chunks = [ChatChunkChoice(index=index, delta=DeltaMessage(**f)) for f in fields]
        if chunks:
            chunks[0].logprobs = logprobs
            chunks[-1].finish_reason = finish_reason
        return "".join(sse(self._chat([c], usage)) for c in chunks)

    def usage(self, usage: Usage) -> str:
        if self.kind == "chat":
            return sse(self._chat([], usage))
        return sse(CompletionResponse(id=self.request_id, model=self.model, choices=[], usage=usage))

    def _so_far(self, completion_tokens: int) -> Usage | None:
        return None if self.usage_prompt_tokens is None else Usage.of(self.usage_prompt_tokens, completion_tokens)

    def _chat(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=choices, usage=usage)


async def sse_stream(events: AsyncIterator[dict], fmt: ChunkFormatter, include_usage: bool,
                     num_choices: int = 1, n: int = 1) -> AsyncIterator[str]:
    """The SSE body: the chunks, the usage chunk if asked for (once every choice has finished), then [DONE]; an
    error mid-stream is sent as an OpenAI error event (the SDK raises it) before [DONE]. A chunk goes out for each
    event that brings text or ends its choice; with the formatter's continuous usage, also for each that brings
    tokens without text yet (part of a UTF-8 character, a model without a tokenizer), so that the usage counts every
    event's tokens when they come. num_choices: how many choices merge into `events`, n of them per prompt."""
    totals = ChoiceTotals(n)
    for line in fmt.opening(num_choices):
        yield line
    try:
        async with contextlib.aclosing(events):  # an error ends every choice's engine request at once
            async for event in events:
                raise_if_error(event)
                totals.add(event)
                if event["text"] or event["finished"] or (fmt.continuous_usage and event["num_new_tokens"]) or \
                        fmt.wants_logprobs(event):
                    yield fmt.delta(event["text"], event["finish_reason"], totals.completion_tokens,
                                    event.get("index", 0), event)
                if event["finished"] and include_usage and len(totals.finished) == num_choices:
                    yield fmt.usage(totals.usage())
    except OpenAIError as exc:
        yield sse(exc.body())
    yield SSE_DONE


class _Choice:
    """One choice's events gathered: its text, finish reason, tokens and logprobs."""

    def __init__(self):
        self.parts, self.token_ids, self.logprobs = [], [], []
        self.finish_reason, self.cumulative_logprob = None, 0.0
        self.prompt_token_ids, self.prompt_logprobs = [], None

    def add(self, event: dict) -> None:
        self.parts.append(event["text"])
        self.finish_reason = event["finish_reason"]
        self.token_ids += event.get("token_ids", [])
        self.logprobs += event.get("logprobs", [])
        self.cumulative_logprob = event.get("cumulative_logprob", self.cumulative_logprob)
        if "prompt_logprobs" in event:
            self.prompt_token_ids, self.prompt_logprobs = event["prompt_token_ids"], event["prompt_logprobs"]


async def collect(events: AsyncIterator[dict], kind: Kind, request_id: str, model: str, num_choices: int = 1,
                  n: int = 1, candidates: int | None = None, logprobs: LogprobFormatter | None = None,
                  tool_family: str | None = None) -> BaseModel:
    """The whole (non-streaming) response body: num_choices choices merged into `events`, `candidates` (default n)
    of them per prompt. With more candidates than n (best_of), the n of highest cumulative logprob are returned, the
    best first (as vLLM), and the usage counts those. With `tool_family`, each chat choice's text is parsed into
    content and tool calls."""
    candidates = candidates or n
    choices, totals = [_Choice() for _ in range(num_choices)], ChoiceTotals(n)
    async with contextlib.aclosing(events):  # an error ends every choice's engine request at once
        async for event in events:
            raise_if_error(event)
            choices[event.get("index", 0)].add(event)
            totals.add(event)
    if len(totals.finished) < num_choices:
        raise OpenAIError(500, "the engine ended the request without a result", type="server_error")
    kept = []
    for start in range(0, num_choices, candidates):
        ids = range(start, start + candidates)
        kept += sorted(ids, key=lambda i: -choices[i].cumulative_logprob)[:n] if candidates > n else ids
    usage = totals.usage(kept)
    fmt = logprobs if logprobs is not None and logprobs.top is not None else None
    out = [choices[i] for i in kept]
    if kind == "chat":
        first = out[0]
        return ChatCompletionResponse(
            id=request_id, model=model, usage=usage,
            prompt_logprobs=None if logprobs is None else logprobs.prompt_logprobs(first.prompt_token_ids,
                                                                                  first.prompt_logprobs),
            choices=[_chat_choice(i, "".join(c.parts), c.finish_reason, tool_family,
                                  fmt and fmt.chat_logprobs(c.token_ids, c.logprobs)) for i, c in enumerate(out)])
    return CompletionResponse(id=request_id, model=model, usage=usage, choices=[
        CompletionChoice(index=i, text="".join(c.parts), finish_reason=c.finish_reason,
                         logprobs=fmt and fmt.completion_logprobs(c.token_ids, c.logprobs, i),
                         prompt_logprobs=None if logprobs is None else logprobs.prompt_logprobs(c.prompt_token_ids,
                                                                                               c.prompt_logprobs))
        for i, c in enumerate(out)])


def _chat_choice(index: int, text: str, reason: str | None, tool_family: str | None, logprobs) -> ChatChoice:
    if tool_family is None:
        return ChatChoice(index=index, message=ResponseMessage(content=text), logprobs=logprobs, finish_reason=reason)
    content, calls = parse(tool_family, text)
    return ChatChoice(index=index, message=ResponseMessage(content=content, tool_calls=calls or None),
                      logprobs=logprobs, finish_reason="tool_calls" if calls else reason)
