"""The online driver's client: a workload sent to the service through its OpenAI API, as its users send it.

Each request is a `POST /v1/completions` of the turn's prompt as token ids, `max_tokens` from the turn,
`temperature: 0`, `ignore_eos: true`, streamed with `stream_options: {include_usage, continuous_usage_stats}`: every
chunk carries the completion tokens so far, so each chunk that brings tokens becomes one event of the request's record
(when it arrived, how many tokens it brought). The conversations' first turns go out at their arrival times (a
Poisson process of the rate: scenarios.make_workload), each later turn once the answer before it has arrived, its
prompt carrying that answer as the model's tokenizer reads the streamed text.

Bounded: at most `max_in_flight` requests are open at once (a request waits for room before it is sent; its times run
from its send, as in vLLM's serving benchmark under --max-concurrency), each within `timeout_s`. A request that fails
(an HTTP error such as a 429 refusal, an error event, a timeout, a stream cut short) is recorded with its error and
ends its conversation; the run ends when every conversation has.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from benchmarks.load import require_loopback

from .metrics import RequestRecord
from .offline import request_id
from .scenarios import Conversation

STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


class OnlineRun:
    """One workload through the service at `url` (loopback only) serving `model`; `await run()` -> (request records,
    wall seconds)."""

    def __init__(self, url: str, model: str, workload: list[Conversation], tokenizer, max_in_flight: int = 256,
                 timeout_s: float = 600.0, progress=None):
        require_loopback(url)
        self.url, self.model, self.workload, self.tokenizer = url, model, workload, tokenizer
        self.max_in_flight, self.timeout_s, self.progress = max_in_flight, timeout_s, progress
        self.records: dict[str, RequestRecord] = {}
        self.start = 0.0

    async def run(self) -> tuple[list[RequestRecord], float]:
        room = asyncio.Semaphore(self.max_in_flight)
        limits = httpx.Limits(max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight)
        timeout = httpx.Timeout(self.timeout_s, connect=10.0)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits) as http:
            self.start = time.perf_counter()
            await asyncio.gather(*(self._conversation(http, room, c) for c in self.workload))
        return list(self.records.values()), time.perf_counter() - self.start

    def _now(self) -> float:
        return time.perf_counter() - self.start

    async def _conversation(self, http: httpx.AsyncClient, room: asyncio.Semaphore, conversation: Conversation):
        """Its turns one after another from its arrival, until its last or its first failed one."""
        await asyncio.sleep(conversation.arrival_s - self._now())
        answers: list[list[int]] = []
        for turn in range(len(conversation.turns)):
            async with room:
                record, text = await self._request(http, conversation, turn, answers)
            if self.progress is not None:
                self.progress.update(1)
            if record.error is not None:
                return
            answers.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def _request(self, http: httpx.AsyncClient, conversation: Conversation, turn: int,
                       answers: list[list[int]]) -> tuple[RequestRecord, str]:
        prompt = conversation.prompt(turn, answers)
        body = {"model": self.model, "prompt": prompt, "max_tokens": conversation.turns[turn].max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": STREAM_OPTIONS}
        record = RequestRecord(request_id(conversation, turn), conversation.id, turn, self._now(), len(prompt))
        self.records[record.request_id] = record
        try:
            async with asyncio.timeout(self.timeout_s):
                return record, await self._stream(http, body, record)
        except TimeoutError:
            record.error = f"no complete answer within {self.timeout_s:g} s"
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        return record, ""

    async def _stream(self, http: httpx.AsyncClient, body: dict, record: RequestRecord) -> str:
        """Send one request and read its answer into `record`: an event for each chunk whose usage counts new
        tokens, the finish reason, or what went wrong. Returns the answer's text."""
        parts, so_far = [], 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return ""
            async for line in response.aiter_lines():
                at = self._now()
                if line == "data: [DONE]":
                    return "".join(parts)
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = f"error event: {chunk['error']['message']}"
                    continue
                if chunk.get("usage") is None:
                    record.error = "a chunk without usage: the service ignores continuous_usage_stats"
                    continue
                if chunk["usage"]["completion_tokens"] > so_far:
                    record.events.append((at, chunk["usage"]["completion_tokens"] - so_far))
                    so_far = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    parts.append(choice["text"])
                    record.finish_reason = choice["finish_reason"] or record.finish_reason
        record.error = "the stream ended before [DONE]"
        return ""
