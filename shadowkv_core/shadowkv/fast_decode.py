"""The Triton fast path of a decode step, for all of a batch's shadow sequences at once: layer.decode_layer's steps in
the same order and with the same results, as kernels (kernels/), with the key rebuild and the value fetch on two
streams joined by events, and no host sync inside a layer or between layers.

The cache builds a DecodePlan once per decode forward (the per-sequence bookkeeping copied to the device once, shared
by every layer) and calls `begin_decode_layer` / `end_decode_layer` per layer instead of `decode_layer` per sequence.
RoPE frequencies are taken per sequence at its prompt length (exact for every rope type whose frequencies do not
depend on the sequence length, and for longrope once the prompt is past the original context).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.append_token import append_token
from kernels.assign_slots import assign_slots
from kernels.decode_attention import decode_attention
from kernels.fetch_values import fetch_values
from kernels.landmark_scores import landmark_scores
from kernels.rebuild_keys import rebuild_keys
from kernels.topk import topk_indices
from shadowkv_core.shadowkv.slots import SequenceState
from shadowkv_core.transfers import to_device


@dataclass
class DecodePlan:
    """Device copies of the batch's bookkeeping; B sequences in batch order."""

    slot_ids: torch.Tensor  # (B,) int32
    gpu_table: torch.Tensor  # (B, max_pages) int32
    host_table: torch.Tensor  # (B, max_pages) int32, value page ids, host then device (read on the GPU)
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
    streams: tuple | None  # (value fetch, key rebuild) on CUDA
    misses: torch.Tensor  # (1,) int32 chunks fetched this forward, summed over layers (read once, after the step)
    device_hits: torch.Tensor  # (1,) int32 chunks fetched from the device value region (device_value_share)
    buffers: list[torch.Tensor]  # the device tensors built for the plan: every tensor above is one or a view of one

    @staticmethod
    def build(cache, states: list[SequenceState]) -> DecodePlan:
        dev, C, budget = cache.device, cache.config.chunk_size, cache.config.budget_chunks
        selected = [max(min(budget, st.num_shadow - st.num_outliers), 0) for st in states]
        window = [st.window_len + 1 for st in states]
        page_tokens = cache.gpu.page_tokens
        rows = [st.seq_len for st in states]
        # every per-sequence integer in one host-to-device copy (each copy costs the host tens of microseconds)
        ints = to_device([[st.slot for st in states], [st.num_shadow for st in states], selected,
                          [st.num_outliers * C for st in states], [k * C for k in selected], window,
                          [st.gpu_pages[r // page_tokens] for st, r in zip(states, rows)],
                          [r % page_tokens for r in rows], [st.window_len for st in states],
                          [st.prompt_len for st in states]], torch.int64, dev)
        small = ints[:6].to(torch.int32)
        rotary = cache.rotary
        prompt_lens = ints[9]
        inv_freq = rotary.frequencies(prompt_lens - 1, prompt_lens if rotary.uses_seq_lens else None).float()
        max_keys = max(st.num_outliers * C + k * C + w for st, k, w in zip(states, selected, window))
        inv_freq = inv_freq.expand(len(states), -1).contiguous()
        tables = cache.page_tables(states)
        counters = torch.zeros(2, 1, dtype=torch.int32, device=dev)
        return DecodePlan(
            slot_ids=small[0], gpu_table=tables[0], host_table=tables[1], num_chunks=small[1], num_selected=small[2],
            lens=[small[3], small[4], small[5]], token_page=ints[6], token_row=ints[7], window_pos=ints[8],
            inv_freq=inv_freq,
            n_max=triton.next_power_of_2(max(max(st.num_shadow for st in states), 1)),
            k_max=max(selected), max_len=triton.next_power_of_2(max_keys), streams=cache.streams,
            misses=counters[0], device_hits=counters[1],
            buffers=[ints, small, tables, inv_freq, counters])

    def tensors(self) -> list[torch.Tensor]:
        """Every device tensor of the plan, as few as can be copied (what a CUDA graph of the forward reads and, for
        the counters, writes)."""
        return self.buffers

    @property
    def graph_key(self) -> tuple[int, int, int]:
        """The kernels' compile-time buckets: what a captured graph depends on beyond the tensors' shapes."""
        return self.n_max, self.k_max, self.max_len


@dataclass
class PendingLayer:
    """A layer's decode begun: selection done, the misses' key rebuild and value fetch queued on the side streams."""

    layer: int
    plan: DecodePlan
    q: torch.Tensor
    done: list  # CUDA events of the side streams' work; empty on CPU (done in order)
    misses: tuple | None  # the lists the side streams read: held until the current stream waits on them


def begin_decode_layer(cache, layer: int, plan: DecodePlan, q: torch.Tensor, k_pre: torch.Tensor,
                       k_rot: torch.Tensor, v: torch.Tensor) -> PendingLayer:
    """Append the new tokens, select, and queue the misses' rebuild and fetch; returns without waiting for them."""
    slots = cache.slots
    append_token(k_pre, k_rot, v, slots.sv[:, layer], plan.slot_ids, cache.gpu.u[layer], plan.token_page,
                 plan.token_row, slots.window_k[:, layer], slots.window_v[:, layer], plan.window_pos)
    if plan.k_max == 0:
        return PendingLayer(layer, plan, q, [], None)
    misses, done = select_and_load(cache, layer, plan, q)
    return PendingLayer(layer, plan, q, done, misses)


def end_decode_layer(cache, pending: PendingLayer) -> torch.Tensor:
    """The current stream waits for the layer's side-stream work, then attends."""
    for event in pending.done:
        torch.cuda.current_stream().wait_event(event)
    slots, layer, plan = cache.slots, pending.layer, pending.plan
    segments = [(slots.outlier_k[:, layer], slots.outlier_v[:, layer], plan.lens[0]),
                (slots.sparse_k[:, layer], slots.sparse_v[:, layer], plan.lens[1]),
                (slots.window_k[:, layer].transpose(1, 2), slots.window_v[:, layer].transpose(1, 2), plan.lens[2])]
    # The selected chunks occupy a prefix of the sparse slots: the budget per sequence never shrinks, and misses
    # fill the first free slots in order (reference.assign_slots).
    return decode_attention(pending.q, segments, plan.slot_ids, cache.scale, plan.max_len)


def select(cache, layer: int, plan: DecodePlan, q: torch.Tensor) -> torch.Tensor:
    """Score the landmarks and pick the top-k chunks -> (B, Hkv, k_max), by score as reference.select_chunks."""
    scores = landmark_scores(q, cache.gpu.landmarks[layer], plan.gpu_table, plan.num_chunks,
                             cache.gpu.outlier_flags[layer], plan.n_max, cache.scale,
                             landmark_scales=cache.gpu.landmark_scales_of(layer))
    return topk_indices(scores, plan.k_max)


def select_and_load(cache, layer: int, plan: DecodePlan, q: torch.Tensor) -> tuple[tuple, list]:
    """Select, update the resident chunks, then queue the misses' key rebuild (stream A) and value fetch (stream B).
    -> the lists the side streams read and their events (see on_two_streams)."""
    slots, C, rotary = cache.slots, cache.config.chunk_size, cache.rotary
    misses = assign_slots(slots.resident[:, layer], plan.slot_ids, select(cache, layer, plan, q), plan.num_selected,
                          miss_total=plan.misses)
    # The short rebuild is queued first: the many fetch programs, waiting on PCIe, would otherwise hold every SM.
    done = on_two_streams(plan.streams, lambda: rebuild_keys(cache.gpu.u[layer], plan.gpu_table, slots.sv[:, layer],
                                                      plan.inv_freq, rotary.attention_factor, rotary.interleaved,
                                                      *misses, plan.slot_ids, slots.sparse_k[:, layer], C),
                   lambda: fetch_into(cache, layer, plan, misses, slots.sparse_v[:, layer]))
    return misses, done


def fetch_into(cache, layer: int, plan: DecodePlan, misses: tuple, dest: torch.Tensor):
    """fetch_values of a layer's miss lists (chunks, slots, count) into dest, with the cache's grid."""
    region = cache.host.device_region(layer)
    fetch_values(cache.host.values[layer], plan.host_table, *misses, plan.slot_ids, dest, cache.config.chunk_size,
                 misses_per_program=cache.fetch_misses_per_program, host_scales=cache.host.scales_of(layer),
                 max_programs=cache.fetch_programs, num_warps=cache.fetch_warps,
                 device_region=None if region is None else (*region, plan.device_hits))


def on_stream(stream: torch.cuda.Stream | None, work) -> torch.cuda.Event | None:
    """work() on `stream`, after what the current stream has queued -> an event recorded after it (the current stream
    waits on it before it reads the results: no host sync). Without a stream (CPU): work() now, and no event."""
    if stream is None:
        work()
        return None
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work()
        event = torch.cuda.Event()
        event.record(stream)
    return event


def on_two_streams(streams: tuple | None, first, second) -> list:
    """first() on streams[0] and second() on streams[1] (see on_stream) -> their events; without streams (CPU), one
    after the other, and no events."""
    if streams is None:
        first()
        second()
        return []
    return [on_stream(stream, work) for stream, work in zip(streams, (first, second))]
