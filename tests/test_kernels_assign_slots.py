import pytest
import torch

from test_kernels_utils import DEVICE, LLAMA, assert_close, ragged_lengths, slot_ids_for
from kernels.assign_slots import assign_slots
from shadowkv_core.shadowkv.batched_reference import assign_slots_batched, miss_lists_batched


def _step(resident, slot_ids, num_chunks, K, Hkv, g, keep_share):
    """A next step's selection: part of each head's resident chunks again, the rest new, ragged counts."""
    B = len(num_chunks)
    k_max = min(K, max(num_chunks))
    selected = torch.full((B, Hkv, k_max), -3, dtype=torch.int64)
    num_selected = torch.tensor([min(K, n) for n in num_chunks], dtype=torch.int32)
    for b, n in enumerate(num_chunks):
        k = int(num_selected[b])
        for h in range(Hkv):
            old = resident[int(slot_ids[b]), h].cpu()
            old = old[old >= 0][torch.randperm(int((old >= 0).sum()), generator=g)]
            keep = old[:int(keep_share * k)]
            fresh = torch.randperm(n, generator=g)
            fresh = fresh[~torch.isin(fresh, keep)][:k - len(keep)]
            selected[b, h, :k] = torch.cat([keep, fresh])[torch.randperm(k, generator=g)]
    return selected.to(resident.device), num_selected.to(resident.device)


def _check(num_chunks, Hkv, K, device, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, N = len(num_chunks), len(num_chunks) + 2
    resident = torch.full((N, Hkv, K), -1, dtype=torch.int64, device=device)
    slot_ids = slot_ids_for(B, N, g).to(device)
    total, expected_total = torch.zeros(1, dtype=torch.int32, device=device), 0  # misses summed over the steps
    for step in range(steps):  # empty slots first, then steps with hits
        selected, num_selected = _step(resident, slot_ids, num_chunks, K, Hkv, g, keep_share=0.6)
        expected_res, miss_mask = assign_slots_batched(resident, slot_ids, selected, num_selected)
        exp_chunks, exp_slots, exp_num = miss_lists_batched(expected_res, miss_mask)
        got = resident.clone()  # in/out: the kernel reads the old resident chunks and writes the new ones
        miss_chunks, miss_slots, num_miss = assign_slots(got, slot_ids, selected, num_selected, miss_total=total)
        expected_total += int(exp_num.sum())
        assert int(total) == expected_total, f"step {step} miss total"
        assert_close(num_miss, exp_num, torch.float32, f"step {step} miss counts", tol=(0, 0))
        listed = torch.arange(K, device=device) < exp_num[..., None]
        assert_close(torch.where(listed, miss_chunks, -1), exp_chunks, torch.float32, f"step {step} miss chunks",
                     tol=(0, 0))
        assert_close(torch.where(listed, miss_slots, -1), exp_slots, torch.float32, f"step {step} miss slots",
                     tol=(0, 0))
        assert_close(got[slot_ids.long()], expected_res, torch.float32, f"step {step} resident", tol=(0, 0))
        resident = got


@pytest.mark.parametrize("num_chunks,Hkv,K", [([37, 5, 70], 2, 16), ([3, 200], 3, 24), ([9], 1, 8)])
def test_assign_slots_small(num_chunks, Hkv, K):
    _check(num_chunks, Hkv, K, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("context,batch", [(32 * 1024, 32), (128 * 1024, 4)])
def test_assign_slots_llama(context, batch):
    num_chunks = ragged_lengths(context // LLAMA["chunk_size"], batch, seed=batch)
    _check(num_chunks, LLAMA["num_kv_heads"], LLAMA["budget_chunks"], "cuda", steps=2)
