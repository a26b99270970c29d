"""The decoder's fused per-token kernels (RMSNorm with the residual add, SwiGLU's gate, RoPE of queries and keys)
against the PyTorch code of shadowkv_core.models, on fresh random inputs: strided views as the model passes them,
odd sizes, every rope layout."""
import pytest
import torch

from test_kernels_utils import DEVICE, LLAMA, LLAMA3_SCALING, assert_close, rotary_for_tests
from kernels.rmsnorm import rms_norm
from kernels.rope import rope
from kernels.swiglu import silu_mul
from shadowkv_core.models.layers import rms_norm_reference, silu_mul_reference

DYNAMIC = {"rope_type": "dynamic", "factor": 4.0}


def _rows(T, D, dtype, device, g, pad=0):
    """(T, D) as a column slice of a wider buffer (row stride D + pad), like the QKV or gate/up outputs."""
    return torch.randn(T, D + pad, generator=g).to(device, dtype)[:, :D]


def _check_rms_norm(T, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, residual = _rows(T, D, dtype, device, g, pad=5), _rows(T, D, dtype, device, g, pad=3)
    weight = (1 + 0.1 * torch.randn(D, generator=g)).to(device, dtype)
    eps = 1e-5
    assert_close(rms_norm(x, weight, eps), rms_norm_reference(x, weight, eps), dtype, "norm")
    out, total = rms_norm(x, weight, eps, residual)
    expected_total = residual + x
    assert torch.equal(total, expected_total), "the residual sum rounds as the model's add"
    assert_close(out, rms_norm_reference(expected_total, weight, eps), dtype, "norm of the sum")


def _check_silu_mul(T, inter, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = 3 * _rows(T, 2 * inter, dtype, device, g, pad=7)
    assert_close(silu_mul(gate_up, block=64), silu_mul_reference(gate_up), dtype, "silu(gate) * up")


def _check_rope(T, Hq, Hkv, d, dtype, device, rotary_dim=None, interleaved=False, scaling=None, start=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * d, generator=g).to(device, dtype)  # the QKV projection's output
    q = qkv[:, :Hq * d].view(T, Hq, d)
    k = qkv[:, Hq * d:(Hq + Hkv) * d].view(T, Hkv, d)
    rotary = rotary_for_tests(rotary_dim or d, interleaved, scaling, device)
    positions = (start + torch.randperm(4 * T + 3, generator=g)[:T]).to(device)  # ragged batches: any order
    seq_lens = positions + 1 + torch.randint(0, 50, (T,), generator=g).to(device) if rotary.uses_seq_lens else None
    freqs = rotary.frequencies(positions, seq_lens).float().expand(T, -1)
    q_out, k_out = rope(q, k, positions, freqs, rotary.attention_factor, interleaved)
    assert_close(q_out, rotary.apply(q, positions, seq_lens), dtype, "rotated queries")
    assert_close(k_out, rotary.apply(k, positions, seq_lens), dtype, "rotated keys")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,D", [(1, 64), (7, 200), (3, 1000)])
def test_rms_norm_small(T, D, dtype):
    _check_rms_norm(T, D, dtype, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,inter", [(1, 64), (5, 150)])
def test_silu_mul_small(T, inter, dtype):
    _check_silu_mul(T, inter, dtype, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rotary_dim,interleaved,scaling", [(None, False, None), (16, True, None),
                                                            (16, False, DYNAMIC), (None, False, LLAMA3_SCALING)])
def test_rope_small(rotary_dim, interleaved, scaling, dtype):
    _check_rope(9, 6, 2, 32, dtype, DEVICE, rotary_dim, interleaved, scaling)


def test_rope_far_positions():
    """Positions past 100K: RoPE angles of 1e5 radians, in fp32 as the reference."""
    _check_rope(5, 4, 2, 32, torch.float32, DEVICE, scaling=LLAMA3_SCALING, start=120_000)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 32, 4096])
def test_layer_ops_llama(T):
    hidden, inter = 4096, 14336
    _check_rms_norm(T, hidden, torch.bfloat16, "cuda", seed=T)
    _check_silu_mul(T, inter, torch.bfloat16, "cuda", seed=T)
    _check_rope(T, LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"], torch.bfloat16, "cuda",
                scaling=LLAMA3_SCALING, start=100_000, seed=T)
