"""The online-softmax step the attention kernels share (flash-attention's running max, denominator and output)."""
import triton
import triton.language as tl


@triton.jit
def online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr, v_scale=None):
    """One block of keys: s (M, N) scores in log2 units (masked ones -inf), v (N, d) their values, each value row
    times v_scale (N,) where given (fp8 values: the scale rides on the weights, N multiplies instead of N*d); acc
    (M, d), m_i and l_i (M,) the running output, max and denominator -> their updates."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    w = p if v_scale is None else p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(w.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    """fp32 x, |x| <= 448 -> float8_e4m3fn, rounded to nearest even. EMULATE (Triton's interpreter, whose cast loses
    the carry of its rounding): round on the e4m3 grid in fp32 first, so that the cast is exact."""
    if EMULATE:
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
        subnormal = (x + 24576.0) - 24576.0  # multiples of 2**-9, e4m3's spacing below 2**-6
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def e4m3_low_term(x, hi, EMULATE: tl.constexpr):
    """What e4m3 hi (of fp32 x) left out, times 16, in e4m3: x ~= hi + lo / 16 holds about 7 mantissa bits (the
    remainder is within half of hi's spacing, 2**-4 of x, so 16 times it stays in range)."""
    return to_e4m3((x - hi.to(tl.float32)) * 16.0, EMULATE)


@triton.jit
def online_softmax_step_e4m3(acc, m_i, l_i, s, v, v_scale, TERMS: tl.constexpr, EMULATE: tl.constexpr):
    """online_softmax_step with fp8 values v (N, d) e4m3 and their scales v_scale (N,), the weights times the scales
    taken to e4m3 for an fp8 dot (FlashAttention-3's recipe): each block's weights are scaled to [0, 256] by its
    largest value scale, so that e4m3's range holds them, and the dot's (M, d) product is scaled back. TERMS 2: the
    weights as two e4m3 terms (e4m3_low_term), two dots."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vs_max = tl.max(v_scale, 0)  # > 0: a block holds a valid key, and the cache's scales are positive
    w = p * (v_scale / vs_max * 256.0)[None, :]
    w8 = to_e4m3(w, EMULATE)
    pv = tl.dot(w8, v)
    if TERMS > 1:
        pv += tl.dot(e4m3_low_term(w, w8, EMULATE), v) * 0.0625
    acc = acc * alpha[:, None] + pv * (vs_max / 256.0)
    return acc, m_new, l_i


@triton.jit
def online_softmax_step_t(acc_t, m_i, l_i, s_t, v, v_scale, DOT_PRECISION: tl.constexpr, E4M3: tl.constexpr,
                          TERMS: tl.constexpr, EMULATE: tl.constexpr):
    """online_softmax_step keys-major, each value row times v_scale (N,): s_t (N, M) the scores transposed, acc_t
    (d, M) the running output transposed (a p·v dot of M = d rows). E4M3: v e4m3 and the weights taken to e4m3 (in
    TERMS terms) as in online_softmax_step_e4m3; else v in the dot's dtype."""
    m_new = tl.maximum(m_i, tl.max(s_t, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s_t - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    if E4M3:
        vs_max = tl.max(v_scale, 0)
        w = p * (v_scale / vs_max * 256.0)[:, None]
        w8 = to_e4m3(w, EMULATE)
        pv = tl.dot(tl.trans(v), w8)
        if TERMS > 1:
            pv += tl.dot(tl.trans(v), e4m3_low_term(w, w8, EMULATE)) * 0.0625
        acc_t = acc_t * alpha[None, :] + pv * (vs_max / 256.0)
    else:
        w = (p * v_scale[:, None]).to(v.dtype)
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), w, input_precision=DOT_PRECISION)
    return acc_t, m_new, l_i
