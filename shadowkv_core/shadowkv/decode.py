"""Decode of one layer of one sequence kept in shadows, on the reference path: append the token, select chunks by
their landmarks, rebuild the missed chunks' keys and fetch their values, attend over [outliers | selected | window].
Each step calls the reference functions of reference.py; fast_decode.py runs the same steps as kernels for a batch.
"""
from __future__ import annotations

import torch

from shadowkv_core.shadowkv.manager import SequenceState
from shadowkv_core.shadowkv.reference import (assign_slots, landmark_scores, meet_landmarks, project_keys, rebuild_keys,
                                              scoring_query, select_chunks, sparse_decode_attention_ref)


def decode_layer(cache, layer: int, st: SequenceState, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
    """One token: append it exactly to the window (and its U row to the shadow), then attend over
    [outliers | selected chunks | window]. q (Hq, d); k_pre, k_rot, v (Hkv, d) -> (Hq, d)."""
    slots, s = cache.slots, st.slot
    cache.gpu.write_u(layer, st.gpu_table, st.seq_len, project_keys(k_pre[None], slots.sv[layer][s]))
    slots.window_k[s, layer, st.window_len] = k_rot
    slots.window_v[s, layer, st.window_len] = v
    n_out = st.num_outliers * cache.config.chunk_size
    keys = [slots.outlier_k[s, layer, :, :n_out]]  # (Hkv, O*C, d)
    values = [slots.outlier_v[s, layer, :, :n_out]]
    k = min(cache.config.budget_chunks, st.num_shadow - st.num_outliers)
    if k > 0:
        sparse_k, sparse_v = select_and_load(cache, layer, st, q, k)
        keys.append(sparse_k)
        values.append(sparse_v)
    window = slice(0, st.window_len + 1)
    keys.append(slots.window_k[s, layer, window].transpose(0, 1))  # (Hkv, window, d)
    values.append(slots.window_v[s, layer, window].transpose(0, 1))
    return sparse_decode_attention_ref(q, torch.cat(keys, 1), torch.cat(values, 1), cache.spec.scale)


def select_and_load(cache, layer: int, st: SequenceState, q: torch.Tensor, k: int) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """Score the shadow's chunks, pick k per KV head, bring the misses into their slots.
    -> keys, values (Hkv, k*C, d) of the selected chunks, in slot order."""
    slots, s, C = cache.slots, st.slot, cache.config.chunk_size
    landmarks = cache.gpu.read_landmarks(layer, st.gpu_table, st.num_shadow)  # (n, Hkv, d or 2d)
    Hkv = landmarks.shape[1]
    excluded = cache.gpu.read_outliers(layer, st.gpu_table, st.num_shadow)  # (Hkv, n)
    if cache.chunk_scorer is None:
        scores = landmark_scores(scoring_query(q, cache.config.landmark_kind), landmarks, excluded,
                                 cache.spec.scale)  # (Hkv, n)
        if cache.config.rescore:
            scores = rescore_candidates(cache, layer, st, q, scores, k)
    else:
        scores = cache.chunk_scorer.scores(layer, st, q, excluded, cache.spec.scale)
    selected = select_chunks(scores, k)  # (Hkv, k)
    resident, miss = assign_slots(slots.resident[s, layer], selected)  # (Hkv, K) each
    slots.resident[s, layer] = resident
    load_misses(cache, layer, st, resident, miss)
    used = (resident >= 0).repeat_interleave(C, dim=1)  # (Hkv, K*C): tokens of occupied slots
    d = slots.sparse_k.shape[-1]
    step = cache.counts.current
    step.selected += Hkv * k
    step.hits += Hkv * k - int(miss.sum())
    return slots.sparse_k[s, layer][used].view(Hkv, k * C, d), slots.sparse_v[s, layer][used].view(Hkv, k * C, d)


def rescore_candidates(cache, layer: int, st: SequenceState, q: torch.Tensor, scores: torch.Tensor,
                       k: int) -> torch.Tensor:
    """The landmarks' rescore·k best chunks per KV head scored again by their rebuilt keys (ShadowKVConfig.rescore).
    scores (Hkv, n) the landmarks' -> (Hkv, n) fp32: per query head the softmax over the candidates of each one's
    largest logit, the max over the GQA group; every other chunk -inf."""
    m = min(cache.config.rescore * k, st.num_shadow - st.num_outliers)
    candidates = select_chunks(scores, m)  # (Hkv, m)
    Hkv, Hq, d = candidates.shape[0], q.shape[0], q.shape[-1]
    heads = torch.arange(Hkv, device=candidates.device).repeat_interleave(m)
    # rounded to the slots' dtype, as the fast path's candidate buffer holds them
    keys = rebuilt_keys(cache, layer, st, candidates.flatten(), heads).to(cache.slots.sparse_k.dtype)  # (Hkv*m, C, d)
    logits = torch.einsum("hgd,hmcd->hgmc", q.float().view(Hkv, Hq // Hkv, d),
                          keys.float().view(Hkv, m, -1, d)) * cache.spec.scale
    rescored = logits.amax(-1).softmax(-1).amax(1)  # (Hkv, m)
    return torch.full_like(scores, float("-inf")).scatter(1, candidates, rescored)


def rope_lens(cache, st: SequenceState, positions: torch.Tensor) -> torch.Tensor | None:
    """The sequence length each key was first rotated with, for RoPE that depends on it (the decoder passes the
    length after the forward: the prompt's for prompt tokens, position + 1 for generated ones); else None."""
    if not getattr(cache.rotary, "uses_seq_lens", False):
        return None
    return torch.where(positions < st.prompt_len, st.prompt_len, positions + 1)  # (M, C)


def load_misses(cache, layer: int, st: SequenceState, resident: torch.Tensor, miss: torch.Tensor) -> None:
    """Rebuild the missed chunks' keys (U rows · SV, RoPE at true positions) and fetch their values from the host,
    into the slots `miss` marks. resident, miss (Hkv, K)."""
    slots, s, C = cache.slots, st.slot, cache.config.chunk_size
    heads, slot_ids = miss.nonzero(as_tuple=True)  # (M,) each
    if heads.numel() == 0:
        return
    chunks = resident[heads, slot_ids]  # (M,)
    keys = rebuilt_keys(cache, layer, st, chunks, heads)  # (M, C, d)
    values = cache.host.gather(layer, st.value_table, chunks, heads, C)  # (M, C, d) on the host
    Hkv, K = miss.shape
    d = keys.shape[-1]
    slots.sparse_k[s, layer].view(Hkv, K, C, d)[heads, slot_ids] = keys.to(slots.sparse_k.dtype)
    slots.sparse_v[s, layer].view(Hkv, K, C, d)[heads, slot_ids] = values.to(slots.sparse_v.device)
    pages = st.value_table[(chunks * C // cache.host.page_tokens).cpu()]
    from_device = int((pages >= cache.host.num_pages).sum())
    step = cache.counts.current
    step.fetched += chunks.shape[0]
    step.from_device += from_device
    step.bytes_fetched += (chunks.shape[0] - from_device) * cache.host.fetch_bytes()


def rebuilt_keys(cache, layer: int, st: SequenceState, chunks: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys of shadow chunks, each for one KV head, from their U rows (moved onto their landmarks with
    ShadowKVConfig.landmark_rebuild). chunks, heads (M,) -> (M, C, d) fp32."""
    C = cache.config.chunk_size
    positions = chunks[:, None] * C + torch.arange(C, device=chunks.device)  # (M, C)
    u_rows = cache.gpu.read_u(layer, st.gpu_table, positions)  # (M, C, r)
    sv = cache.slots.sv[layer][st.slot][heads]  # (M, r, d)
    keys = rebuild_keys(u_rows, sv, positions, cache.rotary, rope_lens(cache, st, positions))
    if cache.config.landmark_rebuild:
        landmarks = cache.gpu.read_landmarks(layer, st.gpu_table, st.num_shadow)[chunks, heads]
        keys = meet_landmarks(keys, landmarks, cache.config.landmark_kind)
    return keys


def rebuild_landmarks(cache, layer: int) -> dict:
    """kernels.rebuild_keys' landmark arguments: the layer's landmarks where rebuilt keys meet them
    (ShadowKVConfig.landmark_rebuild), none otherwise."""
    if not cache.config.landmark_rebuild:
        return {}
    return {"landmarks": cache.gpu.landmarks[layer], "landmark_kind": cache.config.landmark_kind,
            "landmark_scales": cache.gpu.landmark_scales_of(layer)}
