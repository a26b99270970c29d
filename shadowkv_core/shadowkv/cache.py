"""ShadowKVCache: the device side of the shadow (what DESIGN's data path calls the shadow) for sequences kept in
shadows; hybrid.HybridCache keeps the short ones in a dense cache beside it.

Prefill factorises a sequence's keys, finds landmarks and outliers and sends its values to the value store
(prefill.py); each decode step selects chunks, rebuilds and fetches the misses and attends over
[outliers | selected | local + generated], on the kernels for the whole batch (fast_decode.py) or per sequence on the
reference path (decode.py). When the window of exact tokens is full its older half is folded into the shadow, so
generation is bounded only by the pages allocated up front.
"""
from __future__ import annotations

import torch
import triton

from shadowkv_core.attention import chunk_attention
from shadowkv_core.cache.base import AttentionMetadata, CacheSpec, KVCache
from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.memory_model import Pools
from shadowkv_core.numa import NumaPlacement
from shadowkv_core.shadowkv.counters import StepCounts
from shadowkv_core.shadowkv.decode import decode_layer
from shadowkv_core.shadowkv.fast_decode import (begin_decode_layer, end_decode_layer, fetch_shapes,
                                                landmark_top_chunks)
from shadowkv_core.shadowkv.host_store import HostValueStore
from shadowkv_core.shadowkv.manager import SequenceState, ShadowKVManager
from shadowkv_core.shadowkv.pages import GpuPages
from shadowkv_core.shadowkv.plan import DecodePlan, PageTables
from shadowkv_core.shadowkv.prefill import build_shadow, prefill_layer, prompt_keys_values, start_factorization
from shadowkv_core.shadowkv.reference import chunk_landmarks
from shadowkv_core.shadowkv.slots import Slots


class ShadowKVCache(KVCache):
    """Buffers for `pools`' slots, GPU pages and value pages (host, and device for config.device_value_share).
    `rotary` is the model's RotaryEmbedding: keys are rebuilt at their true positions. prefix_caching: the
    manager's (a custom chunk scorer turns it off: its per-slot state is built from the whole prompt)."""

    def __init__(self, spec: CacheSpec, config: ShadowKVConfig, pools: Pools, rotary,
                 placement: NumaPlacement | None = None, prefix_caching: bool = False):
        config.check_model(spec.num_kv_heads, spec.head_dim, spec.num_layers)
        self.spec, self.config, self.rotary, self.device = spec, config, rotary, spec.device
        self.gpu = GpuPages(spec, config, pools.num_gpu_pages)
        self.host = HostValueStore(spec.num_layers, pools.num_host_pages, self.gpu.page_tokens, spec.num_kv_heads,
                                   spec.head_dim, spec.dtype, pin=self.device.type == "cuda", placement=placement,
                                   value_format=config.value_format, chunk_size=config.chunk_size,
                                   num_device_pages=pools.num_device_value_pages, device=self.device)
        self.slots = Slots(spec, config, pools.num_slots)
        self.manager = ShadowKVManager(config, pools.num_slots, self.slots.slot_bytes, pools.num_gpu_pages,
                                       self.gpu.page_bytes, pools.num_host_pages, pools.num_device_value_pages,
                                       self.host.page_bytes, self.device, prefix_caching)
        self.counts = StepCounts(self.host.fetch_bytes())
        # the kernel path's value fetch and key rebuild run on two side streams, joined by events; at the highest
        # priority, which the decode's own stream has too with overlap_prefill (engine/streams.py): above any slices
        self.streams = tuple(torch.cuda.Stream(self.device, priority=torch.cuda.Stream.priority_range()[1])
                             for _ in range(2)) if self.device.type == "cuda" else None
        # a cold prefill's key factorisation (prefill.start_factorization), beside the layer's attention slices
        self.build_stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self.fetch_shapes = fetch_shapes(config, self.device)
        self.page_tables = PageTables(self.device)
        self.manager.on_move = self._move_values
        # selection-policy hook (quest.QuestScorer, baselines.StreamingScorer, baselines.SnapKVScorer): prefill(),
        # fold() and scores(); None: ShadowKV's landmarks
        self._chunk_scorer = None
        self._plans: dict[int, tuple[AttentionMetadata, DecodePlan]] = {}  # this forward's, by metadata object

    def _move_values(self, src: list[int], dst: list[int]) -> None:
        """Shared value pages the manager moved to the device region: copy them; the held page tables are stale."""
        self.host.move_pages(src, dst)
        self.page_tables.clear()

    @property
    def chunk_scorer(self):
        return self._chunk_scorer

    @chunk_scorer.setter
    def chunk_scorer(self, scorer) -> None:
        if scorer is not None:
            self.manager.clear_prefix_cache()
            for index in (self.manager.gpu_index, self.manager.host_index, self.manager.device_index):
                index.enabled = False
        self._chunk_scorer = scorer

    # ---- forward ----

    def _states(self, meta: AttentionMetadata) -> list[SequenceState]:
        states = [self.manager.seqs[seq_id] for seq_id in meta.seq_ids]
        for st, seq_id, n, ctx in zip(states, meta.seq_ids, meta.query_lens, meta.context_lens):
            if (meta.is_prefill and ctx != st.cached) or (not meta.is_prefill and n != 1):
                raise ValueError(f"sequence {seq_id}: ShadowKV prefills a whole prompt after its adopted prefix "
                                 f"({st.cached} tokens) in one forward, whose slices see the earlier ones, and "
                                 f"decodes one token at a time; got {n} tokens after {ctx}")
        return states

    def _decodes_fast(self, meta: AttentionMetadata) -> bool:
        """Whether a forward decodes on the kernels (else: prefill, or the reference path)."""
        return not meta.is_prefill and self.spec.kernels

    def _plan(self, meta: AttentionMetadata) -> DecodePlan:
        """The forward's plan, built once per metadata object (held with it, so that its id cannot be reused by a
        later forward's metadata); a pipelined forward has one per half."""
        held = self._plans.get(id(meta))
        if held is None or held[0] is not meta:
            plan = DecodePlan.build(self._states(meta), self.config, self.rotary, self.page_tables,
                                    self.spec.num_kv_heads, meta.halved)
            held = self._plans[id(meta)] = (meta, plan)
        return held[1]

    def attend(self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        return self.attend_end(self.attend_begin(layer, q, k_pre, k_rot, v, meta))

    def attend_begin(self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMetadata):
        """On the kernels: everything but the wait for the side streams and the attention (attend_end)."""
        if self._decodes_fast(meta):
            return None, begin_decode_layer(self, layer, self._plan(meta), q, k_pre, k_rot, v)
        out = torch.empty_like(q)  # (T, Hq, d)
        for st, start, n in zip(self._states(meta), meta.query_starts, meta.query_lens):
            i = slice(start, start + n)
            if meta.is_prefill:
                out[i] = prefill_layer(self, layer, st, q[i], k_pre[i], k_rot[i], v[i])
            else:
                out[i] = decode_layer(self, layer, st, q[start], k_pre[start], k_rot[start], v[start])[None]
        return out, None

    def attend_end(self, handle) -> torch.Tensor:
        out, pending = handle
        return out if pending is None else end_decode_layer(self, pending)

    def prefill_begin(self, layer, q, k_pre, k_rot, v, meta):
        """Each prompt's keys and values after its adopted prefix's (rebuilt from U rows, SV and RoPE; values from
        the value store, once for all the prompts that read one cached prefix): every attention slice of it sees
        [prefix | the prompt up to its end]. A cold prompt's key factorisation begins now, beside those slices."""
        shared, states = {}, self._states(meta)
        for st, start, n in zip(states, meta.query_starts, meta.query_lens):
            if not st.cached:
                st.factors = start_factorization(self, layer, k_pre[start:start + n])
        return [prompt_keys_values(self, layer, st, k_rot[start:start + n], v[start:start + n], shared)
                for st, start, n in zip(states, meta.query_starts, meta.query_lens)]

    def prefill_read_bytes(self, layer, meta):
        """Each adopted prefix's values in the host region, once for the prompts that read one prefix together
        (prompt_keys_values shares them unless RoPE follows each reader's length)."""
        shared = not getattr(self.rotary, "uses_seq_lens", False)
        seen, total = set(), 0
        for st in self._states(meta):
            key = (id(st.adopted), st.cached)
            if st.cached and not (shared and key in seen):
                seen.add(key)
                total += self.host.host_bytes(st.value_table, st.cached)
        return total

    def prefill_attention(self, q, keys, values, whole=True):
        return chunk_attention(q, keys, values, self.spec.scale, self.spec.prefill_attention, whole)

    def prefill_end(self, layer, q, k_pre, k_rot, v, meta):
        for st, start, n in zip(self._states(meta), meta.query_starts, meta.query_lens):
            i = slice(start, start + n)
            build_shadow(self, layer, st, q[i], k_pre[i], k_rot[i], v[i])

    def prepare_forward(self, meta: AttentionMetadata) -> None:
        if self._decodes_fast(meta):
            self._plan(meta)

    def compile_buckets(self, max_model_len: int) -> int:
        """Landmark scoring and top-k take the batch's chunk count, rounded up to a power of two (DecodePlan.n_max),
        as a compile-time size: both run for every such bucket from the shortest sequence kept in shadows to the
        longest of max_model_len tokens, on layer 0's pages with no chunk of any sequence (every score -inf)."""
        if not self.spec.kernels or self.chunk_scorer is not None:  # a policy scores on the host
            return 0
        C, pc = self.config.chunk_size, self.config.page_chunks
        shortest = triton.next_power_of_2(max(self.config.min_context // C // 2, 1))
        longest = triton.next_power_of_2(triton.cdiv(max_model_len, C))
        q = torch.zeros(1, self.spec.num_q_heads, self.spec.head_dim, dtype=self.spec.dtype, device=self.device)
        num_chunks = torch.zeros(1, dtype=torch.int32, device=self.device)
        buckets = [1 << i for i in range(shortest.bit_length() - 1, longest.bit_length())]
        for n_max in buckets:
            table = torch.zeros(1, triton.next_power_of_2(triton.cdiv(n_max, pc)), dtype=torch.int32,
                                device=self.device)
            landmark_top_chunks(self, 0, q, table, num_chunks, n_max, min(self.config.budget_chunks, n_max))
        return len(buckets)

    def graph_inputs(self, meta: AttentionMetadata):
        if not self._decodes_fast(meta) or self.chunk_scorer is not None:  # a policy scores on the host each step
            return None
        plan = self._plan(meta)
        return plan.graph_key, plan.tensors()

    def finish_forward(self, meta: AttentionMetadata) -> None:
        if not meta.is_prefill:
            self.counts.end_step(self._device_counts())
        for seq_id, st, n in zip(meta.seq_ids, self._states(meta), meta.query_lens):
            st.seq_len += n
            if meta.is_prefill and self.manager.prefix_caching:
                self.manager.prefilled(seq_id, *self._record_of(st))
            if not meta.is_prefill:
                st.window_len += 1
                if st.window_len == self.slots.window_tokens:
                    self._fold(st)
        self._plans.clear()

    def _record_of(self, st: SequenceState):
        """A prefilled sequence's slot basis and outliers, on the host (pinned on CUDA: adoption copies them back
        without waiting; an adopted record's own where the prefill left them unchanged), and the outliers each KV
        head of each layer has in its first p pages, for every p: what manager.prefilled keeps for its pages."""
        O, L, pc = st.num_outliers * self.config.chunk_size, self.spec.num_layers, self.config.page_chunks
        flags = torch.stack([self.gpu.read_outliers(layer, st.gpu_table, st.num_shadow) for layer in range(L)])
        before = torch.nn.functional.pad(flags.long().cumsum(-1), (1, 0))  # (L, Hkv, n + 1)
        counts = before[..., [min(p * pc, st.num_shadow) for p in range(-(-st.num_shadow // pc) + 1)]]
        adopted = st.adopted
        # the slot holds an adopted basis unchanged, and its outliers too where append_suffix made none up: shared
        same_outliers = adopted is not None and adopted.outlier_k.shape[2] == O and int(
            adopted.outliers_of(st.cached // self.gpu.page_tokens).min()) >= st.num_outliers

        def host_copy(buf: torch.Tensor, rows: int | None) -> torch.Tensor:
            src = buf[st.slot, ..., :rows, :]  # copied: the slot is reused after the sequence
            return torch.empty(src.shape, dtype=src.dtype, pin_memory=self.device.type == "cuda").copy_(
                src, non_blocking=True)

        sv = adopted.sv if adopted is not None else tuple(host_copy(layer_sv, None) for layer_sv in self.slots.sv)
        outliers = ((adopted.outlier_k, adopted.outlier_v) if same_outliers
                    else (host_copy(self.slots.outlier_k, O), host_copy(self.slots.outlier_v, O)))
        # waits for the copies above too: the manager indexes the pages by these counts now
        return (sv, *outliers, counts.permute(2, 0, 1).cpu())  # counts (pages + 1, L, Hkv)

    def _device_counts(self) -> tuple[int, torch.Tensor] | None:
        """The kernel path's counts of this decode forward (its plans': one per pipelined half): selections over
        every layer, and its miss counters summed on the device. None on the reference path, which counts as it
        runs."""
        if not self._plans:
            return None
        plans = [plan for _, plan in self._plans.values()]
        counters = torch.stack([plan.counters for plan in plans]).sum(0)
        return sum(plan.num_selections for plan in plans) * self.spec.num_layers, counters

    def _fold(self, st: SequenceState) -> None:
        """Move the window's older half into the shadow, all layers at once: its U rows are already on the GPU
        pages (every token's are written when it arrives); add its landmarks, offload its values, shift the rest."""
        half, C, L = self.config.decode_window // 2, self.config.chunk_size, self.spec.num_layers
        wk, wv = self.slots.window_k[st.slot], self.slots.window_v[st.slot]  # (L, E, Hkv, d)
        Hkv, d = wk.shape[-2:]
        lm = chunk_landmarks(wk[:, :half].reshape(L * half, Hkv, d), C, self.config.landmark_kind)
        lm = lm.view(L, half // C, Hkv, -1)
        self.gpu.write_landmarks(slice(None), st.gpu_table, st.num_shadow, lm)
        if self.chunk_scorer is not None:
            self.chunk_scorer.fold(st, wk[:, :half], C)
        self.host.write(slice(None), st.value_table, st.num_shadow * C, wv[:, :half])
        keep = st.window_len - half
        wk[:, :keep] = wk[:, half:st.window_len].clone()
        wv[:, :keep] = wv[:, half:st.window_len].clone()
        st.num_shadow += half // C
        st.window_len = keep

    def copy_sequence(self, src: int, dst: int) -> None:
        a, b = self.manager.seqs[src], self.manager.seqs[dst]
        self.slots.copy(a.slot, b.slot)
        self.gpu.copy(a.gpu_pages, b.gpu_pages)
        self.host.copy_pages(a.value_pages, b.value_pages)
        b.seq_len, b.window_len, b.num_shadow, b.num_outliers = a.seq_len, a.window_len, a.num_shadow, a.num_outliers

    def step_stats(self) -> dict[str, float]:
        return self.counts.stats()

    def close(self) -> None:
        self.host.close()
