"""One engine's value store on the host (its shard): one large region allocated once, handed out in pages.

A page holds the values of `page_tokens` consecutive tokens of one sequence for every layer. On CUDA the region is
pinned with cudaHostRegister, so the GPU can read it directly (zero-copy, over unified virtual addressing); the
caching host allocator is not used because it rounds every allocation up to a power of two.
"""
from __future__ import annotations

import math
import weakref

import torch

from shadowkv_core.dense_cache import BlockAllocator
from shadowkv_core.numa import NumaPlacement, load_libnuma
from shadowkv_core.shadowkv.pages import locate
from shadowkv_core.shadowkv.reference import gather_values

OS_PAGE = 4096


class HostValueStore:
    def __init__(self, num_layers: int, num_pages: int, page_tokens: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pin: bool | None = None, placement: NumaPlacement | None = None):
        self.page_tokens = page_tokens
        self.shape = (num_layers, num_pages, page_tokens, num_kv_heads, head_dim)
        self.dtype = dtype
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self.placement = placement
        self.numa_bound = False
        self.values = self._allocate_region()  # (L, num_pages, page_tokens, Hkv, d)
        self.pages = BlockAllocator(num_pages)

    def _allocate_region(self) -> torch.Tensor:
        """The one host allocation of the store, bound to the GPU's NUMA node before anything touches it. Pinned
        regions start and end on OS page boundaries: cudaHostRegister refuses a range that shares a page with one
        registered before."""
        nbytes = math.prod(self.shape) * self.dtype.itemsize
        span = -(-nbytes // OS_PAGE) * OS_PAGE
        raw = torch.empty(span + OS_PAGE, dtype=torch.uint8)  # not yet touched: no physical page placed
        start = -raw.data_ptr() % OS_PAGE
        region = raw[start:start + span]
        if self.placement is not None:
            self.numa_bound = self.placement.bind_memory(region.data_ptr(), span, load_libnuma())
        if not self.pinned:
            return region[:nbytes].view(self.dtype).view(self.shape)
        err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), span, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {span / 2**30:.2f} GiB of host values failed: error {int(err)}")
        self._unregister = weakref.finalize(self, _unregister, region)  # also when the store is dropped unclosed
        return region[:nbytes].view(self.dtype).view(self.shape)

    @property
    def num_pages(self) -> int:
        return self.shape[1]

    @property
    def num_free(self) -> int:
        return self.pages.num_free

    @property
    def page_bytes(self) -> int:
        """Values of one page, every layer."""
        L, _, page_tokens, Hkv, d = self.shape
        return L * page_tokens * Hkv * d * self.dtype.itemsize

    @property
    def bytes_in_use(self) -> int:
        return (self.num_pages - self.num_free) * self.page_bytes

    def alloc(self, n: int) -> list[int]:
        """n pages, or a MemoryError naming what is missing (and nothing allocated)."""
        if n > self.num_free:
            raise MemoryError(f"host value store: need {n} pages of {self.page_tokens} tokens, "
                              f"{self.num_free} of {self.num_pages} free")
        return self.pages.alloc(n)

    def free(self, pages: list[int]) -> None:
        self.pages.free(pages)

    def write(self, layers: slice | int, table: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Values ([L,] n, Hkv, d) of tokens [start, start + n) of the sequence whose page table (CPU) is `table`."""
        rows = torch.arange(start, start + values.shape[-3])
        page, offset = locate(table, rows, self.page_tokens)
        self.values[layers, page, offset] = values.to("cpu", self.dtype)

    def gather(self, layer: int, table: torch.Tensor, chunk_ids: torch.Tensor, heads: torch.Tensor,
               chunk_size: int) -> torch.Tensor:
        """Values (M, C, d), on the host, of M (chunk, KV head) pairs of one sequence."""
        return gather_values(self.values[layer], table, chunk_ids.cpu(), heads.cpu(), chunk_size)

    def close(self) -> None:
        if self.pinned:
            self._unregister()
        self.values = None


def _unregister(region: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(region.data_ptr())
