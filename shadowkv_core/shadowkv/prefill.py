"""Prefill of one layer of one sequence kept in shadows: exact causal attention over its prompt, then the layer's
shadow (the key factorisation, landmarks, outliers, values offloaded, the window). Both decode paths read what it
writes; it runs the reference functions of reference.py. A prompt whose first pages were adopted from the prefix
cache prefills only the tokens after them: its queries attend over the prefix too (prompt_keys_values), and its
tokens join the adopted shadow (append_suffix). The engine's sliced prefill runs the same parts: prompt_keys_values
in ShadowKVCache.prefill_begin, build_shadow in prefill_end.
"""
from __future__ import annotations

import torch

from kernels.fetch_values import fetch_values
from shadowkv_core.attention import prefill_attention_ref
from shadowkv_core.shadowkv.decode import rope_lens
from shadowkv_core.shadowkv.manager import SequenceState
from shadowkv_core.shadowkv.reference import chunk_landmarks, factorize_keys, find_outlier_chunks, project_keys


def prefill_layer(cache, layer: int, st: SequenceState, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    """Exact causal attention over the whole prompt (after its adopted prefix, if any), then the layer's shadow.
    q (S, Hq, d); k_pre, k_rot, v (S, Hkv, d) of the tokens after the prefix -> (S, Hq, d)."""
    keys, values = prompt_keys_values(cache, layer, st, k_rot, v)
    out = prefill_attention_ref(q, keys, values, cache.spec.scale, cache.spec.prefill_chunk_tokens,
                                cache.spec.prefill_attention)
    build_shadow(cache, layer, st, q, k_pre, k_rot, v)
    return out


def prompt_keys_values(cache, layer: int, st: SequenceState, k_rot: torch.Tensor,
                       v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (st.cached + S, Hkv, d) the prompt's S queries attend over: after an adopted prefix, the
    adopted basis and outliers go into the slot (adopt_prefix) and the prefix's keys and values come first."""
    if not st.cached:
        return k_rot, v
    keys, values = adopt_prefix(cache, layer, st)
    return torch.cat([keys.to(k_rot.dtype), k_rot]), torch.cat([values.to(v.dtype), v])


def build_shadow(cache, layer: int, st: SequenceState, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                 v: torch.Tensor) -> None:
    """The layer's shadow of the prompt, once its attention has run (prefill_layer, or the engine's sliced
    prefill): of the whole prompt, or after an adopted prefix the tokens after it appended (append_suffix). Shapes as
    in prefill_layer."""
    if st.cached:
        append_suffix(cache, layer, st, k_pre, k_rot, v)
        return
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


def adopt_prefix(cache, layer: int, st: SequenceState) -> tuple[torch.Tensor, torch.Tensor]:
    """The adopted basis and outliers of the sequence's prefix (st.cached tokens, whole pages) into the slot; -> the
    prefix's keys and values (prefix_keys_values)."""
    slots, C, P, record = cache.slots, cache.config.chunk_size, st.cached, st.adopted
    slots.sv[st.slot, layer] = record.sv[layer].to(slots.sv.device, slots.sv.dtype)  # (Hkv, r, d)
    slots.resident[st.slot, layer] = -1
    flags = cache.gpu.read_outliers(layer, st.gpu_table, P // C)  # (Hkv, n): the record's outliers in the prefix
    for h, a in enumerate(flags.sum(1).tolist()):  # per KV head: the first of its outliers, in ascending order
        slots.outlier_k[st.slot, layer, h, :a * C] = record.outlier_k[layer, h, :a * C].to(slots.outlier_k.device)
        slots.outlier_v[st.slot, layer, h, :a * C] = record.outlier_v[layer, h, :a * C].to(slots.outlier_v.device)
    return prefix_keys_values(cache, layer, st, flags)


def append_suffix(cache, layer: int, st: SequenceState, k_pre: torch.Tensor, k_rot: torch.Tensor,
                  v: torch.Tensor) -> None:
    """The prompt's tokens after its adopted prefix into the shadow (after adopt_prefix), as generated tokens fold
    in: U rows projected on the adopted basis, landmarks and values of the chunks before the window (and outliers
    made up to st.num_outliers per head), the rest exact in the window. k_pre, k_rot, v (S, Hkv, d)."""
    slots, C, P = cache.slots, cache.config.chunk_size, st.cached
    adopted = cache.gpu.read_outliers(layer, st.gpu_table, P // C).sum(1).tolist()  # outliers per head in the prefix
    cache.gpu.write_u(layer, st.gpu_table, P, project_keys(k_pre, slots.sv[st.slot, layer]))
    middle = st.num_shadow * C - P  # new tokens that enter the shadow
    if middle:
        landmarks = chunk_landmarks(k_rot[:middle], C)
        cache.gpu.write_landmarks(layer, st.gpu_table, P // C, landmarks)
        cache.host.write(layer, st.value_table, P, v[:middle])
        if min(adopted) < st.num_outliers:
            make_up_outliers(cache, layer, st, k_rot[:middle], v[:middle], landmarks, adopted)
    slots.window_k[st.slot, layer, :st.window_len] = k_rot[middle:]
    slots.window_v[st.slot, layer, :st.window_len] = v[middle:]


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
    if cache.spec.kernels:
        values = fetch_prefix_values(cache, layer, st, Hkv, n)
    else:
        chunks = torch.arange(n).repeat(Hkv)  # (Hkv*n,) every chunk of every head
        values = cache.host.gather(layer, st.value_table, chunks, torch.arange(Hkv).repeat_interleave(n), C,
                                   keys.device).view(Hkv, P, -1)
    values = values.transpose(0, 1)  # (P, Hkv, d)
    # every head's flagged chunks at once: a head's k-th flagged chunk (ascending) is its k-th outlier in the slot
    heads, ids = flags.nonzero(as_tuple=True)  # (M,) each, ascending chunk per head
    order = flags.long().cumsum(-1)[heads, ids] - 1  # (M,) rank of each among its head's outliers
    offs = torch.arange(C, device=ids.device)
    rows, src, heads = ((ids[:, None] * C + offs).flatten(), (order[:, None] * C + offs).flatten(),
                        heads.repeat_interleave(C))
    keys[rows, heads] = slots.outlier_k[st.slot, layer][heads, src].float()
    values[rows, heads] = slots.outlier_v[st.slot, layer][heads, src].to(values.dtype)
    return keys, values


def fetch_prefix_values(cache, layer: int, st: SequenceState, num_kv_heads: int, n: int) -> torch.Tensor:
    """Values (Hkv, n*C, d) of the first n chunks of a sequence, every KV head, read on the device by the decode
    path's fetch kernel: every chunk a miss, straight from the pinned host pages (and the device region's) at PCIe
    speed, with no host gather or staging copy."""
    C, device = cache.config.chunk_size, st.gpu_table.device
    ints = torch.arange(n, dtype=torch.int32, device=device).expand(1, num_kv_heads, n).contiguous()  # (1, Hkv, n)
    num_miss = torch.full((1, num_kv_heads), n, dtype=torch.int32, device=device)
    out = torch.empty(1, num_kv_heads, n * C, cache.host.shape[-1], dtype=cache.host.dtype, device=device)
    region = cache.host.device_region(layer)
    table = st.value_table[None].to(device, torch.int32)
    fetch_values(cache.host.values[layer], table, ints, ints, num_miss, torch.zeros(1, dtype=torch.int32,
                 device=device), out, C, host_scales=cache.host.scales_of(layer),
                 device_region=None if region is None else (*region, torch.zeros(1, dtype=torch.int32, device=device)))
    return out[0]


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
