"""Slots: each sequence's fixed GPU working set, one slot per sequence, buffers for `num_slots` allocated once.

A sequence's tokens [0, seq_len) are split at `num_shadow * chunk_size`: before it, the shadow (U rows and landmarks
on the GPU pages, values in value pages); from it on, the window (local chunks + generated tokens, exact). Outlier
chunks are shadow chunks whose keys and values are also kept exact in the slot, and never selected.
"""
from __future__ import annotations

import torch

from shadowkv_core.cache.allocator import commit_host_pages
from shadowkv_core.cache.base import CacheSpec
from shadowkv_core.config import ShadowKVConfig


class Slots:
    """sv: one tensor a layer, (N, Hkv, r, d) at the layer's rank: each sequence's key basis; resident
    (N, L, Hkv, K): chunk id in each sparse slot, -1 empty; sparse_k/v (N, L, Hkv, K*C, d); outlier_k/v
    (N, L, Hkv, O*C, d); window_k/v (N, L, E, Hkv, d) with E = (local_chunks * C) + decode_window."""

    sv: list[torch.Tensor]
    resident: torch.Tensor
    sparse_k: torch.Tensor
    sparse_v: torch.Tensor
    outlier_k: torch.Tensor
    outlier_v: torch.Tensor
    window_k: torch.Tensor
    window_v: torch.Tensor

    def __init__(self, spec: CacheSpec, config: ShadowKVConfig, num_slots: int):
        self.num_slots = num_slots
        self.window_tokens = config.local_chunks * config.chunk_size + config.decode_window
        specs = self.buffer_specs(spec.num_layers, spec.num_kv_heads, spec.head_dim, config, spec.dtype)
        for name, (shape, dt) in specs.items():
            setattr(self, name, torch.zeros((num_slots, *shape), dtype=dt, device=spec.device))
        self.sv = [torch.zeros(num_slots, spec.num_kv_heads, config.layer_rank(layer), spec.head_dim,
                               dtype=spec.dtype, device=spec.device) for layer in range(spec.num_layers)]
        self.buffers = [*self.sv, *(getattr(self, name) for name in specs)]
        commit_host_pages(*self.buffers)
        self.slot_bytes = sum(t[0].numel() * t.element_size() for t in self.buffers)

    @staticmethod
    def buffer_specs(num_layers: int, num_kv_heads: int, head_dim: int, config: ShadowKVConfig,
                     dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape (without the leading slot dimension) and dtype of each buffer of a slot but the bases (sv)."""
        L, Hkv, d, C = num_layers, num_kv_heads, head_dim, config.chunk_size
        K, O = config.budget_chunks, config.outlier_chunks
        E = config.local_chunks * C + config.decode_window
        return {
            "resident": ((L, Hkv, K), torch.int64),
            "sparse_k": ((L, Hkv, K * C, d), dtype), "sparse_v": ((L, Hkv, K * C, d), dtype),
            "outlier_k": ((L, Hkv, O * C, d), dtype), "outlier_v": ((L, Hkv, O * C, d), dtype),
            "window_k": ((L, E, Hkv, d), dtype), "window_v": ((L, E, Hkv, d), dtype),
        }

    def copy(self, src: int, dst: int) -> None:
        """Slot src's contents, every buffer, into slot dst."""
        for buf in self.buffers:
            buf[dst] = buf[src]
