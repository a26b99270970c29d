"""Selection bookkeeping for a ragged decode batch: hit/miss of this step's top-k chunks against the chunks resident
in each (sequence, KV head)'s sparse slots, with stable slots (a hit never moves). Reference:
shadowkv_core.shadowkv.batched_reference.assign_slots_batched (+ miss_lists_batched for the list form).

Shapes (B sequences, N slots, Hkv KV heads, K slots per head = budget chunks, k_max <= K):
  resident     (N, Hkv, K) int64 in/out   one layer of the slots' resident chunk ids, -1 empty; rows slot_ids[b]
                                          are rewritten in place (stride over N free, inner dims contiguous)
  slot_ids     (B,) int32                 slot of each sequence
  selected     (B, Hkv, k_max) int64      this step's chunks (torch.topk of the scores), distinct per row
  num_selected (B,) int32                 chunks that count per sequence (<= k_max); the rest of a row is ignored
  miss_chunks  (B, Hkv, K) int32 out      the j-th missed chunk, in `selected` order, j < num_miss
  miss_slots   (B, Hkv, K) int32 out      the slot it goes to: the j-th slot (in slot order) whose chunk left
  num_miss     (B, Hkv) int32 out
  miss_total   (1,) int32 in/out, optional  num_miss summed into it (a step's miss count, read once after the step)
One program per (sequence, KV head): the K x k membership test runs in BLOCK_J columns of `selected` at a time.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _assign_slots_kernel(resident_ptr, slot_ptr, selected_ptr, num_selected_ptr, miss_chunks_ptr, miss_slots_ptr,
                         num_miss_ptr, total_ptr, stride_rn, stride_rh, stride_sb, stride_sh, stride_mb, stride_mh,
                         stride_nb, K: tl.constexpr, K_PAD: tl.constexpr, K_MAX: tl.constexpr, BLOCK_J: tl.constexpr,
                         TOTAL: tl.constexpr):
    h, b = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    k = tl.load(num_selected_ptr + b)
    offs_s = tl.arange(0, K_PAD)
    s_mask = offs_s < K
    res_ptrs = resident_ptr + slot * stride_rn + h * stride_rh + offs_s
    resident = tl.load(res_ptrs, mask=s_mask, other=-1)
    kept = tl.zeros([K_PAD], dtype=tl.int32)  # 1 where the slot's chunk is selected again
    num_miss = 0
    miss_base = b * stride_mb + h * stride_mh
    for j0 in range(0, K_MAX, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_mask = offs_j < k
        sel = tl.load(selected_ptr + b * stride_sb + h * stride_sh + offs_j, mask=j_mask, other=-2)
        same = (resident[:, None] == sel[None, :]) & s_mask[:, None] & j_mask[None, :]  # (K_PAD, BLOCK_J)
        kept = tl.maximum(kept, tl.max(same.to(tl.int32), 1))
        is_miss = j_mask & (tl.max(same.to(tl.int32), 0) == 0)
        rank = num_miss + tl.cumsum(is_miss.to(tl.int32), 0) - 1  # order among the misses
        tl.store(miss_chunks_ptr + miss_base + rank, sel.to(tl.int32), mask=is_miss)
        num_miss += tl.sum(is_miss.to(tl.int32), 0)
    free = s_mask & (kept == 0)
    free_rank = tl.cumsum(free.to(tl.int32), 0) - 1  # order among the slots whose chunk left
    takes_miss = free & (free_rank < num_miss)
    tl.store(miss_slots_ptr + miss_base + free_rank, offs_s, mask=takes_miss)
    tl.store(num_miss_ptr + b * stride_nb + h, num_miss)
    if TOTAL:
        tl.atomic_add(total_ptr, num_miss)
    # The j-th miss goes to the j-th free slot: read back the chunk ids this program stored above.
    tl.debug_barrier()
    incoming = tl.load(miss_chunks_ptr + miss_base + free_rank, mask=takes_miss, other=-1).to(tl.int64)
    tl.store(res_ptrs, tl.where(kept > 0, resident, incoming), mask=s_mask)


def assign_slots(resident: torch.Tensor, slot_ids: torch.Tensor, selected: torch.Tensor,
                 num_selected: torch.Tensor,
                 miss_total: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Updates resident[slot_ids] in place and adds the misses to miss_total if given -> miss_chunks, miss_slots
    (B, Hkv, K) int32, num_miss (B, Hkv) int32."""
    N, Hkv, K = resident.shape
    B, Hkv_s, k_max = selected.shape
    assert Hkv_s == Hkv and k_max <= K and slot_ids.shape == num_selected.shape == (B,), (resident.shape,
                                                                                         selected.shape)
    assert resident.dtype == selected.dtype == torch.int64
    assert slot_ids.dtype == num_selected.dtype == torch.int32
    assert resident.stride(2) == 1 and resident.stride(1) == K and selected.is_contiguous()
    assert miss_total is None or (miss_total.dtype == torch.int32 and miss_total.numel() == 1)
    miss_chunks = torch.empty(B, Hkv, K, dtype=torch.int32, device=resident.device)
    miss_slots = torch.empty_like(miss_chunks)
    num_miss = torch.empty(B, Hkv, dtype=torch.int32, device=resident.device)
    block_j = min(32, triton.next_power_of_2(k_max))
    _assign_slots_kernel[(Hkv, B)](
        resident, slot_ids, selected, num_selected, miss_chunks, miss_slots, num_miss,
        num_miss if miss_total is None else miss_total,  # not read without miss_total
        resident.stride(0), resident.stride(1), selected.stride(0), selected.stride(1), miss_chunks.stride(0),
        miss_chunks.stride(1), num_miss.stride(0),
        K=K, K_PAD=triton.next_power_of_2(K), K_MAX=k_max, BLOCK_J=block_j, TOTAL=miss_total is not None,
        num_warps=4)
    return miss_chunks, miss_slots, num_miss
