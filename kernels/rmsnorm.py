"""RMSNorm, with the residual add before it fused in: one launch instead of the PyTorch path's eight. Reference:
shadowkv_core.models.layers.rms_norm_reference (fp32 statistics, normalised rows rounded to the input's dtype, then
the weight applied; the residual sum rounded to the dtype first, as `h + x` in the model's dtype).

Shapes (T rows, D hidden):
  x            (T, D)           any stride over T, channels contiguous
  residual     (T, D) or None   added to x first; the sum is also returned (the residual stream's next value)
  weight       (D,)             the input's dtype
  out          (T, D)           contiguous
One program per row, the whole row in registers.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, eps, stride_x, stride_r,
                     D: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * D + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, 0) / D + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * D + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """-> norm(x), or with a residual (norm(residual + x), residual + x)."""
    T, D = x.shape
    assert weight.shape == (D,) and weight.dtype == x.dtype and x.stride(1) == 1, (x.shape, weight.shape)
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    total = out if residual is None else torch.empty_like(out)
    block = triton.next_power_of_2(D)
    if T:
        _rms_norm_kernel[(T,)](x, x if residual is None else residual, weight, out, total, eps, x.stride(0),
                               0 if residual is None else residual.stride(0), D=D, BLOCK=block,
                               HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)))
    return out if residual is None else (out, total)
