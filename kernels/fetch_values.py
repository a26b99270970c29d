"""Value fetch: the missed chunks' values, read straight from the pinned host pages inside the kernel (zero-copy over
unified virtual addressing: Triton's launcher maps a pinned or cudaHostRegister-ed host pointer to its device
address), written into their GPU slots. No staging copy, no CPU gather. Reference:
shadowkv_core.shadowkv.batched_reference.gather_values_batched.

Shapes (B sequences, N slots, Hkv KV heads, K slots per head, C chunk_size, d head_dim, P host pages):
  host_values  (P, PAGE_TOKENS, Hkv, d)     one layer of the host store, pinned host memory (CPU tensor; on the
                                            interpreter any CPU tensor), token rows contiguous
  host_table   (B, max_pages) int32         host page of each logical page of each sequence (on the GPU)
  miss_chunks, miss_slots (B, Hkv, K) int32 from assign_slots; entries j < num_miss (B, Hkv) int32 count
  slot_ids     (B,) int32
  value_slots  (N, Hkv, K*C, d) out         one layer of the slots' sparse values (channels contiguous, other
                                            strides free); only the missed slots are written
  host_scales  (P, PAGE_TOKENS/C, Hkv) fp32 optional: host_values are then float8_e4m3fn, dequantised here as
                                            fp32 value * its chunk's scale, rounded once to value_slots' dtype
  device_region                             optional (device_values, device_scales or None, device_hits): a second
                                            region of pages, in device memory, as host_values and host_scales;
                                            host_table's ids P and up are its pages 0, 1, ...; device_hits (1,)
                                            int32 counts the misses read from it
Work items of (sequence, KV head, MISSES_PER_PROGRAM misses), one per program or, with a capped grid, several;
items past num_miss do nothing.
"""
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_items", "blocks", "stride_mb", "stride_mh"])  # these follow the miss count
def _fetch_values_kernel(host_ptr, scales_ptr, dev_ptr, dev_scales_ptr, dev_hits_ptr, table_ptr, miss_chunks_ptr,
                         miss_slots_ptr, num_miss_ptr, slot_ptr, out_ptr, num_items, blocks, num_host_pages,
                         stride_hp, stride_ht, stride_sp, stride_sc, stride_tb, stride_mb, stride_mh, stride_nb,
                         stride_on, stride_oh, stride_ot,
                         NUM_HEADS: tl.constexpr, CHUNK: tl.constexpr,
                         PAGE_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, MISSES_PER_PROGRAM: tl.constexpr,
                         FP8: tl.constexpr, TIERED: tl.constexpr):
    # Work items (sequence, KV head, block of MISSES_PER_PROGRAM misses), taken in turn by the grid's programs: one
    # each with a full grid, several each with a capped (persistent) one. `blocks` is a runtime value, not a constant:
    # it follows the miss count, which a prefix read sets to the prefix's chunks (one compile per prefix length).
    ROWS: tl.constexpr = MISSES_PER_PROGRAM * CHUNK
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        blk, h, b = item % blocks, item // blocks % NUM_HEADS, item // (blocks * NUM_HEADS)
        num_miss = tl.load(num_miss_ptr + b * stride_nb + h)
        if blk * MISSES_PER_PROGRAM < num_miss:
            miss = blk * MISSES_PER_PROGRAM + offs_r // CHUNK  # (ROWS,) miss index of each token row
            r_mask = miss < num_miss
            chunk = tl.load(miss_chunks_ptr + b * stride_mb + h * stride_mh + miss, mask=r_mask, other=0)
            slot_chunk = tl.load(miss_slots_ptr + b * stride_mb + h * stride_mh + miss, mask=r_mask, other=0)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            token = chunk * CHUNK + offs_r % CHUNK
            page = tl.load(table_ptr + b * stride_tb + token // PAGE_TOKENS, mask=r_mask, other=0).to(tl.int64)
            on_host = r_mask
            if TIERED:  # the device region has the host's layout; a masked-off load moves no bytes
                on_dev = r_mask & (page >= num_host_pages)
                on_host = r_mask & (page < num_host_pages)
                dev_page = tl.where(on_dev, page - num_host_pages, 0)
                tl.atomic_add(dev_hits_ptr, tl.sum(on_dev.to(tl.int32), 0) // CHUNK)
            src = page * stride_hp + (token % PAGE_TOKENS) * stride_ht + h * HEAD_DIM
            vals = tl.load(host_ptr + src[:, None] + offs_d[None, :], mask=on_host[:, None])
            if TIERED:
                src_dev = dev_page * stride_hp + (token % PAGE_TOKENS) * stride_ht + h * HEAD_DIM
                vals = tl.where(on_dev[:, None], tl.load(dev_ptr + src_dev[:, None] + offs_d[None, :],
                                                         mask=on_dev[:, None]), vals)
            if FP8:
                scale_row = (token % PAGE_TOKENS) // CHUNK * stride_sc + h
                scale = tl.load(scales_ptr + page * stride_sp + scale_row, mask=on_host, other=0.0)
                if TIERED:
                    scale = tl.where(on_dev, tl.load(dev_scales_ptr + dev_page * stride_sp + scale_row, mask=on_dev,
                                                     other=0.0), scale)
                vals = vals.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
            vals = vals.to(out_ptr.dtype.element_ty)
            dst = slot * stride_on + h * stride_oh + (slot_chunk * CHUNK + offs_r % CHUNK).to(tl.int64) * stride_ot
            tl.store(out_ptr + dst[:, None] + offs_d[None, :], vals, mask=r_mask[:, None])


def fetch_values(host_values: torch.Tensor, host_table: torch.Tensor, miss_chunks: torch.Tensor,
                 miss_slots: torch.Tensor, num_miss: torch.Tensor, slot_ids: torch.Tensor,
                 value_slots: torch.Tensor, chunk_size: int, misses_per_program: int = 4,
                 host_scales: torch.Tensor | None = None, max_programs: int | None = None, num_warps: int = 4,
                 device_region: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None) -> None:
    """max_programs caps the grid (programs then loop over the work): fewer multiprocessors wait on PCIe, the others
    stay free for work on other streams. None: one program per (sequence, KV head, block of misses).
    device_region: (device_values, device_scales or None, device_hits), pages P and up of host_table."""
    P, page_tokens, Hkv, d = host_values.shape
    N, Hkv_o, KC, d_o = value_slots.shape
    B, _, K = miss_chunks.shape
    assert Hkv_o == Hkv and d_o == d and KC == K * chunk_size and miss_chunks.shape == (B, Hkv, K)
    assert miss_slots.shape == miss_chunks.shape
    # On CUDA the host tensor must be pinned or cudaHostRegister-ed: Triton's launcher refuses any other host pointer.
    assert host_values.device.type == "cpu", "host values are read in place from host memory (zero-copy)"
    fp8 = host_scales is not None
    if fp8:
        assert host_values.dtype == torch.float8_e4m3fn and host_scales.dtype == torch.float32
        assert host_scales.shape == (P, page_tokens // chunk_size, Hkv) and host_scales.stride(2) == 1
        assert host_scales.device.type == "cpu", "scales are read in place from host memory, as the values"
        host_values = host_values.view(torch.uint8)  # bit-cast back to e4m3 in the kernel
    else:
        assert host_values.dtype == value_slots.dtype
        host_scales = host_values  # not read
    if device_region is None:
        dev_values, dev_scales, dev_hits = host_values, host_scales, num_miss  # not read
    else:  # read with the host region's strides
        dev_values, dev_scales, dev_hits = device_region
        assert dev_hits.dtype == torch.int32 and dev_hits.numel() == 1
        dev_values = dev_values.view(torch.uint8) if fp8 else dev_values
        dev_scales = dev_scales if fp8 else dev_values  # not read without fp8
        assert dev_values.dtype == host_values.dtype and dev_values.shape[1:] == host_values.shape[1:]
        assert dev_values.stride() == host_values.stride() and dev_scales.stride() == host_scales.stride()
    assert d == triton.next_power_of_2(d)
    assert host_values.stride(3) == 1 and host_values.stride(2) == d and host_values.stride(1) == Hkv * d
    assert value_slots.stride(3) == 1
    assert miss_chunks.is_contiguous() and miss_slots.is_contiguous() and num_miss.shape == (B, Hkv)
    assert num_miss.is_contiguous()
    assert host_table.dtype == miss_chunks.dtype == miss_slots.dtype == num_miss.dtype == slot_ids.dtype == torch.int32
    assert host_table.stride(1) == 1 and host_table.shape[0] == B and slot_ids.shape == (B,)
    blocks = triton.cdiv(K, misses_per_program)
    num_items = B * Hkv * blocks
    grid = (num_items if max_programs is None else max(1, min(max_programs, num_items)),)
    _fetch_values_kernel[grid](
        host_values, host_scales, dev_values, dev_scales, dev_hits, host_table, miss_chunks, miss_slots, num_miss,
        slot_ids, value_slots, num_items, blocks, P,
        host_values.stride(0), host_values.stride(1), host_scales.stride(0), host_scales.stride(1),
        host_table.stride(0), miss_chunks.stride(0), miss_chunks.stride(1), num_miss.stride(0),
        value_slots.stride(0), value_slots.stride(1), value_slots.stride(2),
        NUM_HEADS=Hkv, CHUNK=chunk_size, PAGE_TOKENS=page_tokens, HEAD_DIM=d,
        MISSES_PER_PROGRAM=misses_per_program, FP8=fp8, TIERED=device_region is not None, num_warps=num_warps)
