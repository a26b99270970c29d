"""A burst: many requests sent to the service at once, each over its own connection, with what each got back."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable

import httpx

from serve_app.edge import SHED_HEADER


async def send_at_once(url: str, content: bytes, n: int, timeout_s: float, shared_client: bool = False,
                       on_reply: Callable[[dict], None] | None = None) -> list[dict]:
    """`n` POSTs of the JSON `content` to /v1/completions at once, over connections opened beforehand; per request:
    status, latency `s` from its own send, `sent_s` (its send after the first's), `edge` (answered by the proxy's
    edge shedding), Retry-After, completion tokens. One httpx client per request unless `shared_client`: one
    AsyncClient's pool hands concurrent requests to its connections one after another, at a cost that grows with the
    requests pending, so the last ones would be measured waiting for the client."""
    headers = {"content-type": "application/json"}
    timeout = httpx.Timeout(timeout_s, connect=10)
    async with contextlib.AsyncExitStack() as stack:
        if shared_client:
            one = httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=n))
            clients = [await stack.enter_async_context(one)] * n
        else:
            clients = [await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=timeout))
                       for _ in range(n)]
        await asyncio.gather(*(client.get("/health") for client in clients))  # open the connections
        requests = [client.build_request("POST", "/v1/completions", content=content, headers=headers)
                    for client in clients]
        start = time.monotonic()

        async def one(client: httpx.AsyncClient, request: httpx.Request) -> dict:
            sent = time.monotonic()
            r = await client.send(request)
            reply = {"status": r.status_code, "s": time.monotonic() - sent, "sent_s": sent - start,
                     "edge": r.headers.get(SHED_HEADER) == "edge", "retry_after": r.headers.get("Retry-After"),
                     "completion_tokens": r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None}
            if on_reply is not None:
                on_reply(reply)
            return reply

        return await asyncio.gather(*(one(client, request) for client, request in zip(clients, requests)))
