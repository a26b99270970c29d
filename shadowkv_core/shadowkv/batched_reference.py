"""Batched (ragged, multi-sequence) forms of the reference steps, in the layouts the Triton kernels use: each one
loops over the sequences and calls the per-sequence function of reference.py, which stays the one definition.

Layouts (one layer): B sequences of a decode batch, each in slot slot_ids[b] of N slots; page tables (B, max_pages);
miss lists (B, Hkv, K): entry j < num_miss[b, h] is the j-th missed chunk and the slot it goes to.
"""
from __future__ import annotations

import torch

from shadowkv_core.attention import attention_ref
from shadowkv_core.shadowkv.pages import locate
from shadowkv_core.shadowkv.reference import (assign_slots, dequantize_tokens, dequantize_values, gather_scales,
                                              gather_values, landmark_scores, meet_landmarks, paged_rows,
                                              rebuild_keys, sparse_decode_attention_ref)


def landmark_scores_batched(q: torch.Tensor, landmarks: torch.Tensor, page_table: torch.Tensor,
                            num_chunks: torch.Tensor, outlier_flags: torch.Tensor, n_max: int,
                            scale: float) -> torch.Tensor:
    """q (B, Hq, d), landmarks (P, page_chunks, Hkv, d), outlier_flags (P, page_chunks, Hkv) -> scores
    (B, Hkv, n_max) fp32, -inf past each sequence's chunks."""
    B, Hkv = q.shape[0], landmarks.shape[2]
    scores = torch.full((B, Hkv, n_max), float("-inf"), device=q.device)
    for b in range(B):
        n, table = int(num_chunks[b]), page_table[b].long()
        rows = torch.arange(n, device=q.device)
        lm = paged_rows(landmarks, table, rows)  # (n, Hkv, d)
        excluded = paged_rows(outlier_flags, table, rows).T.bool()  # (Hkv, n)
        scores[b, :, :n] = landmark_scores(q[b], lm, excluded, scale)
    return scores


def assign_slots_batched(resident: torch.Tensor, slot_ids: torch.Tensor, selected: torch.Tensor,
                         num_selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """resident (N, Hkv, K), selected (B, Hkv, k_max) -> new resident, miss_mask (B, Hkv, K), of the B slots."""
    pairs = [assign_slots(resident[int(s)], selected[b, :, :int(num_selected[b])]) for b, s in enumerate(slot_ids)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def miss_lists_batched(new_resident: torch.Tensor, miss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       torch.Tensor]:
    """The miss lists of assign_slots' result: (B, Hkv, K) each -> miss_chunks, miss_slots (B, Hkv, K) int32 (-1
    past the count), num_miss (B, Hkv) int32. The j-th miss, in slot order, is the j-th of `selected` order."""
    B, Hkv, K = miss_mask.shape
    miss_slots = torch.argsort((~miss_mask).to(torch.int8), dim=-1, stable=True)  # missed slots first, in order
    num_miss = miss_mask.sum(-1)
    listed = torch.arange(K, device=miss_mask.device) < num_miss[..., None]
    miss_chunks = torch.where(listed, new_resident.gather(-1, miss_slots), -1)
    return miss_chunks.int(), torch.where(listed, miss_slots, -1).int(), num_miss.int()


def _misses(miss_chunks, miss_slots, num_miss, b, h):
    m = int(num_miss[b, h])
    return miss_chunks[b, h, :m].long(), miss_slots[b, h, :m].long()


def rebuild_keys_batched(key_slots: torch.Tensor, u_pages: torch.Tensor, page_table: torch.Tensor, sv: torch.Tensor,
                         rotary, miss_chunks: torch.Tensor, miss_slots: torch.Tensor, num_miss: torch.Tensor,
                         slot_ids: torch.Tensor, chunk_size: int, landmarks: torch.Tensor | None = None,
                         landmark_kind: str = "bounds", landmark_scales: torch.Tensor | None = None) -> torch.Tensor:
    """key_slots (N, Hkv, K*C, d) -> a copy with every missed slot's keys rebuilt (RoPE(U rows · SV), fp32 math);
    with landmarks (P, page_chunks, Hkv, d or 2d; fp8 with landmark_scales (P, page_chunks, Hkv)), each moved onto
    its chunk's landmark (meet_landmarks)."""
    out = key_slots.clone()
    N, Hkv, KC, d = key_slots.shape
    C = chunk_size
    for b, s in enumerate(slot_ids.tolist()):
        for h in range(Hkv):
            chunks, slots = _misses(miss_chunks, miss_slots, num_miss, b, h)
            positions = chunks[:, None] * C + torch.arange(C, device=chunks.device)  # (M, C)
            u_rows = paged_rows(u_pages, page_table[b].long(), positions)  # (M, C, r)
            keys = rebuild_keys(u_rows, sv[s, h].expand(len(chunks), -1, -1), positions, rotary)  # (M, C, d)
            if landmarks is not None:
                where = locate(page_table[b].long(), chunks, landmarks.shape[1])
                lm = landmarks[where][:, h].float()
                if landmark_scales is not None:
                    lm = lm * landmark_scales[where][:, h, None]
                keys = meet_landmarks(keys, lm, landmark_kind)
            out[s, h].view(KC // C, C, d)[slots] = keys.to(out.dtype)
    return out


def candidate_logits_batched(u_pages: torch.Tensor, page_table: torch.Tensor, sv: torch.Tensor, rotary,
                             candidates: torch.Tensor, count: torch.Tensor, slot_ids: torch.Tensor, q: torch.Tensor,
                             scale: float, chunk_size: int, **landmarks) -> torch.Tensor:
    """candidates (B, Hkv, m), the first count (B, Hkv) of each row rebuilt (rebuild_keys_batched, rounded to q's
    dtype) and scored against q (B, Hq, d) -> (B, Hkv, Hq/Hkv, m) fp32: each candidate's largest logit with each
    query head of its group, -inf past the count."""
    B, Hkv, m = candidates.shape
    N, d, C = sv.shape[0], sv.shape[-1], chunk_size
    order = torch.arange(m, dtype=candidates.dtype, device=candidates.device).expand(B, Hkv, m)
    scratch = torch.zeros(N, Hkv, m * C, d, dtype=q.dtype, device=q.device)
    keys = rebuild_keys_batched(scratch, u_pages, page_table, sv, rotary, candidates, order, count, slot_ids, C,
                                **landmarks)[slot_ids.long()]  # (B, Hkv, m*C, d)
    logits = torch.einsum("bhgd,bhtd->bhgt", q.float().view(B, Hkv, -1, d), keys.float()) * scale
    best = logits.view(B, Hkv, -1, m, C).amax(-1)
    valid = order < count[..., None]  # (B, Hkv, m)
    return best.masked_fill(~valid[:, :, None], float("-inf"))


def gather_values_batched(value_slots: torch.Tensor, host_values: torch.Tensor, host_table: torch.Tensor,
                          miss_chunks: torch.Tensor, miss_slots: torch.Tensor, num_miss: torch.Tensor,
                          slot_ids: torch.Tensor, chunk_size: int,
                          host_scales: torch.Tensor | None = None) -> torch.Tensor:
    """value_slots (N, Hkv, K*C, d), host_values (P, page_tokens, Hkv, d) -> a copy with every missed slot's values;
    with host_scales (P, page_tokens/C, Hkv), host_values are fp8 and dequantised."""
    out = value_slots.clone()
    N, Hkv, KC, d = value_slots.shape
    C = chunk_size
    for b, s in enumerate(slot_ids.tolist()):
        for h in range(Hkv):
            chunks, slots = _misses(miss_chunks.cpu(), miss_slots.cpu(), num_miss.cpu(), b, h)
            heads = torch.full_like(chunks, h)
            table = host_table[b].long().cpu()
            values = gather_values(host_values, table, chunks, heads, C)  # (M, C, d)
            if host_scales is not None:
                values = dequantize_values(values, gather_scales(host_scales, table, chunks, heads), out.dtype)
            out[s, h].view(KC // C, C, d)[slots.to(out.device)] = values.to(out.device)
    return out


def sparse_decode_attention_batched(q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                                    slot_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, Hq, d); segments of (k, v (N, Hkv, T, d), lens (B,)): each sequence attends to the first lens[b] keys
    of each segment of its slot, concatenated ([outliers | selected | local + generated]) -> (B, Hq, d)."""
    out = torch.empty_like(q)
    for b, s in enumerate(slot_ids.tolist()):
        keys = torch.cat([k[s, :, :int(n[b])] for k, _, n in segments], 1)  # (Hkv, n, d)
        values = torch.cat([v[s, :, :int(n[b])] for _, v, n in segments], 1)
        out[b] = sparse_decode_attention_ref(q[b], keys, values, scale)
    return out


def dense_decode_attention_batched(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                   block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                                   scale: float, scales: tuple[torch.Tensor, torch.Tensor] | None = None
                                   ) -> torch.Tensor:
    """q (B, Hq, d), pools (rows, Hkv, d) addressed through block_table (B, max_blocks) -> (B, Hq, d): each query
    over its sequence's first context_lens[b] keys (the dense cache's decode). scales: (rows, Hkv) each of fp8
    pools, which are read dequantised to q's dtype."""
    if scales is not None:
        k_pool, v_pool = dequantize_tokens(k_pool, scales[0], q.dtype), dequantize_tokens(v_pool, scales[1], q.dtype)
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        rows = paged_rows(torch.arange(k_pool.shape[0], device=q.device).view(-1, block_size),
                          block_table[b].long(), torch.arange(n, device=q.device))  # (n,)
        out[b] = attention_ref(q[b][None], k_pool[rows], v_pool[rows], scale, causal=False)[0]
    return out
