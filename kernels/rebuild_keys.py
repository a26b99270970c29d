"""Key rebuild, fused: the missed chunks' U rows (paged), times SV of their KV head, RoPE at their true positions
(fp32 math, the model's rope scaling through its inv_freq and attention factor), written into the key slots.
Misses only. Reference: shadowkv_core.shadowkv.batched_reference.rebuild_keys_batched.

Shapes (B sequences, N slots, Hkv KV heads, K slots per head, C chunk_size, d head_dim, r rank, P GPU pages):
  u_pages      (P, PAGE_TOKENS, r)          one layer of the GPU pages' U rows, contiguous
  page_table   (B, max_pages) int32         GPU page of each logical page of each sequence
  sv           (N, Hkv, r, d)               one layer of the slots' key bases (stride over N free, rest contiguous)
  inv_freq     (B, ROTARY_DIM/2) fp32       each sequence's RoPE frequencies (stride over B may be 0: shared)
  miss_chunks, miss_slots (B, Hkv, K) int32 from assign_slots; entries j < num_miss (B, Hkv) int32 count
  slot_ids     (B,) int32
  key_slots    (N, Hkv, K*C, d) out         one layer of the slots' sparse keys (channels contiguous, other strides
                                           free: a prefix read writes (P, Hkv, d) rows through a transposed view)
  landmarks    (P, PAGE_TOKENS/C, Hkv, d or 2d)  optional (ShadowKVConfig.landmark_rebuild): one layer's landmarks; each
               rebuilt chunk then meets its landmark (mean: shifted so that its mean is the landmark; bounds: each
               key clamped into them), reference.meet_landmarks; landmark_scales (P, PAGE_TOKENS/C, Hkv) fp32 for
               fp8 landmarks
RoPE rotates channel pairs (kernels.rope.rope_pairs): the product is split into the pairs' two halves (two dots) so
the rotation needs no shuffle.
One program per (sequence, KV head, MISS_BLOCK misses): SV is read once per MISS_BLOCK * C rows (from L2, mostly).

candidate_logits runs the same kernel on candidate chunks (ShadowKVConfig.rescore; SCORE) and stores no key: each
program scores its rows against the KV head's group of query heads, q (B, Hq, d), and writes each candidate's
largest logit per query head, (B, Hkv, Hq/Hkv, m) fp32.
"""
import torch
import triton
import triton.language as tl

from kernels.rope import reduce_angle, rope_pairs


# what a rebuilt chunk is moved onto; globals a kernel reads must be constexpr objects
NO_LANDMARKS, MEAN, BOUNDS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _meet_landmark(x, centre, half, KIND: tl.constexpr, MISS_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                   WIDTH: tl.constexpr):
    """x (MISS_BLOCK*CHUNK, WIDTH) rebuilt rows, chunk by chunk; centre, half the same rows' landmark halves. Bounds
    clamp each row alone; a mean shifts each chunk by its rows' mean (a reduction over the chunk's rows)."""
    if KIND == MEAN:
        mid = tl.sum(tl.reshape(x, (MISS_BLOCK, CHUNK, WIDTH)), axis=1) / CHUNK
        mid = tl.reshape(tl.broadcast_to(mid[:, None, :], (MISS_BLOCK, CHUNK, WIDTH)), (MISS_BLOCK * CHUNK, WIDTH))
        y = x - mid + centre
    else:
        y = tl.minimum(tl.maximum(x, centre - half), centre + half)
    return y


@triton.jit
def _rebuild_keys_kernel(u_ptr, table_ptr, sv_ptr, inv_freq_ptr, chunks_ptr, miss_slots_ptr, count_ptr, slot_ptr,
                         q_ptr, out_ptr, lm_ptr, lm_scale_ptr, attention_factor, scale,
                         stride_up, stride_ut, stride_tb, stride_svn, stride_svh, stride_ib, stride_mb, stride_mh,
                         stride_nb, stride_qb, stride_qh, stride_o0, stride_o1, stride_o2, stride_lp, stride_lc,
                         stride_lh, stride_sp, stride_sc,
                         CHUNK: tl.constexpr, PAGE_TOKENS: tl.constexpr, RANK: tl.constexpr, HEAD_DIM: tl.constexpr,
                         ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, MISS_BLOCK: tl.constexpr,
                         BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr, LANDMARKS: tl.constexpr,
                         LM_SCALED: tl.constexpr, SCORE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr):
    """SCORE: out (B, Hkv, GROUP, m) the chunks' largest logits with q; else out the key slots, at miss_slots."""
    pid, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(count_ptr + b * stride_nb + h)
    if pid * MISS_BLOCK >= count:
        return
    ROWS: tl.constexpr = MISS_BLOCK * CHUNK
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_m = tl.arange(0, ROWS)
    miss = pid * MISS_BLOCK + offs_m // CHUNK
    m_mask = miss < count
    chunk = tl.load(chunks_ptr + b * stride_mb + h * stride_mh + miss, mask=m_mask, other=0)
    token = chunk * CHUNK + offs_m % CHUNK  # (ROWS,) true positions
    page = tl.load(table_ptr + b * stride_tb + token // PAGE_TOKENS, mask=m_mask, other=0).to(tl.int64)
    u_rows = page * stride_up + (token % PAGE_TOKENS) * stride_ut
    first, second, is_rot = rope_pairs(HEAD_DIM, ROTARY_DIM, INTERLEAVED)
    offs_j = tl.arange(0, HALF)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    sv_base = sv_ptr + slot * stride_svn + h * stride_svh
    acc1 = tl.zeros([ROWS, HALF], dtype=tl.float32)
    acc2 = tl.zeros([ROWS, HALF], dtype=tl.float32)
    for r0 in range(0, RANK, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < RANK
        u = tl.load(u_ptr + u_rows[:, None] + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        sv_rows = sv_base + offs_r[:, None] * HEAD_DIM
        sv1 = tl.load(sv_rows + first[None, :], mask=r_mask[:, None], other=0.0)
        sv2 = tl.load(sv_rows + second[None, :], mask=r_mask[:, None], other=0.0)
        acc1 = tl.dot(u, sv1, acc1, input_precision=DOT_PRECISION)
        acc2 = tl.dot(u, sv2, acc2, input_precision=DOT_PRECISION)
    # fp32 RoPE, as the reference: freqs = position * inv_freq; cos/sin scaled by the attention factor.
    inv_freq = tl.load(inv_freq_ptr + b * stride_ib + offs_j, mask=is_rot, other=0.0)
    freqs = token.to(tl.float32)[:, None] * inv_freq[None, :]  # (ROWS, HALF)
    angle = reduce_angle(freqs)
    cos = tl.where(is_rot[None, :], tl.cos(angle) * attention_factor, 1.0)
    sin = tl.where(is_rot[None, :], tl.sin(angle) * attention_factor, 0.0)
    out1 = acc1 * cos - acc2 * sin
    out2 = acc2 * cos + acc1 * sin
    if LANDMARKS != NO_LANDMARKS:
        lm_rows = page * stride_lp + (chunk % (PAGE_TOKENS // CHUNK)) * stride_lc + h * stride_lh  # (ROWS,)
        lm_scale = 1.0
        if LM_SCALED:
            lm_scale = tl.load(lm_scale_ptr + page * stride_sp + (chunk % (PAGE_TOKENS // CHUNK)) * stride_sc + h,
                               mask=m_mask, other=1.0)[:, None]
        lm = lm_ptr + lm_rows[:, None]
        centre1 = tl.load(lm + first[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32) * lm_scale
        centre2 = tl.load(lm + second[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32) * lm_scale
        half1, half2 = centre1, centre2
        if LANDMARKS == BOUNDS:
            half1 = tl.load(lm + HEAD_DIM + first[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32) * lm_scale
            half2 = tl.load(lm + HEAD_DIM + second[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32) * lm_scale
        out1 = _meet_landmark(out1, centre1, half1, LANDMARKS, MISS_BLOCK, CHUNK, HALF)
        out2 = _meet_landmark(out2, centre2, half2, LANDMARKS, MISS_BLOCK, CHUNK, HALF)
    if SCORE:
        offs_g = tl.arange(0, GROUP_PAD)
        g_mask = offs_g < GROUP
        q_cols = q_ptr + b * stride_qb + (h * GROUP + offs_g)[None, :] * stride_qh  # (1, GROUP_PAD)
        q1 = tl.load(q_cols + first[:, None], mask=g_mask[None, :], other=0.0)  # (HALF, GROUP_PAD)
        q2 = tl.load(q_cols + second[:, None], mask=g_mask[None, :], other=0.0)
        # keys rounded to the model's dtype first, as the key slots would hold them
        logits = tl.dot(out1.to(q1.dtype), q1, input_precision=DOT_PRECISION)
        logits = tl.dot(out2.to(q2.dtype), q2, logits, input_precision=DOT_PRECISION) * scale  # (ROWS, GROUP_PAD)
        best = tl.max(tl.reshape(logits, (MISS_BLOCK, CHUNK, GROUP_PAD)), axis=1)  # (MISS_BLOCK, GROUP_PAD)
        offs_c = pid * MISS_BLOCK + tl.arange(0, MISS_BLOCK)
        dst = out_ptr + b * stride_o0 + h * stride_o1 + offs_g[None, :] * stride_o2 + offs_c[:, None]
        tl.store(dst, best, mask=(offs_c < count)[:, None] & g_mask[None, :])
    else:
        slot_chunk = tl.load(miss_slots_ptr + b * stride_mb + h * stride_mh + miss, mask=m_mask, other=0)
        row = (slot_chunk * CHUNK + offs_m % CHUNK).to(tl.int64)  # (ROWS,) of the slot's K*C
        dst = out_ptr + slot * stride_o0 + h * stride_o1 + row[:, None] * stride_o2
        tl.store(dst + first[None, :], out1.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
        tl.store(dst + second[None, :], out2.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def _launch(u_pages, page_table, sv, inv_freq, attention_factor, interleaved, chunks, miss_slots, count, slot_ids,
            q, out, scale, chunk_size, landmarks, landmark_kind, landmark_scales, miss_block, block_r, num_warps,
            num_stages, score: bool, group: int = 1) -> None:
    """Checks shared by both uses, then one launch: a program per (MISS_BLOCK chunks, KV head, sequence). q: the
    queries when scoring, else the key slots (read for their dtype only); miss_slots: read only when not scoring."""
    P, page_tokens, r = u_pages.shape
    N, Hkv, r_sv, d = sv.shape
    B, _, K = chunks.shape
    rot_half = inv_freq.shape[1]
    assert r_sv == r and chunks.shape[1] == Hkv and count.shape == (B, Hkv), (sv.shape, chunks.shape, count.shape)
    assert 2 * rot_half <= d and d == triton.next_power_of_2(d) and inv_freq.shape[0] == B
    assert u_pages.dtype == sv.dtype == q.dtype and inv_freq.dtype == torch.float32
    assert u_pages.is_contiguous() and inv_freq.stride(1) == 1
    assert sv.stride(3) == 1 and sv.stride(2) == d and chunks.is_contiguous() and miss_slots.is_contiguous()
    assert page_table.dtype == chunks.dtype == miss_slots.dtype == count.dtype == slot_ids.dtype == torch.int32
    assert page_table.stride(1) == 1 and page_table.shape[0] == B and slot_ids.shape == (B,)
    kind = (NO_LANDMARKS if landmarks is None else {"mean": MEAN, "bounds": BOUNDS}[landmark_kind]).value
    if landmarks is not None:
        width = d * (2 if kind == BOUNDS.value else 1)
        assert landmarks.shape == (P, page_tokens // chunk_size, Hkv, width) and landmarks.stride(3) == 1, (
            landmarks.shape, width)
        assert (landmark_scales is None) == (landmarks.dtype != torch.float8_e4m3fn)
        assert landmark_scales is None or (landmark_scales.shape == landmarks.shape[:3]
                                           and landmark_scales.stride(2) == 1)
    lm = landmarks if landmarks is not None else u_pages
    scales = landmark_scales if landmark_scales is not None else lm
    grid = (triton.cdiv(K, miss_block), Hkv, B)
    _rebuild_keys_kernel[grid](
        u_pages, page_table, sv, inv_freq, chunks, miss_slots, count, slot_ids, q, out, lm, scales,
        attention_factor, scale,
        u_pages.stride(0), u_pages.stride(1), page_table.stride(0), sv.stride(0), sv.stride(1), inv_freq.stride(0),
        chunks.stride(0), chunks.stride(1), count.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        out.stride(2), lm.stride(0), lm.stride(1), lm.stride(2), scales.stride(0), scales.stride(1),
        CHUNK=chunk_size, PAGE_TOKENS=page_tokens, RANK=r, HEAD_DIM=d, ROTARY_DIM=2 * rot_half,
        INTERLEAVED=interleaved, MISS_BLOCK=miss_block, BLOCK_R=block_r,
        DOT_PRECISION="ieee" if u_pages.dtype == torch.float32 else "tf32", LANDMARKS=kind,  # fp32: no tf32
        LM_SCALED=landmark_scales is not None, SCORE=score, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), num_warps=num_warps, num_stages=num_stages)


def rebuild_keys(u_pages: torch.Tensor, page_table: torch.Tensor, sv: torch.Tensor, inv_freq: torch.Tensor,
                 attention_factor: float, interleaved: bool, miss_chunks: torch.Tensor, miss_slots: torch.Tensor,
                 num_miss: torch.Tensor, slot_ids: torch.Tensor, key_slots: torch.Tensor, chunk_size: int,
                 landmarks: torch.Tensor | None = None, landmark_kind: str = "bounds",
                 landmark_scales: torch.Tensor | None = None, miss_block: int = 4, block_r: int = 64,
                 num_warps: int = 8, num_stages: int = 3) -> None:
    """The default tile is the fastest measured on Hopper (`python -m benchmarks.kernels --tiles-only`).
    landmarks: move each rebuilt chunk onto its landmark of `landmark_kind` ("mean" or "bounds"); None: do not."""
    N, Hkv, _, d = sv.shape
    assert key_slots.shape == (N, Hkv, miss_chunks.shape[2] * chunk_size, d) and key_slots.stride(3) == 1, (
        key_slots.shape)
    assert miss_slots.shape == miss_chunks.shape
    _launch(u_pages, page_table, sv, inv_freq, attention_factor, interleaved, miss_chunks, miss_slots, num_miss,
            slot_ids, key_slots, key_slots, 1.0, chunk_size, landmarks, landmark_kind, landmark_scales, miss_block,
            block_r, num_warps, num_stages, score=False)


def candidate_logits(u_pages: torch.Tensor, page_table: torch.Tensor, sv: torch.Tensor, inv_freq: torch.Tensor,
                     attention_factor: float, interleaved: bool, candidates: torch.Tensor, count: torch.Tensor,
                     slot_ids: torch.Tensor, q: torch.Tensor, scale: float, chunk_size: int,
                     landmarks: torch.Tensor | None = None, landmark_kind: str = "bounds",
                     landmark_scales: torch.Tensor | None = None, miss_block: int = 4, block_r: int = 64,
                     num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """Candidate chunks scored by their rebuilt keys, never stored: candidates (B, Hkv, m) int32, the first count
    (B, Hkv) of each row scored; q (B, Hq, d) in the model's dtype -> (B, Hkv, Hq/Hkv, m) fp32, each candidate's
    largest logit (times scale) with each query head of its KV head's group, -inf past the count.
    Reference: batched_reference.candidate_logits_batched."""
    (B, Hkv, m), Hq, d = candidates.shape, q.shape[1], sv.shape[3]
    assert q.shape == (B, Hq, d) and Hq % Hkv == 0 and q.stride(2) == 1, q.shape
    out = torch.full((B, Hkv, Hq // Hkv, m), float("-inf"), dtype=torch.float32, device=q.device)
    _launch(u_pages, page_table, sv, inv_freq, attention_factor, interleaved, candidates, candidates, count,
            slot_ids, q, out, scale, chunk_size, landmarks, landmark_kind, landmark_scales, miss_block, block_r,
            num_warps, num_stages, score=True, group=Hq // Hkv)
    return out
