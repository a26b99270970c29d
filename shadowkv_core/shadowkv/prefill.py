"""Prefill of one layer of one sequence kept in shadows: exact causal attention over its prompt, then the layer's
shadow (the key factorisation, landmarks, outliers, values offloaded, the window). Both decode paths read what it
writes; it runs the reference functions of reference.py.
"""
from __future__ import annotations

import torch

from shadowkv_core.attention import prefill_attention_ref
from shadowkv_core.shadowkv.manager import SequenceState
from shadowkv_core.shadowkv.reference import chunk_landmarks, factorize_keys, find_outlier_chunks


def prefill_layer(cache, layer: int, st: SequenceState, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    """Exact causal attention over the whole prompt, then the layer's shadow. q (P, Hq, d); k_pre, k_rot, v
    (P, Hkv, d) -> (P, Hq, d)."""
    out = prefill_attention_ref(q, k_rot, v, cache.spec.scale, cache.spec.prefill_chunk_tokens,
                                cache.spec.prefill_attention)
    build_shadow(cache, layer, st, q, k_pre, k_rot, v)
    return out


def build_shadow(cache, layer: int, st: SequenceState, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                 v: torch.Tensor) -> None:
    """The layer's shadow of the whole prompt, once its attention has run (prefill_layer, or the engine's sliced
    prefill). Shapes as in prefill_layer."""
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
