"""Slots: each sequence's fixed GPU working set, and the per-sequence bookkeeping of the shadow.

A sequence's tokens [0, seq_len) are split at `num_shadow * chunk_size`: before it, the shadow (U rows and landmarks
on the GPU pages, values in host pages); from it on, the window (local chunks + generated tokens, exact). Outlier
chunks are shadow chunks whose keys and values are also kept exact in the slot, and never selected.
"""
from __future__ import annotations

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
    sparse_k/v (N, L, Hkv, K*C, d); outlier_ids (N, L, Hkv, O); outlier_k/v (N, L, Hkv, O*C, d);
    window_k/v (N, L, E, Hkv, d) with E = (local_chunks * C) + decode_window."""

    def __init__(self, max_num_seqs: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 config: ShadowKVConfig, dtype: torch.dtype, device: torch.device | str):
        N, L, Hkv, d, C = max_num_seqs, num_layers, num_kv_heads, head_dim, config.chunk_size
        K, O = config.budget_chunks, config.outlier_chunks
        self.window_tokens = config.local_chunks * C + config.decode_window

        def zeros(*shape, dt=dtype):
            return torch.zeros(shape, dtype=dt, device=device)

        self.sv = zeros(N, L, Hkv, config.rank, d)
        self.resident = zeros(N, L, Hkv, K, dt=torch.int64)
        self.sparse_k, self.sparse_v = zeros(N, L, Hkv, K * C, d), zeros(N, L, Hkv, K * C, d)
        self.outlier_ids = zeros(N, L, Hkv, O, dt=torch.int64)
        self.outlier_k, self.outlier_v = zeros(N, L, Hkv, O * C, d), zeros(N, L, Hkv, O * C, d)
        self.window_k = zeros(N, L, self.window_tokens, Hkv, d)
        self.window_v = zeros(N, L, self.window_tokens, Hkv, d)
        self.slots = BlockAllocator(N)
        buffers = (self.sv, self.resident, self.sparse_k, self.sparse_v, self.outlier_ids, self.outlier_k,
                   self.outlier_v, self.window_k, self.window_v)
        self.slot_bytes = sum(b[0].numel() * b.element_size() for b in buffers)

    @property
    def num_slots(self) -> int:
        return self.slots.num_blocks

    @property
    def num_free(self) -> int:
        return self.slots.num_free

    @property
    def bytes_in_use(self) -> int:
        return (self.num_slots - self.num_free) * self.slot_bytes

    def alloc(self) -> int:
        slot = self.slots.alloc(1)[0]
        self.resident[slot] = -1
        return slot

    def free(self, slot: int) -> None:
        self.slots.free([slot])
