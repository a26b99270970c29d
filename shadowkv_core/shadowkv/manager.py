"""ShadowKVManager: the shadow's CPU bookkeeping. Each sequence kept in shadows holds one slot, and as many GPU pages
(U rows, landmarks) as value pages, reserved at admission for its whole length (prompt + generation); value pages are
split between the host store and, for ShadowKVConfig.device_value_share, the device region (its first pages there).

Value page ids: host pages are 0 .. H - 1, device pages follow, H .. H + D - 1 (what host_store.HostValueStore and the
fetch kernel read them by)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shadowkv_core.cache.allocator import BlockAllocator
from shadowkv_core.cache.base import CacheManager
from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.memory_model import device_value_pages
from shadowkv_core.transfers import to_device


@dataclass
class SequenceState:
    slot: int
    prompt_len: int
    gpu_pages: list[int]
    value_pages: list[int]
    gpu_table: torch.Tensor  # (num_pages,) int64 on the device
    value_table: torch.Tensor  # (num_pages,) int64 on the host
    num_shadow: int  # chunks in the shadow
    window_len: int  # exact tokens in the window
    num_outliers: int
    seq_len: int = 0


class ShadowKVManager(CacheManager):
    """Pools of slots, GPU pages, host value pages and device value pages, each unit `*_bytes` large. It keeps no
    prefix cache: a ShadowKV prompt prefills whole (allocate returns 0), and its pages go back to the pools at its
    end."""

    def __init__(self, config: ShadowKVConfig, num_slots: int, slot_bytes: int, num_gpu_pages: int,
                 gpu_page_bytes: int, num_host_pages: int, num_device_value_pages: int, value_page_bytes: int,
                 device: torch.device):
        self.config, self.device = config, device
        self.page_tokens = config.page_chunks * config.chunk_size
        tokens = f"of {self.page_tokens} tokens"
        self.slots = BlockAllocator(num_slots, slot_bytes, "ShadowKV slots")
        self.gpu_pages = BlockAllocator(num_gpu_pages, gpu_page_bytes, f"GPU shadow pages {tokens}")
        self.host_pages = BlockAllocator(num_host_pages, value_page_bytes, f"pages {tokens} in the host value store")
        self.device_value_pages = BlockAllocator(num_device_value_pages, value_page_bytes,
                                                 f"pages {tokens} in the device value store")
        self.seqs: dict[int, SequenceState] = {}

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """GPU pages and, as many, value pages of one sequence."""
        return math.ceil((prompt_len + max_new_tokens) / self.page_tokens)

    def _shortfall(self, n: int, free: bool) -> list[str]:
        """What a sequence of n pages lacks, in what is free now (or, free False, in the whole pools)."""
        d = device_value_pages(self.config, n)
        need = ((self.slots, 1, "slots"), (self.gpu_pages, n, "GPU pages"),
                (self.host_pages, n - d, "host value pages"), (self.device_value_pages, d, "device value pages"))
        room = [(pool.num_free if free else pool.num_blocks, k, what) for pool, k, what in need]
        return [f"{what} ({k} needed, {r} {'free' if free else 'in all'})" for r, k, what in room if k > r]

    def can_allocate(self, prompt_len: int, max_new_tokens: int, prompt_token_ids: list[int] | None = None) -> bool:
        return not self._shortfall(self.pages_needed(prompt_len, max_new_tokens), free=True)

    def fits_when_empty(self, prompt_len: int, max_new_tokens: int) -> bool:
        return not self._shortfall(self.pages_needed(prompt_len, max_new_tokens), free=False)

    def footprint(self, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
        """(device bytes, host bytes) reserved by `allocate`: pages, plus the slot on the device."""
        n = self.pages_needed(prompt_len, max_new_tokens)
        d = device_value_pages(self.config, n)
        value = self.host_pages.unit_bytes
        return n * self.gpu_pages.unit_bytes + d * value + self.slots.unit_bytes, (n - d) * value

    def allocate(self, seq_id: int, prompt_len: int, max_new_tokens: int,
                 prompt_token_ids: list[int] | None = None) -> int:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already holds a ShadowKV slot")
        n = self.pages_needed(prompt_len, max_new_tokens)
        short = self._shortfall(n, free=True)
        if short:
            raise MemoryError(f"ShadowKV cache full for a sequence of {prompt_len}+{max_new_tokens} tokens: short of "
                              + ", ".join(short))
        C = self.config.chunk_size
        num_shadow = max(prompt_len // C - self.config.local_chunks, 0)  # the middle chunks
        on_device = device_value_pages(self.config, n)
        gpu_pages = self.gpu_pages.alloc(n)
        value_pages = [self.host_pages.num_blocks + p for p in self.device_value_pages.alloc(on_device)]
        value_pages += self.host_pages.alloc(n - on_device)
        self.seqs[seq_id] = SequenceState(
            slot=self.slots.alloc(1)[0], prompt_len=prompt_len, gpu_pages=gpu_pages, value_pages=value_pages,
            gpu_table=to_device(gpu_pages, torch.int64, self.device),
            value_table=torch.tensor(value_pages, dtype=torch.int64),
            num_shadow=num_shadow, window_len=prompt_len - num_shadow * C,
            num_outliers=min(self.config.outlier_chunks, num_shadow))
        return 0

    def free(self, seq_id: int, token_ids: list[int] | None = None) -> None:
        st = self.seqs.pop(seq_id)
        host = self.host_pages.num_blocks
        self.gpu_pages.free(st.gpu_pages)
        self.device_value_pages.free([p - host for p in st.value_pages if p >= host])
        self.host_pages.free([p for p in st.value_pages if p < host])
        self.slots.free([st.slot])

    def usage(self) -> dict[str, int]:
        on_device = (self.slots, self.gpu_pages, self.device_value_pages)
        return {"num_seqs": len(self.seqs),
                "gpu_bytes_in_use": sum(p.bytes_in_use for p in on_device),
                "gpu_bytes_total": sum(p.bytes_total for p in on_device),
                "host_bytes_in_use": self.host_pages.bytes_in_use, "host_bytes_total": self.host_pages.bytes_total}
