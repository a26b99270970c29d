"""Admission control: a linear upper bound of the engine's memory model, the capacity board that the ingress and the
request router share (replicas' reported free bytes and slots, minus this process's own reservations since the last
report), and the bounded-wait admission gate in front of it.

Placement happens at admission: the request is reserved on the replica it fits best (least bytes left over), and the
router sends it there. A reservation ends when that replica's report lists the request (its bytes are then inside
the reported free bytes) or when the request ends, whichever comes first.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from serve_app.errors import OpenAIError, over_capacity

Footprint = Callable[[int, int], tuple[int, int]]


@dataclass(frozen=True)
class FootprintModel:
    """bytes(prompt_len, max_tokens) = base + per_prompt_token * prompt_len + per_new_token * max_tokens, for GPU and
    host, fitted to the engine's `footprint` and lifted so that it is never below it at the probed lengths."""

    gpu: tuple[float, float, float]
    host: tuple[float, float, float]

    @classmethod
    def fit(cls, footprint: Footprint, max_model_len: int) -> "FootprintModel":
        long = max(2, max_model_len // 2)
        at_1_1, at_long_1, at_1_long = footprint(1, 1), footprint(long, 1), footprint(1, long)
        probes = [(p, m) for p in _lengths(max_model_len) for m in (1, 16, 256) if p + m <= max_model_len]
        observed = [(p, m, footprint(p, m)) for p, m in probes]
        return cls(*(_fit_one(i, at_1_1, at_long_1, at_1_long, long, observed) for i in (0, 1)))

    def predict(self, prompt_len: int, max_tokens: int) -> tuple[int, int]:
        return _eval(self.gpu, prompt_len, max_tokens), _eval(self.host, prompt_len, max_tokens)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FootprintModel":
        return cls(gpu=tuple(d["gpu"]), host=tuple(d["host"]))


def _lengths(max_model_len: int) -> list[int]:
    """64 consecutive lengths (page rounding repeats with the page size, up to 64 tokens) and a few long ones."""
    longer = (500, 4096, max_model_len // 3, max_model_len - 256)
    return sorted({n for n in (*range(1, 65), *longer) if 1 <= n < max_model_len})


def _fit_one(i: int, at_1_1, at_long_1, at_1_long, long: int, observed) -> tuple[float, float, float]:
    per_prompt = (at_long_1[i] - at_1_1[i]) / (long - 1)
    per_new = (at_1_long[i] - at_1_1[i]) / (long - 1)
    base = at_1_1[i] - per_prompt - per_new
    shortfall = max((fp[i] - _eval((base, per_prompt, per_new), p, m) for p, m, fp in observed), default=0)
    return base + max(0, shortfall), per_prompt, per_new


def _eval(coeffs: tuple[float, float, float], prompt_len: int, max_tokens: int) -> int:
    base, per_prompt, per_new = coeffs
    return int(base + per_prompt * prompt_len + per_new * max_tokens + 0.999)


@dataclass
class _Replica:
    """One replica's last report and this process's requests on it: `reserved` (placed, not in the report yet, so
    not in its free bytes), `counted` (placed and in the report), `credited` (ended here, still in the report: its
    bytes are free again although the report does not say so yet)."""

    free_gpu: int
    free_host: int
    free_slots: int
    stats: dict
    reserved: dict[str, tuple[int, int]] = field(default_factory=dict)
    counted: dict[str, tuple[int, int]] = field(default_factory=dict)
    credited: dict[str, tuple[int, int]] = field(default_factory=dict)

    def room(self) -> tuple[int, int, int]:
        gpu = self.free_gpu - _total(self.reserved, 0) + _total(self.credited, 0)
        host = self.free_host - _total(self.reserved, 1) + _total(self.credited, 1)
        return gpu, host, self.free_slots - len(self.reserved) + len(self.credited)

    def reported(self, stats: dict) -> "_Replica":
        """This replica after a fresh report: what the report lists is counted, what it no longer lists is gone."""
        listed = set(stats.get("request_ids", ()))
        held = {**self.reserved, **self.counted}
        return _Replica(stats["free_gpu_bytes"], stats["free_host_bytes"], stats["free_slots"], stats,
                        reserved={k: v for k, v in self.reserved.items() if k not in listed},
                        counted={k: v for k, v in held.items() if k in listed and k not in self.credited},
                        credited={k: v for k, v in self.credited.items() if k in listed})

    def release(self, request_id: str) -> None:
        self.reserved.pop(request_id, None)
        if request_id in self.counted:
            self.credited[request_id] = self.counted.pop(request_id)


def _total(requests: dict[str, tuple[int, int]], i: int) -> int:
    return sum(v[i] for v in requests.values())


class CapacityBoard:
    """Replicas' last reported capacity plus this process's reservations. Thread-safe: the router updates it from
    Serve's router loop, the ingress reads and reserves from its own event loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = {}

    def update(self, reports: dict[str, dict]) -> None:
        """Replace the view with fresh `record_routing_stats` reports, keyed by replica id; replicas not reported
        yet (no capacity in their stats) are left out."""
        with self._lock:
            self._replicas = {rid: self._replicas.get(rid, _Replica(0, 0, 0, {})).reported(stats)
                              for rid, stats in reports.items() if "free_gpu_bytes" in stats}

    def place(self, request_id: str, gpu: int, host: int) -> str | None:
        """Reserve the request on the replica it fits best (least GPU, then host, bytes left over); None if none."""
        with self._lock:
            fits = [(room[0] - gpu, room[1] - host, rid) for rid, rep in self._replicas.items()
                    for room in [rep.room()] if room[0] >= gpu and room[1] >= host and room[2] >= 1]
            if not fits:
                return None
            rid = min(fits)[2]
            self._replicas[rid].reserved[request_id] = (gpu, host)
            return rid

    def placement(self, request_id: str) -> str | None:
        with self._lock:
            return next((rid for rid, rep in self._replicas.items()
                         if request_id in rep.reserved or request_id in rep.counted), None)

    def release(self, request_id: str) -> None:
        with self._lock:
            for rep in self._replicas.values():
                rep.release(request_id)

    def fits_when_idle(self, gpu: int, host: int) -> bool:
        """Whether some replica could hold the request once everything on it has finished."""
        with self._lock:
            return any(rep.stats.get("gpu_bytes_total", 0) >= gpu and rep.stats.get("host_bytes_total", 0) >= host
                       for rep in self._replicas.values())

    def reports(self) -> list[dict]:
        with self._lock:
            return [dict(rep.stats) for rep in self._replicas.values()]

    def has_free_slot(self) -> bool:
        with self._lock:
            return any(rep.room()[2] >= 1 for rep in self._replicas.values())

    def num_replicas(self) -> int:
        with self._lock:
            return len(self._replicas)

    def num_reserved(self) -> int:
        with self._lock:
            return sum(len(rep.reserved) for rep in self._replicas.values())


_BOARDS: dict[tuple[str, str], CapacityBoard] = {}
_BOARDS_LOCK = threading.Lock()


def board_for(app_name: str, deployment_name: str) -> CapacityBoard:
    """This process's capacity board for one engine deployment, shared by its router and its ingress."""
    with _BOARDS_LOCK:
        return _BOARDS.setdefault((app_name, deployment_name), CapacityBoard())


class AdmissionGate:
    """Admit a request onto a replica with room for it, waiting at most `max_wait_s` and only while fewer than
    `max_waiting` others wait; beyond that, refuse at once with 429 and a Retry-After."""

    def __init__(self, board: CapacityBoard, max_waiting: int, max_wait_s: float, poll_s: float = 0.02):
        self.board, self.max_waiting, self.max_wait_s, self.poll_s = board, max_waiting, max_wait_s, poll_s
        self.num_waiting = 0

    def refuse_early(self) -> None:
        """Refuse before any work on the request (tokenization) when no replica has a slot and none may wait."""
        if self.num_waiting >= self.max_waiting and not self.board.has_free_slot():
            raise over_capacity(self.max_wait_s)

    async def admit(self, request_id: str, gpu: int, host: int) -> str:
        if not self.board.fits_when_idle(gpu, host):
            raise OpenAIError(400, f"The request needs {gpu} GPU and {host} host bytes; no replica has that much "
                                   "even when idle. Shorten the prompt or max_tokens.", code="request_too_large")
        replica = self.board.place(request_id, gpu, host)
        if replica is not None:
            return replica
        if self.num_waiting >= self.max_waiting:
            raise over_capacity(self.max_wait_s)
        return await self._wait_for_room(request_id, gpu, host)

    async def _wait_for_room(self, request_id: str, gpu: int, host: int) -> str:
        self.num_waiting += 1
        try:
            deadline = time.monotonic() + self.max_wait_s
            while time.monotonic() < deadline:
                await asyncio.sleep(self.poll_s)
                replica = self.board.place(request_id, gpu, host)
                if replica is not None:
                    return replica
            raise over_capacity(self.max_wait_s)
        finally:
            self.num_waiting -= 1
