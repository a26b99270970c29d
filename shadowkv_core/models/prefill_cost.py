"""The cost model of a sliced prefill (DecoderLayer.prefill_slices): FLOPs from the model's geometry, and the budget
of one engine step that each slice is sized to fit."""
from __future__ import annotations

import math
from collections.abc import Callable, Generator

from .spec import ModelSpec

# Prefill FLOPs that take about as long as one byte read from pinned host memory: a Hopper GPU's dense bf16 matrix
# rate over a PCIe 5 x16 link's bandwidth, as their data sheets give them.
HOST_BYTE_FLOPS = 12_500


class PrefillBudget:
    """FLOPs a prefill may still spend in this engine step (`left`, of the step's `granted`; inf: no limit), and
    what each part of a layer costs; bytes read from host memory count as the FLOPs that take as long
    (HOST_BYTE_FLOPS). spec: the geometry this device's layers hold (a tensor-parallel rank's share)."""

    def __init__(self, spec: ModelSpec):
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.projection_row = 2 * spec.hidden_size * (q + 2 * kv)  # 2 FLOPs per weight per token: q/k/v
        self.output_row = 2 * (q * spec.hidden_size + 3 * spec.hidden_size * spec.intermediate_size)  # o_proj, MLP
        self.pair = 4 * q  # one query and one key: q·k and p·v over every head
        self.left = self.granted = math.inf

    def grant(self, flops: float) -> None:
        """A step's FLOPs for this prefill (inf: no limit)."""
        self.left = self.granted = flops

    def attention(self, keys_before: int, n: int) -> float:
        """Causal attention of n queries that follow keys_before keys (a cached prefix counted): each sees those
        and the chunk's keys up to its own."""
        return self.pair * (n * keys_before + n * (n + 1) / 2)

    def prompt(self, cached: int, n: int) -> float:
        """One layer's prefill of n prompt tokens after `cached` tokens of cached prefix."""
        return n * (self.projection_row + self.output_row) + self.attention(cached, n)

    @staticmethod
    def host_read(num_bytes: int) -> float:
        """The FLOPs a read of num_bytes from host memory counts as."""
        return num_bytes * HOST_BYTE_FLOPS

    def run_whole(self, cost: float, run: Callable[[], None]) -> Generator[None, None, None]:
        """run(), one unit of `cost` that does not split (a cache's read of a cached prefix): in this step if it fits
        what is left or nothing of the step's grant is spent yet, else first thing in the next step (pausing, with
        nothing left, ends this one). A unit that costs nothing runs at once."""
        if cost and cost > self.left and self.left < self.granted:
            self.left = 0
            yield
        run()
        self.left -= cost

    def run_slices(self, n: int, limit: int, cost: Callable[[int, int], float],
                   run: Callable[[int, int], None]) -> Generator[None, None, None]:
        """run(s, e) over consecutive ranges covering [0, n), pausing (yield) before each: each range the longest,
        up to `limit` long, whose cost(s, e) fits what is left (one at least: a step always advances), which it
        spends. cost must grow with e."""
        s = 0
        while s < n:
            yield
            lo, hi = s + 1, min(s + limit, n)
            while lo < hi:  # the largest e in [lo, hi] that fits
                mid = (lo + hi + 1) // 2
                if cost(s, mid) <= self.left:
                    lo = mid
                else:
                    hi = mid - 1
            run(s, lo)
            self.left -= cost(s, lo)
            s = lo
