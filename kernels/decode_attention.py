"""Decode attention, flash-decoding: each program attends one query's GQA group over one split of its keys (online
softmax), a second kernel merges the splits. Ragged lengths, GQA, keys from up to three segments per sequence.

ShadowKV: the segments are [outliers | selected chunks | local + generated] of each sequence's slot. Dense: one
paged segment, the pool's rows addressed through a block table. The same kernel: only the index source differs.
References: shadowkv_core.shadowkv.batched_reference.sparse_decode_attention_batched and
dense_decode_attention_batched.

Shapes (B sequences, Hq = Hkv * G query heads, d head_dim, N slots):
  q                 (B, Hq, d) contiguous; out (B, Hq, d), q's dtype
  segment i (<= 3)  k, v (N, Hkv, T_i, d) strided views (last dim contiguous, k and v with the same strides),
                    rows slot_ids[b]; lens (B,) int32 keys of each sequence in the segment (a prefix of T_i).
                    A window stored (N, E, Hkv, d) is passed as its .transpose(1, 2); a dense pool (rows, Hkv, d)
                    as .permute(1, 0, 2)[None] with page_table (B, max_blocks) int32 and page_size (segment 0 only)
  slot_ids          (B,) int32
  partials          m, l (B, Hq, S) fp32, acc (B, Hq, S, d) fp32 for S splits of split_tokens keys

A dense fp8 pool has its own split kernel (paged_fp8_decode_attention): keys (rows, Hkv, d) e4m3, values stored a
page at a time with the page's tokens contiguous per dimension (pages, Hkv, d, page), one fp32 scale per token and
KV head (Hkv, rows). Both enter the dots as their e4m3 values (exact) in fp16 (in fp32 for an fp32 q): the key scales
multiply the fp32 scores and the value scales the softmax weights. The fp16 dots take q scaled by a power of two to
max |q| = 256 and each block's weights over its largest value scale, so that neither overflows nor flushes whatever
q's and the values' range. Values page-transposed make the second dot's operand K-major: it reads them with
`ldmatrix` where token-major fp8 values cost byte-wide shared loads and permutes (docs/benchmarks.md).
"""
import torch
import triton
import triton.language as tl

from kernels import MIN_HEAD_DIM, sm_count
from kernels.fp8 import e4m3_to, fp16_query, paired_e4m3
from kernels.online_softmax import online_softmax_step

# The pipeliner spends one stage on each block's page-table load before its keys and values; from five stages on it
# keeps two key and value buffers in flight instead of one.
FP8_STAGES = 5


@triton.jit
def _segment_rows(t, start, n, table_ptr, PAGE_SIZE: tl.constexpr):
    """Rows of keys [start, start + n) of a segment, for the tokens t of the whole list."""
    local = t - start
    inside = (local >= 0) & (local < n)
    if PAGE_SIZE > 0:
        block = tl.load(table_ptr + local // PAGE_SIZE, mask=inside, other=0).to(tl.int64)
        row = block * PAGE_SIZE + local % PAGE_SIZE
    else:
        row = local.to(tl.int64)
    return inside, row


@triton.jit
def _split_kernel(q_ptr, k0_ptr, v0_ptr, k1_ptr, v1_ptr, k2_ptr, v2_ptr, lens0_ptr, lens1_ptr, lens2_ptr,
                  table_ptr, slot_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, scale_log2, num_splits, split_tokens,
                  stride_qb, stride_0n, stride_0h, stride_0t, stride_1n, stride_1h, stride_1t,
                  stride_2n, stride_2h, stride_2t, stride_tb, stride_pb, stride_ab, GROUP: tl.constexpr,
                  GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    split, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n0, n1, n2 = tl.load(lens0_ptr + b), tl.load(lens1_ptr + b), tl.load(lens2_ptr + b)
    lo = split * split_tokens
    hi = tl.minimum(lo + split_tokens, n0 + n1 + n2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = h * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * HEAD_DIM + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    base0 = slot * stride_0n + h * stride_0h
    base1 = slot * stride_1n + h * stride_1h
    base2 = slot * stride_2n + h * stride_2h
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        valid = t < hi
        in0, row0 = _segment_rows(t, 0, n0, table_ptr + b * stride_tb, PAGE_SIZE)
        in1, row1 = _segment_rows(t, n0, n1, table_ptr, 0)
        in2, row2 = _segment_rows(t, n0 + n1, n2, table_ptr, 0)
        k_rows = tl.where(in0, k0_ptr + base0 + row0 * stride_0t,
                          tl.where(in1, k1_ptr + base1 + row1 * stride_1t, k2_ptr + base2 + row2 * stride_2t))
        v_rows = tl.where(in0, v0_ptr + base0 + row0 * stride_0t,
                          tl.where(in1, v1_ptr + base1 + row1 * stride_1t, v2_ptr + base2 + row2 * stride_2t))
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (GROUP_PAD, BLOCK_N), log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)
    _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, acc, m_i, l_i, b, heads, g_mask, split, num_splits,
                    stride_pb, stride_ab, HEAD_DIM)


@triton.jit
def _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, acc, m_i, l_i, b, heads, g_mask, split, num_splits,
                    stride_pb, stride_ab, HEAD_DIM: tl.constexpr):
    part = b * stride_pb + heads * num_splits + split
    tl.store(part_m_ptr + part, m_i, mask=g_mask)
    tl.store(part_l_ptr + part, l_i, mask=g_mask)
    tl.store(part_acc_ptr + b * stride_ab + (heads * num_splits + split)[:, None] * HEAD_DIM
             + tl.arange(0, HEAD_DIM)[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _fp8_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, lens_ptr, table_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                      scale_log2, num_splits, split_tokens, stride_qb, stride_kt, stride_vp, stride_sh, stride_tb,
                      stride_pb, stride_ab, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                      PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      FP8_DOT: tl.constexpr, ASM: tl.constexpr):
    """The dense fp8 pool's split (paged_fp8_decode_attention): a block of BLOCK_N keys spans BLOCK_N / PAGE whole
    pages; every address comes from one table entry a page, hinted constant over it, so that the keys' rows and the
    values' page rows load as 16-byte vectors. Whole pages are read: the codes past a sequence's end weigh zero."""
    split, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(lens_ptr + b)
    lo = split * split_tokens
    hi = tl.minimum(lo + split_tokens, n)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    in_page = offs_n % PAGE  # a block starts on a page: split_tokens and BLOCK_N are multiples of PAGE
    heads = h * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * HEAD_DIM + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    score_scale = scale_log2
    if FP8_DOT == tl.float16:
        q, q_up = fp16_query(q)
        score_scale = scale_log2 / q_up
    table = table_ptr + b * stride_tb
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        valid = start + offs_n < hi
        whole = tl.max_constancy(start + offs_n - in_page < hi, PAGE)  # the pages the block reaches
        page = tl.max_constancy(tl.load(table + start // PAGE + offs_n // PAGE, mask=whole, other=0), PAGE)
        page = page.to(tl.int64)
        k_rows = page * (PAGE * stride_kt) + in_page * stride_kt + h * HEAD_DIM
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=whole[:, None], other=0.0)
        v_cols = tl.max_contiguous(tl.multiple_of(page * stride_vp + h * (HEAD_DIM * PAGE) + in_page, PAGE), PAGE)
        v = tl.load(v_ptr + v_cols[None, :] + offs_d[:, None] * PAGE, mask=whole[None, :], other=0.0)  # (d, keys)
        s_rows = h * stride_sh + page * PAGE + in_page
        k_scale = tl.load(ks_ptr + s_rows, mask=valid, other=0.0)
        v_scale = tl.load(vs_ptr + s_rows, mask=valid, other=0.0)
        # the scales ride on the (GROUP_PAD, BLOCK_N) scores and weights, not on the (BLOCK_N, d) tiles
        s = tl.dot(q, tl.trans(e4m3_to(k, FP8_DOT, ASM)), input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * (k_scale * score_scale)[None, :], float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, tl.trans(v), DOT_PRECISION, v_scale, FP8_DOT, ASM)
    _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, acc, m_i, l_i, b, heads, g_mask, split, num_splits,
                    stride_pb, stride_ab, HEAD_DIM)


@triton.jit
def _merge_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, num_splits, stride_pb, stride_ab, stride_ob,
                  SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    hq, b = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    part = b * stride_pb + hq * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l_part = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + b * stride_ab + (hq * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # empty splits weigh nothing
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_part * w, 0)
    tl.store(out_ptr + b * stride_ob + hq * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty))


def _splits(B: int, Hkv: int, max_len: int, block_n: int, split_tokens: int | None, per_sm: int,
            device: torch.device) -> tuple[int, int]:
    """(split_tokens, num_splits): by default enough splits to give every multiprocessor per_sm programs, whatever
    the batch."""
    blocks = triton.next_power_of_2(triton.cdiv(max_len, block_n))  # bucketed: few distinct SPLITS_PAD
    if split_tokens is None:
        split_tokens = block_n * triton.cdiv(blocks * B * Hkv, per_sm * sm_count(device))
    split_tokens = min(split_tokens, block_n * blocks)
    assert split_tokens % block_n == 0
    return split_tokens, triton.cdiv(blocks * block_n, split_tokens)


def _partials(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, Hq, d = q.shape
    part_m = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    return part_m, torch.empty_like(part_m), torch.empty(B, Hq, num_splits, d, dtype=torch.float32, device=q.device)


def _merge(q: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, part_acc: torch.Tensor) -> torch.Tensor:
    B, Hq, d = q.shape
    out = torch.empty_like(q)
    num_splits = part_m.shape[2]
    _merge_kernel[(Hq, B)](
        part_m, part_l, part_acc, out, num_splits, part_m.stride(0), part_acc.stride(0), out.stride(0),
        SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=d, num_warps=4)
    return out


def _check_q(q: torch.Tensor) -> None:
    assert q.dim() == 3 and q.is_contiguous(), q.shape
    d = q.shape[2]
    assert d == triton.next_power_of_2(d), f"head_dim {d} is not a power of two"
    assert d >= MIN_HEAD_DIM, f"head_dim {d} is narrower than the kernels take ({MIN_HEAD_DIM})"


def decode_attention(q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                     slot_ids: torch.Tensor, scale: float, max_len: int, page_table: torch.Tensor | None = None,
                     page_size: int = 0, block_n: int = 64, split_tokens: int | None = None,
                     programs_per_sm: int = 4, num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """segments: 1 to 3 of (k, v, lens) in q's dtype; max_len >= the longest sequence's key count (a bound, no host
    sync). block_n: keys per loop step; split_tokens (a multiple of block_n): keys per split; by default enough
    splits for programs_per_sm programs on every SM. num_warps, num_stages: the split kernel's launch (num_stages
    None: Triton's default)."""
    _check_q(q)
    B, Hq, d = q.shape
    assert slot_ids.shape == (B,) and slot_ids.dtype == torch.int32
    for k, v, lens in segments:
        assert k.dim() == 4 and k.shape == v.shape and k.stride() == v.stride() and k.stride(3) == 1, k.shape
        assert k.shape[3] == d and Hq % k.shape[1] == 0 and k.dtype == v.dtype == q.dtype
        assert lens.shape == (B,) and lens.dtype == torch.int32
    assert 1 <= len(segments) <= 3
    assert (page_table is None) == (page_size == 0)
    if page_table is None:
        page_table = slot_ids  # never read
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    Hkv = segments[0][0].shape[1]
    segments = list(segments) + [(segments[0][0], segments[0][1], torch.zeros_like(slot_ids))] * (3 - len(segments))
    split_tokens, num_splits = _splits(B, Hkv, max_len, block_n, split_tokens, programs_per_sm, q.device)
    part_m, part_l, part_acc = _partials(q, num_splits)
    (k0, v0, n0), (k1, v1, n1), (k2, v2, n2) = segments
    launch = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    _split_kernel[(num_splits, Hkv, B)](
        q, k0, v0, k1, v1, k2, v2, n0, n1, n2, page_table, slot_ids, part_m, part_l, part_acc,
        scale * 1.4426950408889634, num_splits, split_tokens,  # scale in exp2 units: times log2(e)
        q.stride(0), k0.stride(0), k0.stride(1), k0.stride(2), k1.stride(0), k1.stride(1), k1.stride(2),
        k2.stride(0), k2.stride(1), k2.stride(2), page_table.stride(0), part_m.stride(0), part_acc.stride(0),
        GROUP=Hq // Hkv, GROUP_PAD=max(16, triton.next_power_of_2(Hq // Hkv)), HEAD_DIM=d, PAGE_SIZE=page_size,
        BLOCK_N=block_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **launch)
    return _merge(q, part_m, part_l, part_acc)


def paged_fp8_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pages: torch.Tensor,
                               scales: tuple[torch.Tensor, torch.Tensor], lens: torch.Tensor,
                               page_table: torch.Tensor, scale: float, max_len: int, block_n: int | None = None,
                               split_tokens: int | None = None, programs_per_sm: int = 16, num_warps: int = 4,
                               num_stages: int = FP8_STAGES) -> torch.Tensor:
    """The dense fp8 pool: q (B, Hq, d) in the model's dtype; k_pool (pages * page, Hkv, d) e4m3, a page's tokens in
    consecutive rows; v_pages (pages, Hkv, d, page) e4m3; scales (k, v) (Hkv, pages * page) fp32, the same strides;
    lens (B,) int32 keys of each sequence; page_table (B, >= its pages) int32; max_len >= the longest (a bound).
    The codes of a sequence's last page past its length must be finite (they weigh zero; a NaN would not).
    block_n: keys per loop step (default max(128, page)), a multiple of the page; split_tokens a multiple of block_n.
    fp8 pools take wider steps and more programs than the bf16 one: half the bytes per key leave each program more
    latency to hide."""
    _check_q(q)
    B, Hq, d = q.shape
    page = v_pages.shape[3]
    Hkv = k_pool.shape[1]
    assert k_pool.dtype == v_pages.dtype == torch.float8_e4m3fn and k_pool.is_contiguous() and v_pages.is_contiguous()
    assert v_pages.shape == (k_pool.shape[0] // page, Hkv, d, page) and k_pool.shape[2] == d and Hq % Hkv == 0
    for sc in scales:
        assert sc.dtype == torch.float32 and sc.shape == (Hkv, k_pool.shape[0]) and sc.stride() == scales[0].stride()
        assert sc.stride(1) == 1
    assert lens.shape == (B,) and lens.dtype == torch.int32
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    block_n = block_n or max(128, page)
    assert block_n % page == 0, f"block_n {block_n} must be a multiple of the page ({page})"
    assert block_n == triton.next_power_of_2(block_n), f"block_n {block_n} must be a power of two"
    split_tokens, num_splits = _splits(B, Hkv, max_len, block_n, split_tokens, programs_per_sm, q.device)
    part_m, part_l, part_acc = _partials(q, num_splits)
    _fp8_split_kernel[(num_splits, Hkv, B)](
        q, k_pool, v_pages, scales[0], scales[1], lens, page_table, part_m, part_l, part_acc,
        scale * 1.4426950408889634, num_splits, split_tokens, q.stride(0), k_pool.stride(0), v_pages.stride(0),
        scales[0].stride(0), page_table.stride(0), part_m.stride(0), part_acc.stride(0), GROUP=Hq // Hkv,
        GROUP_PAD=max(16, triton.next_power_of_2(Hq // Hkv)), HEAD_DIM=d, PAGE=page, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8_DOT=tl.float32 if q.dtype == torch.float32 else tl.float16,
        ASM=q.dtype != torch.float32 and paired_e4m3(q.device), num_warps=num_warps, num_stages=num_stages)
    return _merge(q, part_m, part_l, part_acc)
