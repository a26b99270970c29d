"""Admission control: the memory model's bytes per request, the capacity board that the ingress and the
request router share (replicas' reported free bytes and slots, minus this process's own reservations since the last
report), and the bounded-wait admission gate in front of it.

Placement happens at admission: the request is reserved on a replica and the router sends it there. A request with a
full block of prompt goes to the replica last given its longest known prefix (affinity keys: the chained hashes of
its first 1, 2, 4, ... blocks), so a conversation's turns and a document's readers find their cached prefix; when
that replica lacks room, or no replica is known to hold the prefix, to the least-loaded one that fits. A shorter
request goes where it fits best (least bytes left over), keeping large holes for large requests. Each ingress
process keeps its own map of prefixes to replicas. A reservation ends when that replica's report lists the request
(its bytes are then inside the reported free bytes) or when the request ends, whichever comes first.
"""
from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

from serve_app.errors import OpenAIError, over_capacity
from shadowkv_core import ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.cache.prefix import block_hashes

HOLD_TIMES_KEPT = 32  # the predicted wait follows recent requests, not the service's whole history
ENDED_KEPT_S = 60.0  # how long a request that ended before any report listed it waits for a late report to list it
AFFINITY_KEYS_KEPT = 16384  # prefixes whose replica a board remembers, the least recently placed forgotten first


def affinity_keys(token_ids: Sequence[int], block_size: int) -> tuple[bytes, ...]:
    """The chained hashes (the engine's prefix-cache names) of a prompt's first 1, 2, 4, 8, ... full blocks, deepest
    first: two prompts share every key up to the largest power of two within their common full blocks."""
    keys = [h for n, h in enumerate(block_hashes(token_ids, block_size), 1) if n & (n - 1) == 0]
    return tuple(reversed(keys))

@dataclass(frozen=True)
class Footprint:
    """The engine's memory model for one request: (GPU bytes, host bytes) a sequence of `prompt_len` prompt tokens
    and up to `max_tokens` generated ones holds; the same function the engine's cache sizes its reservations by."""

    geometry: mm.Geometry
    shadowkv: ShadowKVConfig | None
    block_size: int

    def predict(self, prompt_len: int, max_tokens: int) -> tuple[int, int]:
        need = mm.seq_bytes(self.geometry, self.shadowkv, prompt_len, max_tokens, self.block_size)
        return need.gpu, need.host


@dataclass
class _Replica:
    """One replica's last report and this process's requests on it: `reserved` (placed, not in the report yet, so
    not in its free bytes), `counted` (placed and in the report), `credited` (ended here, still in the report: its
    bytes are free again although the report does not say so yet), `ended` (ended here while only reserved, with the
    time it ended: a report taken before its end may still list it, and is then credited with it; reports taken
    before it reached the replica do not list it, so it waits for one that does, up to ENDED_KEPT_S)."""

    free_gpu: int
    free_host: int
    free_slots: int
    stats: dict
    reserved: dict[str, tuple[int, int]] = field(default_factory=dict)
    counted: dict[str, tuple[int, int]] = field(default_factory=dict)
    credited: dict[str, tuple[int, int]] = field(default_factory=dict)
    ended: dict[str, tuple[tuple[int, int], float]] = field(default_factory=dict)

    def room(self) -> tuple[int, int, int]:
        gpu = self.free_gpu - _total(self.reserved, 0) + _total(self.credited, 0)
        host = self.free_host - _total(self.reserved, 1) + _total(self.credited, 1)
        return gpu, host, self.free_slots - len(self.reserved) + len(self.credited)

    def reported(self, stats: dict, now: float) -> "_Replica":
        """This replica after a fresh report: what the report lists is counted, what it no longer lists is gone."""
        listed = set(stats.get("request_ids", ()))
        held = {**self.reserved, **self.counted}
        ended = {k: need for k, (need, _) in self.ended.items()}
        return _Replica(stats["free_gpu_bytes"], stats["free_host_bytes"], stats["free_slots"], stats,
                        reserved={k: v for k, v in self.reserved.items() if k not in listed},
                        counted={k: v for k, v in held.items() if k in listed and k not in self.credited},
                        credited={k: v for k, v in {**self.credited, **ended}.items() if k in listed},
                        ended={k: e for k, e in self.ended.items() if k not in listed and now - e[1] < ENDED_KEPT_S})

    def release(self, request_id: str, now: float) -> None:
        if request_id in self.reserved:
            self.ended[request_id] = (self.reserved.pop(request_id), now)
        if request_id in self.counted:
            self.credited[request_id] = self.counted.pop(request_id)


def _total(requests: dict[str, tuple[int, int]], i: int) -> int:
    return sum(v[i] for v in requests.values())


class CapacityBoard:
    """Replicas' last reported capacity plus this process's reservations. Thread-safe: the router updates it from
    Serve's router loop, the ingress reads and reserves from its own event loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock  # times how long an ended request waits for a report to list it
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = {}
        self._holder: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # affinity key -> replica

    def update(self, reports: dict[str, dict]) -> None:
        """Replace the view with fresh `record_routing_stats` reports, keyed by replica id; replicas not reported
        yet (no capacity in their stats) are left out."""
        with self._lock:
            now = self.clock()
            self._replicas = {rid: self._replicas.get(rid, _Replica(0, 0, 0, {})).reported(stats, now)
                              for rid, stats in reports.items() if "free_gpu_bytes" in stats}
            for key in [k for k, rid in self._holder.items() if rid not in self._replicas]:
                del self._holder[key]  # a replica gone took its cache with it

    def place(self, request_id: str, gpu: int, host: int, among: set[str] | None = None,
              keys: tuple[bytes, ...] = ()) -> str | None:
        """Reserve the request on a replica (of `among`, default all) with room for it; None if it fits none.
        With affinity `keys` (deepest first): the replica last given the deepest of them that fits, else the one
        with the most room (GPU, then host bytes, then slots), and the keys are then that replica's. Without: the
        one it fits best, least GPU, then host, bytes left over."""
        with self._lock:
            rooms = {rid: room for rid, rep in self._replicas.items() if among is None or rid in among
                     for room in [rep.room()] if room[0] >= gpu and room[1] >= host and room[2] >= 1}
            if not rooms:
                return None
            if keys:
                rid = next((self._holder[k] for k in keys if self._holder.get(k) in rooms), None)
                rid = rid if rid is not None else max(rooms, key=lambda r: (rooms[r], r))
                self._remember(keys, rid)
            else:
                rid = min(rooms, key=lambda r: (rooms[r][0] - gpu, rooms[r][1] - host, r))
            self._replicas[rid].reserved[request_id] = (gpu, host)
            return rid

    def _remember(self, keys: tuple[bytes, ...], rid: str) -> None:
        for key in keys:
            self._holder[key] = rid
            self._holder.move_to_end(key)
        while len(self._holder) > AFFINITY_KEYS_KEPT:
            self._holder.popitem(last=False)

    def placement(self, request_id: str) -> str | None:
        with self._lock:
            return next((rid for rid, rep in self._replicas.items()
                         if request_id in rep.reserved or request_id in rep.counted), None)

    def release(self, request_id: str) -> None:
        with self._lock:
            now = self.clock()
            for rep in self._replicas.values():
                rep.release(request_id, now)

    def fits_when_idle(self, gpu: int, host: int) -> bool:
        """Whether some replica could hold the request once everything on it has finished."""
        with self._lock:
            return any(rep.stats.get("gpu_bytes_total", 0) >= gpu and rep.stats.get("host_bytes_total", 0) >= host
                       for rep in self._replicas.values())

    def reports(self) -> list[dict]:
        with self._lock:
            return [dict(rep.stats) for rep in self._replicas.values()]

    def next_free_at(self) -> float | None:
        """The earliest wall-clock time at which a request on any replica can end, as the replicas last bounded it
        (LLMEngine.next_finish_s); None if some replica gave no bound."""
        with self._lock:
            bounds = [rep.stats.get("next_free_at") for rep in self._replicas.values()]
        return None if not bounds or None in bounds else min(bounds)

    def has_free_slot(self) -> bool:
        with self._lock:
            return any(rep.room()[2] >= 1 for rep in self._replicas.values())

    def total_slots(self) -> int:
        """Slots of every reported replica, taken or not."""
        with self._lock:
            return sum(rep.stats.get("num_slots", 0) for rep in self._replicas.values())

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
    """Admit a request onto a replica with room for it. Without room it queues, first come first placed, while
    fewer than `max_waiting` others wait and its predicted wait stays within `max_wait_s`; beyond either bound, or
    when the replicas' bounds say no request can end within the wait, it is refused at once with 429 and a
    Retry-After. The predicted wait: the requests ahead of it, served `total_slots` at a time, each for the mean
    time a recent request held its slot."""

    def __init__(self, board: CapacityBoard, max_waiting: int, max_wait_s: float, poll_s: float = 0.02,
                 clock: Callable[[], float] = time.monotonic):
        self.board, self.max_waiting, self.max_wait_s, self.poll_s = board, max_waiting, max_wait_s, poll_s
        self.clock = clock  # times how long requests hold their slots
        self._queue: dict[str, asyncio.Event] = {}  # the waiting line, in arrival order: each one's turn to poll
        self._admitted_at: dict[str, float] = {}
        self._hold_s = collections.deque(maxlen=HOLD_TIMES_KEPT)  # slot hold times of the last requests to end

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    def capacity(self) -> tuple[int, float] | None:
        """(requests the service holds at most: every slot and the waiting line, the Retry-After of a refusal), for
        the proxies' edge shedding (serve_app/edge.py); None while no replica has reported."""
        slots = self.board.total_slots()
        return (slots + self.max_waiting, self._retry_after_s(self.max_waiting + 1)) if slots else None

    def predicted_wait_s(self, position: int) -> float | None:
        """Seconds until the `position`-th request in line gets a slot; None before any request has ended here."""
        slots = self.board.total_slots()
        if not self._hold_s or not slots:
            return None
        return math.ceil(position / slots) * sum(self._hold_s) / len(self._hold_s)

    def refuse_early(self) -> None:
        """Refuse before any work on the request (tokenization) when it would have to wait and the line has no room
        for it. It waits behind any line (first come, first placed: a free slot is the head's), else when no replica
        has a free slot."""
        if self.num_waiting >= self.max_waiting and (self._queue or not self.board.has_free_slot()):
            raise over_capacity(self._retry_after_s(self.num_waiting + 1))

    async def admit(self, request_id: str, gpu: int, host: int, keys: tuple[bytes, ...] = ()) -> str:
        if not self.board.fits_when_idle(gpu, host):
            raise OpenAIError(400, f"The request needs {gpu} GPU and {host} host bytes; no replica has that much "
                                   "even when idle. Shorten the prompt or max_tokens.", code="request_too_large")
        replica = None if self._queue else self.board.place(request_id, gpu, host, keys=keys)
        if replica is None:
            self._refuse_beyond_bounds(self.num_waiting + 1)
            replica = await self._wait_for_room(request_id, gpu, host, keys)
        self._admitted_at[request_id] = self.clock()
        return replica

    def release(self, request_id: str) -> None:
        """The request has ended: its reservation goes, and the time it held its slot feeds the predicted wait."""
        admitted = self._admitted_at.pop(request_id, None)
        if admitted is not None:
            self._hold_s.append(self.clock() - admitted)
        self.board.release(request_id)

    def _refuse_beyond_bounds(self, position: int) -> None:
        if position > self.max_waiting:
            raise over_capacity(self._retry_after_s(position))
        predicted = self.predicted_wait_s(position)
        if predicted is not None and predicted > self.max_wait_s:
            raise over_capacity(predicted)
        free_at = self.board.next_free_at()
        if free_at is not None and (free_in := free_at - time.time()) > self.max_wait_s:
            # No request anywhere can end within the wait (every replica's slots are still in their prefills):
            # waiting could only end in this same refusal. Retry-After: when the first one may end.
            raise over_capacity(free_in)

    def _retry_after_s(self, position: int) -> float:
        predicted = self.predicted_wait_s(position)
        return 1.0 if predicted is None else predicted

    async def _wait_for_room(self, request_id: str, gpu: int, host: int, keys: tuple[bytes, ...]) -> str:
        """Waits in line for room: only the head polls, the others wait for their turn (the head leaving, placed or
        not, hands it on), so requests are placed in the order they came."""
        turn = self._queue[request_id] = asyncio.Event()
        if len(self._queue) == 1:
            turn.set()
        try:
            async with asyncio.timeout(self.max_wait_s):
                await turn.wait()
                while (replica := self.board.place(request_id, gpu, host, keys=keys)) is None:
                    await asyncio.sleep(self.poll_s)
                return replica
        except TimeoutError:
            raise over_capacity(self._retry_after_s(self.num_waiting)) from None
        finally:
            del self._queue[request_id]
            if self._queue:
                next(iter(self._queue.values())).set()
