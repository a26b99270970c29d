"""Top-k of the landmark scores, one program per row in one launch: the indices of the k largest scores, largest
first. Reference: shadowkv_core.shadowkv.reference.select_chunks (torch.topk).

Shapes (R rows, n scores per row, k <= n):
  scores       (R, n) fp32                 rows contiguous (any stride over R); finite or -inf, never NaN
  out          (R, k) int64 out            indices, by score descending; also the program's scratch (see below)
Each score maps to an int32 key of the same order (-0.0 as +0.0). A bisection over the 32 key bits finds the k-th
largest key `lo` (stopping early once exactly k keys are >= the midpoint), counting keys >= each midpoint. Every key
> lo is selected and, of the keys == lo, the first ones in index order up to k. Their (key, reversed index) pairs go
to `out` at distinct places from one scan, are read back as one K_PAD block, sorted, and their indices stored.
The row stays in registers up to BLOCK scores; longer rows are re-read a tile of BLOCK at a time in every pass.

Ties (equal scores, the -inf padding past a sequence's chunks and at its outliers included) go to the lower index:
the result is the first k of a stable descending sort. torch.topk leaves the order of ties unspecified.
Scores are assumed never NaN (the scoring kernel writes none; a NaN's key would rank by its sign bit, above +inf
or below -inf). +inf ranks first.
torch.topk takes several launches (radix passes, a scan, a sort); the bisection costs 32 reductions at most.
"""
import torch
import triton
import triton.language as tl

MAX_BLOCK = 32768  # scores a program holds in registers (one int32 key each): 32 registers a thread at 32 warps
INT32_MIN = tl.constexpr(-2147483648)  # a global a kernel may read must be a constexpr object


@triton.jit
def _ordered_keys(row_ptr, offs, n):
    """-> int32 keys whose signed order is the scores' order; past the row INT32_MIN, below every score."""
    bits = tl.load(row_ptr + offs, mask=offs < n, other=0.0).to(tl.int32, bitcast=True)
    bits = tl.where(bits == INT32_MIN, 0, bits)  # -0.0 ties with +0.0, as the scores compare
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: the magnitude bits reversed
    return tl.where(offs < n, keys, INT32_MIN)


@triton.jit
def _count_at_least(keys, row_ptr, n, mid, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr):
    """Keys >= mid in the row: `keys` when it holds the whole row, else re-read a tile at a time."""
    if NUM_TILES == 1:
        count = tl.sum((keys >= mid).to(tl.int32), 0)
    else:
        count = 0
        for t in range(NUM_TILES):
            tile = _ordered_keys(row_ptr, t * BLOCK + tl.arange(0, BLOCK), n)
            count += tl.sum((tile >= mid).to(tl.int32), 0)
    return count


@triton.jit
def _store_selected(keys, offs, n, k, lo, quota, gt_base, eq_base, out_row, INDEX_BITS: tl.constexpr):
    """Store one tile's selected (key, reversed index) pairs: keys > lo from the front of the row's k places, the
    first `quota` keys == lo (in index order) from its back. -> the running counts of keys > lo and == lo."""
    gt = (keys > lo).to(tl.int32)
    eq = ((keys == lo) & (offs < n)).to(tl.int32)
    flags = gt + (eq << 15)  # both counts in one scan: a tile (<= 2^15 keys) has < 2^15 keys before any key
    before = tl.cumsum(flags, 0) - flags
    gt_rank = gt_base + (before & 0x7FFF)
    eq_rank = eq_base + (before >> 15)
    take_eq = (eq > 0) & (eq_rank < quota)
    place = tl.where(gt > 0, gt_rank, k - 1 - eq_rank)
    packed = (keys.to(tl.int64) << INDEX_BITS) | ((1 << INDEX_BITS) - 1 - offs)  # equal keys: lower index larger
    tl.store(out_row + place, packed, mask=(gt > 0) | take_eq)
    return gt_base + tl.sum(gt, 0), eq_base + tl.sum(eq, 0)


@triton.jit
def _topk_kernel(scores_ptr, out_ptr, n, k, stride_s, stride_o, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
                 K_PAD: tl.constexpr, INDEX_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = scores_ptr + row * stride_s
    out_row = out_ptr + row * stride_o
    offs = tl.arange(0, BLOCK)
    keys = _ordered_keys(row_ptr, offs, n)  # the whole row when NUM_TILES == 1
    # Invariant: c_lo = #(keys >= lo) >= k > c_hi = #(keys >= hi). int64 bounds: hi starts at 2^31.
    lo = tl.full([], INT32_MIN, tl.int64)
    hi = lo + 2 ** 32
    c_lo = tl.full([], 0, tl.int32) + n  # a tensor even where n == 1 is specialized to a constexpr
    c_hi = tl.full([], 0, tl.int32)
    while (hi - lo > 1) & (c_lo != k):
        mid = lo + ((hi - lo) >> 1)
        count = _count_at_least(keys, row_ptr, n, mid.to(tl.int32), BLOCK, NUM_TILES)
        lo, c_lo = tl.where(count >= k, mid, lo), tl.where(count >= k, count, c_lo)
        hi, c_hi = tl.where(count >= k, hi, mid), tl.where(count >= k, c_hi, count)
    # lo is now the k-th largest key (hi == lo + 1: #(keys > lo) == c_hi), or exactly k keys are >= lo (take them
    # all: c_hi <= #(keys > lo)). Either way k - c_hi keys == lo complete the k.
    lo32 = lo.to(tl.int32)
    quota = k - c_hi
    if NUM_TILES == 1:
        _store_selected(keys, offs, n, k, lo32, quota, 0, 0, out_row, INDEX_BITS)
    else:
        gt_base = 0
        eq_base = 0
        for t in range(NUM_TILES):
            tile_offs = t * BLOCK + offs
            gt_base, eq_base = _store_selected(_ordered_keys(row_ptr, tile_offs, n), tile_offs, n, k, lo32, quota,
                                               gt_base, eq_base, out_row, INDEX_BITS)
    tl.debug_barrier()  # the k pairs this program's threads just stored, read back by other threads
    offs_k = tl.arange(0, K_PAD)
    packed = tl.load(out_row + offs_k, mask=offs_k < k, other=0)
    packed = tl.where(offs_k < k, packed, tl.full([K_PAD], INT32_MIN, tl.int64) << INDEX_BITS)  # below all pairs
    top = tl.sort(packed, descending=True)
    tl.store(out_row + offs_k, (1 << INDEX_BITS) - 1 - (top & ((1 << INDEX_BITS) - 1)), mask=offs_k < k)


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores (..., n) fp32 -> (..., k) int64 indices of the k largest per row, largest first, ties to the lower
    index (torch.topk(k).indices wherever scores differ)."""
    n = scores.shape[-1]
    assert scores.dtype == torch.float32 and 1 <= k <= n, (scores.dtype, k, n)
    rows = scores.reshape(-1, n)
    assert rows.stride(-1) == 1, "rows must be contiguous"
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=scores.device)
    block = min(MAX_BLOCK, triton.next_power_of_2(n))
    num_tiles = triton.cdiv(n, block)
    if rows.shape[0]:
        _topk_kernel[(rows.shape[0],)](rows, out, n, k, rows.stride(0), out.stride(0), BLOCK=block,
                                       NUM_TILES=num_tiles, K_PAD=triton.next_power_of_2(k),
                                       INDEX_BITS=max(1, (num_tiles * block - 1).bit_length()),
                                       num_warps=min(32, max(4, block // 1024)))
    return out.view(*scores.shape[:-1], k)
