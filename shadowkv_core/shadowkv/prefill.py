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
from kernels.rebuild_keys import rebuild_keys
from shadowkv_core.attention import prefill_attention_ref
from shadowkv_core.shadowkv.decode import rebuild_landmarks, rope_lens
from shadowkv_core.shadowkv.manager import Factors, SequenceState
from shadowkv_core.shadowkv.reference import (chunk_landmarks, factorize_keys, find_outlier_chunks, meet_landmarks,
                                              project_keys)
from shadowkv_core.transfers import to_device


def prefill_layer(cache, layer: int, st: SequenceState, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    """Exact causal attention over the whole prompt (after its adopted prefix, if any), then the layer's shadow.
    q (S, Hq, d); k_pre, k_rot, v (S, Hkv, d) of the tokens after the prefix -> (S, Hq, d)."""
    if not st.cached:
        st.factors = start_factorization(cache, layer, k_pre)
    keys, values = prompt_keys_values(cache, layer, st, k_rot, v)
    out = prefill_attention_ref(q, keys, values, cache.spec.scale, cache.spec.prefill_chunk_tokens,
                                cache.spec.prefill_attention)
    build_shadow(cache, layer, st, q, k_pre, k_rot, v)
    return out


def start_factorization(cache, layer: int, k_pre: torch.Tensor) -> Factors:
    """factorize_keys(k_pre, the layer's rank) begun: on CUDA on the cache's build stream, after the work queued so
    far on the current stream (which wrote k_pre), so that it runs beside the layer's attention slices queued next;
    elsewhere at once. take_factors ends it."""
    rank = cache.config.layer_rank(layer)
    if cache.build_stream is None:
        return Factors(*factorize_keys(k_pre, rank))
    cache.build_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cache.build_stream):
        factors = Factors(*factorize_keys(k_pre, rank), torch.cuda.Event())
        factors.done.record()
    k_pre.record_stream(cache.build_stream)  # read there: its memory is not reused before that stream is past it
    return factors


def take_factors(st: SequenceState) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's factorisation under way (start_factorization), handed over: on CUDA the current stream waits
    for it, and the tensors it made on the build stream are not reused there before this stream is past them."""
    factors, st.factors = st.factors, None
    if factors.done is not None:
        current = torch.cuda.current_stream()
        current.wait_event(factors.done)
        for t in (factors.u, factors.sv):
            t.record_stream(current)
    return factors.u, factors.sv


def prompt_keys_values(cache, layer: int, st: SequenceState, k_rot: torch.Tensor, v: torch.Tensor,
                       shared: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (st.cached + S, Hkv, d) the prompt's S queries attend over: after an adopted prefix, the
    adopted basis and outliers go into the slot (adopt_prefix) and the prefix's keys and values come first.
    shared: the prefixes already rebuilt for this forward's other prompts, by record and length, which readers of
    one cached document reuse instead of rebuilding its keys and reading its values again."""
    if not st.cached:
        return k_rot, v
    P, S = st.cached, k_rot.shape[0]
    keys, values = k_rot.new_empty((P + S, *k_rot.shape[1:])), v.new_empty((P + S, *v.shape[1:]))
    # RoPE that depends on the sequence's length rotates each reader's prefix its own way
    key = None if shared is None or getattr(cache.rotary, "uses_seq_lens", False) else (id(st.adopted), P)
    if key is not None and key in shared:
        adopt_slot(cache, layer, st)
        keys[:P], values[:P] = shared[key]
    else:
        adopt_prefix(cache, layer, st, keys[:P], values[:P])
        if key is not None:
            shared[key] = keys[:P], values[:P]
    keys[P:], values[P:] = k_rot, v
    return keys, values


def build_shadow(cache, layer: int, st: SequenceState, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                 v: torch.Tensor) -> None:
    """The layer's shadow of the prompt, once its attention has run (prefill_layer, or the engine's sliced
    prefill): of the whole prompt, its key factorisation the one begun with its attention (st.factors; begun here
    if none was), or after an adopted prefix the tokens after it appended (append_suffix). Shapes as in
    prefill_layer."""
    if st.cached:
        append_suffix(cache, layer, st, k_pre, k_rot, v)
        return
    slots, C = cache.slots, cache.config.chunk_size
    if st.factors is None:
        st.factors = start_factorization(cache, layer, k_pre)
    u, sv = take_factors(st)  # (P, r), (Hkv, r, d)
    cache.gpu.write_u(layer, st.gpu_table, 0, u)
    slots.sv[layer][st.slot] = sv.to(slots.sv[layer].dtype)
    slots.resident[st.slot, layer] = -1  # the slot's sparse buffer holds nothing of this sequence yet
    middle = st.num_shadow * C
    if cache.chunk_scorer is not None:  # even with no shadow chunks yet: the window's folds extend what it keeps
        cache.chunk_scorer.prefill(layer, st, q, k_rot, C, cache.spec.scale)
    if st.num_shadow:
        cache.gpu.write_landmarks(layer, st.gpu_table, 0,
                                  chunk_landmarks(k_rot[:middle], C, cache.config.landmark_kind))  # (n, Hkv, d or 2d)
        cache.host.write(layer, st.value_table, 0, v[:middle])
        if st.num_outliers:
            store_outliers(cache, layer, st, k_rot[:middle], v[:middle])
    slots.window_k[st.slot, layer, :st.window_len] = k_rot[middle:]
    slots.window_v[st.slot, layer, :st.window_len] = v[middle:]


def store_outliers(cache, layer: int, st: SequenceState, k_rot: torch.Tensor, v: torch.Tensor) -> None:
    """Keep the outlier chunks of the shadow exact in the slot. k_rot, v (n*C, Hkv, d)."""
    slots, C = cache.slots, cache.config.chunk_size
    ids = find_outlier_chunks(k_rot, C, st.num_outliers)  # (Hkv, O)
    Hkv, O = ids.shape
    tokens = (ids[:, :, None] * C + torch.arange(C, device=ids.device)).view(Hkv, O * C)  # (Hkv, O*C)
    heads = torch.arange(Hkv, device=ids.device)[:, None]
    cache.gpu.mark_outliers(layer, st.gpu_table, ids)
    slots.outlier_k[st.slot, layer, :, :O * C] = k_rot[tokens, heads]  # (Hkv, O*C, d)
    slots.outlier_v[st.slot, layer, :, :O * C] = v[tokens, heads]


def adopt_prefix(cache, layer: int, st: SequenceState, keys: torch.Tensor, values: torch.Tensor) -> None:
    """The adopted basis and outliers of the sequence's prefix (st.cached tokens, whole pages) into the slot; the
    prefix's keys and values into keys, values (P, Hkv, d) (prefix_keys_values). From the record's pinned host
    tensors on CUDA: nothing here waits for the device."""
    adopt_slot(cache, layer, st)
    prefix_keys_values(cache, layer, st, keys, values)


def adopt_slot(cache, layer: int, st: SequenceState) -> None:
    """The adopted basis and outliers of the sequence's prefix into its slot."""
    slots, record = cache.slots, st.adopted
    slots.sv[layer][st.slot].copy_(record.sv[layer], non_blocking=True)  # (Hkv, r, d)
    slots.resident[st.slot, layer] = -1
    # all the record's outlier rows, one contiguous copy: past a head's adopted ones append_suffix makes them up
    # (or, past st.num_outliers, nothing reads them)
    rows = record.outlier_k.shape[2]
    slots.outlier_k[st.slot, layer, :, :rows].copy_(record.outlier_k[layer], non_blocking=True)
    slots.outlier_v[st.slot, layer, :, :rows].copy_(record.outlier_v[layer], non_blocking=True)


def adopted_outliers(cache, layer: int, st: SequenceState) -> list[int]:
    """Outlier chunks of each KV head of the layer in the sequence's adopted prefix: the record's counts, on the
    host (the device's flags hold the same)."""
    return st.adopted.outliers_of(st.cached // cache.gpu.page_tokens)[layer].tolist()


def append_suffix(cache, layer: int, st: SequenceState, k_pre: torch.Tensor, k_rot: torch.Tensor,
                  v: torch.Tensor) -> None:
    """The prompt's tokens after its adopted prefix into the shadow (after adopt_prefix), as generated tokens fold
    in: U rows projected on the adopted basis, landmarks and values of the chunks before the window (and outliers
    made up to st.num_outliers per head), the rest exact in the window. k_pre, k_rot, v (S, Hkv, d)."""
    slots, C, P = cache.slots, cache.config.chunk_size, st.cached
    cache.gpu.write_u(layer, st.gpu_table, P, project_keys(k_pre, slots.sv[layer][st.slot]))
    middle = st.num_shadow * C - P  # new tokens that enter the shadow
    if middle:
        cache.gpu.write_landmarks(layer, st.gpu_table, P // C, chunk_landmarks(k_rot[:middle], C,
                                                                                cache.config.landmark_kind))
        cache.host.write(layer, st.value_table, P, v[:middle])
        adopted = adopted_outliers(cache, layer, st)
        if min(adopted) < st.num_outliers:
            make_up_outliers(cache, layer, st, k_rot[:middle], v[:middle], adopted)
    slots.window_k[st.slot, layer, :st.window_len] = k_rot[middle:]
    slots.window_v[st.slot, layer, :st.window_len] = v[middle:]


def prefix_keys_values(cache, layer: int, st: SequenceState, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Keys and values (P, Hkv, d) of a sequence's adopted prefix, for attention, into keys and values: keys rebuilt
    from U rows and the slot's SV with RoPE at their true positions (as decode rebuilds a missed chunk; fp32 math,
    rounded once into keys), values read from the value store; the outlier chunks exact, from the slot. With
    kernels, both by the decode path's kernels, every chunk a miss."""
    slots, C, P = cache.slots, cache.config.chunk_size, st.cached
    device = st.gpu_table.device
    Hkv, n = slots.sv[layer].shape[1], P // C
    if cache.spec.kernels:
        rebuild_prefix_keys(cache, layer, st, n, keys)
        fetch_prefix_values(cache, layer, st, Hkv, n, values)
    else:
        positions = torch.arange(P, device=device)
        u = cache.gpu.read_u(layer, st.gpu_table, positions)  # (P, r)
        k_pre = torch.einsum("pr,hrd->phd", u.float(), slots.sv[layer][st.slot].float())  # (P, Hkv, d)
        d = k_pre.shape[2]
        k_rot = cache.rotary.apply(k_pre, positions, rope_lens(cache, st, positions)).float()
        if cache.config.landmark_rebuild:  # as decode moves a rebuilt chunk
            landmarks = cache.gpu.read_landmarks(layer, st.gpu_table, n).reshape(n * Hkv, -1)
            chunks = k_rot.view(n, C, Hkv, d).transpose(1, 2).reshape(n * Hkv, C, d)
            k_rot = meet_landmarks(chunks, landmarks, cache.config.landmark_kind).view(n, Hkv, C, d).transpose(1, 2)
        keys.copy_(k_rot.reshape(P, Hkv, d))
        chunks = torch.arange(n).repeat(Hkv)  # (Hkv*n,) every chunk of every head
        values.copy_(cache.host.gather(layer, st.value_table, chunks, torch.arange(Hkv).repeat_interleave(n), C,
                                       device).view(Hkv, P, -1).transpose(0, 1))
    # a head's k-th flagged chunk (ascending) is its k-th outlier in the slot; the counts come from the host, so no
    # shape here depends on the device's flags
    pairs = [(h, k) for h, a in enumerate(adopted_outliers(cache, layer, st)) for k in range(a)]
    if not pairs:
        return
    heads, order = to_device(pairs, torch.int64, device).T  # (M,) each
    flags = cache.gpu.read_outliers(layer, st.gpu_table, n)  # (Hkv, n)
    flagged_first = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True)  # (Hkv, n), ascending within each
    ids = flagged_first[heads, order]  # (M,)
    offs = torch.arange(C, device=device)
    rows, src, heads = ((ids[:, None] * C + offs).flatten(), (order[:, None] * C + offs).flatten(),
                        heads.repeat_interleave(C))
    keys[rows, heads] = slots.outlier_k[st.slot, layer][heads, src]
    values[rows, heads] = slots.outlier_v[st.slot, layer][heads, src]


def every_chunk(num_kv_heads: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Miss lists (1, Hkv, n) int32 naming every one of n chunks into the slot of its own index, and their counts
    (1, Hkv): the decode kernels' arguments for a whole prefix, read in order."""
    ints = torch.arange(n, dtype=torch.int32, device=device).expand(1, num_kv_heads, n).contiguous()
    return ints, torch.full((1, num_kv_heads), n, dtype=torch.int32, device=device)


def rebuild_prefix_keys(cache, layer: int, st: SequenceState, n: int, out: torch.Tensor) -> None:
    """Keys of the first n chunks of a sequence into out (n*C, Hkv, d), rebuilt by the decode path's fused kernel (U
    rows times the slot's SV, RoPE at their true positions, onto their landmarks where configured): every prefix
    position rotated with one set of frequencies, the reader's (rope_lens). The kernel writes out's rows in place,
    through a (1, Hkv, n*C, d) view: no copy between layouts."""
    C, device = cache.config.chunk_size, st.gpu_table.device
    sv = cache.slots.sv[layer][st.slot:st.slot + 1]  # (1, Hkv, r, d): the output's one slot
    Hkv, d = sv.shape[1], sv.shape[3]
    ints, num_miss = every_chunk(Hkv, n, device)
    first = torch.zeros(1, dtype=torch.int64, device=device)
    inv_freq = cache.rotary.frequencies(first, rope_lens(cache, st, first)).float().reshape(1, -1)
    rebuild_keys(cache.gpu.u[layer], st.gpu_table[None].to(torch.int32), sv, inv_freq, cache.rotary.attention_factor,
                 cache.rotary.interleaved, ints, ints, num_miss, torch.zeros(1, dtype=torch.int32, device=device),
                 out.transpose(0, 1)[None], C, **rebuild_landmarks(cache, layer))


def fetch_prefix_values(cache, layer: int, st: SequenceState, num_kv_heads: int, n: int, out: torch.Tensor) -> None:
    """Values of the first n chunks of a sequence, every KV head, into out (n*C, Hkv, d), read on the device by the
    decode path's fetch kernel: every chunk a miss, straight from the pinned host pages (and the device region's) at
    PCIe speed, with no host gather or staging copy, written in place as rebuild_prefix_keys writes keys."""
    C, device = cache.config.chunk_size, st.gpu_table.device
    ints, num_miss = every_chunk(num_kv_heads, n, device)
    region = cache.host.device_region(layer)
    table = to_device(st.value_table[None], torch.int32, device)
    fetch_values(cache.host.values[layer], table, ints, ints, num_miss, torch.zeros(1, dtype=torch.int32,
                 device=device), out.transpose(0, 1)[None], C, host_scales=cache.host.scales_of(layer),
                 device_region=None if region is None else (*region, torch.zeros(1, dtype=torch.int32, device=device)))


def make_up_outliers(cache, layer: int, st: SequenceState, k_rot: torch.Tensor, v: torch.Tensor,
                     adopted: list[int]) -> None:
    """A KV head that adopted fewer than st.num_outliers outliers keeps as many more exact: the new shadow chunks
    their means approximate worst (the slot keeps one count for all heads). k_rot, v (m*C, Hkv, d) of the new shadow
    chunks; adopted: outliers per head in the prefix."""
    slots, C, O, first = cache.slots, cache.config.chunk_size, st.num_outliers, st.cached // cache.config.chunk_size
    worst = find_outlier_chunks(k_rot, C, O - min(adopted))  # (Hkv, D), ascending
    # (head, its j-th made-up chunk, the slot's chunk it goes to) of every head's first O - a worst chunks
    made_up = [(h, j, a + j) for h, a in enumerate(adopted) for j in range(O - a)]
    heads, j, dst = to_device(made_up, torch.int64, k_rot.device).T  # (M,) each
    mine = worst[heads, j]  # (M,)
    offs = torch.arange(C, device=k_rot.device)
    rows, dst, heads = mine[:, None] * C + offs, dst[:, None] * C + offs, heads[:, None]  # (M, C), (M, C), (M, 1)
    slots.outlier_k[st.slot, layer][heads, dst] = k_rot[rows, heads]
    slots.outlier_v[st.slot, layer][heads, dst] = v[rows, heads]
    cache.gpu.mark_outliers(layer, st.gpu_table, mine + first, heads[:, 0])
