"""A forward's new keys and values written into the dense fp8 pool, fused: each token and KV head quantised to e4m3
with its own fp32 scale (largest magnitude to E4M3_MAX) and stored, the key as a token row, the value into its
block's page-transposed rows. One launch a layer instead of the PyTorch path's casts, reductions and indexed writes.
Reference: shadowkv_core.cache.dense.DenseKVCache._store (reference.quantize_values over chunks of one token), code
for code: the scale the largest magnitude times fp32(1 / E4M3_MAX), the codes an IEEE division rounded to nearest
even.

Shapes (n tokens, Hkv KV heads, d head_dim, R pool rows, page tokens a block):
  k, v          (n, Hkv, d)           the model's dtype, channels contiguous (any stride over tokens and heads)
  rows          (n,) int64            pool rows; row r lies in block r // page at r % page
  k_pool        (R, Hkv, d) e4m3      contiguous
  v_pages       (R / page, Hkv, d, page) e4m3, contiguous
  k/v_scales    (Hkv, R) fp32         the same strides, rows contiguous
A value that is not finite is stored as 0 (the pool's codes stay finite: the decode kernel weighs the codes past a
sequence's end by zero, which a NaN would defeat).
"""
import torch
import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
TINY = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal: the scale of an all-zero row


@triton.jit
def _round_to_e4m3(y):
    """y in [-E4M3_MAX, E4M3_MAX] fp32 -> the nearest e4m3 value (ties to even), still fp32: e4m3 keeps 3 bits below
    the leading one, from 2^-6 down at the subnormals' spacing 2^-9. Adding 2^23 times that spacing rounds to a
    multiple of it (fp32's own rounding); the sign is put back by its bit (-0 as the cast gives it). Done here
    because Triton's interpreter mis-rounds fp32 to e4m3 across a power of two; the cast then converts exactly."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magnitude = (tl.abs(y) + spacing * 8388608.0) - spacing * 8388608.0
    return (magnitude.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _quantise(x):
    scale = tl.maximum(tl.max(tl.abs(x), 0) * (1.0 / E4M3_MAX), TINY)
    return _round_to_e4m3(tl.clamp(tl.div_rn(x, scale), -E4M3_MAX, E4M3_MAX)).to(tl.float8e4nv), scale


@triton.jit
def _store_fp8_kernel(k_ptr, v_ptr, rows_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr, stride_kn, stride_kh, stride_vn,
                      stride_vh, stride_sh, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      PAGE: tl.constexpr):
    i, h = tl.program_id(0), tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    row = tl.load(rows_ptr + i)
    k_code, k_scale = _quantise(tl.load(k_ptr + i * stride_kn + h * stride_kh + offs_d).to(tl.float32))
    tl.store(kp_ptr + (row * NUM_KV_HEADS + h) * HEAD_DIM + offs_d, k_code)
    tl.store(ks_ptr + h * stride_sh + row, k_scale)
    v = tl.load(v_ptr + i * stride_vn + h * stride_vh + offs_d).to(tl.float32)
    v_code, v_scale = _quantise(tl.where(tl.abs(v) < float("inf"), v, 0.0))  # NaN fails the comparison too
    block = row // PAGE
    tl.store(vp_ptr + ((block * NUM_KV_HEADS + h) * HEAD_DIM + offs_d) * PAGE + row % PAGE, v_code)
    tl.store(vs_ptr + h * stride_sh + row, v_scale)


def store_fp8(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, k_pool: torch.Tensor, v_pages: torch.Tensor,
              k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
    n, Hkv, d = k.shape
    page = v_pages.shape[3]
    assert v.shape == k.shape and k.stride(2) == v.stride(2) == 1 and d == triton.next_power_of_2(d)
    assert rows.shape == (n,) and rows.dtype == torch.int64
    assert k_pool.dtype == v_pages.dtype == torch.float8_e4m3fn and k_pool.is_contiguous() and v_pages.is_contiguous()
    assert k_pool.shape[1:] == (Hkv, d) and v_pages.shape == (k_pool.shape[0] // page, Hkv, d, page)
    assert k_scales.shape == v_scales.shape == (Hkv, k_pool.shape[0]) and k_scales.stride() == v_scales.stride()
    assert k_scales.stride(1) == 1 and k_scales.dtype == v_scales.dtype == torch.float32
    if n:
        _store_fp8_kernel[(n, Hkv)](k, v, rows, k_pool, v_pages, k_scales, v_scales, k.stride(0), k.stride(1),
                                    v.stride(0), v.stride(1), k_scales.stride(0), NUM_KV_HEADS=Hkv, HEAD_DIM=d,
                                    PAGE=page, num_warps=1)
