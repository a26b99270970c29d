"""ShadowKVCache: the KVCache interface over the shadow (DESIGN.md's data path), ragged batches, per-sequence state.

Sequences that fit in `config.min_context` tokens stay in a composed dense cache; the others are kept in shadows:
prefill factorises their keys, finds landmarks and outliers and sends values to the host; each decode step selects
chunks, rebuilds/fetches the misses (layer.py) and attends over [outliers | selected | local + generated]. When the
window of exact tokens is full its older half is folded into the shadow, so generation is bounded only by the pages
allocated up front.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch
import triton

from shadowkv_core.attention import AttentionMetadata, KVCache, kernels_by_default
from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.memory_model import device_value_pages
from shadowkv_core.shadowkv.fast_decode import DecodePlan, begin_decode_layer, end_decode_layer
from shadowkv_core.shadowkv.host_store import HostValueStore
from shadowkv_core.shadowkv.layer import decode_layer, prefill_layer
from shadowkv_core.shadowkv.pages import GpuPages
from shadowkv_core.shadowkv.reference import chunk_landmarks
from shadowkv_core.shadowkv.slots import SequenceState, Slots
from shadowkv_core.transfers import Readback, to_device


@dataclass
class StepCounters:
    selected: int = 0  # (sequence, layer, KV head, chunk) selections
    hits: int = 0
    fetched: int = 0  # chunks rebuilt and fetched (the misses)
    bytes_fetched: int = 0  # value bytes read from the host
    from_device: int = 0  # chunks fetched from the device value region (config.device_value_share), not the host


@dataclass
class BatchSplit:
    """A forward's sequences split between the dense cache and the shadow."""

    dense_meta: AttentionMetadata | None
    dense_tokens: torch.Tensor  # (T_dense,) rows of the forward's tokens that belong to dense sequences
    shadow: list[tuple[SequenceState, int, int]]  # (state, query_start, query_len)
    shadow_tokens: torch.Tensor  # (S,) rows of the forward's tokens that belong to shadow sequences
    plan: DecodePlan | None = None  # the fast path's bookkeeping of a decode forward (or half), shared by its layers


class ShadowKVCache(KVCache):
    """Sizes come from the engine: `max_num_seqs` slots, `num_gpu_pages` / `num_host_pages` pages of
    `config.page_chunks` chunks, and `num_device_value_pages` value pages in device memory (config.device_value_share).
    `rotary` is the model's RotaryEmbedding (keys are rebuilt at their true positions); `dense` holds the sequences that
    fit in config.min_context tokens."""

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int, config: ShadowKVConfig,
                 scale: float, rotary, dtype: torch.dtype, device: torch.device | str, max_num_seqs: int,
                 num_gpu_pages: int, num_host_pages: int, dense: KVCache,
                 prefill_chunk_tokens: int = 8192, placement=None, use_kernels: bool | None = None,
                 num_device_value_pages: int = 0):
        config.check_model(num_kv_heads, head_dim)
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.config, self.scale, self.rotary, self.dense = config, scale, rotary, dense
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.gpu = GpuPages(num_layers, num_gpu_pages, config.page_chunks, config.chunk_size, config.rank, num_kv_heads,
                            head_dim, dtype, device, config.landmark_format)
        self.host = HostValueStore(num_layers, num_host_pages, self.gpu.page_tokens, num_kv_heads, head_dim, dtype,
                                   pin=self.device.type == "cuda", placement=placement,
                                   value_format=config.value_format, chunk_size=config.chunk_size,
                                   num_device_pages=num_device_value_pages, device=device)
        self.slots = Slots(max_num_seqs, num_layers, num_kv_heads, head_dim, config, dtype, device)
        self.seqs: dict[int, SequenceState] = {}
        self.step, self._last_step = StepCounters(), StepCounters()
        # The fast path's counts of the forward under way, and of the decode steps whose counts are not yet read:
        # (selected, the step's counts on their way to the host, or None for the reference path's self.step)
        self._step_counts = None
        self._unread: deque[tuple[StepCounters | int, Readback | None]] = deque()
        # Decode on the Triton kernels (value fetch and key rebuild on two streams) by default on CUDA; the
        # reference path (layer.decode_layer) elsewhere, for heads narrower than the kernels take, and for a custom
        # chunk_scorer.
        self.use_kernels = kernels_by_default(device, head_dim) if use_kernels is None else use_kernels
        self.streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) \
            if self.device.type == "cuda" else None
        # Values in the model's dtype are fetched by 8 persistent programs of 32 missed chunks at a time: with that
        # much in flight each, 8 multiprocessors move the full host-to-device bandwidth (H200: 50.9 GB/s, as 66
        # programs of 4 misses did), and the others stay free for the work beside it (the key rebuild; in pipelined
        # halves the other half's layer: 122K x 13 step 50.3 -> 46.9 ms). benchmarks/kernels.py --fetch-shapes-only.
        # Otherwise 66 programs of 4 misses, of 8 warps each:
        # - fp8 values, pipelined, 122K on an H200 (this session's kernels): 545 against 519 tok/s for 16 x 32 at 26,
        #   300 against 272 at 8 (benchmarks/results/fetch_grid/fp8_66x4.json against throughput.json);
        # - a prefetch looks each miss up in its staged list, which a program of many misses serialises (122K x 8:
        #   284 ms a step with 8 x 32, 35.1 ms with 66 x 4; prefetch_grid_8x32.json, _66x4.json);
        # - with a device value region a program's device misses wait on its host ones, so time tracks host bytes
        #   only with few misses per program (122K x 13, all misses: 32 x 8 takes 0.67 ms with 95 % of the pages on
        #   the device, 66 x 4 0.26; kernel_device_region.json);
        # - 8 warps: fp8 values and landmarks, tiered, pipelined at 122K x 31 on an H200, 725-728 tok/s in three
        #   runs against 693-703 in three with 4 warps (8 misses a program: 676; 33 programs: 427-462;
        #   fetch_grid/fp8lm_tier_*, repeats_122k_host.json).
        few_per_program = config.value_format == "fp8" or config.device_value_share > 0
        programs, self.fetch_misses_per_program, self.fetch_warps = (66, 4, 8) if few_per_program else (8, 32, 4)
        self.fetch_programs = programs if self.device.type == "cuda" else None  # None: one program per work item
        self.chunk_scorer = None  # selection-policy hook (e.g. quest.QuestScorer); None: ShadowKV's landmarks
        self._splits: dict[int, tuple[AttentionMetadata, BatchSplit]] = {}  # this forward's, by metadata
        self._plans: list[DecodePlan] = []  # this forward's fast-path plans (one per pipelined half)
        self._page_tables: OrderedDict[tuple, tuple] = OrderedDict()  # batch -> (its states, its page tables)
        self.held_page_tables = 8  # batches whose tables are kept (pipelined halves count one each)

    # ---- allocation ----

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """GPU pages (U rows + landmarks) and, as many, value pages of one sequence (on the host and the device)."""
        return math.ceil((prompt_len + max_new_tokens) / self.gpu.page_tokens)

    def _value_pages_fit(self, n: int, free: bool) -> bool:
        d = device_value_pages(self.config, n)
        host, device = (self.host.num_free, self.host.device_pages.num_free) if free else \
            (self.host.num_pages, self.host.device_pages.num_pages)
        return n - d <= host and d <= device

    def can_allocate(self, prompt_len: int, max_new_tokens: int) -> bool:
        if self.config.stays_dense(prompt_len, max_new_tokens):
            return self.dense.can_allocate(prompt_len, max_new_tokens)
        n = self.pages_needed(prompt_len, max_new_tokens)
        return self.slots.num_free >= 1 and self.gpu.num_free >= n and self._value_pages_fit(n, free=True)

    def fits_when_empty(self, prompt_len: int, max_new_tokens: int) -> bool:
        if self.config.stays_dense(prompt_len, max_new_tokens):
            return self.dense.fits_when_empty(prompt_len, max_new_tokens)
        n = self.pages_needed(prompt_len, max_new_tokens)
        return n <= self.gpu.num_pages and self._value_pages_fit(n, free=False)

    def footprint(self, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
        """(device bytes, host bytes) reserved by `allocate`: pages, plus the slot on the device."""
        if self.config.stays_dense(prompt_len, max_new_tokens):
            return self.dense.footprint(prompt_len, max_new_tokens)
        n = self.pages_needed(prompt_len, max_new_tokens)
        d = device_value_pages(self.config, n)
        return (n * self.gpu.page_bytes + d * self.host.page_bytes + self.slots.slot_bytes,
                (n - d) * self.host.page_bytes)

    def allocate(self, seq_id: int, prompt_len: int, max_new_tokens: int) -> None:
        """Reserve the slot and every page the sequence can need; MemoryError, nothing reserved, if they don't fit."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already holds a ShadowKV slot")
        if self.config.stays_dense(prompt_len, max_new_tokens):
            return self.dense.allocate(seq_id, prompt_len, max_new_tokens)
        if not self.can_allocate(prompt_len, max_new_tokens):
            raise MemoryError(
                f"ShadowKV cache full: a sequence of {prompt_len}+{max_new_tokens} tokens needs 1 slot and "
                f"{self.pages_needed(prompt_len, max_new_tokens)} GPU and value pages; free: {self.slots.num_free} "
                f"slots, {self.gpu.num_free} GPU pages, {self.host.num_free} host pages, "
                f"{self.host.device_pages.num_free} device value pages")
        n = self.pages_needed(prompt_len, max_new_tokens)
        C = self.config.chunk_size
        num_shadow = max(prompt_len // C - self.config.local_chunks, 0)  # the middle chunks
        gpu_pages, host_pages = self.gpu.alloc(n), self.host.alloc(n, on_device=device_value_pages(self.config, n))
        self.seqs[seq_id] = SequenceState(
            slot=self.slots.alloc(), prompt_len=prompt_len, gpu_pages=gpu_pages, host_pages=host_pages,
            gpu_table=to_device(gpu_pages, torch.int64, self.device),
            host_table=torch.tensor(host_pages, dtype=torch.int64),
            num_shadow=num_shadow, window_len=prompt_len - num_shadow * C,
            num_outliers=min(self.config.outlier_chunks, num_shadow))

    def free(self, seq_id: int) -> None:
        st = self.seqs.pop(seq_id, None)
        if st is None:
            return self.dense.free(seq_id)
        self.gpu.free(st.gpu_pages)
        self.host.free(st.host_pages)
        self.slots.free(st.slot)

    # ---- forward ----

    def attend(self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        return self.attend_end(self.attend_begin(layer, q, k_pre, k_rot, v, meta))

    def attend_begin(self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMetadata):
        """Everything but the fast path's wait for its side streams and its attention (attend_end)."""
        split = self._split_batch(meta)
        if split.dense_meta is None and self._decodes_fast(meta, split):
            # every token is a shadow sequence's, in order: the kernels take the layer's tensors as they are
            return None, None, begin_decode_layer(self, layer, self._plan(split), q, k_pre, k_rot, v)
        out = torch.empty_like(q)  # (T, Hq, d)
        if split.dense_meta is not None:
            rows = split.dense_tokens
            out[rows] = self.dense.attend(layer, q[rows], k_pre[rows], k_rot[rows], v[rows], split.dense_meta)
        if self._decodes_fast(meta, split):
            rows = split.shadow_tokens
            plan = self._plan(split)
            return out, rows, begin_decode_layer(self, layer, plan, q[rows], k_pre[rows], k_rot[rows], v[rows])
        for st, start, n in split.shadow:
            i = slice(start, start + n)
            if meta.is_prefill:
                out[i] = prefill_layer(self, layer, st, q[i], k_pre[i], k_rot[i], v[i])
            else:
                out[i] = decode_layer(self, layer, st, q[start], k_pre[start], k_rot[start], v[start])[None]
        return out, None, None

    def attend_end(self, handle) -> torch.Tensor:
        out, rows, pending = handle
        if pending is None:
            return out
        if out is None:  # the whole forward's tokens
            return end_decode_layer(self, pending)
        out[rows] = end_decode_layer(self, pending)
        return out

    def _decodes_fast(self, meta: AttentionMetadata, split: BatchSplit) -> bool:
        """Whether the forward's shadow sequences decode on the kernels (else: prefill, or the reference path)."""
        return not meta.is_prefill and bool(split.shadow) and self.use_kernels and self.chunk_scorer is None

    def page_tables(self, states: list[SequenceState]) -> torch.Tensor:
        """(2, B, W) int32 on the device: the GPU page table and the value page table, zero-padded to W, the power
        of two at or above the batch's longest page list (a captured CUDA graph is keyed on their shape). A sequence's
        pages are fixed when it is allocated, so a batch's tables are built once and copied while the same sequences
        decode together: building them from Python lists took the host about 1 ms each at 122K x 16, 4 ms of a 52 ms
        step at 122K x 31 (two halves), with the GPU idle. The copy is the plan's own (a captured graph keeps the
        plan's tensors as its inputs and overwrites them)."""
        key = tuple(map(id, states))
        held = self._page_tables.pop(key, None)
        if held is None:
            width = triton.next_power_of_2(max(len(st.gpu_pages) for st in states))
            rows = [[st.gpu_pages + [0] * (width - len(st.gpu_pages)) for st in states],
                    [st.host_pages + [0] * (width - len(st.host_pages)) for st in states]]
            held = (tuple(states), to_device(rows, torch.int32, self.device))
        self._page_tables[key] = held  # most recent last; holding the states keeps their ids from being reused
        while len(self._page_tables) > self.held_page_tables:
            self._page_tables.popitem(last=False)
        return held[1].clone()

    def _plan(self, split: BatchSplit) -> DecodePlan:
        if split.plan is None:
            split.plan = DecodePlan.build(self, [st for st, _, _ in split.shadow])
            self._plans.append(split.plan)
        return split.plan

    def prepare_forward(self, meta: AttentionMetadata) -> None:
        split = self._split_batch(meta)
        if split.dense_meta is not None:
            self.dense.prepare_forward(split.dense_meta)
        if self._decodes_fast(meta, split):
            self._plan(split)

    def graph_inputs(self, meta: AttentionMetadata):
        split = self._split_batch(meta)
        if split.shadow and not self._decodes_fast(meta, split):
            return None
        key, tensors = [], [split.dense_tokens, split.shadow_tokens]
        if split.dense_meta is not None:
            dense = self.dense.graph_inputs(split.dense_meta)
            if dense is None:
                return None
            key.append(dense[0])
            tensors += dense[1]
        if split.shadow:
            plan = self._plan(split)
            key.append(plan.graph_key)
            tensors += plan.tensors()
        return tuple(key), tensors

    def _split_batch(self, meta: AttentionMetadata) -> BatchSplit:
        # The same split serves every layer of a forward: build it once per metadata object (held, so that its id
        # cannot be reused by a later forward's metadata); a pipelined forward has one per half.
        held = self._splits.get(id(meta))
        if held is not None and held[0] is meta:
            return held[1]
        dense_idx, shadow, dense_rows = [], [], []
        for i, (seq_id, start, n, ctx) in enumerate(zip(meta.seq_ids, meta.query_starts, meta.query_lens,
                                                        meta.context_lens)):
            st = self.seqs.get(seq_id)
            if st is None:
                dense_idx.append(i)
                dense_rows.extend(range(start, start + n))
                continue
            if (meta.is_prefill and ctx != 0) or (not meta.is_prefill and n != 1):
                raise ValueError(f"sequence {seq_id}: ShadowKV prefills whole prompts (context 0) and decodes one "
                                 f"token at a time; got {n} tokens after {ctx}")
            shadow.append((st, start, n))
        dense_tokens = to_device(dense_rows, torch.int64, meta.positions.device)
        shadow_tokens = to_device([start for _, start, _ in shadow], torch.int64, self.device)
        dense_meta = None
        if dense_idx:
            dense_meta = AttentionMetadata(
                meta.is_prefill, [meta.seq_ids[i] for i in dense_idx], [meta.query_lens[i] for i in dense_idx],
                [meta.context_lens[i] for i in dense_idx], meta.positions[dense_tokens])
        split = BatchSplit(dense_meta, dense_tokens, shadow, shadow_tokens)
        self._splits[id(meta)] = (meta, split)
        return split

    def finish_forward(self, meta: AttentionMetadata) -> None:
        split = self._split_batch(meta)
        if split.dense_meta is not None:
            self.dense.finish_forward(split.dense_meta)
        if self._plans:
            self._count_fast_step(split)
        for st, _, n in split.shadow:
            st.seq_len += n
            if not meta.is_prefill:
                st.window_len += 1
                if st.window_len == self.slots.window_tokens:
                    self._fold(st)
        if not meta.is_prefill:
            self._unread.append((self.step, None) if self._step_counts is None else self._step_counts)
            self.step = StepCounters()
            self._read_counts()  # the steps that have finished: at most the one before this with async decode
        self._step_counts = None
        self._splits.clear()
        self._plans.clear()

    def _count_fast_step(self, split: BatchSplit) -> None:
        """The fast path's step counters: its miss counts, summed over its layers on the device, are copied back once
        per step and read when last_step is (a decode step launched while the one before it runs does not wait)."""
        Hkv = self.slots.sparse_v.shape[2]
        selected = sum(max(min(self.config.budget_chunks, st.num_shadow - st.num_outliers), 0)
                       for st, _, _ in split.shadow) * Hkv * self.num_layers
        counts = torch.stack([torch.cat([p.misses, p.device_hits]) for p in self._plans])
        self._step_counts = selected, Readback(counts.sum(0))

    @property
    def last_step(self) -> StepCounters:
        """The counters of the last decode step that has finished on the device (never waits: with async decode
        usually the step before the one in flight; otherwise the last step)."""
        self._read_counts()
        return self._last_step

    def _read_counts(self) -> None:
        while self._unread and (self._unread[0][1] is None or self._unread[0][1].ready()):
            counters, readback = self._unread.popleft()
            if readback is not None:
                fetched, from_device = readback.tolist()
                host_bytes = (fetched - from_device) * self.host.fetch_bytes()
                counters = StepCounters(counters, counters - fetched, fetched, host_bytes, from_device)
            self._last_step = counters

    def _fold(self, st: SequenceState) -> None:
        """Move the window's older half into the shadow, all layers at once: its U rows are already on the GPU
        pages (every token's are written when it arrives); add its landmarks, offload its values, shift the rest."""
        half, C, L = self.config.decode_window // 2, self.config.chunk_size, self.num_layers
        wk, wv = self.slots.window_k[st.slot], self.slots.window_v[st.slot]  # (L, E, Hkv, d)
        Hkv, d = wk.shape[-2:]
        lm = chunk_landmarks(wk[:, :half].reshape(L * half, Hkv, d), C).view(L, half // C, Hkv, d)
        self.gpu.write_landmarks(slice(None), st.gpu_table, st.num_shadow, lm)
        self.host.write(slice(None), st.host_table, st.num_shadow * C, wv[:, :half])
        keep = st.window_len - half
        wk[:, :keep] = wk[:, half:st.window_len].clone()
        wv[:, :keep] = wv[:, half:st.window_len].clone()
        st.num_shadow += half // C
        st.window_len = keep

    # ---- statistics ----

    def stats(self) -> dict[str, float]:
        dense = self.dense.stats()
        last = self.last_step
        return {
            "num_seqs": len(self.seqs) + dense["num_seqs"],
            "hit_rate": last.hits / last.selected if last.selected else 0.0,
            "chunks_fetched": last.fetched,
            "bytes_fetched": last.bytes_fetched,
            "chunks_from_device": last.from_device,
            "gpu_bytes_in_use": (self.gpu.bytes_in_use + self.slots.bytes_in_use + self.host.device_pages.bytes_in_use
                                 + dense["gpu_bytes_in_use"]),
            "host_bytes_in_use": self.host.bytes_in_use + dense["host_bytes_in_use"],
            "gpu_bytes_total": (self.gpu.num_pages * self.gpu.page_bytes + self.slots.num_slots * self.slots.slot_bytes
                                + self.host.device_pages.num_pages * self.host.device_pages.page_bytes
                                + dense.get("gpu_bytes_total", 0)),
            "host_bytes_total": self.host.num_pages * self.host.page_bytes + dense.get("host_bytes_total", 0),
        }

    def close(self) -> None:
        self.host.close()
