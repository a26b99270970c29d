"""Slots: each sequence's fixed GPU working set, and the per-sequence bookkeeping of the shadow.

A sequence's tokens [0, seq_len) are split at `num_shadow * chunk_size`: before it, the shadow (U rows and landmarks
on the GPU pages, values in host pages); from it on, the window (local chunks + generated tokens, exact). Outlier
chunks are shadow chunks whose keys and values are also kept exact in the slot, and never selected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.dense_cache import BlockAllocator


@dataclass
class SequenceState:
    slot: int
    prompt_len: int
    gpu_pages: list[int]
    host_pages: list[int]
    gpu_table: torch.Tensor  # (num_pages,) int64 on the device
    host_table: torch.Tensor  # (num_pages,) int64 on the host
    num_shadow: int  # chunks in the shadow
    window_len: int  # exact tokens in the window
    num_outliers: int
    seq_len: int = 0


class Slots:
    """Buffers of `max_num_seqs` slots for every layer, allocated once.

    sv (N, L, Hkv, r, d): each sequence's key basis; resident (N, L, Hkv, K): chunk id in each sparse slot, -1 empty;
    sparse_k/v (N, L, Hkv, K*C, d); outlier_k/v (N, L, Hkv, O*C, d);
    window_k/v (N, L, E, Hkv, d) with E = (local_chunks * C) + decode_window."""

    sv: torch.Tensor
    resident: torch.Tensor
    sparse_k: torch.Tensor
    sparse_v: torch.Tensor
    outlier_k: torch.Tensor
    outlier_v: torch.Tensor
    window_k: torch.Tensor
    window_v: torch.Tensor

    def __init__(self, max_num_seqs: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 config: ShadowKVConfig, dtype: torch.dtype, device: torch.device | str):
        self.window_tokens = config.local_chunks * config.chunk_size + config.decode_window
        specs = self.buffer_specs(num_layers, num_kv_heads, head_dim, config, dtype)
        for name, (shape, dt) in specs.items():
            setattr(self, name, torch.zeros((max_num_seqs, *shape), dtype=dt, device=device))
        self.buffers = [getattr(self, name) for name in specs]
        self.slot_bytes = sum(math.prod(shape) * dt.itemsize for shape, dt in specs.values())
        self.slots = BlockAllocator(max_num_seqs, self.slot_bytes, "ShadowKV slots")

    @staticmethod
    def buffer_specs(num_layers: int, num_kv_heads: int, head_dim: int, config: ShadowKVConfig,
                     dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape (without the leading slot dimension) and dtype of each buffer of a slot."""
        L, Hkv, d, C = num_layers, num_kv_heads, head_dim, config.chunk_size
        K, O = config.budget_chunks, config.outlier_chunks
        E = config.local_chunks * C + config.decode_window
        return {
            "sv": ((L, Hkv, config.rank, d), dtype),
            "resident": ((L, Hkv, K), torch.int64),
            "sparse_k": ((L, Hkv, K * C, d), dtype), "sparse_v": ((L, Hkv, K * C, d), dtype),
            "outlier_k": ((L, Hkv, O * C, d), dtype), "outlier_v": ((L, Hkv, O * C, d), dtype),
            "window_k": ((L, E, Hkv, d), dtype), "window_v": ((L, E, Hkv, d), dtype),
        }

    @property
    def num_slots(self) -> int:
        return self.slots.num_blocks

    @property
    def num_free(self) -> int:
        return self.slots.num_free

    @property
    def bytes_in_use(self) -> int:
        return self.slots.bytes_in_use

    def alloc(self) -> int:
        slot = self.slots.alloc(1)[0]
        self.resident[slot] = -1
        return slot

    def free(self, slot: int) -> None:
        self.slots.free([slot])
