"""e4m3 inputs of the kernels' dots: fp16 by the hardware's paired conversion where the device has it (Triton's own
cast to bf16 goes through fp16 and a slow scalar conversion), and a query scaled into fp16's range."""
import os

import torch
import triton
import triton.language as tl

_PAIRED: dict[int | None, bool] = {}


def paired_e4m3(device: torch.device) -> bool:
    """Whether a kernel on `device` takes the paired conversion: CUDA sm_89 and later, never in the interpreter (it
    runs no inline assembly)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if device.index not in _PAIRED:
        props = torch.cuda.get_device_properties(device)
        _PAIRED[device.index] = (props.major, props.minor) >= (8, 9)
    return _PAIRED[device.index]


@triton.jit
def e4m3_to(x, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """e4m3 (or its uint8 bits) -> DTYPE, exactly; ASM: fp16 by `cvt.rn.f16x2.e4m3x2`."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }""", constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=True,
            pack=4)
    return x.to(tl.float8e4nv, bitcast=True).to(DTYPE)


@triton.jit
def fp16_query(q):
    """q (rows, d) -> q in fp16 scaled by a power of two to max |q| = 256, and that power (divide the dot by it)."""
    q_max = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
    q_up = tl.exp2(8.0 - tl.ceil(tl.log2(tl.maximum(q_max, 1e-30))))
    return (q.to(tl.float32) * q_up).to(tl.float16), q_up
