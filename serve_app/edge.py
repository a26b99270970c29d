"""Load shedding at the edge: Serve's HTTP proxy answers a completion request with 429 before forwarding it, when the
service already holds as many requests as it can (every replica's slots plus the ingress's waiting line).

Why: the proxy forwards requests one after another (receive, hand to the ingress over Ray), so in a burst of long
requests the excess reached the ingress's fast refusal only after every request ahead of it (docs/benchmarks.md,
the service's overload). Refused here, a request never leaves the proxy.

How: Ray Serve builds its proxy's ASGI stack with the Starlette middlewares returned by the function that the
environment variable RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names (EDGE_ENV: scripts/serve.sh, the Docker image
and the RayService set it). The proxy learns the capacity from the ingress's own responses, which carry it in
CAPACITY_HEADER (and the Retry-After it would give in RETRY_HEADER): no extra call, and autoscaling is followed as
replicas report. Until a response has told it, and for every other route, the proxy forwards everything. It sheds only
requests that the ingress would refuse at once too: at capacity every slot is taken and the waiting line is full. Each
proxy counts its own requests, so several proxies together may still forward more; the ingress stays the authority.
At capacity a malformed request is answered 429 here, not 400: the proxy does not read bodies. Its 429s carry
SHED_HEADER: edge, so that a client or benchmark can tell them from the ingress's.

Latency in a burst: the shed request is answered as soon as it reaches this middleware, and its unread body does not
hold the answer back (uvicorn discards the rest of a body once the response is complete). It reaches the middleware
when the proxy has taken in the requests sent before it (docs/benchmarks.md has the timings). A client that sends a
burst through ONE httpx AsyncClient measures its own connection pool instead: it issues the requests one after
another, slower as more are pending, and the shed ones, sent last, seem to take seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from starlette.middleware import Middleware

from serve_app.errors import over_capacity

EDGE_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "serve_app.edge:proxy_middlewares"}
CAPACITY_HEADER = b"x-shadowkv-capacity"
RETRY_HEADER = b"x-shadowkv-retry-after-s"
SHED_HEADER = "x-shadowkv-shed"  # "edge" on the 429s this proxy answered itself
SHED_PATHS = ("/v1/completions", "/v1/chat/completions")


def proxy_middlewares() -> list[Middleware]:
    return [Middleware(EdgeShedder)]


@dataclass
class EdgeShedder:
    """ASGI middleware of the proxy: in-flight completion requests against the last advertised capacity."""

    app: object
    in_flight: int = 0
    capacity: int | None = None
    retry_after_s: float = 1.0
    shed: int = 0

    async def __call__(self, scope, receive, send):
        watched = self._watch(send)
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith(SHED_PATHS):
            return await self.app(scope, receive, watched)
        if self.capacity is not None and self.in_flight >= self.capacity:
            self.shed += 1
            refusal = over_capacity(self.retry_after_s).response()
            refusal.headers[SHED_HEADER] = "edge"
            return await refusal(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, receive, watched)
        finally:
            self.in_flight -= 1

    def _watch(self, send):
        """`send` that reads the capacity the ingress advertises on its responses."""
        async def watched(message):
            if message["type"] == "http.response.start":
                for name, value in message.get("headers", ()):
                    if name == CAPACITY_HEADER:
                        self.capacity = int(value)
                    elif name == RETRY_HEADER:
                        self.retry_after_s = float(value)
            await send(message)
        return watched


@dataclass
class CapacitySource:
    """Set by the Ingress when it starts: () -> (capacity, retry_after_s), or None while no replica has reported."""

    read: object = field(default=lambda: None)


@dataclass
class CapacityAdvert:
    """ASGI middleware of the ingress: every response carries the service's capacity for the proxies' EdgeShedder."""

    app: object
    source: CapacitySource = field(default_factory=CapacitySource)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def advertised(message):
            known = self.source.read() if message["type"] == "http.response.start" else None
            if known is not None:
                capacity, retry_after_s = known
                message = {**message, "headers": [*message.get("headers", ()),
                                                   (CAPACITY_HEADER, str(capacity).encode()),
                                                   (RETRY_HEADER, str(retry_after_s).encode())]}
            await send(message)
        return await self.app(scope, receive, advertised)
