"""The decode step's new token appended to its sequence's ShadowKV state, fused: its U row on the sequence's key basis
(K_cat · V_r, fp32) written into its GPU page, and its exact key and value into the window. One launch instead of the
PyTorch path's gather, casts, batched product and three indexed writes. Reference: the per-sequence append of
shadowkv_core.shadowkv.layer.decode_layer (reference.project_keys, GpuPages.write_u, the window writes).

Shapes (B sequences, N slots, Hkv KV heads, d head_dim, r rank, P GPU pages, E window tokens):
  k_pre, k_rot, v (B, Hkv, d)          the new tokens' pre-RoPE key, post-RoPE key, value (any stride over B and
                                       heads, channels contiguous)
  sv           (N, Hkv, r, d)          one layer of the slots' key bases (stride over N free, rest contiguous)
  slot_ids     (B,) int32
  u_pages      (P, PAGE_TOKENS, r)     one layer of the GPU pages' U rows, contiguous; row (token_page[b],
                                       token_row[b]) int64 is written
  window_k/v   (N, E, Hkv, d)          one layer of the slots' windows (stride over N free, rest contiguous); token
                                       window_pos[b] int64 is written
One program per (sequence, BLOCK_R ranks); the first of each sequence also writes the window.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _append_token_kernel(k_pre_ptr, k_rot_ptr, v_ptr, sv_ptr, slot_ptr, u_ptr, page_ptr, row_ptr, win_k_ptr,
                         win_v_ptr, pos_ptr, stride_kb, stride_kh, stride_rb, stride_rh, stride_vb, stride_vh,
                         stride_svn, stride_svh, stride_up, stride_ut, stride_wn, stride_we,
                         NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, RANK: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    b, rb = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    u = tl.zeros([BLOCK_R], dtype=tl.float32)
    for h in range(NUM_KV_HEADS):
        k = tl.load(k_pre_ptr + b * stride_kb + h * stride_kh + offs_d).to(tl.float32)
        sv = tl.load(sv_ptr + slot * stride_svn + h * stride_svh + offs_r[:, None] * HEAD_DIM + offs_d[None, :],
                     mask=r_mask[:, None], other=0.0)
        u += tl.sum(sv.to(tl.float32) * k[None, :], 1)
    page, row = tl.load(page_ptr + b), tl.load(row_ptr + b)
    tl.store(u_ptr + page * stride_up + row * stride_ut + offs_r, u.to(u_ptr.dtype.element_ty), mask=r_mask)
    if rb == 0:
        window = slot * stride_wn + tl.load(pos_ptr + b) * stride_we
        for h in range(NUM_KV_HEADS):
            tl.store(win_k_ptr + window + h * HEAD_DIM + offs_d,
                     tl.load(k_rot_ptr + b * stride_rb + h * stride_rh + offs_d))
            tl.store(win_v_ptr + window + h * HEAD_DIM + offs_d,
                     tl.load(v_ptr + b * stride_vb + h * stride_vh + offs_d))


def append_token(k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor, sv: torch.Tensor,
                 slot_ids: torch.Tensor, u_pages: torch.Tensor, token_page: torch.Tensor, token_row: torch.Tensor,
                 window_k: torch.Tensor, window_v: torch.Tensor, window_pos: torch.Tensor,
                 block_r: int = 32) -> None:
    B, Hkv, d = k_pre.shape
    N, _, r, _ = sv.shape
    assert k_rot.shape == v.shape == (B, Hkv, d) and sv.shape == (N, Hkv, r, d), (k_rot.shape, v.shape, sv.shape)
    assert u_pages.shape[2] == r and u_pages.is_contiguous() and window_k.shape == window_v.shape
    assert window_k.shape[2:] == (Hkv, d) and window_k.stride() == window_v.stride()
    assert window_k.stride(2) == d and window_k.stride(3) == 1 and sv.stride(3) == 1 and sv.stride(2) == d
    assert sv.stride(1) == r * d and k_pre.stride(2) == k_rot.stride(2) == v.stride(2) == 1
    assert k_pre.dtype == k_rot.dtype == v.dtype == sv.dtype == u_pages.dtype == window_k.dtype
    assert slot_ids.dtype == torch.int32 and token_page.dtype == token_row.dtype == window_pos.dtype == torch.int64
    assert d == triton.next_power_of_2(d)
    if B:
        _append_token_kernel[(B, triton.cdiv(r, block_r))](
            k_pre, k_rot, v, sv, slot_ids, u_pages, token_page, token_row, window_k, window_v, window_pos,
            k_pre.stride(0), k_pre.stride(1), k_rot.stride(0), k_rot.stride(1), v.stride(0), v.stride(1),
            sv.stride(0), sv.stride(1), u_pages.stride(0), u_pages.stride(1), window_k.stride(0), window_k.stride(1),
            NUM_KV_HEADS=Hkv, HEAD_DIM=d, RANK=r, BLOCK_R=block_r, num_warps=4)
