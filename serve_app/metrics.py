"""The ingress's Prometheus metrics, in a registry of its own (Ray's process-wide metrics stay separate), rendered as
Prometheus text by GET /metrics: our own `shadowkv_*` series, and beside them the `vllm:*` series vLLM exposes (same
names, `model_name` label), so dashboards built for vLLM work unchanged."""
from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKENS_PER_S_WINDOW_S = 10.0
# *_peak: the most in use after any step between a replica's last two reports; *_total: since each replica started
_REPLICA_SUMS = ("gpu_bytes_in_use", "gpu_bytes_peak", "gpu_bytes_total", "host_bytes_in_use", "host_bytes_peak",
                 "host_bytes_total", "num_running", "num_waiting", "chunks_selected_total", "chunk_hits_total",
                 "prefix_hit_tokens", "prefix_query_tokens", "prefix_cached_bytes", "prefix_evictions")


disable_created_metrics()  # the *_created series only add noise to a scrape


def process_rss_bytes() -> int:
    """This process's resident set size now (Linux; 0 elsewhere), for leak checks."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class ServiceMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("shadowkv_admission_queue_depth", "Requests waiting for admission", registry=r)
        self.reserved = Gauge("shadowkv_admission_reserved", "Requests placed but not yet in a replica report",
                              registry=r)
        self.admitted = Counter("shadowkv_requests_admitted", "Requests admitted", registry=r)
        self.rejected = Counter("shadowkv_requests_rejected", "Requests refused", ["reason"], registry=r)
        self.tokens = Counter("shadowkv_generated_tokens", "Tokens generated", registry=r)
        self.tokens_per_s = Gauge("shadowkv_tokens_per_second", "Tokens generated per second, last 10 s",
                                  registry=r)
        self.ttft = Histogram("shadowkv_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS_S)
        self.itl = Histogram("shadowkv_inter_token_latency_seconds", "Time between streamed tokens", registry=r,
                             buckets=LATENCY_BUCKETS_S)
        self.hit_rate = Gauge("shadowkv_hit_rate", "Mean ShadowKV chunk hit rate over replicas", registry=r)
        self.replicas = Gauge("shadowkv_replicas_ready", "Engine replicas that reported capacity", registry=r)
        self.replica_requests = Gauge("shadowkv_replica_requests", "Requests each engine replica has taken since it "
                                      "started", ["replica", "device"], registry=r)
        self.replica_sums = {k: Gauge(f"shadowkv_{k}", f"{k}, summed over replicas", registry=r)
                             for k in _REPLICA_SUMS}
        self.errors = Counter("shadowkv_request_errors", "Completion requests answered with an error status, 400s "
                              "included", ["status"], registry=r)
        self.vllm = VllmMetrics(r)
        self.model_name = ""  # the served model's name, once an engine replica has told it
        self._recent_tokens: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)

    def record_tokens(self, count: int, gap_s: float, first: bool) -> None:
        """`count` new tokens `gap_s` after the request's last ones (or after its arrival, when `first`)."""
        if count > 0:
            self.tokens.inc(count)
            self.vllm.generation_tokens.labels(self.model_name).inc(count)
            self._recent_tokens.append((time.monotonic(), count))
        latency, vllm_latency = (self.ttft, self.vllm.ttft) if first else (self.itl, self.vllm.itl)
        gap_per_token_s = gap_s if first else gap_s / count
        latency.observe(gap_per_token_s)
        vllm_latency.labels(self.model_name).observe(gap_per_token_s)

    def record_end(self, finished_reason: str, prompt_tokens: int, e2e_s: float) -> None:
        self.vllm.success.labels(self.model_name, finished_reason).inc()
        self.vllm.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.vllm.e2e.labels(self.model_name).observe(e2e_s)

    def render(self, reports: list[dict], queue_depth: int, reserved: int) -> bytes:
        """Refresh the gauges from the replicas' latest reports, then render everything as Prometheus text."""
        self.queue_depth.set(queue_depth)
        self.reserved.set(reserved)
        self.replicas.set(len(reports))
        for key, gauge in self.replica_sums.items():
            gauge.set(sum(rep.get(key, 0) for rep in reports))
        self.replica_requests.clear()  # replicas gone since the last scrape leave no stale series
        for rep in reports:
            if "replica" in rep:
                self.replica_requests.labels(rep["replica"], rep["device"]).set(rep["num_requests"])
        rates = [rep["hit_rate"] for rep in reports if rep.get("hit_rate") is not None]
        self.hit_rate.set(sum(rates) / len(rates) if rates else 0.0)
        self.tokens_per_s.set(self._tokens_per_second())
        self.vllm.running.labels(self.model_name).set(sum(rep.get("num_running", 0) for rep in reports))
        self.vllm.waiting.labels(self.model_name).set(queue_depth + sum(rep.get("num_waiting", 0) for rep in reports))
        return generate_latest(self.registry)

    def _tokens_per_second(self) -> float:
        since = time.monotonic() - TOKENS_PER_S_WINDOW_S
        return sum(n for t, n in self._recent_tokens if t >= since) / TOKENS_PER_S_WINDOW_S


class VllmMetrics:
    """The series vLLM's engine exposes, under its names, each with the `model_name` label."""

    def __init__(self, r: CollectorRegistry):
        model = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the engines' batches", model, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting: in the admission queue and the "
                             "engines' own", model, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", model, registry=r,
                              buckets=LATENCY_BUCKETS_S)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens", model, registry=r,
                             buckets=LATENCY_BUCKETS_S)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token", model,
                             registry=r, buckets=LATENCY_BUCKETS_S)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of ended requests", model, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", model, registry=r)
        self.success = Counter("vllm:request_success", "Requests ended, by why", model + ["finished_reason"],
                               registry=r)


@dataclass
class ErrorCounter:
    """ASGI middleware: counts the error statuses (400s included: the route never sees a request pydantic refused)
    that the completion routes answer with."""

    app: object
    metrics: ServiceMetrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.errors.labels(str(message["status"])).inc()
            await send(message)

        return await self.app(scope, receive, counted)
