"""The engine deployment: one replica per device (or per tensor-parallel group of devices of one host), owning one
`LLMEngine` (or a `TensorParallelEngine`, rank 0 of the group, which drives its N-1 worker processes).

One worker thread owns the engine; an async step loop on the replica's event loop hands it the requests that
arrived (and the aborts) since the last step, runs `engine.step()` there, and hands each request's newest output to
its stream. A stream keeps only its newest output (outputs are cumulative), so nothing queues up behind a slow
client. A client that goes away cancels the `generate` generator, which aborts the request in the engine at the
next step boundary, freeing its slot and pages.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from serve_app import faults
from serve_app.admission import Footprint
from serve_app.errors import error_event
from serve_app.metrics import process_rss_bytes
from serve_app.replica_stream import RequestStream
from serve_app.router import MemoryAwareRouter
from shadowkv_core import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from shadowkv_core import memory_model as mm
from shadowkv_core.engine.tensor_parallel import TensorParallelEngine, start_engine

logger = logging.getLogger("ray.serve")
ROUTING_STATS_PERIOD_S = 0.5
UNHEALTHY_AFTER_S = 120.0  # a step that takes this long means a stuck engine


def load_malloc_trim():
    """glibc's malloc_trim, or None under another C library (loaded in the replica: ctypes objects do not pickle)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError):
        return None


def engine_footprint(engine: LLMEngine | TensorParallelEngine) -> Footprint:
    """The memory model for this engine's model, dtype and cache configuration; with tensor parallelism one rank's
    (its heads, its ShadowKV config): every rank holds the same share, as its reported free bytes count."""
    dtype = next(engine.model.parameters()).dtype
    geometry = mm.Geometry.from_spec(engine.model.rank_spec, dtype, engine.config.kv_cache_dtype)
    return Footprint(geometry, engine.shadowkv, engine.config.block_size)


def replica_location() -> dict[str, str]:
    """This replica's Serve id and the GPUs Ray gave it ("gpu0", ...; "cpu" without one): the labels of its series
    in the ingress's metrics, which show where requests went."""
    gpus = ",".join(f"gpu{gpu}" for gpu in ray.get_gpu_ids())
    return {"replica": serve.get_replica_context().replica_id.unique_id, "device": gpus or "cpu"}


@dataclass
class StepResult:
    outputs: list[RequestOutput]
    refused: list[tuple[str, int, str]]  # (request_id, HTTP status, message)
    stats: dict
    busy: bool
    next_free_at: float | None = None  # wall-clock time before which no request of this replica can end (or None)


@dataclass
class _Held:
    gpu_bytes: int
    host_bytes: int
    stream: RequestStream = field(default_factory=RequestStream)


@serve.deployment(
    max_ongoing_requests=64,
    health_check_period_s=5.0,
    health_check_timeout_s=30.0,
    request_router_config=RequestRouterConfig(request_router_class=MemoryAwareRouter,
                                              request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
)
class EngineReplica:
    def __init__(self, engine_config: dict, served_model_name: str):
        self.engine = start_engine(EngineConfig(**engine_config))
        self.served_model_name = served_model_name
        self.max_num_seqs = self.engine.config.max_num_seqs
        self.footprint = engine_footprint(self.engine)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._held: dict[str, _Held] = {}
        self._adds: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._stats = self.engine.stats()
        self._peak = self._in_use()  # the most bytes in use after any step since the last routing report
        self._next_free_at: float | None = None  # LLMEngine.next_finish_s after the last step, as a wall-clock time
        self._step_started: float | None = None
        self._loop_task: asyncio.Task | None = None
        self._malloc_trim = load_malloc_trim()
        self._num_requests = 0  # taken since this replica started
        self._location = replica_location()
        logger.info("engine replica ready: %s, max_model_len %d, %d slots", served_model_name,
                    self.engine.max_model_len, self.max_num_seqs)

    # ---- what the ingress calls ------------------------------------------------------------------------------
    def model_info(self) -> dict:
        return {"model": self.served_model_name, "max_model_len": self.engine.max_model_len,
                "tokenizer": self.engine.tokenizer, "footprint": self.footprint}

    async def generate(self, request: dict) -> AsyncIterator[dict]:
        """Stream one request's events; `request` holds request_id, prompt_token_ids, params, gpu_bytes,
        host_bytes (the ingress's prediction, which this replica's reported free bytes account for) and affinity
        (its prefix's keys, which only the router reads)."""
        self._ensure_step_loop()
        request_id = request["request_id"]
        refusal = self._refusal(request_id)
        if refusal is not None:
            yield refusal
            return
        held = self._held[request_id] = _Held(request["gpu_bytes"], request["host_bytes"])
        self._num_requests += 1
        self._adds.append((request_id, request["prompt_token_ids"], request["params"]))
        self._wake.set()
        try:
            async for event in held.stream.events():
                yield event
        finally:
            if not held.stream.finished:  # cancelled (client gone) or closed early: free it in the engine now
                self._aborts.append(request_id)
                self._wake.set()
            self._held.pop(request_id, None)

    def stats(self) -> dict:
        return {**self._stats, "num_held": len(self._held), "rss_bytes": process_rss_bytes()}

    def inject_fault(self, kind: str, value: float | str | None = None) -> None:
        """Tests only: refused unless the replica's environment turns fault injection on (see serve_app.faults)."""
        faults.inject(self.engine, kind, value)

    # ---- what Serve calls ------------------------------------------------------------------------------------
    def record_routing_stats(self) -> dict:
        gpu_held = sum(h.gpu_bytes for h in self._held.values())
        host_held = sum(h.host_bytes for h in self._held.values())
        s = self._stats
        peak, self._peak = self._peak, self._in_use()
        return {**s, "gpu_bytes_peak": peak[0], "host_bytes_peak": peak[1],
                "free_gpu_bytes": s["gpu_bytes_total"] - max(gpu_held, s["gpu_bytes_in_use"]),
                "free_host_bytes": s["host_bytes_total"] - max(host_held, s["host_bytes_in_use"]),
                "free_slots": self.max_num_seqs - len(self._held), "num_slots": self.max_num_seqs,
                "request_ids": list(self._held), "num_requests": self._num_requests,
                "next_free_at": self._next_free_at, **self._location}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Predicted memory demand as a share of this replica's capacity (the larger of GPU, host and slots)."""
        s = self._stats
        gpu = sum(h.gpu_bytes for h in self._held.values()) / max(1, s["gpu_bytes_total"])
        host = sum(h.host_bytes for h in self._held.values()) / max(1, s["host_bytes_total"])
        slots = len(self._held) / self.max_num_seqs
        return {"memory_demand": max(gpu, host, slots), "num_waiting": float(s.get("num_waiting", 0))}

    def check_health(self) -> None:
        if self._loop_task is not None and self._loop_task.done():
            raise RuntimeError(f"the engine step loop has stopped: {self._loop_task.exception()!r}")
        if self._step_started is not None and time.monotonic() - self._step_started > UNHEALTHY_AFTER_S:
            raise RuntimeError(f"an engine step has run for more than {UNHEALTHY_AFTER_S:.0f} s")
        self.engine.check_health()  # raises if the engine broke (a tensor-parallel rank): Serve replaces the replica

    # ---- the step loop ---------------------------------------------------------------------------------------
    def _refusal(self, request_id: str) -> dict | None:
        if request_id in self._held:
            return error_event(400, f"request id {request_id!r} is already in flight", param="request_id")
        if len(self._held) >= self.max_num_seqs:
            return error_event(429, "this replica has no free slot; retry later", type="rate_limit_error",
                               code="rate_limit_exceeded")
        return None

    def _ensure_step_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        busy = False
        while True:
            if not (busy or self._adds or self._aborts):
                self._wake.clear()
                await self._wake.wait()
            adds, aborts = self._adds, self._aborts
            self._adds, self._aborts = [], []
            self._step_started = time.monotonic()
            try:
                result = await loop.run_in_executor(self._executor, self._run_step, adds, aborts)
            except Exception as exc:  # the engine is in an unknown state: fail what runs, keep serving
                logger.exception("engine step failed")
                result = self._fail_all(adds, f"engine step failed: {type(exc).__name__}: {exc}")
            self._step_started = None
            busy = result.busy
            self._dispatch(result)

    def _run_step(self, adds: list[tuple[str, list[int], SamplingParams]], aborts: list[str]) -> StepResult:
        """Runs on the engine thread, the only thread that touches the engine."""
        refused = []
        for request_id in aborts:
            self.engine.abort(request_id)
        for request_id, prompt_token_ids, params in adds:
            try:
                self.engine.add_request(request_id, prompt_token_ids, params)
            except ValueError as exc:
                refused.append((request_id, 400, str(exc)))
            except RuntimeError as exc:  # the engine's waiting queue is full
                refused.append((request_id, 429, str(exc)))
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        busy = self.engine.has_unfinished_requests()
        if not busy and self._malloc_trim is not None:
            # Idle: hand the heap's free pages back to the OS. A step's tensors come and go through glibc's arenas
            # (per thread: engine, torch, Ray), which keep what was freed; without this, idle RSS is whatever
            # the busiest recent step left, tens of MiB above the baseline and drifting up with the rare large mix.
            self._malloc_trim(0)
        bound = self.engine.next_finish_s()
        return StepResult(outputs, refused, self.engine.stats(), busy, None if bound is None else time.time() + bound)

    def _fail_all(self, adds, message: str) -> StepResult:
        request_ids = set(self._held) | {request_id for request_id, _, _ in adds}
        for request_id in request_ids:
            self._executor.submit(self.engine.abort, request_id)
        return StepResult([], [(rid, 500, message) for rid in request_ids], self._stats, False)

    def _in_use(self) -> tuple[int, int]:
        return self._stats["gpu_bytes_in_use"], self._stats["host_bytes_in_use"]

    def _dispatch(self, result: StepResult) -> None:
        self._stats = result.stats
        self._peak = tuple(map(max, self._peak, self._in_use()))
        self._next_free_at = result.next_free_at
        for request_id, status, message in result.refused:
            if request_id in self._held:
                self._held[request_id].stream.fail(status, message)
        for output in result.outputs:
            if output.request_id in self._held:
                self._held[output.request_id].stream.push(output)
