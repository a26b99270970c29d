import pytest
import torch

from test_kernels_utils import DEVICE, LLAMA, assert_close, page_tables, ragged_lengths, random_misses, slot_ids_for
from kernels.fetch_values import _fetch_values_kernel, fetch_values
from shadowkv_core.shadowkv.batched_reference import gather_values_batched
from shadowkv_core.shadowkv.reference import quantize_values


def _split_pool(values, scales, P, device):
    """A pool's pages P and up as a device region (values, scales or None, its miss counter), None if there are
    none; its first P pages as the host store (pinned on CUDA)."""
    region = None
    if P < len(values):
        region = (values[P:].to(device), None if scales is None else scales[P:].to(device),
                  torch.zeros(1, dtype=torch.int32, device=device))
        values, scales = values[:P], None if scales is None else scales[:P]
    if device == "cuda":
        values, scales = values.pin_memory(), None if scales is None else scales.pin_memory()
    return values, scales, region


def _check(num_chunks, Hkv, d, K, C, page_tokens, dtype, device, seed=0, fp8=False, max_programs=None,
           device_pages=0):
    """device_pages: the pool's last pages are handed to the kernel as its device region (ids P_host and up)."""
    g = torch.Generator().manual_seed(seed)
    B, N = len(num_chunks), len(num_chunks) + 1
    table, num_pages = page_tables([n * C for n in num_chunks], page_tokens, g)
    host_values = torch.randn(num_pages, page_tokens, Hkv, d, generator=g).to(dtype)
    host_scales = None
    if fp8:  # chunks of very different magnitudes: each scale matters
        magnitude = torch.exp(4 * torch.randn(num_pages, page_tokens // C, 1, Hkv, 1, generator=g))
        values = host_values.float().unflatten(1, (-1, C)) * magnitude
        host_values, host_scales = quantize_values(values.flatten(1, 2), C)
    expected_from = host_values, host_scales
    P = num_pages - device_pages
    host_values, host_scales, region = _split_pool(host_values, host_scales, P, device)
    value_slots = torch.randn(N, Hkv, K * C, d, generator=g).to(device, dtype)
    slot_ids = slot_ids_for(B, N, g).to(device)
    misses = [t.to(device) for t in random_misses(B, Hkv, K, num_chunks, g)]
    expected = gather_values_batched(value_slots, expected_from[0], table, *misses, slot_ids, C, expected_from[1])
    got = value_slots.clone()
    got[expected != value_slots] = float("nan")  # poison the outputs
    fetch_values(host_values, table.to(device), *misses, slot_ids, got, C, host_scales=host_scales,
                 max_programs=max_programs, device_region=region)
    assert_close(got, expected, dtype, "value slots", tol=(0, 0))  # a copy (fp8: one product, one rounding): bit-exact
    if device_pages:  # the misses whose page lies in the device region, counted
        chunks, _, num_miss = (t.cpu() for t in misses)
        on_device = [int((table.cpu()[b].long()[chunks[b, h, :int(num_miss[b, h])].long() * C // page_tokens] >= P)
                         .sum()) for b in range(B) for h in range(Hkv)]
        assert int(region[2]) == sum(on_device) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_chunks,Hkv,K", [([37, 5, 70], 2, 12), ([3], 3, 5)])
def test_fetch_values_small(num_chunks, Hkv, K, dtype):
    _check(num_chunks, Hkv, 32, K, 4, 16, dtype, DEVICE)


@pytest.mark.parametrize("max_programs", [1, 5])
def test_fetch_values_capped_grid_loops_over_all_the_work(max_programs):
    _check([37, 5, 70], 2, 32, 12, 4, 16, torch.float16, DEVICE, seed=4, max_programs=max_programs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fetch_values_fp8_dequantises_each_chunk_with_its_scale(dtype):
    _check([37, 5, 70], 2, 32, 12, 4, 16, dtype, DEVICE, seed=3, fp8=True)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("device_pages", [4, 13])
def test_fetch_values_reads_each_page_from_its_region(fp8, device_pages):
    """Pages split between the host and a device region: each miss is read where its page lies."""
    _check([37, 5, 70], 2, 32, 12, 4, 16, torch.float16, DEVICE, seed=6, fp8=fp8, max_programs=3,
           device_pages=device_pages)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_fetch_values_device_region_llama(fp8):
    C = LLAMA["chunk_size"]
    num_chunks = ragged_lengths(128 * 1024 // C, 4, seed=7)
    _check(num_chunks, LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["budget_chunks"], C, 128, torch.bfloat16,
           "cuda", fp8=fp8, max_programs=16, device_pages=1500)


@pytest.mark.gpu
@pytest.mark.parametrize("context,batch", [(32 * 1024, 32), (128 * 1024, 4)])
def test_fetch_values_llama(context, batch):
    C = LLAMA["chunk_size"]
    num_chunks = ragged_lengths(context // C, batch, seed=batch)
    _check(num_chunks, LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["budget_chunks"], C, 128, torch.bfloat16,
           "cuda")


@pytest.mark.gpu
def test_fetch_values_fp8_llama():
    C = LLAMA["chunk_size"]
    num_chunks = ragged_lengths(128 * 1024 // C, 4, seed=5)
    _check(num_chunks, LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["budget_chunks"], C, 128, torch.bfloat16,
           "cuda", fp8=True, max_programs=32)


@pytest.mark.gpu
def test_fetch_values_compiles_once_for_every_miss_count():
    """A prefix read's miss count is the prefix's chunk count: reads of prefixes of other lengths (multiples of 16
    or not) launch the kernel already compiled."""
    compiled = _fetch_values_kernel.device_caches[torch.cuda.current_device()][0]
    _check([300, 170], 2, 32, 12, 4, 16, torch.bfloat16, "cuda", seed=8)
    count = len(compiled)
    for K in (32, 45, 100, 256):
        _check([300, 170], 2, 32, K, 4, 16, torch.bfloat16, "cuda", seed=K)
    assert len(compiled) == count
