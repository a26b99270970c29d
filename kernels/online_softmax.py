"""The online-softmax step the attention kernels share (flash-attention's running max, denominator and output)."""
import triton
import triton.language as tl

from kernels.fp8 import e4m3_to


@triton.jit
def online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr, v_scale=None, V_DTYPE: tl.constexpr = None,
                        ASM: tl.constexpr = False):
    """One block of keys: s (M, N) scores in log2 units (masked ones -inf), v (N, d) their values, each value row
    times v_scale (N,) where given (fp8 values: the scale rides on the weights, N multiplies instead of N*d; the
    weights enter the dot over the block's largest scale, in [0, 1] for a half-precision v); acc (M, d), m_i and
    l_i (M,) the running output, max and denominator -> their updates. V_DTYPE: v is e4m3, converted to it here
    (e4m3_to, ASM), after the weights: converted before them, its registers stay live across the softmax."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if v_scale is None:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        v_max = tl.maximum(tl.max(v_scale, 0), 1e-30)
        w = p * (v_scale / v_max)[None, :]
        if V_DTYPE is not None:
            v = e4m3_to(v, V_DTYPE, ASM)
        acc = acc * alpha[:, None] + tl.dot(w.to(v.dtype), v, input_precision=DOT_PRECISION) * v_max
    return acc, m_new, l_i
