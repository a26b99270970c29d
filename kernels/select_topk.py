"""Top-k of the landmark scores, one program per (sequence, KV head) row: the row in registers, Triton's bitonic top-k
(tl.topk) over one int64 word per chunk that packs the score's order-preserving bits above the chunk's reversed index.
torch.topk takes several launches per call (radix passes, a scan, a sort); this takes one. Reference:
shadowkv_core.shadowkv.reference.select_chunks (torch.topk), by score, largest first.

Ties go to the lower index (torch.topk leaves their order unspecified). Scores are finite or -inf (never NaN);
-0.0 ranks below +0.0.

Shapes (R rows, n chunks per row):
  scores       (R, n) fp32                 rows contiguous in memory (any stride over R)
  out          (R, k) int64                chunk ids, largest score first
Rows longer than MAX_ROW (or a Triton without tl.topk) take torch.topk.
"""
import torch
import triton
import triton.language as tl

MAX_ROW = 32768  # chunks a program holds in registers (one int64 each): 256 KiB of a row at 32 warps


@triton.jit
def _topk_kernel(scores_ptr, out_ptr, n, k, stride_s, stride_o, BLOCK: tl.constexpr, K_PAD: tl.constexpr,
                 INDEX_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    in_row = offs < n
    bits = tl.load(scores_ptr + row * stride_s + offs, mask=in_row, other=0.0).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order of these ints = the floats' order
    key = tl.where(in_row, ordered.to(tl.int64) + 2147483649, 0)  # in [1, 2^32]; past the row: 0, below all
    packed = (key << INDEX_BITS) | (BLOCK - 1 - offs)  # equal scores: the lower index packs larger
    top = tl.topk(packed, K_PAD)  # (K_PAD,) largest first
    offs_k = tl.arange(0, K_PAD)
    tl.store(out_ptr + row * stride_o + offs_k, (BLOCK - 1) - (top & (BLOCK - 1)), mask=offs_k < k)


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores (..., n) fp32 -> (..., k) int64 indices of the k largest per row, largest first."""
    n = scores.shape[-1]
    assert scores.dtype == torch.float32 and 1 <= k <= n, (scores.dtype, k, n)
    block = triton.next_power_of_2(n)
    if block > MAX_ROW or not hasattr(tl, "topk"):
        return scores.topk(k, dim=-1).indices
    rows = scores.reshape(-1, n)
    assert rows.stride(1) == 1, "rows must be contiguous"
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=scores.device)
    if rows.shape[0]:
        _topk_kernel[(rows.shape[0],)](rows, out, n, k, rows.stride(0), out.stride(0), BLOCK=block,
                                       K_PAD=triton.next_power_of_2(k), INDEX_BITS=block.bit_length() - 1,
                                       num_warps=min(32, max(4, block // 512)))
    return out.view(*scores.shape[:-1], k)
