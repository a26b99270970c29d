"""One engine's value store on the host (its shard): one large region allocated once, handed out in pages.

A page holds the values of `page_tokens` consecutive tokens of one sequence for every layer. On CUDA the region is
pinned with cudaHostRegister, so the GPU can read it directly (zero-copy, over unified virtual addressing); the
caching host allocator is not used because it rounds every allocation up to a power of two.
"""
from __future__ import annotations

import math
import weakref

import torch

from shadowkv_core.numa import NumaPlacement, load_libnuma
from shadowkv_core.shadowkv.pages import PagePool
from shadowkv_core.shadowkv.reference import gather_values

OS_PAGE = 4096


class HostValueStore(PagePool):
    def __init__(self, num_layers: int, num_pages: int, page_tokens: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pin: bool | None = None, placement: NumaPlacement | None = None):
        self.page_tokens = page_tokens
        self.shape = (num_layers, num_pages, page_tokens, num_kv_heads, head_dim)
        self.dtype = dtype
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self.placement = placement
        self.numa_bound = False
        self._written = None  # CUDA event after the last write queued from the device
        self.values = self._allocate_region()  # (L, num_pages, page_tokens, Hkv, d)
        page_bytes = num_layers * page_tokens * num_kv_heads * head_dim * dtype.itemsize  # values, every layer
        super().__init__(num_pages, page_bytes, f"pages of {page_tokens} tokens in the host value store")

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

    def write(self, layers: slice | int, table: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Values ([L,] n, Hkv, d) of tokens [start, start + n) of the sequence whose page table (CPU) is `table`.

        One copy per run of consecutive physical pages, straight from the device into the pinned region (DMA, queued
        on the current stream: the fetch kernels that read these pages run after it; `gather` waits for it)."""
        values = values.to(self.dtype)
        async_copy = self.pinned and values.is_cuda
        done = 0
        for page, offset, rows in page_runs(table.tolist(), start, values.shape[-3], self.page_tokens):
            run_pages = -(-(offset + rows) // self.page_tokens)
            dst = self.values[layers, page:page + run_pages].flatten(-4, -3).narrow(-3, offset, rows)
            dst.copy_(values.narrow(-3, done, rows), non_blocking=async_copy)
            done += rows
        if async_copy:
            self._written = torch.cuda.Event()
            self._written.record()

    def gather(self, layer: int, table: torch.Tensor, chunk_ids: torch.Tensor, heads: torch.Tensor,
               chunk_size: int) -> torch.Tensor:
        """Values (M, C, d), on the host, of M (chunk, KV head) pairs of one sequence."""
        if self._written is not None:
            self._written.synchronize()
        return gather_values(self.values[layer], table, chunk_ids.cpu(), heads.cpu(), chunk_size)

    def close(self) -> None:
        if self.pinned:
            self._unregister()
        self.values = None


def page_runs(pages: list[int], start: int, n: int, page_rows: int) -> list[tuple[int, int, int]]:
    """Rows [start, start + n) of a sequence whose page table is `pages`, as the fewest (first physical page, row
    offset in it, rows) runs that are contiguous in the store (consecutive physical pages)."""
    runs: list[list[int]] = []
    pos, end = start, start + n
    while pos < end:
        logical, offset = divmod(pos, page_rows)
        rows = min(page_rows - offset, end - pos)
        page = pages[logical]
        if runs and offset == 0 and runs[-1][0] + (runs[-1][1] + runs[-1][2]) // page_rows == page:
            runs[-1][2] += rows
        else:
            runs.append([page, offset, rows])
        pos += rows
    return [tuple(run) for run in runs]


def _unregister(region: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(region.data_ptr())
