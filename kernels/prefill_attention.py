"""Prefill attention, flash-attention forward (online softmax): each program attends BLOCK_M queries of one query head
of one sequence to that sequence's keys. A ragged batch in one launch, GQA without repeating keys and values (the G
query heads of a KV head are adjacent programs, so they read its keys from L2), no mask in memory.

Each sequence prefills a chunk: its queries sit at positions [s, e) and see keys [0, e), s = e - (query count), so
keys before s are seen by every query and only the diagonal block [s, e) is causal. A program's key loop runs in two
stages: keys every one of its queries sees (no mask), then the diagonal blocks (masked).
Reference: shadowkv_core.attention.prefill_chunks_attention_ref.

Shapes (B sequences, Hq = Hkv * G query heads, d head_dim):
  q, out         (total_q, Hq, d), tokens of all sequences packed; out in q's dtype
  k, v           (total_k, Hkv, d), same strides, last dim contiguous
  cu_seqlens_q   (B + 1,) int32 offsets of each sequence's queries; cu_seqlens_k likewise for keys, each
                 sequence with at least as many keys as queries
  lse            (total_q, Hq) fp32, natural log of each query's softmax denominator (optional output)
"""
import torch
import triton
import triton.language as tl

from kernels.online_softmax import online_softmax_step

HEAD_DIMS = (64, 128)
LOG2_E = 1.4426950408889634


@triton.jit
def _attend_keys(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kt, scale_log2, pos_m, k_len, lo, hi,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over keys [lo, hi); MASKED applies the causal mask and the sequence's end."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        rows = keys.to(tl.int64)[:, None] * stride_kt
        if MASKED:
            k = tl.load(k_ptrs + rows, mask=(keys < k_len)[:, None], other=0.0)
            v = tl.load(v_ptrs + rows, mask=(keys < k_len)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs + rows)
            v = tl.load(v_ptrs + rows)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            s = tl.where((keys[None, :] <= pos_m[:, None]) & (keys[None, :] < k_len), s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, scale_log2,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_lt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    hq, b = tl.program_id(0), tl.program_id(2)
    start_m = tl.num_programs(1) - 1 - tl.program_id(1)  # the blocks with the most keys first: a shorter tail
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if start_m * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_k_ptr + b)
    k_len = tl.load(cu_k_ptr + b + 1) - k_start
    chunk_start = k_len - q_len
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + hq * stride_qh + offs_d[None, :], mask=m_valid[:, None],
                other=0.0)
    kv_head = hq // GROUP
    k_ptrs = k_ptr + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh + offs_d[None, :]
    v_ptrs = v_ptr + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh + offs_d[None, :]
    pos_m = chunk_start + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Keys before this block's first query are seen by all its queries; whole key blocks of them need no mask.
    unmasked_end = (chunk_start + start_m * BLOCK_M) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kt, scale_log2, pos_m, k_len, 0,
                                 unmasked_end, BLOCK_N, False, DOT_PRECISION)
    diagonal_end = tl.minimum(chunk_start + (start_m + 1) * BLOCK_M, k_len)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kt, scale_log2, pos_m, k_len,
                                 unmasked_end, diagonal_end, BLOCK_N, True, DOT_PRECISION)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + hq * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])
    if WRITE_LSE:
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # log2 units -> natural log
        tl.store(lse_ptr + q_rows * stride_lt + hq, lse, mask=m_valid)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, scale: float, return_lse: bool = False,
                      block_m: int = 128, block_n: int = 64, num_warps: int = 8, num_stages: int = 3):
    """-> out (total_q, Hq, d), and lse (total_q, Hq) fp32 with return_lse. max_seqlen_q >= the longest query
    count (a bound, no host sync). Block sizes and warps are the autotuning knobs; the defaults suit head dim 128
    on Hopper."""
    total_q, Hq, d = q.shape
    Hkv = k.shape[1]
    B = cu_seqlens_q.shape[0] - 1
    assert d in HEAD_DIMS, f"head_dim {d} is not one the kernel takes {HEAD_DIMS}"
    assert k.dim() == 3 and k.shape == v.shape and k.shape[2] == d and k.stride() == v.stride(), (k.shape, v.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1, "the head dim must be contiguous"
    assert Hq % Hkv == 0, f"{Hq} query heads are not a multiple of {Hkv} KV heads"
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16), q.dtype
    assert cu_seqlens_q.shape == cu_seqlens_k.shape == (B + 1,), (cu_seqlens_q.shape, cu_seqlens_k.shape)
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert q.device == k.device == cu_seqlens_q.device == cu_seqlens_k.device
    out = torch.empty_like(q)
    lse = torch.empty(total_q, Hq, dtype=torch.float32, device=q.device) if return_lse else out  # out: never written
    grid = (Hq, triton.cdiv(max_seqlen_q, block_m), B)
    _prefill_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale * LOG2_E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        GROUP=Hq // Hkv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, WRITE_LSE=return_lse,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages)
    return (out, lse) if return_lse else out
