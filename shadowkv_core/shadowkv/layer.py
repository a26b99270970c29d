"""One layer of one sequence kept in shadows: prefill (build the shadow) and decode (select, rebuild, fetch, attend).

Each function runs DESIGN.md's steps in order on the buffers of a ShadowKVCache, calling the reference functions;
the Triton fast path replaces the same steps one by one.
"""
from __future__ import annotations

import torch

from shadowkv_core.attention import prefill_attention_ref
from shadowkv_core.shadowkv.reference import (assign_slots, chunk_landmarks, factorize_keys, find_outlier_chunks,
                                              landmark_scores, project_keys, rebuild_keys, select_chunks,
                                              sparse_decode_attention_ref)
from shadowkv_core.shadowkv.slots import SequenceState


def prefill_layer(cache, layer: int, st: SequenceState, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    """Exact causal attention over the whole prompt, then the layer's shadow. q (P, Hq, d); k_pre, k_rot, v
    (P, Hkv, d) -> (P, Hq, d)."""
    out = prefill_attention_ref(q, k_rot, v, cache.scale, cache.prefill_chunk_tokens)
    slots, C = cache.slots, cache.config.chunk_size
    u, sv = factorize_keys(k_pre, cache.config.rank)  # (P, r), (Hkv, r, d)
    cache.gpu.write_u(layer, st.gpu_table, 0, u)
    slots.sv[st.slot, layer] = sv.to(slots.sv.dtype)
    middle = st.num_shadow * C
    if st.num_shadow:
        landmarks = chunk_landmarks(k_rot[:middle], C)  # (n, Hkv, d)
        cache.gpu.write_landmarks(layer, st.gpu_table, 0, landmarks)
        if cache.chunk_scorer is not None:
            cache.chunk_scorer.prefill(layer, st, k_rot[:middle], C)
        cache.host.write(layer, st.host_table, 0, v[:middle])
        if st.num_outliers:
            store_outliers(cache, layer, st, k_rot[:middle], v[:middle], landmarks)
    slots.window_k[st.slot, layer, :st.window_len] = k_rot[middle:]
    slots.window_v[st.slot, layer, :st.window_len] = v[middle:]
    return out


def store_outliers(cache, layer: int, st: SequenceState, k_rot: torch.Tensor, v: torch.Tensor,
                   landmarks: torch.Tensor) -> None:
    """Keep the outlier chunks of the shadow exact in the slot. k_rot, v (n*C, Hkv, d); landmarks (n, Hkv, d)."""
    slots, C = cache.slots, cache.config.chunk_size
    ids = find_outlier_chunks(k_rot, landmarks, C, st.num_outliers)  # (Hkv, O)
    Hkv, O = ids.shape
    tokens = (ids[:, :, None] * C + torch.arange(C, device=ids.device)).view(Hkv, O * C)  # (Hkv, O*C)
    heads = torch.arange(Hkv, device=ids.device)[:, None]
    cache.gpu.mark_outliers(layer, st.gpu_table, ids)
    slots.outlier_k[st.slot, layer, :, :O * C] = k_rot[tokens, heads]  # (Hkv, O*C, d)
    slots.outlier_v[st.slot, layer, :, :O * C] = v[tokens, heads]


def decode_layer(cache, layer: int, st: SequenceState, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
    """One token: append it exactly to the window (and its U row to the shadow), then attend over
    [outliers | selected chunks | window]. q (Hq, d); k_pre, k_rot, v (Hkv, d) -> (Hq, d)."""
    slots, s = cache.slots, st.slot
    cache.gpu.write_u(layer, st.gpu_table, st.seq_len, project_keys(k_pre[None], slots.sv[s, layer]))
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
    return sparse_decode_attention_ref(q, torch.cat(keys, 1), torch.cat(values, 1), cache.scale)


def select_and_load(cache, layer: int, st: SequenceState, q: torch.Tensor, k: int) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """Score the shadow's chunks, pick k per KV head, bring the misses into their slots.
    -> keys, values (Hkv, k*C, d) of the selected chunks, in slot order."""
    slots, s, C = cache.slots, st.slot, cache.config.chunk_size
    landmarks = cache.gpu.read_landmarks(layer, st.gpu_table, st.num_shadow)  # (n, Hkv, d)
    Hkv = landmarks.shape[1]
    excluded = cache.gpu.read_outliers(layer, st.gpu_table, st.num_shadow)  # (Hkv, n)
    if cache.chunk_scorer is None:
        scores = landmark_scores(q, landmarks, excluded, cache.scale)  # (Hkv, n)
    else:
        scores = cache.chunk_scorer.scores(layer, st, q, excluded, cache.scale)
    selected = select_chunks(scores, k)  # (Hkv, k)
    resident, miss = assign_slots(slots.resident[s, layer], selected)  # (Hkv, K) each
    slots.resident[s, layer] = resident
    load_misses(cache, layer, st, resident, miss)
    used = (resident >= 0).repeat_interleave(C, dim=1)  # (Hkv, K*C): tokens of occupied slots
    d = slots.sparse_k.shape[-1]
    step = cache.step
    step.selected += Hkv * k
    step.hits += Hkv * k - int(miss.sum())
    return slots.sparse_k[s, layer][used].view(Hkv, k * C, d), slots.sparse_v[s, layer][used].view(Hkv, k * C, d)


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
    positions = chunks[:, None] * C + torch.arange(C, device=chunks.device)  # (M, C)
    u_rows = cache.gpu.read_u(layer, st.gpu_table, positions)  # (M, C, r)
    sv = slots.sv[s, layer][heads]  # (M, r, d)
    keys = rebuild_keys(u_rows, sv, positions, cache.rotary, rope_lens(cache, st, positions))  # (M, C, d)
    values = cache.host.gather(layer, st.host_table, chunks, heads, C)  # (M, C, d) on the host
    Hkv, K = miss.shape
    d = keys.shape[-1]
    slots.sparse_k[s, layer].view(Hkv, K, C, d)[heads, slot_ids] = keys.to(slots.sparse_k.dtype)
    slots.sparse_v[s, layer].view(Hkv, K, C, d)[heads, slot_ids] = values.to(slots.sparse_v.device)
    pages = st.host_table[(chunks * C // cache.host.page_tokens).cpu()]
    from_device = int((pages >= cache.host.num_pages).sum())
    cache.step.fetched += chunks.shape[0]
    cache.step.from_device += from_device
    cache.step.bytes_fetched += (chunks.shape[0] - from_device) * cache.host.fetch_bytes()
