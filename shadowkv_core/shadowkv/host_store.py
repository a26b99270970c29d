"""One engine's value store on the host (its shard): one large region allocated once, addressed in pages; and,
optionally, a second region of the same pages in device memory (ShadowKVConfig.device_value_share).

A page holds the values of `page_tokens` consecutive tokens of one sequence for every layer: in the model's dtype,
or (value_format "fp8") as e4m3 with one fp32 scale per chunk and KV head. On CUDA the host region is pinned with
cudaHostRegister, so the GPU can read it directly (zero-copy, over unified virtual addressing); the caching host
allocator is not used because it rounds every allocation up to a power of two.

Page ids: host pages are 0 .. num_pages - 1; device pages follow, num_pages .. num_pages + num_device_pages - 1.
A sequence's page table mixes both (its first pages on the device: manager.ShadowKVManager hands them out);
fetch_values reads each page from where it lies.
"""
from __future__ import annotations

import math
import weakref

import torch

from shadowkv_core.cache.allocator import commit_host_pages
from shadowkv_core.numa import NumaPlacement, load_libnuma
from shadowkv_core.shadowkv.reference import (FP8, dequantize_values, gather_scales, gather_values,
                                              quantize_values)

# Pinned regions start and end on this boundary, a huge page's: with transparent huge pages two neighbouring
# allocations can share one, and cudaHostRegister refuses a range that shares a page with one registered before.
PIN_ALIGN = 2 << 20


class HostValueStore:
    def __init__(self, num_layers: int, num_pages: int, page_tokens: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pin: bool | None = None, placement: NumaPlacement | None = None,
                 value_format: str = "model", chunk_size: int = 1, num_device_pages: int = 0,
                 device: torch.device | str = "cpu"):
        """chunk_size: tokens per chunk, the unit fetched (and scaled, for fp8 values). num_device_pages: pages of
        the device region, on `device`."""
        self.page_tokens, self.chunk_size = page_tokens, chunk_size
        self.dtype = dtype  # what gather returns
        self.fp8 = value_format == "fp8"
        self.shape = (num_layers, num_pages, page_tokens, num_kv_heads, head_dim)
        self.scales_shape = (num_layers, num_pages, page_tokens // chunk_size, num_kv_heads) if self.fp8 else None
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self.placement = placement
        self.numa_bound = False
        self._written = None  # CUDA event after the last write queued from the device
        self.values, self.scales = self._allocate_region()  # (L, pages, page_tokens, Hkv, d); fp8: + scales
        per_layer = page_tokens * num_kv_heads * head_dim * self.values.element_size()
        if self.fp8:
            per_layer += math.prod(self.scales_shape[2:]) * self.scales.element_size()
        self.num_pages, self.num_device_pages = num_pages, num_device_pages
        self.page_bytes = num_layers * per_layer
        device_shape = (num_layers, num_device_pages, *self.shape[2:])
        self.device_values = torch.zeros(device_shape, dtype=self.values.dtype, device=device)
        self.device_scales = torch.zeros((num_layers, num_device_pages, *self.scales_shape[2:]), dtype=torch.float32,
                                         device=device) if self.fp8 else None

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Pages src's values (every layer) into pages dst, in whichever regions each lies: one gather and one scatter
        per pair of regions (host or device on either side), not a copy per page."""
        if self._written is not None:
            self._written.synchronize()
        groups: dict[tuple[int, int], tuple[list, list[int], list[int]]] = {}  # by (src, dst) region
        for s, d in zip(src, dst):
            (src_values, src_scales, i), (dst_values, dst_scales, j) = self._page(s), self._page(d)
            regions = [(src_values, dst_values)] + ([(src_scales, dst_scales)] if self.fp8 else [])
            group = groups.setdefault((id(src_values), id(dst_values)), (regions, [], []))
            group[1].append(i)
            group[2].append(j)
        for regions, i, j in groups.values():
            for a, b in regions:
                a, b = _as_bytes(a), _as_bytes(b)  # fp8 has no CPU index kernels; its bytes copy alike
                rows = a.index_select(1, torch.tensor(i, device=a.device)).to(b.device)
                b.index_copy_(1, torch.tensor(j, device=b.device), rows)

    def move_pages(self, src: list[int], dst: list[int]) -> None:
        """Host pages src into device pages dst (ids as the tables hold them), every layer: one asynchronous copy per
        layer and run of pages consecutive on both sides, queued on the current stream (before the steps that read
        dst)."""
        pairs = sorted(zip(src, dst))
        for s, d in pairs:
            if s >= self.num_pages or d < self.num_pages:
                raise ValueError(f"page {s} -> {d}: only host pages move, and only into the device region")
        runs: list[list[int]] = []
        for s, d in pairs:
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d - self.num_pages:
                runs[-1][2] += 1
            else:
                runs.append([s, d - self.num_pages, 1])
        regions = [(self.values, self.device_values)] + ([(self.scales, self.device_scales)] if self.fp8 else [])
        for s, d, n in runs:
            for host, device in regions:
                for layer in range(host.shape[0]):
                    device[layer, d:d + n].copy_(host[layer, s:s + n], non_blocking=self.pinned)

    def _page(self, page: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(values, scales, index there) of a page id."""
        if page >= self.num_pages:
            return self.device_values, self.device_scales, page - self.num_pages
        return self.values, self.scales, page

    def _regions(self, table: torch.Tensor):
        """(values, scales, the table with this region's page ids and 0 for the other's, whether each logical page
        lies here) for the host region, then the device region if it has pages."""
        on_device = table >= self.num_pages
        yield self.values, self.scales, torch.where(on_device, 0, table), ~on_device
        if self.num_device_pages:
            yield self.device_values, self.device_scales, torch.where(on_device, table - self.num_pages, 0), on_device

    def _allocate_region(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one host allocation of the store (values, then fp8 scales), bound to the GPU's NUMA node before
        anything touches it. It starts and ends on PIN_ALIGN boundaries."""
        value_dtype = FP8 if self.fp8 else self.dtype
        value_bytes = math.prod(self.shape) * value_dtype.itemsize
        scale_offset = -(-value_bytes // 16) * 16
        nbytes = scale_offset + (math.prod(self.scales_shape) * 4 if self.fp8 else 0)
        span = -(-nbytes // PIN_ALIGN) * PIN_ALIGN
        raw = torch.empty(span + PIN_ALIGN, dtype=torch.uint8)  # not yet touched: no physical page placed
        start = -raw.data_ptr() % PIN_ALIGN
        region = raw[start:start + span]
        if self.placement is not None:
            self.numa_bound = self.placement.bind_memory(region.data_ptr(), span, load_libnuma())
        if self.pinned:
            err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), span, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {span / 2**30:.2f} GiB of host values failed: "
                                   f"error {int(err)}")
            self._unregister = weakref.finalize(self, _unregister, region)  # also when the store is dropped unclosed
        else:  # pinning maps every page; unpinned, they are written now, on the node bound above
            commit_host_pages(region)
        values = region[:value_bytes].view(value_dtype).view(self.shape)
        scales = region[scale_offset:nbytes].view(torch.float32).view(self.scales_shape) if self.fp8 else None
        return values, scales

    def write(self, layers: slice | int, table: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Values ([L,] n, Hkv, d) of tokens [start, start + n) of the sequence whose page table (CPU) is `table`;
        fp8 stores take whole chunks (start and n multiples of chunk_size) and quantise them where they are.

        One copy per run of consecutive physical pages, straight from the device into the pinned region (DMA, queued
        on the current stream: the fetch kernels that read these pages run after it; `gather` waits for it)."""
        n = values.shape[-3]
        if self.fp8:
            C = self.chunk_size
            if start % C or n % C:
                raise ValueError(f"fp8 values are written in whole chunks of {C} tokens; got tokens "
                                 f"[{start}, {start + n})")
            values, scales = quantize_values(values, C)
        values = values.to(self.values.dtype)
        first_page = start // self.page_tokens
        logical = torch.arange(first_page, -(-(start + n) // self.page_tokens))  # the pages the tokens touch
        for region, region_scales, pages, here in self._regions(table):
            async_copy = self.pinned and values.is_cuda and region.device.type == "cpu"
            pages = pages.tolist()
            for first, last in _runs(here[logical].tolist(), first_page):  # runs of pages in this region
                lo, hi = max(start, first * self.page_tokens), min(start + n, last * self.page_tokens)
                if self.fp8:
                    _copy_rows(region_scales[layers], pages, lo // C,
                               scales.narrow(-2, (lo - start) // C, (hi - lo) // C), 1, async_copy)
                _copy_rows(region[layers], pages, lo, values.narrow(-3, lo - start, hi - lo), 2, async_copy)
                if async_copy:
                    self._written = torch.cuda.Event()
                    self._written.record()

    def gather(self, layer: int, table: torch.Tensor, chunk_ids: torch.Tensor, heads: torch.Tensor,
               chunk_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Values (M, C, d), on `device` (the host by default), of M (chunk, KV head) pairs of one sequence, in the
        model's dtype. Each region gathers where it lives and only its gathered values move: a prefix read to the
        GPU never sends the device region's values through the host."""
        if self._written is not None:
            self._written.synchronize()
        chunk_ids, heads = chunk_ids.cpu(), heads.cpu()
        out = None
        for region, region_scales, pages, here in self._regions(table):
            idx = chunk_ids.to(region.device), heads.to(region.device)
            values = gather_values(region[layer], pages.to(region.device), *idx, chunk_size)
            if self.fp8:
                values = dequantize_values(values, gather_scales(region_scales[layer], pages.to(region.device), *idx),
                                           self.dtype)
            values = values.to(device)
            chunk_here = here[chunk_ids * chunk_size // self.page_tokens].to(device)
            out = values if out is None else torch.where(chunk_here[:, None, None], values, out)
        return out

    def scales_of(self, layer: int) -> torch.Tensor | None:
        """One layer's fp8 scales (num_pages, page_chunks, Hkv); None when values are kept in the model's dtype."""
        return self.scales[layer] if self.fp8 else None

    def device_region(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """One layer of the device region: its values and fp8 scales, as the host's; None when it has no pages."""
        if not self.num_device_pages:
            return None
        return self.device_values[layer], self.device_scales[layer] if self.fp8 else None

    def host_bytes(self, table: torch.Tensor, num_tokens: int) -> int:
        """Bytes of one layer read from host memory to read a sequence's first num_tokens tokens (table: its pages);
        its pages in the device region read none."""
        pages = table[:-(-num_tokens // self.page_tokens)]
        return int((pages < self.num_pages).sum()) * (self.page_bytes // self.shape[0])

    def fetch_bytes(self) -> int:
        """Host bytes read to fetch one chunk (chunk_size tokens) of one KV head."""
        d = self.shape[-1]
        return self.chunk_size * d * self.values.element_size() + (self.scales.element_size() if self.fp8 else 0)

    def close(self) -> None:
        if self.pinned:
            self._unregister()
        self.values = None


def _copy_rows(dst: torch.Tensor, pages: list[int], start: int, src: torch.Tensor, inner_dims: int,
                non_blocking: bool) -> None:
    """Rows [start, start + n) of a sequence into the store: dst ([L,] num_pages, rows_per_page, *inner) one view
    of the store, src ([L,] n, *inner), `inner_dims` trailing dims per row; one copy per run of pages."""
    row_dim = -1 - inner_dims
    done = 0
    for page, offset, rows in page_runs(pages, start, src.shape[row_dim], dst.shape[row_dim]):
        run_pages = -(-(offset + rows) // dst.shape[row_dim])
        run = dst.narrow(row_dim - 1, page, run_pages).flatten(row_dim - 1, row_dim)
        run.narrow(row_dim, offset, rows).copy_(src.narrow(row_dim, done, rows), non_blocking=non_blocking)
        done += rows


def _runs(flags: list[bool], first: int) -> list[tuple[int, int]]:
    """[start, end) of each run of True in flags, numbered from `first`."""
    runs, begin = [], None
    for i, flag in enumerate(flags + [False]):
        if flag and begin is None:
            begin = i
        elif not flag and begin is not None:
            runs.append((first + begin, first + i))
            begin = None
    return runs


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


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A view of a tensor of 1-byte elements as uint8 (the same storage); any other tensor as it is."""
    return t.view(torch.uint8) if t.element_size() == 1 else t
