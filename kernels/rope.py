"""RoPE of a forward's queries and keys, fused: one launch rotates both (the PyTorch path takes ~16 small kernels per
tensor). Reference: shadowkv_core.models.rotary.RotaryEmbedding.apply (fp32 angles and rotation, the model's rope
scaling through its inv_freq and attention factor, the result rounded to the input's dtype).

Shapes (T tokens, Hq query heads, Hkv KV heads, d head_dim):
  q            (T, Hq, d)                 any strides over T and heads, channels contiguous (a view of the QKV output)
  k            (T, Hkv, d)                the same
  positions    (T,) int64
  inv_freq     (T, ROTARY_DIM/2) fp32     per token; stride over T may be 0 (one set of frequencies for all)
  q_out, k_out (T, Hq, d), (T, Hkv, d)    contiguous, the inputs' dtype
One program per (token, head of q or k). Also home of the RoPE helpers the key rebuild shares (`rope_pairs`,
`reduce_angle`).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def reduce_angle(x):
    """x - 2πk in [-π, π] (Cody-Waite, 2π split in two so k * hi is exact): tl.cos/tl.sin may lower to the
    hardware's approximations, accurate only there; positions reach 1e5+ radians."""
    k = tl.floor(x * 0.15915494309189535 + 0.5)
    return (x - k * 6.28125) - k * 0.0019353071795864769


@triton.jit
def rope_pairs(HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Channel pair j of a head: (first[j], second[j]) for j < HEAD_DIM/2, and is_rot[j]. RoPE rotates pairs
    (i, i + ROTARY_DIM/2), or (2i, 2i+1) when INTERLEAVED, of the first ROTARY_DIM channels; pairs past ROTARY_DIM/2
    are channels it leaves alone. Splitting a head into the pairs' two halves needs no shuffle."""
    HALF: tl.constexpr = HEAD_DIM // 2
    ROT_HALF: tl.constexpr = ROTARY_DIM // 2
    offs_j = tl.arange(0, HALF)
    is_rot = offs_j < ROT_HALF
    pass_j = ROTARY_DIM + offs_j - ROT_HALF
    if INTERLEAVED:
        first = tl.where(is_rot, 2 * offs_j, pass_j)
        second = tl.where(is_rot, 2 * offs_j + 1, pass_j + (HEAD_DIM - ROTARY_DIM) // 2)
    else:
        first = tl.where(is_rot, offs_j, pass_j)
        second = tl.where(is_rot, offs_j + ROT_HALF, pass_j + (HEAD_DIM - ROTARY_DIM) // 2)
    return first, second, is_rot


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, inv_freq_ptr, q_out_ptr, k_out_ptr, attention_factor,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_it,
                 NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    t, head = tl.program_id(0), tl.program_id(1)
    first, second, is_rot = rope_pairs(HEAD_DIM, ROTARY_DIM, INTERLEAVED)
    if head < NUM_Q_HEADS:
        src = q_ptr + t * stride_qt + head * stride_qh
        dst = q_out_ptr + (t * NUM_Q_HEADS + head) * HEAD_DIM
    else:
        src = k_ptr + t * stride_kt + (head - NUM_Q_HEADS) * stride_kh
        dst = k_out_ptr + (t * NUM_KV_HEADS + head - NUM_Q_HEADS) * HEAD_DIM
    x1 = tl.load(src + first).to(tl.float32)
    x2 = tl.load(src + second).to(tl.float32)
    position = tl.load(pos_ptr + t).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + t * stride_it + tl.arange(0, HEAD_DIM // 2), mask=is_rot, other=0.0)
    angle = reduce_angle(position * inv_freq)
    cos = tl.where(is_rot, tl.cos(angle) * attention_factor, 1.0)
    sin = tl.where(is_rot, tl.sin(angle) * attention_factor, 0.0)
    out_ty = q_out_ptr.dtype.element_ty
    tl.store(dst + first, (x1 * cos - x2 * sin).to(out_ty))
    tl.store(dst + second, (x2 * cos + x1 * sin).to(out_ty))


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float,
         interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q_out, k_out), q and k rotated at their positions (new contiguous tensors)."""
    T, Hq, d = q.shape
    _, Hkv, _ = k.shape
    rot_half = inv_freq.shape[-1]
    assert k.shape == (T, Hkv, d) and positions.shape == (T,) and inv_freq.shape == (T, rot_half), (
        q.shape, k.shape, positions.shape, inv_freq.shape)
    assert q.dtype == k.dtype and inv_freq.dtype == torch.float32 and positions.dtype == torch.int64
    assert q.stride(2) == k.stride(2) == 1 and inv_freq.stride(1) == 1
    assert 2 * rot_half <= d and d == triton.next_power_of_2(d)
    q_out = torch.empty(T, Hq, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, Hkv, d, dtype=k.dtype, device=k.device)
    if T:
        _rope_kernel[(T, Hq + Hkv)](
            q, k, positions, inv_freq, q_out, k_out, attention_factor,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), inv_freq.stride(0),
            NUM_Q_HEADS=Hq, NUM_KV_HEADS=Hkv, HEAD_DIM=d, ROTARY_DIM=2 * rot_half, INTERLEAVED=interleaved,
            num_warps=1)
    return q_out, k_out
