"""Prefill of one layer of one sequence kept in shadows: exact causal attention over its prompt, then the layer's
shadow (the key factorisation, landmarks, outliers, values offloaded, the window). Both decode paths read what it
writes; it runs the reference functions of reference.py. A prompt whose first pages were adopted from the prefix
cache prefills only the tokens after them (prefill_suffix_layer).
"""
from __future__ import annotations

import torch

from shadowkv_core.attention import prefill_attention_ref
from shadowkv_core.shadowkv.decode import rope_lens
from shadowkv_core.shadowkv.manager import SequenceState
from shadowkv_core.shadowkv.reference import chunk_landmarks, factorize_keys, find_outlier_chunks, project_keys


def prefill_layer(cache, layer: int, st: SequenceState, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    """Exact causal attention over the whole prompt, then the layer's shadow. q (P, Hq, d); k_pre, k_rot, v
    (P, Hkv, d) -> (P, Hq, d)."""
    out = prefill_attention_ref(q, k_rot, v, cache.spec.scale, cache.spec.prefill_chunk_tokens,
                                cache.spec.prefill_attention)
    slots, C = cache.slots, cache.config.chunk_size
    u, sv = factorize_keys(k_pre, cache.config.rank)  # (P, r), (Hkv, r, d)
    cache.gpu.write_u(layer, st.gpu_table, 0, u)
    slots.sv[st.slot, layer] = sv.to(slots.sv.dtype)
    slots.resident[st.slot, layer] = -1  # the slot's sparse buffer holds nothing of this sequence yet
    middle = st.num_shadow * C
    if cache.chunk_scorer is not None:  # even with no shadow chunks yet: the window's folds extend what it keeps
        cache.chunk_scorer.prefill(layer, st, q, k_rot, C, cache.spec.scale)
    if st.num_shadow:
        landmarks = chunk_landmarks(k_rot[:middle], C)  # (n, Hkv, d)
        cache.gpu.write_landmarks(layer, st.gpu_table, 0, landmarks)
        cache.host.write(layer, st.value_table, 0, v[:middle])
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


def prefill_suffix_layer(cache, layer: int, st: SequenceState, q: torch.Tensor, k_pre: torch.Tensor,
                         k_rot: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The prompt's tokens after its adopted prefix (st.cached tokens, whole pages): the adopted basis and outliers
    into the slot, exact causal attention over the whole prompt (the prefix's keys rebuilt, its values read from the
    value store), then the new tokens into the shadow as generated tokens fold in: U rows projected on the basis,
    landmarks and values of the chunks before the window, the rest exact in the window. q (S, Hq, d); k_pre, k_rot,
    v (S, Hkv, d) -> (S, Hq, d)."""
    slots, C, P, record = cache.slots, cache.config.chunk_size, st.cached, st.adopted
    sv = record.sv[layer].to(slots.sv.device, slots.sv.dtype)  # (Hkv, r, d)
    slots.sv[st.slot, layer] = sv
    slots.resident[st.slot, layer] = -1
    flags = cache.gpu.read_outliers(layer, st.gpu_table, P // C)  # (Hkv, n): the record's outliers in the prefix
    adopted = flags.sum(1).tolist()  # per KV head: the first of its outliers, which are in ascending order
    for h, a in enumerate(adopted):
        slots.outlier_k[st.slot, layer, h, :a * C] = record.outlier_k[layer, h, :a * C].to(slots.outlier_k.device)
        slots.outlier_v[st.slot, layer, h, :a * C] = record.outlier_v[layer, h, :a * C].to(slots.outlier_v.device)
    keys, values = prefix_keys_values(cache, layer, st, flags)
    out = prefill_attention_ref(q, torch.cat([keys.to(k_rot.dtype), k_rot]), torch.cat([values.to(v.dtype), v]),
                                cache.spec.scale, cache.spec.prefill_chunk_tokens, cache.spec.prefill_attention)
    cache.gpu.write_u(layer, st.gpu_table, P, project_keys(k_pre, sv))
    middle = st.num_shadow * C - P  # new tokens that enter the shadow
    if middle:
        landmarks = chunk_landmarks(k_rot[:middle], C)
        cache.gpu.write_landmarks(layer, st.gpu_table, P // C, landmarks)
        cache.host.write(layer, st.value_table, P, v[:middle])
        if min(adopted) < st.num_outliers:
            make_up_outliers(cache, layer, st, k_rot[:middle], v[:middle], landmarks, adopted)
    slots.window_k[st.slot, layer, :st.window_len] = k_rot[middle:]
    slots.window_v[st.slot, layer, :st.window_len] = v[middle:]
    return out


def prefix_keys_values(cache, layer: int, st: SequenceState, flags: torch.Tensor) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
    """Keys and values (P, Hkv, d) of a sequence's adopted prefix, for attention: keys rebuilt from U rows and the
    slot's SV with RoPE at their true positions (as decode rebuilds a missed chunk), values read from the value
    store; the outlier chunks (flags (Hkv, P/C)) exact, from the slot."""
    slots, C, P = cache.slots, cache.config.chunk_size, st.cached
    positions = torch.arange(P, device=st.gpu_table.device)
    u = cache.gpu.read_u(layer, st.gpu_table, positions)  # (P, r)
    k_pre = torch.einsum("pr,hrd->phd", u.float(), slots.sv[st.slot, layer].float())  # (P, Hkv, d)
    keys = cache.rotary.apply(k_pre, positions, rope_lens(cache, st, positions)).float()
    Hkv, n = k_pre.shape[1], P // C
    chunks = torch.arange(n).repeat(Hkv)  # (Hkv*n,) every chunk of every head
    values = cache.host.gather(layer, st.value_table, chunks, torch.arange(Hkv).repeat_interleave(n), C)
    values = values.view(Hkv, P, -1).transpose(0, 1).to(keys.device)  # (P, Hkv, d)
    for h in range(Hkv):
        ids = flags[h].nonzero()[:, 0]
        rows = (ids[:, None] * C + torch.arange(C, device=ids.device)).flatten()
        keys[rows, h] = slots.outlier_k[st.slot, layer, h, :rows.numel()].float()
        values[rows, h] = slots.outlier_v[st.slot, layer, h, :rows.numel()].to(values.dtype)
    return keys, values


def make_up_outliers(cache, layer: int, st: SequenceState, k_rot: torch.Tensor, v: torch.Tensor,
                     landmarks: torch.Tensor, adopted: list[int]) -> None:
    """A KV head that adopted fewer than st.num_outliers outliers keeps as many more exact: the new shadow chunks
    its landmarks approximate worst (the slot keeps one count for all heads). k_rot, v (m*C, Hkv, d) and landmarks
    (m, Hkv, d) of the new shadow chunks; adopted: outliers per head in the prefix."""
    slots, C, O, first = cache.slots, cache.config.chunk_size, st.num_outliers, st.cached // cache.config.chunk_size
    worst = find_outlier_chunks(k_rot, landmarks, C, O - min(adopted))  # (Hkv, D), ascending
    ids, heads = [], []
    for h, a in enumerate(adopted):
        mine = worst[h, :O - a]
        rows = (mine[:, None] * C + torch.arange(C, device=mine.device)).flatten()
        slots.outlier_k[st.slot, layer, h, a * C:O * C] = k_rot[rows, h]
        slots.outlier_v[st.slot, layer, h, a * C:O * C] = v[rows, h]
        ids.append(mine + first)
        heads.append(torch.full_like(mine, h))
    cache.gpu.mark_outliers(layer, st.gpu_table, torch.cat(ids), torch.cat(heads))
