"""GPU pages of the shadow: U rows and landmarks, one page table per sequence for both.

A page holds, for every layer, the U rows of `page_chunks * chunk_size` consecutive tokens and the landmarks of
those `page_chunks` chunks. Value pages (host_store.py) cover the same tokens, so a sequence needs as many of each;
the two kinds are handed out from separate pools (manager.py) because they live in different memories.
"""
from __future__ import annotations

import torch

from shadowkv_core.cache.allocator import commit_host_pages
from shadowkv_core.cache.base import CacheSpec
from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.shadowkv.reference import FP8, quantize_values


def locate(table: torch.Tensor, rows: torch.Tensor, page_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical (page, offset) of a sequence's logical rows: table (seq_pages,), rows (*idx) -> two (*idx)."""
    return table[rows // page_rows], rows % page_rows


class GpuPages:
    """Per layer and page: U rows (page_tokens, r) at the layer's rank (u: one tensor a layer), landmarks
    (page_chunks, Hkv, d) (bounds: 2d; fp8: and their scales (page_chunks, Hkv)), and outlier flags (page_chunks, Hkv)
    uint8, 1 where the chunk is one of its KV head's outliers (kept exact in the slot, so never scored): the scoring
    kernel reads one byte beside each landmark instead of comparing every chunk with the outlier list."""

    def __init__(self, spec: CacheSpec, config: ShadowKVConfig, num_pages: int):
        L, Hkv, d, dev = spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.device
        self.num_pages = num_pages
        self.page_chunks = page_chunks = config.page_chunks
        self.page_tokens = page_chunks * config.chunk_size
        self.u = [torch.zeros(num_pages, self.page_tokens, config.layer_rank(layer), dtype=spec.dtype, device=dev)
                  for layer in range(L)]
        fp8 = config.landmark_format == "fp8"
        self.landmarks = torch.zeros(L, num_pages, page_chunks, Hkv, d * config.landmark_width,
                                     dtype=FP8 if fp8 else spec.dtype, device=dev)
        self.landmark_scales = torch.ones(L, num_pages, page_chunks, Hkv, device=dev) if fp8 else None
        self.outlier_flags = torch.zeros(L, num_pages, page_chunks, Hkv, dtype=torch.uint8, device=dev)
        commit_host_pages(*self.buffers)
        self.page_bytes = sum(t[0].numel() * t.element_size() for t in self.u) + sum(
            t[:, 0].numel() * t.element_size() for t in self.layered)

    @property
    def layered(self) -> list[torch.Tensor]:
        """The per-page tensors of every layer at once, each (L, num_pages, ...)."""
        return [t for t in (self.landmarks, self.landmark_scales, self.outlier_flags) if t is not None]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every per-page tensor: U's, one a layer (num_pages, ...), and the layered ones."""
        return [*self.u, *self.layered]

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Pages src (every layer, every buffer) into pages dst."""
        src_ids, dst_ids = (torch.tensor(p, device=self.landmarks.device) for p in (src, dst))
        for u in self.u:
            u[dst_ids] = u[src_ids]
        for buf in self.layered:
            buf[:, dst_ids] = buf[:, src_ids]

    def write_u(self, layer: int, table: torch.Tensor, start: int, u: torch.Tensor) -> None:
        """U rows (n, r) of tokens [start, start + n)."""
        rows = torch.arange(start, start + u.shape[0], device=table.device)
        self.u[layer][locate(table, rows, self.page_tokens)] = u.to(self.u[layer].dtype)

    def read_u(self, layer: int, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """positions (*idx) -> U rows (*idx, r)."""
        return self.u[layer][locate(table, positions, self.page_tokens)]

    def write_landmarks(self, layers: slice | int, table: torch.Tensor, start: int, lm: torch.Tensor) -> None:
        """Landmarks ([L,] n, Hkv, d or 2d) of chunks [start, start + n), for one layer or a slice of layers; the
        chunks are not outliers (mark_outliers)."""
        rows = torch.arange(start, start + lm.shape[-3], device=table.device)
        page, offset = locate(table, rows, self.page_chunks)
        # a device scalar: index_put_ copies a Python one to the device with a blocking copy (a sync)
        self.outlier_flags[layers, page, offset] = self.outlier_flags.new_zeros(())
        if self.landmark_scales is not None:
            lm, scales = quantize_values(lm, 1)  # one scale per chunk and KV head
            self.landmark_scales[layers, page, offset] = scales
        self.landmarks[layers, page, offset] = lm.to(self.landmarks.dtype)

    def read_landmarks(self, layer: int, table: torch.Tensor, num_chunks: int) -> torch.Tensor:
        """Landmarks of chunks [0, num_chunks): (n, Hkv, d or 2d); fp8 ones dequantised to fp32 (value * scale, as the
        scoring kernel's logits take them)."""
        rows = torch.arange(num_chunks, device=table.device)
        where = locate(table, rows, self.page_chunks)
        if self.landmark_scales is None:
            return self.landmarks[layer][where]
        return self.landmarks[layer][where].float() * self.landmark_scales[layer][where][..., None]

    def mark_outliers(self, layer: int, table: torch.Tensor, ids: torch.Tensor,
                      heads: torch.Tensor | None = None) -> None:
        """Flag chunk ids (Hkv, O) as their KV head's outliers (after their landmarks are written); or ids (M,) as
        outliers of the KV heads `heads` (M,)."""
        if heads is None:
            heads = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        page, offset = locate(table, ids, self.page_chunks)
        self.outlier_flags[layer, page, offset, heads] = self.outlier_flags.new_ones(())  # as in write_landmarks

    def read_outliers(self, layer: int, table: torch.Tensor, num_chunks: int) -> torch.Tensor:
        """Outlier flags of chunks [0, num_chunks) -> (Hkv, n) bool."""
        rows = torch.arange(num_chunks, device=table.device)
        return self.outlier_flags[layer][locate(table, rows, self.page_chunks)].T.bool()

    def landmark_scales_of(self, layer: int) -> torch.Tensor | None:
        """One layer's fp8 landmark scales (num_pages, page_chunks, Hkv); None for landmarks in the model's dtype."""
        return None if self.landmark_scales is None else self.landmark_scales[layer]
