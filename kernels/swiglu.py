"""SwiGLU's gate: silu(gate) * up in one launch over the fused gate/up projection's output (the PyTorch path writes
silu(gate) and reads it back). Reference: shadowkv_core.models.layers.silu_mul_reference (silu in fp32 rounded to
the dtype, then the product rounded, as F.silu(gate) * up in the model's dtype).

Shapes (T rows, I intermediate):
  gate_up      (T, 2I)          gate = [:, :I], up = [:, I:]; any stride over T, channels contiguous
  out          (T, I)           contiguous
One program per (row, BLOCK channels).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, I: tl.constexpr, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * I + offs, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    T, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(1) == 1, gate_up.shape
    inter = two_i // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        _silu_mul_kernel[(T, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), I=inter, BLOCK=block,
                                                           num_warps=4)
    return out
