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
Two launches: the first writes each block's logits (B, Hq, n_max) and, per program (a few consecutive blocks, their
loads pipelined), its softmax partials (max, sum of exp) per query head; the second combines the partials of all
programs and writes the scores. A single pass would read the landmarks twice (softmax needs the global max before
normalising, and the group max comes after normalising).
Outliers are flagged on the pages beside their landmarks: one byte read beside each landmark is cheaper than comparing
every chunk with a list of its sequence's outlier ids (docs/benchmarks.md has the measurement).
"""
import torch
import triton
import triton.language as tl

from kernels import MIN_HEAD_DIM, sm_count
from kernels.fp8 import e4m3_to, fp16_query, paired_e4m3


# The chunk bucket (N_MAX) is what varies between compiles; so that a launch on placeholder inputs compiles the
# variant the engine's batches use (ShadowKVCache.compile_buckets), the query, the chunk counts (a view at any
# offset), the page table's row stride and the blocks per program (which follow the batch size) leave the
# specialisation.
@triton.jit(do_not_specialize=["stride_tb", "blocks_per_program", "num_parts"],
            do_not_specialize_on_alignment=["q_ptr", "num_chunks_ptr"])
def _logits_kernel(q_ptr, lm_ptr, lm_scales_ptr, table_ptr, num_chunks_ptr, flags_ptr, logits_ptr, part_m_ptr,
                   part_l_ptr, scale, blocks_per_program, num_parts,
                   stride_qb, stride_lmp, stride_lmc, stride_sp, stride_sc, stride_fp, stride_fc, stride_tb,
                   stride_lb, stride_pb,
                   N_MAX: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_DOT: tl.constexpr, ASM: tl.constexpr):
    part_id, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(num_chunks_ptr + b)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = h * GROUP + offs_g  # (GROUP_PAD,) query heads of this KV head
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * HEAD_DIM + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    if FP8 and FP8_DOT == tl.float16:  # e4m3 converts exactly to FP8_DOT; the chunk's scale multiplies its logit
        q, q_up = fp16_query(q)
        scale = scale / q_up
    rows = b * stride_lb + heads * N_MAX
    # this program's blocks of chunks, its softmax partials (running max, sum of exp) carried across them
    m_run = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_run = tl.zeros([GROUP_PAD], tl.float32)
    for i in tl.range(0, blocks_per_program, num_stages=STAGES):
        offs_n = (part_id * blocks_per_program + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n
        page = tl.load(table_ptr + b * stride_tb + offs_n // PAGE_CHUNKS, mask=n_mask, other=0).to(tl.int64)
        within = offs_n % PAGE_CHUNKS
        lm = tl.load(lm_ptr + (page * stride_lmp + within * stride_lmc + h * HEAD_DIM)[:, None] + offs_d[None, :],
                     mask=n_mask[:, None], other=0)
        outlier = tl.load(flags_ptr + page * stride_fp + within * stride_fc + h, mask=n_mask, other=1)
        if FP8:
            lm_scale = tl.load(lm_scales_ptr + page * stride_sp + within * stride_sc + h, mask=n_mask, other=1.0)
            logits = tl.dot(q, tl.trans(e4m3_to(lm, FP8_DOT, ASM)), input_precision=DOT_PRECISION)
            logits = logits * (lm_scale * scale)[None, :]  # (GROUP_PAD, BLOCK_N) fp32
        else:
            logits = tl.dot(q, tl.trans(lm), input_precision=DOT_PRECISION) * scale
        valid = n_mask & (outlier == 0)
        logits = tl.where(valid[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(logits, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid chunk yet: nothing to rescale
        l_run = l_run * tl.exp(m_run - m_safe) + tl.sum(tl.exp(logits - m_safe[:, None]), 1)
        m_run = m_new
        tl.store(logits_ptr + rows[:, None] + offs_n[None, :], logits,
                 mask=g_mask[:, None] & (offs_n < N_MAX)[None, :])
    part = b * stride_pb + heads * num_parts + part_id
    tl.store(part_m_ptr + part, m_run, mask=g_mask)
    tl.store(part_l_ptr + part, l_run, mask=g_mask)


@triton.jit(do_not_specialize=["num_parts"])
def _scores_kernel(logits_ptr, part_m_ptr, part_l_ptr, scores_ptr, num_parts, stride_lb, stride_pb, stride_sb,
                   N_MAX: tl.constexpr, BLOCKS_PAD: tl.constexpr, GROUP: tl.constexpr,
                   GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    blk, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_k = tl.arange(0, BLOCKS_PAD)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    heads = h * GROUP + offs_g
    g_mask = offs_g < GROUP
    part = b * stride_pb + heads[:, None] * num_parts + offs_k[None, :]
    part_mask = g_mask[:, None] & (offs_k < num_parts)[None, :]
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


MAX_BLOCKS_PER_PROGRAM = 4
PROGRAMS_PER_SM = 2  # below this many programs a multiprocessor, one block a program


def blocks_per_program(programs: int, num_sms: int) -> int:
    """Blocks of chunks each program of the first launch scores in turn, its loads pipelined across them: as many
    as leave every multiprocessor PROGRAMS_PER_SM programs, at most MAX_BLOCKS_PER_PROGRAM. programs: one per
    block."""
    return max(1, min(MAX_BLOCKS_PER_PROGRAM, programs // (PROGRAMS_PER_SM * num_sms)))


def landmark_scores(q: torch.Tensor, landmarks: torch.Tensor, page_table: torch.Tensor, num_chunks: torch.Tensor,
                    outlier_flags: torch.Tensor, n_max: int, scale: float, block_n: int = 128, num_warps: int = 4,
                    landmark_scales: torch.Tensor | None = None, per_program: int | None = None) -> torch.Tensor:
    """-> scores (B, Hkv, n_max) fp32. n_max >= max(num_chunks) (a bucket: it is a compile-time size). The default
    block_n x num_warps is the fastest measured on Hopper (`python -m benchmarks.kernels --scores-only`).
    per_program: blocks of block_n chunks per program of the first launch (None: blocks_per_program)."""
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
    per_program = per_program or blocks_per_program(num_blocks * Hkv * B, sm_count(q.device))
    num_parts = triton.cdiv(num_blocks, per_program)
    logits = torch.empty(B, Hq, n_max, dtype=torch.float32, device=q.device)
    part_m = torch.empty(B, Hq, num_parts, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    scores = torch.empty(B, Hkv, n_max, dtype=torch.float32, device=q.device)
    group_pad = max(16, triton.next_power_of_2(G))  # tl.dot needs 16 rows
    _logits_kernel[(num_parts, Hkv, B)](
        q, landmarks, landmark_scales, page_table, num_chunks, outlier_flags, logits, part_m, part_l, scale,
        per_program, num_parts,
        q.stride(0), landmarks.stride(0), landmarks.stride(1), landmark_scales.stride(0), landmark_scales.stride(1),
        outlier_flags.stride(0), outlier_flags.stride(1), page_table.stride(0), logits.stride(0), part_m.stride(0),
        N_MAX=n_max, GROUP=G, GROUP_PAD=group_pad, HEAD_DIM=d, PAGE_CHUNKS=page_chunks, BLOCK_N=block_n, STAGES=2,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8,
        FP8_DOT=tl.float32 if q.dtype == torch.float32 else tl.float16,
        ASM=fp8 and q.dtype != torch.float32 and paired_e4m3(q.device), num_warps=num_warps)
    # Wider blocks here: each program first combines the partials of all parts of its (sequence, KV head); their
    # count pads to the bucket's block count, so that the batch size, which sets it, compiles nothing new.
    score_block = min(1024, triton.next_power_of_2(n_max))
    _scores_kernel[(triton.cdiv(n_max, score_block), Hkv, B)](
        logits, part_m, part_l, scores, num_parts, logits.stride(0), part_m.stride(0), scores.stride(0),
        N_MAX=n_max, BLOCKS_PAD=triton.next_power_of_2(num_blocks), GROUP=G,
        GROUP_PAD=triton.next_power_of_2(G), BLOCK_N=score_block, num_warps=4)
    return scores
