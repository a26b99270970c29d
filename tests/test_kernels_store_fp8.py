"""kernels/store_fp8.py against the PyTorch path it replaces (reference.quantize_values over chunks of one token, a
value that is not finite stored as 0): code for code and scale for scale, on fresh random inputs (strided token
rows, rows scattered over blocks, odd token counts, magnitudes far from 1, all-zero rows)."""
import pytest
import torch

from test_kernels_utils import DEVICE
from kernels.store_fp8 import store_fp8
from shadowkv_core.shadowkv.reference import quantize_values


def _check(n, Hkv, d, page, blocks, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2 * Hkv, d, generator=g) * torch.logspace(-4, 4, n)[:, None, None]
    k, v = x[:, :Hkv].to(device, dtype), x[:, Hkv:].to(device, dtype)  # strided over tokens
    v[0, 0] = 0.0  # an all-zero row
    if n > 2:
        v[2, -1, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    rows = torch.randperm(blocks * page, generator=g)[:n].to(device)
    k_pool = torch.zeros(blocks * page, Hkv, d, dtype=torch.float8_e4m3fn, device=device)
    v_pages = torch.zeros(blocks, Hkv, d, page, dtype=torch.float8_e4m3fn, device=device)
    k_scales, v_scales = (torch.ones(Hkv, blocks * page, device=device) for _ in "kv")
    store_fp8(k, v, rows, k_pool, v_pages, k_scales, v_scales)
    k_codes, k_want = quantize_values(k, 1)
    v_codes, v_want = quantize_values(torch.where(torch.isfinite(v), v, 0), 1)
    assert torch.equal(k_pool[rows].view(torch.uint8), k_codes.view(torch.uint8))
    assert torch.equal(v_pages[rows // page, :, :, rows % page].view(torch.uint8), v_codes.view(torch.uint8))
    assert torch.equal(k_scales[:, rows], k_want.T) and torch.equal(v_scales[:, rows], v_want.T)
    untouched = torch.ones(blocks * page, dtype=torch.bool, device=device)
    untouched[rows] = False
    assert not k_pool[untouched].view(torch.uint8).any() and (k_scales[:, untouched] == 1).all()
    assert torch.isfinite(v_pages.float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,Hkv,d,page,blocks", [(1, 2, 32, 4, 3), (7, 3, 16, 16, 2), (40, 2, 64, 8, 9)])
def test_store_fp8_equals_the_pytorch_path(n, Hkv, d, page, blocks, dtype):
    _check(n, Hkv, d, page, blocks, dtype, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 13, 300])
def test_store_fp8_equals_the_pytorch_path_llama(n):
    _check(n, 8, 128, 64, 16, torch.bfloat16, "cuda", seed=n)
