"""A local Ray Serve instance of this service, on loopback, for tests and benchmarks: Ray (2 CPUs, no dashboard),
Serve on a free 127.0.0.1 port, the app built from `build_app` args; the engine replicas' own stats; and a burst of
requests sent to it at once. Not used by the deployed service, which Serve starts from a config (configs/)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from typing import Callable, Iterator

import httpx
import ray
from ray import serve

from serve_app.app import build_app
from serve_app.edge import EDGE_ENV, SHED_HEADER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 60.0, replicas: int = 1) -> None:
    """Until /health answers 200 with `replicas` engine replicas reported."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/health")
        if r.status_code == 200 and r.json()["replicas"] >= replicas:
            return
        time.sleep(0.2)
    raise TimeoutError("the service never became healthy")


@contextlib.contextmanager
def ray_session(env: dict[str, str] | None = None, **init_options) -> Iterator[None]:
    """Ray on this machine (2 CPUs and no dashboard unless `init_options` say otherwise), shut down on exit. `env`
    reaches the workers (they inherit the driver's environment when Ray starts)."""
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    ray.init(**{"num_cpus": 2, "include_dashboard": False, "log_to_driver": False, **init_options})
    try:
        yield
    finally:
        ray.shutdown()
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


@contextlib.contextmanager
def serve_on_loopback(args: dict, app: str, replicas: int = 1) -> Iterator[str]:
    """Inside a Ray session: Serve on a free loopback port, the app built from `args`; yields its base URL once
    `replicas` engine replicas have reported, and shuts Serve down on exit."""
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=app, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, replicas=replicas)
        yield base
    finally:
        serve.shutdown()


@contextlib.contextmanager
def local_service(args: dict, app: str, env: dict[str, str] | None = None, replicas: int = 1) -> Iterator[str]:
    """Ray (2 CPUs, no dashboard) and Serve on a free loopback port, the app built from `args`, its HTTP proxy
    shedding load at the edge as deployed (EDGE_ENV); yields its base URL."""
    with ray_session({**EDGE_ENV, **(env or {})}), serve_on_loopback(args, app, replicas) as base:
        yield base


def engine_stats(app: str) -> dict:
    """One engine replica's stats (bytes and requests in use, process RSS), through Serve's handle."""
    return serve.get_deployment_handle("EngineReplica", app).stats.remote().result()


def wait_drained(app: str, within_s: float) -> dict:
    """The engine's stats once it holds no request and no byte, or when `within_s` has passed."""
    deadline = time.monotonic() + within_s
    stats = engine_stats(app)
    while (stats["num_running"] or stats["num_held"] or stats["gpu_bytes_in_use"]) and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = engine_stats(app)
    return stats


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
