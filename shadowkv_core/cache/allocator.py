"""A free list of fixed-size units (KV blocks, shadow pages, value pages, slots): CPU bookkeeping only; and
`commit_host_pages`, which commits a pool's host memory when it is made."""
from __future__ import annotations

import torch


def commit_host_pages(*pools: torch.Tensor) -> None:
    """Write every page of pools in host memory now: the OS maps a fresh allocation's pages only when first written,
    and a prefix cache, which reuses the least recently released unit, reaches every unit of a pool in time, so a
    process's memory would climb towards its pools' size long after start. Device memory is resident when allocated."""
    for pool in pools:
        if pool is not None and pool.device.type == "cpu":
            pool.zero_()


class BlockAllocator:
    """Units 0 .. num_blocks - 1. unit_bytes and `what` (e.g. "pages of 128 tokens") make its counters and its refusal
    speak in the caller's terms."""

    def __init__(self, num_blocks: int, unit_bytes: int = 0, what: str = "blocks"):
        self.num_blocks = num_blocks
        self.unit_bytes = unit_bytes
        self.what = what
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_in_use(self) -> int:
        return (self.num_blocks - self.num_free) * self.unit_bytes

    @property
    def bytes_total(self) -> int:
        return self.num_blocks * self.unit_bytes

    def alloc(self, n: int) -> list[int]:
        """n units, or a MemoryError naming what is missing (and nothing allocated)."""
        if n > len(self._free):
            raise MemoryError(f"need {n} {self.what}, {len(self._free)} of {self.num_blocks} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
