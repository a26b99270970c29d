import pytest
import torch

from test_kernels_utils import DEVICE, LLAMA, assert_close, page_tables, ragged_lengths, random_misses, slot_ids_for
from kernels.fetch_values import fetch_values
from shadowkv_core.shadowkv.batched_reference import gather_values_batched


def _check(num_chunks, Hkv, d, K, C, page_tokens, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, N = len(num_chunks), len(num_chunks) + 1
    table, num_pages = page_tables([n * C for n in num_chunks], page_tokens, g)
    host_values = torch.randn(num_pages, page_tokens, Hkv, d, generator=g).to(dtype)
    if device == "cuda":
        host_values = host_values.pin_memory()
    value_slots = torch.randn(N, Hkv, K * C, d, generator=g).to(device, dtype)
    slot_ids = slot_ids_for(B, N, g).to(device)
    misses = [t.to(device) for t in random_misses(B, Hkv, K, num_chunks, g)]
    expected = gather_values_batched(value_slots, host_values, table, *misses, slot_ids, C)
    got = value_slots.clone()
    got[expected != value_slots] = float("nan")  # poison the outputs
    fetch_values(host_values, table.to(device), *misses, slot_ids, got, C)
    assert_close(got, expected, dtype, "value slots", tol=(0, 0))  # a copy: bit-exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_chunks,Hkv,K", [([37, 5, 70], 2, 12), ([3], 3, 5)])
def test_fetch_values_small(num_chunks, Hkv, K, dtype):
    _check(num_chunks, Hkv, 32, K, 4, 16, dtype, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("context,batch", [(32 * 1024, 32), (128 * 1024, 4)])
def test_fetch_values_llama(context, batch):
    C = LLAMA["chunk_size"]
    num_chunks = ragged_lengths(context // C, batch, seed=batch)
    _check(num_chunks, LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["budget_chunks"], C, 128, torch.bfloat16,
           "cuda")
