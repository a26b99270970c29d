"""The Triton fast path of a decode step, for all of a batch's shadow sequences at once: decode.decode_layer's steps in
the same order and with the same results, as kernels (kernels/), with the key rebuild and the value fetch on two
streams joined by events, and no host sync inside a layer or between layers.

The cache builds a DecodePlan once per decode forward (plan.py) and calls `begin_decode_layer` / `end_decode_layer`
per layer instead of `decode_layer` per sequence.
RoPE frequencies are taken per sequence at its prompt length (exact for every rope type whose frequencies do not
depend on the sequence length, and for longrope once the prompt is past the original context).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels.append_token import append_token
from kernels.assign_slots import assign_slots
from kernels.decode_attention import decode_attention
from kernels.fetch_values import fetch_values
from kernels.landmark_scores import landmark_scores
from kernels.rebuild_keys import candidate_logits, rebuild_keys
from kernels.topk import topk_indices
from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.shadowkv.decode import rebuild_landmarks
from shadowkv_core.shadowkv.plan import DecodePlan
from shadowkv_core.shadowkv.reference import scoring_query


class FetchShape(NamedTuple):
    """How the value fetch's grid is cut: programs (None: one per work item), missed chunks per program, warps."""

    programs: int | None
    misses_per_program: int
    warps: int


class FetchShapes(NamedTuple):
    """The value fetch's shape for a whole batch's forward and for a pipelined half's (DecodePlan.halved)."""

    whole: FetchShape
    half: FetchShape


def fetch_shapes(config: ShadowKVConfig, device: torch.device) -> FetchShapes:
    """A pipelined half's fetch runs beside the other half's layer and leaves it multiprocessors: with values in the
    model's dtype a few persistent programs of many misses each move the whole host-to-device bandwidth; fp8 values,
    and values partly in the device region (whose misses would wait behind a program's host ones), go faster with
    more programs of few misses. A whole batch's fetch has only its layer's key rebuild beside it (queued first): on
    CUDA one program per few misses keeps the most reads in flight.
    docs/benchmarks.md has the measurements behind each shape."""
    few = config.value_format == "fp8" or config.device_value_share > 0
    programs, misses, warps = (66, 4, 8) if few else (8, 32, 4)
    if device.type != "cuda":
        half = FetchShape(None, misses, warps)
        return FetchShapes(half, half)
    return FetchShapes(FetchShape(None, 4, 8), FetchShape(programs, misses, warps))


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
    append_token(k_pre, k_rot, v, slots.sv[layer], plan.slot_ids, cache.gpu.u[layer], plan.token_page,
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
    return decode_attention(pending.q, segments, plan.slot_ids, cache.spec.scale, plan.max_len)


def select(cache, layer: int, plan: DecodePlan, q: torch.Tensor) -> torch.Tensor:
    """Score the landmarks (or ask the cache's selection policy) and pick the top-k chunks -> (B, Hkv, k_max), by
    score as reference.select_chunks."""
    if cache.chunk_scorer is not None:
        return topk_indices(policy_scores(cache, layer, plan, q), plan.k_max)
    if cache.config.rescore:
        return topk_indices(rescored_scores(cache, layer, plan, q), plan.k_max)
    return landmark_top_chunks(cache, layer, q, plan.gpu_table, plan.num_chunks, plan.n_max, plan.k_max)


def landmark_top_chunks(cache, layer: int, q: torch.Tensor, gpu_table: torch.Tensor, num_chunks: torch.Tensor,
                        n_max: int, k: int) -> torch.Tensor:
    """The k chunks of each sequence and KV head whose landmarks score highest against q -> (B, Hkv, k)."""
    scores = landmark_scores(scoring_query(q, cache.config.landmark_kind), cache.gpu.landmarks[layer], gpu_table,
                             num_chunks, cache.gpu.outlier_flags[layer], n_max, cache.spec.scale,
                             landmark_scales=cache.gpu.landmark_scales_of(layer))
    return topk_indices(scores, k)


def rescored_scores(cache, layer: int, plan: DecodePlan, q: torch.Tensor) -> torch.Tensor:
    """decode.rescore_candidates for the batch: the landmarks' rescore·k best chunks of each sequence and KV head,
    scored by the largest logits of their rebuilt keys (kernels.rebuild_keys.candidate_logits, which never stores
    them) -> (B, Hkv, n_max) fp32, -inf but at the candidates."""
    C, rotary = cache.config.chunk_size, cache.rotary
    m = min(cache.config.rescore * plan.k_max, plan.n_max)
    candidates = landmark_top_chunks(cache, layer, q, plan.gpu_table, plan.num_chunks, plan.n_max, m)  # (B, Hkv, m)
    B, Hkv = candidates.shape[:2]
    available = plan.num_chunks - plan.lens[0] // C  # (B,) shadow chunks that are not outliers
    count = torch.minimum(cache.config.rescore * plan.num_selected, available)  # (B,) candidates of each sequence
    best = candidate_logits(cache.gpu.u[layer], plan.gpu_table, cache.slots.sv[layer], plan.inv_freq,
                            rotary.attention_factor, rotary.interleaved, candidates.to(torch.int32),
                            count[:, None].expand(B, Hkv).contiguous(), plan.slot_ids, q,
                            cache.spec.scale, C, **rebuild_landmarks(cache, layer))  # (B, Hkv, G, m)
    return rescored_scores_of(candidates, best, count, plan.n_max)


def rescored_scores_of(candidates: torch.Tensor, best: torch.Tensor, count: torch.Tensor, n_max: int) -> torch.Tensor:
    """candidates (B, Hkv, m), their largest logits best (B, Hkv, G, m), the first count (B,) of each sequence's
    scored -> (B, Hkv, n_max) fp32: per query head the softmax over the candidates, the max over the group; -inf at
    every other chunk."""
    B, Hkv, m = candidates.shape
    valid = (torch.arange(m, device=best.device) < count[:, None])[:, None, None, :]  # (B, 1, 1, m)
    rescored = torch.where(valid, best.softmax(-1), float("-inf")).amax(2)  # (B, Hkv, m)
    scores = torch.full((B, Hkv, n_max), float("-inf"), dtype=torch.float32, device=best.device)
    # past a sequence's count its candidates are its outliers' and padding's ids, scored -inf as they were
    return scores.scatter_(2, candidates, rescored)


def policy_scores(cache, layer: int, plan: DecodePlan, q: torch.Tensor) -> torch.Tensor:
    """The selection policy's scores of each sequence's chunks (its scores(), as the reference path asks them), laid
    out as landmark_scores': (B, Hkv, n_max) fp32, -inf past a sequence's chunks. Asked per sequence, from the
    policy's own bookkeeping on the host: its decode is never captured in a CUDA graph (ShadowKVCache.graph_inputs)."""
    B, Hkv = len(plan.states), cache.spec.num_kv_heads
    scores = torch.full((B, Hkv, plan.n_max), float("-inf"), dtype=torch.float32, device=q.device)
    for b, st in enumerate(plan.states):
        excluded = cache.gpu.read_outliers(layer, st.gpu_table, st.num_shadow)  # (Hkv, n)
        scores[b, :, :st.num_shadow] = cache.chunk_scorer.scores(layer, st, q[b], excluded, cache.spec.scale)
    return scores


def select_and_load(cache, layer: int, plan: DecodePlan, q: torch.Tensor) -> tuple[tuple, list]:
    """Select, update the resident chunks, then queue the misses' key rebuild (stream A) and value fetch (stream B).
    -> the lists the side streams read and their events (see on_two_streams)."""
    slots, C, rotary = cache.slots, cache.config.chunk_size, cache.rotary
    misses = assign_slots(slots.resident[:, layer], plan.slot_ids, select(cache, layer, plan, q), plan.num_selected,
                          miss_total=plan.misses)
    landmarks = rebuild_landmarks(cache, layer)
    # The short rebuild is queued first: the many fetch programs, waiting on PCIe, would otherwise hold every SM.
    done = on_two_streams(cache.streams, lambda: rebuild_keys(cache.gpu.u[layer], plan.gpu_table, slots.sv[layer],
                                                      plan.inv_freq, rotary.attention_factor, rotary.interleaved,
                                                      *misses, plan.slot_ids, slots.sparse_k[:, layer], C,
                                                      **landmarks),
                   lambda: fetch_misses(cache, layer, plan, misses))
    return misses, done


def fetch_misses(cache, layer: int, plan: DecodePlan, misses: tuple) -> None:
    """fetch_values of a layer's miss lists (chunks, slots, count) into its sparse value slots."""
    shapes = cache.fetch_shapes
    region, shape = cache.host.device_region(layer), shapes.half if plan.halved else shapes.whole
    fetch_values(cache.host.values[layer], plan.value_table, *misses, plan.slot_ids, cache.slots.sparse_v[:, layer],
                 cache.config.chunk_size, misses_per_program=shape.misses_per_program,
                 host_scales=cache.host.scales_of(layer), max_programs=shape.programs, num_warps=shape.warps,
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
