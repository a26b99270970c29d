"""What each decode step of the shadow selected and fetched, for the engine's stats (hit rate, bytes over PCIe)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from shadowkv_core.transfers import Readback


@dataclass
class StepCounters:
    selected: int = 0  # (sequence, layer, KV head, chunk) selections
    hits: int = 0
    fetched: int = 0  # chunks rebuilt and fetched (the misses)
    bytes_fetched: int = 0  # value bytes read from the host
    from_device: int = 0  # chunks fetched from the device value region (config.device_value_share), not the host


class StepCounts:
    """The reference path adds to `current` as it runs. The kernel path counts its misses on the device, summed over
    a step's layers, and hands them over once per step; they are read when `last` is asked for and that step has
    finished, never waiting (with async decode, usually the step before the one in flight). `total` sums every step
    read so far."""

    def __init__(self, fetch_bytes: int):
        self.fetch_bytes = fetch_bytes  # host bytes of one chunk of one KV head
        self.current = StepCounters()
        self._last = StepCounters()
        self._total = StepCounters()
        self._unread: deque[tuple[StepCounters | int, Readback | None]] = deque()

    def end_step(self, device_counts: tuple[int, torch.Tensor] | None) -> None:
        """A decode step ended: its counts are `current` (reference path), or device_counts (selected, (2,) int32
        device tensor of chunks fetched and of those from the device region)."""
        if device_counts is None:
            self._unread.append((self.current, None))
        else:
            selected, counts = device_counts
            self._unread.append((selected, Readback(counts)))
        self.current = StepCounters()
        self._read()

    @property
    def last(self) -> StepCounters:
        """The counters of the last decode step that has finished on the device."""
        self._read()
        return self._last

    def _read(self) -> None:
        while self._unread and (self._unread[0][1] is None or self._unread[0][1].ready()):
            counters, readback = self._unread.popleft()
            if readback is not None:
                fetched, from_device = readback.tolist()
                counters = StepCounters(counters, counters - fetched, fetched,
                                        (fetched - from_device) * self.fetch_bytes, from_device)
            self._last = counters
            for name, value in vars(counters).items():
                setattr(self._total, name, getattr(self._total, name) + value)

    def stats(self) -> dict[str, float]:
        """The last finished step's figures, and every finished step's totals (`*_total`, counters that only grow)."""
        last, total = self.last, self._total
        return {"hit_rate": last.hits / last.selected if last.selected else 0.0, "chunks_fetched": last.fetched,
                "bytes_fetched": last.bytes_fetched, "chunks_from_device": last.from_device,
                "chunks_selected_total": total.selected, "chunk_hits_total": total.hits,
                "chunks_fetched_total": total.fetched, "bytes_fetched_total": total.bytes_fetched}
