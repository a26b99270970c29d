"""Landmark scoring for a ragged decode batch: q·landmarksᵀ, softmax over each sequence's chunks, max over the GQA
group. Reference: shadowkv_core.shadowkv.batched_reference.landmark_scores_batched.

Shapes (B sequences, Hq = Hkv * G query heads, d the landmark width: head_dim, or 2·head_dim for bounds landmarks
scored against their [q, |q|] query; P pages of PAGE_CHUNKS chunks, n_max chunks):
  q            (B, Hq, d)                      bf16/fp16/fp32, contiguous
  landmarks    (P, PAGE_CHUNKS, Hkv, d)        one layer of the GPU pages, contiguous
  page_table   (B, max_pages) int32            physical page of each logical page of each sequence
  num_chunks   (B,) int32                      shadow chunks per sequence (ragged)
  outlier_flags (P, PAGE_CHUNKS, Hkv) uint8    one layer of the GPU pages: nonzero where the chunk is an outlier of
                                               its KV head (attended exactly, so left out of the softmax)
  scores       (B, Hkv, n_max) fp32 out        softmax prob, max over the group; -inf for outliers and padding
  landmark_scales (P, PAGE_CHUNKS, Hkv) fp32    optional: landmarks are then float8_e4m3fn, a chunk's logit is
                                               (q · its e4m3 landmark, exact in fp16) * its scale; a half-precision
                                               q enters the fp16 dot scaled by a power of two (kernels/fp8.py)
Two launches: the first writes each block's logits (B, Hq, n_max) and its softmax partials (max, sum of exp) per
query head; the second combines the partials of all blocks and writes the scores. A single pass would read the
landmarks twice (softmax needs the global max before normalising, and the group max comes after normalising).
Outliers are flagged on the pages beside their landmarks: one byte read beside each landmark is cheaper than comparing
every chunk with a list of its sequence's outlier ids (docs/benchmarks.md has the measurement).
"""
import torch
import triton
import triton.language as tl

from kernels import MIN_HEAD_DIM
from kernels.fp8 import e4m3_to, fp16_query, paired_e4m3


# The chunk bucket (N_MAX) is what varies between compiles; so that a launch on placeholder inputs compiles the
# variant the engine's batches use (ShadowKVCache.compile_buckets), the query, the chunk counts (a view at any
# offset) and the page table's row stride leave the specialisation.
@triton.jit(do_not_specialize=["stride_tb"], do_not_specialize_on_alignment=["q_ptr", "num_chunks_ptr"])
def _logits_kernel(q_ptr, lm_ptr, lm_scales_ptr, table_ptr, num_chunks_ptr, flags_ptr, logits_ptr, part_m_ptr,
                   part_l_ptr, scale,
                   stride_qb, stride_lmp, stride_lmc, stride_sp, stride_sc, stride_fp, stride_fc, stride_tb,
                   stride_lb, stride_pb,
                   N_MAX: tl.constexpr, NUM_BLOCKS: tl.constexpr, GROUP: tl.constexpr,
                   GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_CHUNKS: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_DOT: tl.constexpr,
                   ASM: tl.constexpr):
    blk, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(num_chunks_ptr + b)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    heads = h * GROUP + offs_g  # (GROUP_PAD,) query heads of this KV head
    g_mask = offs_g < GROUP
    n_mask = offs_n < n
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * HEAD_DIM + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    page = tl.load(table_ptr + b * stride_tb + offs_n // PAGE_CHUNKS, mask=n_mask, other=0)
    lm_rows = page.to(tl.int64) * stride_lmp + (offs_n % PAGE_CHUNKS) * stride_lmc + h * HEAD_DIM
    lm = tl.load(lm_ptr + lm_rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0)
    if FP8:  # e4m3 converts exactly to FP8_DOT; the chunk's scale multiplies its logit
        if FP8_DOT == tl.float16:
            q, q_up = fp16_query(q)
            scale = scale / q_up
        lm = e4m3_to(lm, FP8_DOT, ASM)
    logits = tl.dot(q, tl.trans(lm), input_precision=DOT_PRECISION) * scale  # (GROUP_PAD, BLOCK_N) fp32
    if FP8:
        lm_scale = tl.load(lm_scales_ptr + page.to(tl.int64) * stride_sp + (offs_n % PAGE_CHUNKS) * stride_sc + h,
                           mask=n_mask, other=1.0)
        logits = logits * lm_scale[None, :]
    outlier = tl.load(flags_ptr + page.to(tl.int64) * stride_fp + (offs_n % PAGE_CHUNKS) * stride_fc + h,
                      mask=n_mask, other=1)
    valid = n_mask & (outlier == 0)
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m = tl.max(logits, 1)  # (GROUP_PAD,)
    p = tl.where(valid[None, :], tl.exp(logits - tl.where(m == float("-inf"), 0.0, m)[:, None]), 0.0)
    l_sum = tl.sum(p, 1)
    rows = b * stride_lb + heads * N_MAX
    tl.store(logits_ptr + rows[:, None] + offs_n[None, :], logits, mask=g_mask[:, None] & (offs_n < N_MAX)[None, :])
    part = b * stride_pb + heads * NUM_BLOCKS + blk
    tl.store(part_m_ptr + part, m, mask=g_mask)
    tl.store(part_l_ptr + part, l_sum, mask=g_mask)


@triton.jit
def _scores_kernel(logits_ptr, part_m_ptr, part_l_ptr, scores_ptr, stride_lb, stride_pb, stride_sb,
                   N_MAX: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCKS_PAD: tl.constexpr, GROUP: tl.constexpr,
                   GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    blk, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_k = tl.arange(0, BLOCKS_PAD)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    heads = h * GROUP + offs_g
    g_mask = offs_g < GROUP
    part = b * stride_pb + heads[:, None] * NUM_BLOCKS + offs_k[None, :]
    part_mask = g_mask[:, None] & (offs_k < NUM_BLOCKS)[None, :]
    m = tl.load(part_m_ptr + part, mask=part_mask, other=float("-inf"))  # (GROUP_PAD, BLOCKS_PAD)
    l_part = tl.load(part_l_ptr + part, mask=part_mask, other=0.0)
    m_max = tl.max(m, 1)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # a head with no valid chunk: every score -inf
    l_sum = tl.sum(l_part * tl.exp(m - m_safe[:, None]), 1)
    n_mask = offs_n < N_MAX
    logits = tl.load(logits_ptr + b * stride_lb + heads[:, None] * N_MAX + offs_n[None, :],
                     mask=g_mask[:, None] & n_mask[None, :], other=float("-inf"))
    p = tl.exp(logits - m_safe[:, None]) / l_sum[:, None]
    p = tl.where(logits == float("-inf"), float("-inf"), p)
    tl.store(scores_ptr + b * stride_sb + h * N_MAX + offs_n, tl.max(p, 0), mask=n_mask)


def landmark_scores(q: torch.Tensor, landmarks: torch.Tensor, page_table: torch.Tensor, num_chunks: torch.Tensor,
                    outlier_flags: torch.Tensor, n_max: int, scale: float, block_n: int = 128, num_warps: int = 4,
                    landmark_scales: torch.Tensor | None = None) -> torch.Tensor:
    """-> scores (B, Hkv, n_max) fp32. n_max >= max(num_chunks) (a bucket: it is a compile-time size). The default
    block_n x num_warps is the fastest measured on Hopper (`python -m benchmarks.kernels --scores-only`)."""
    B, Hq, d = q.shape
    P, page_chunks, Hkv, d_lm = landmarks.shape
    assert d_lm == d and Hq % Hkv == 0 and d == triton.next_power_of_2(d), (q.shape, landmarks.shape)
    assert d >= MIN_HEAD_DIM, f"head_dim {d} is narrower than the kernels take ({MIN_HEAD_DIM})"
    fp8 = landmark_scales is not None
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if fp8:
        assert landmarks.dtype == torch.float8_e4m3fn and landmark_scales.dtype == torch.float32
        assert landmark_scales.shape == (P, page_chunks, Hkv) and landmark_scales.is_contiguous()
        landmarks = landmarks.view(torch.uint8)  # bit-cast back to e4m3 in the kernel
    else:
        assert landmarks.dtype == q.dtype
        landmark_scales = landmarks  # not read
    assert q.is_contiguous() and landmarks.is_contiguous() and page_table.stride(1) == 1
    assert page_table.dtype == num_chunks.dtype == torch.int32
    assert num_chunks.shape == (B,) and page_table.shape[0] == B
    assert outlier_flags.dtype == torch.uint8 and outlier_flags.shape == (P, page_chunks, Hkv)
    assert outlier_flags.stride(2) == 1
    G = Hq // Hkv
    num_blocks = triton.cdiv(n_max, block_n)
    logits = torch.empty(B, Hq, n_max, dtype=torch.float32, device=q.device)
    part_m = torch.empty(B, Hq, num_blocks, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    scores = torch.empty(B, Hkv, n_max, dtype=torch.float32, device=q.device)
    group_pad = max(16, triton.next_power_of_2(G))  # tl.dot needs 16 rows
    _logits_kernel[(num_blocks, Hkv, B)](
        q, landmarks, landmark_scales, page_table, num_chunks, outlier_flags, logits, part_m, part_l, scale,
        q.stride(0), landmarks.stride(0), landmarks.stride(1), landmark_scales.stride(0), landmark_scales.stride(1),
        outlier_flags.stride(0), outlier_flags.stride(1), page_table.stride(0), logits.stride(0), part_m.stride(0),
        N_MAX=n_max, NUM_BLOCKS=num_blocks, GROUP=G, GROUP_PAD=group_pad, HEAD_DIM=d, PAGE_CHUNKS=page_chunks,
        BLOCK_N=block_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8,
        FP8_DOT=tl.float32 if q.dtype == torch.float32 else tl.float16,
        ASM=fp8 and q.dtype != torch.float32 and paired_e4m3(q.device), num_warps=num_warps)
    # Wider blocks here: each program first combines the partials of all blocks of its (sequence, KV head).
    score_block = min(1024, triton.next_power_of_2(n_max))
    _scores_kernel[(triton.cdiv(n_max, score_block), Hkv, B)](
        logits, part_m, part_l, scores, logits.stride(0), part_m.stride(0), scores.stride(0),
        N_MAX=n_max, NUM_BLOCKS=num_blocks, BLOCKS_PAD=triton.next_power_of_2(num_blocks), GROUP=G,
        GROUP_PAD=triton.next_power_of_2(G), BLOCK_N=score_block, num_warps=4)
    return scores
