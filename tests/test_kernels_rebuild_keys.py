import pytest
import torch

from test_kernels_utils import (DEVICE, LLAMA, LLAMA3_SCALING, assert_close, page_tables, ragged_lengths,
                               random_misses, rotary_for_tests, slot_ids_for)
from kernels.rebuild_keys import rebuild_keys
from shadowkv_core.shadowkv.batched_reference import rebuild_keys_batched


def _check(num_chunks, Hkv, d, rank, K, C, page_tokens, dtype, device, rotary_dim=None, interleaved=False,
           scaling=None, seed=0, landmark_kind=None, fp8_landmarks=False, **shape):
    g = torch.Generator().manual_seed(seed)
    B, N = len(num_chunks), len(num_chunks) + 1
    table, num_pages = page_tables([n * C for n in num_chunks], page_tokens, g)
    u_pages = torch.randn(num_pages, page_tokens, rank, generator=g).to(device, dtype)
    sv = (torch.randn(N, Hkv, rank, d, generator=g) / rank ** 0.5).to(device, dtype)
    key_slots = torch.randn(N, Hkv, K * C, d, generator=g).to(device, dtype)
    slot_ids = slot_ids_for(B, N, g).to(device)
    miss_chunks, miss_slots, num_miss = (t.to(device) for t in random_misses(B, Hkv, K, num_chunks, g))
    rotary = rotary_for_tests(rotary_dim or d, interleaved, scaling, device)
    landmarks = {}
    if landmark_kind is not None:  # centres near the rebuilt keys' scale, half-ranges that clamp some and not others
        lm = torch.randn(num_pages, page_tokens // C, Hkv, d, generator=g)
        if landmark_kind == "bounds":
            lm = torch.cat([lm, torch.rand(num_pages, page_tokens // C, Hkv, d, generator=g) * 2], -1)
        scales = None
        if fp8_landmarks:
            scales = torch.rand(num_pages, page_tokens // C, Hkv, generator=g) + 0.5
            lm = (lm / scales[..., None]).to(torch.float8_e4m3fn)
            scales = scales.to(device)
        landmarks = {"landmarks": lm.to(device) if fp8_landmarks else lm.to(device, dtype),
                     "landmark_kind": landmark_kind, "landmark_scales": scales}
    expected = rebuild_keys_batched(key_slots, u_pages, table.to(device), sv, rotary, miss_chunks, miss_slots,
                                    num_miss, slot_ids, C, **landmarks)
    got = key_slots.clone()
    written = expected != key_slots
    got[written] = float("nan")  # poison the outputs
    inv_freq = rotary.inv_freq.float()[None].expand(B, -1)
    rebuild_keys(u_pages, table.to(device), sv, inv_freq, rotary.attention_factor, interleaved, miss_chunks,
                 miss_slots, num_miss, slot_ids, got, C, **landmarks, **shape)
    assert_close(got, expected, dtype, "key slots")
    return expected, key_slots


@pytest.mark.parametrize("landmark_kind,fp8", [("bounds", False), ("mean", False), ("bounds", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rebuild_keys_meet_landmarks(landmark_kind, fp8, dtype):
    """Each rebuilt chunk meets its landmark (ShadowKVConfig.landmark_rebuild), partial rotary and odd counts
    included; the reference's rows moved indeed (a mean shifts every coordinate, bounds clamp those outside)."""
    expected, _ = _check([37, 5, 70], Hkv=2, d=32, rank=40, K=12, C=4, page_tokens=16, dtype=dtype, device=DEVICE,
                         rotary_dim=16, interleaved=True, seed=3, landmark_kind=landmark_kind, fp8_landmarks=fp8)
    plain, before = _check([37, 5, 70], Hkv=2, d=32, rank=40, K=12, C=4, page_tokens=16, dtype=dtype,
                           device=DEVICE, rotary_dim=16, interleaved=True, seed=3)
    written = plain != before
    assert (expected[written] != plain[written]).float().mean() > (0.9 if landmark_kind == "mean" else 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rotary_dim,interleaved,scaling", [(None, False, None), (16, True, None),
                                                            (None, False, LLAMA3_SCALING)])
def test_rebuild_keys_small(dtype, rotary_dim, interleaved, scaling):
    _check([37, 5, 70], Hkv=2, d=32, rank=40, K=12, C=4, page_tokens=16, dtype=dtype, device=DEVICE,
           rotary_dim=rotary_dim, interleaved=interleaved, scaling=scaling)


@pytest.mark.parametrize("miss_block,block_r,num_warps", [(4, 16, 4), (8, 64, 4), (32, 32, 8)])
def test_rebuild_keys_tile_shapes(miss_block, block_r, num_warps):
    """Other tiles (misses per program, rank step, warps): the same keys; rank 40 is not a multiple of 16 or 64."""
    _check([37, 5, 70], Hkv=2, d=32, rank=40, K=12, C=4, page_tokens=16, dtype=torch.float32, device=DEVICE,
           seed=5, miss_block=miss_block, block_r=block_r, num_warps=num_warps)


def test_rebuild_keys_far_positions():
    """Positions past 100K: RoPE angles of 1e5 radians, in fp32 as the reference."""
    _check([30000, 26000], Hkv=2, d=32, rank=40, K=12, C=4, page_tokens=512, dtype=torch.float32, device=DEVICE,
           scaling=LLAMA3_SCALING)


@pytest.mark.gpu
@pytest.mark.parametrize("landmark_kind,fp8", [("bounds", False), ("mean", False), ("bounds", True)])
def test_rebuild_keys_meet_landmarks_llama(landmark_kind, fp8):
    C = LLAMA["chunk_size"]
    _check(ragged_lengths(32 * 1024 // C, 8, seed=8), LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["rank"],
           LLAMA["budget_chunks"], C, 128, torch.bfloat16, "cuda", scaling=LLAMA3_SCALING,
           landmark_kind=landmark_kind, fp8_landmarks=fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [{}, dict(miss_block=16, block_r=32), dict(miss_block=32, num_warps=4)])
@pytest.mark.parametrize("context,batch", [(32 * 1024, 32), (128 * 1024, 4)])
def test_rebuild_keys_llama(context, batch, shape):
    C = LLAMA["chunk_size"]
    num_chunks = ragged_lengths(context // C, batch, seed=batch)
    _check(num_chunks, LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["rank"], LLAMA["budget_chunks"], C, 128,
           torch.bfloat16, "cuda", scaling=LLAMA3_SCALING, **shape)
