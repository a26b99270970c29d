import pytest
import torch

from test_kernels_utils import DEVICE, LLAMA, assert_close, page_tables, ragged_lengths, random_misses, slot_ids_for
from kernels.fetch_values import fetch_values
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


def _check_staged(num_chunks, Hkv, d, K, C, page_tokens, dtype, device, seed=0, fp8=False, misses_per_program=4,
                  device_pages=0):
    """A prefetch (miss_slots None: the j-th chunk to staging slot j) of random lists, then a fetch whose misses are
    partly among them: equal to the reference fetch from the host, with the staged misses read from the staging
    area (their host rows are poisoned after the prefetch) and counted. device_pages: the pool's last pages are a
    device region (as in _check), read by both fetches; its misses that were not staged are counted as its own."""
    g = torch.Generator().manual_seed(seed)
    B, N = len(num_chunks), len(num_chunks) + 1
    table, num_pages = page_tables([n * C for n in num_chunks], page_tokens, g)
    host_values = torch.randn(num_pages, page_tokens, Hkv, d, generator=g).to(dtype)
    host_scales = None
    if fp8:
        host_values, host_scales = quantize_values(host_values.float(), C)
    expected_from = host_values, host_scales
    P = num_pages - device_pages
    host_values, host_scales, region = _split_pool(host_values, host_scales, P, device)
    slot_ids = slot_ids_for(B, N, g).to(device)
    misses = [t.to(device) for t in random_misses(B, Hkv, K, num_chunks, g)]
    stage_chunks, stage_count = misses[0].clone(), misses[2].clone()
    for b in range(B):  # the prefetch guessed about half of each head's misses, and chunks that are not missed
        for h in range(Hkv):
            m = int(misses[2][b, h])
            guessed = misses[0][b, h, :m][torch.randperm(m, generator=g)[:m // 2].to(device)]
            others = torch.tensor([c for c in torch.randperm(num_chunks[b], generator=g).tolist()
                                   if c not in misses[0][b, h, :m].tolist()][:K - len(guessed)], dtype=torch.int32)
            row = torch.cat([guessed, others.to(device)])[torch.randperm(len(guessed) + len(others), generator=g)
                                                          .to(device)]
            stage_chunks[b, h, :len(row)] = row
            stage_count[b, h] = len(row)
    expected_hits = sum(int(torch.isin(misses[0][b, h, :int(misses[2][b, h])],
                                       stage_chunks[b, h, :int(stage_count[b, h])]).sum())
                        for b in range(B) for h in range(Hkv))
    value_slots = torch.randn(N, Hkv, K * C, d, generator=g).to(device, dtype)
    expected = gather_values_batched(value_slots, expected_from[0], table, *misses, slot_ids, C, expected_from[1])
    stage = torch.full_like(value_slots, float("nan"))
    fetch_values(host_values, table.to(device), stage_chunks, None, stage_count, slot_ids, stage, C,
                 host_scales=host_scales, device_region=region)
    unstaged_on_device = 0
    for b in range(B):  # the staged chunks' values are not read again from their pages
        for h in range(Hkv):
            staged_here = stage_chunks[b, h, :int(stage_count[b, h])].tolist()
            for c in staged_here:
                rows = torch.arange(c * C, c * C + C)
                pages = table[b].long().cpu()[rows // page_tokens]  # the stores are indexed on the host
                poison = 0x7F if fp8 else float("nan")  # 0x7F: e4m3's NaN
                for store, at, first in ((host_values, pages < P, 0), (region and region[0], pages >= P, P)):
                    if at.any():
                        store.view(torch.uint8 if fp8 else dtype)[pages[at] - first, rows[at] % page_tokens, h] = poison
            unstaged_on_device += sum(int(table[b, c * C // page_tokens]) >= P
                                      for c in misses[0][b, h, :int(misses[2][b, h])].tolist() if c not in staged_here)
    if region:
        region[2].zero_()
    got = value_slots.clone()
    got[expected != value_slots] = float("nan")
    hits = torch.zeros(1, dtype=torch.int32, device=device)
    fetch_values(host_values, table.to(device), *misses, slot_ids, got, C, host_scales=host_scales,
                 staged=(stage_chunks, stage_count, stage, hits), max_programs=3,
                 misses_per_program=misses_per_program, device_region=region)
    assert_close(got, expected, dtype, "value slots", tol=(0, 0))
    assert int(hits) == expected_hits > 0
    if region:
        assert int(region[2]) == unstaged_on_device > 0


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype,misses_per_program", [(torch.float32, 4), (torch.float16, 4), (torch.float16, 8)])
def test_fetch_values_copies_the_misses_a_prefetch_staged(dtype, misses_per_program, fp8):
    _check_staged([37, 5, 70], 2, 32, 12, 4, 16, dtype, DEVICE, seed=6, fp8=fp8, misses_per_program=misses_per_program)


@pytest.mark.parametrize("fp8", [False, True])
def test_fetch_values_staged_misses_and_a_device_region(fp8):
    """A prefetch and a device value tier together (ShadowKVConfig.prefetch with device_value_share)."""
    _check_staged([37, 5, 70], 2, 32, 12, 4, 16, torch.float16, DEVICE, seed=8, fp8=fp8, device_pages=20)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("misses_per_program", [4, 32])
def test_fetch_values_staged_llama(fp8, misses_per_program):
    C = LLAMA["chunk_size"]
    _check_staged(ragged_lengths(32 * 1024 // C, 4, seed=7), LLAMA["num_kv_heads"], LLAMA["head_dim"],
                  LLAMA["budget_chunks"], C, 128, torch.bfloat16, "cuda", fp8=fp8,
                  misses_per_program=misses_per_program)
