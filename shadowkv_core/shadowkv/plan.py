"""A decode forward's plan for the kernel path: the batch's per-sequence bookkeeping copied to the device once and
shared by every layer, and the batch's page tables, built once while the same sequences decode together."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton

from shadowkv_core.shadowkv.manager import SequenceState
from shadowkv_core.transfers import to_device


class PageTables:
    """(2, B, W) int32 device tables of a batch: GPU pages and value pages, zero-padded to W, the power of two at or
    above its longest page list (a captured CUDA graph is keyed on their shape). A sequence's pages are fixed when it
    is allocated (until shared values move to the device: `clear`), so the tables of the last few batches are held
    and copied while the same sequences decode together instead of being rebuilt from Python lists every step."""

    def __init__(self, device: torch.device, held: int = 8):
        self.device = device
        self.held = held  # batches whose tables are kept (pipelined halves count one each)
        self._tables: OrderedDict[tuple, tuple] = OrderedDict()  # batch -> (its states, its tables)

    def clear(self) -> None:
        """Forget the held tables (a sequence's value pages moved)."""
        self._tables.clear()

    def of(self, states: list[SequenceState]) -> torch.Tensor:
        """A fresh copy, the plan's own (a captured graph keeps the plan's tensors as its inputs, and overwrites
        them)."""
        key = tuple(map(id, states))
        held = self._tables.pop(key, None)
        if held is None:
            width = triton.next_power_of_2(max(len(st.gpu_pages) for st in states))
            rows = [[st.gpu_pages + [0] * (width - len(st.gpu_pages)) for st in states],
                    [st.value_pages + [0] * (width - len(st.value_pages)) for st in states]]
            held = (tuple(states), to_device(rows, torch.int32, self.device))
        self._tables[key] = held  # most recent last; holding the states keeps their ids from being reused
        while len(self._tables) > self.held:
            self._tables.popitem(last=False)
        return held[1].clone()


@dataclass
class DecodePlan:
    """Device copies of the batch's bookkeeping; B sequences in batch order."""

    slot_ids: torch.Tensor  # (B,) int32
    gpu_table: torch.Tensor  # (B, max_pages) int32
    value_table: torch.Tensor  # (B, max_pages) int32, value page ids, host then device (read on the GPU)
    num_chunks: torch.Tensor  # (B,) int32 shadow chunks
    num_selected: torch.Tensor  # (B,) int32 chunks selected = min(budget, shadow - outliers)
    lens: list[torch.Tensor]  # (B,) int32 keys attended per segment: outliers, selected, window (+ the new token)
    token_page: torch.Tensor  # (B,) int64 GPU page and row of the new token's U row
    token_row: torch.Tensor
    window_pos: torch.Tensor  # (B,) int64 the new token's place in the window
    inv_freq: torch.Tensor  # (B, rotary_dim/2) fp32
    n_max: int  # compile-time buckets (powers of two): chunks, selected chunks, keys
    k_max: int
    max_len: int
    num_selections: int  # (sequence, KV head, chunk) selections per layer
    counters: torch.Tensor  # (2,) int32 chunks fetched this forward and those from the device value region, summed
    # over layers (read once, after the step)
    buffers: list[torch.Tensor]  # the device tensors built for the plan: every tensor above is one or a view of one
    states: tuple[SequenceState, ...]  # the batch's host bookkeeping (a selection policy scores by it)
    halved: bool  # one of a forward's two pipelined halves (AttentionMetadata.halved)

    @staticmethod
    def build(states: list[SequenceState], config, rotary, page_tables: PageTables, num_kv_heads: int,
              halved: bool = False) -> DecodePlan:
        dev, C, budget = page_tables.device, config.chunk_size, config.budget_chunks
        selected = [max(min(budget, st.num_shadow - st.num_outliers), 0) for st in states]
        window = [st.window_len + 1 for st in states]
        page_tokens = config.page_chunks * C
        rows = [st.seq_len for st in states]
        # every per-sequence integer in one host-to-device copy (each copy costs the host tens of microseconds)
        ints = to_device([[st.slot for st in states], [st.num_shadow for st in states], selected,
                          [st.num_outliers * C for st in states], [k * C for k in selected], window,
                          [st.gpu_pages[r // page_tokens] for st, r in zip(states, rows)],
                          [r % page_tokens for r in rows], [st.window_len for st in states],
                          [st.prompt_len for st in states]], torch.int64, dev)
        small = ints[:6].to(torch.int32)
        prompt_lens = ints[9]
        inv_freq = rotary.frequencies(prompt_lens - 1, prompt_lens if rotary.uses_seq_lens else None).float()
        inv_freq = inv_freq.expand(len(states), -1).contiguous()
        max_keys = max(st.num_outliers * C + k * C + w for st, k, w in zip(states, selected, window))
        tables = page_tables.of(states)
        counters = torch.zeros(2, dtype=torch.int32, device=dev)
        return DecodePlan(
            slot_ids=small[0], gpu_table=tables[0], value_table=tables[1], num_chunks=small[1], num_selected=small[2],
            lens=[small[3], small[4], small[5]], token_page=ints[6], token_row=ints[7], window_pos=ints[8],
            inv_freq=inv_freq, n_max=triton.next_power_of_2(max(max(st.num_shadow for st in states), 1)),
            k_max=max(selected), max_len=triton.next_power_of_2(max_keys),
            num_selections=sum(selected) * num_kv_heads, counters=counters,
            buffers=[ints, small, tables, inv_freq, counters], states=tuple(states), halved=halved)

    @property
    def misses(self) -> torch.Tensor:
        return self.counters[0:1]

    @property
    def device_hits(self) -> torch.Tensor:
        return self.counters[1:2]

    def tensors(self) -> list[torch.Tensor]:
        """Every device tensor of the plan, as few as can be copied (what a CUDA graph of the forward reads and, for
        the counters, writes)."""
        return self.buffers

    @property
    def graph_key(self) -> tuple[int, int, int]:
        """The kernels' compile-time buckets: what a captured graph depends on beyond the tensors' shapes."""
        return self.n_max, self.k_max, self.max_len
