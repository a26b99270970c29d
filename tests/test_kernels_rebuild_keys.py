import pytest
import torch

from test_kernels_utils import (DEVICE, LLAMA, LLAMA3_SCALING, assert_close, page_tables, ragged_lengths,
                               random_misses, rotary_for_tests, slot_ids_for)
from kernels.rebuild_keys import candidate_logits, rebuild_keys
from shadowkv_core.shadowkv.batched_reference import candidate_logits_batched, rebuild_keys_batched


def _inputs(num_chunks, Hkv, d, rank, C, page_tokens, dtype, device, rotary_dim=None, interleaved=False,
            scaling=None, seed=0, landmark_kind=None, fp8_landmarks=False):
    """A layer's paged U rows, slots' SV, page tables, slot ids, RoPE and (optionally) landmarks."""
    g = torch.Generator().manual_seed(seed)
    B, N = len(num_chunks), len(num_chunks) + 1
    table, num_pages = page_tables([n * C for n in num_chunks], page_tokens, g)
    u_pages = torch.randn(num_pages, page_tokens, rank, generator=g).to(device, dtype)
    sv = (torch.randn(N, Hkv, rank, d, generator=g) / rank ** 0.5).to(device, dtype)
    slot_ids = slot_ids_for(B, N, g).to(device)
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
    inv_freq = rotary.inv_freq.float()[None].expand(B, -1)
    return g, dict(u_pages=u_pages, table=table.to(device), sv=sv, slot_ids=slot_ids, rotary=rotary,
                   inv_freq=inv_freq, landmarks=landmarks)


def _check(num_chunks, Hkv, d, rank, K, C, page_tokens, dtype, device, rotary_dim=None, interleaved=False,
           scaling=None, seed=0, landmark_kind=None, fp8_landmarks=False, **shape):
    g, x = _inputs(num_chunks, Hkv, d, rank, C, page_tokens, dtype, device, rotary_dim, interleaved, scaling, seed,
                   landmark_kind, fp8_landmarks)
    B, N = len(num_chunks), x["sv"].shape[0]
    key_slots = torch.randn(N, Hkv, K * C, d, generator=g).to(device, dtype)
    miss_chunks, miss_slots, num_miss = (t.to(device) for t in random_misses(B, Hkv, K, num_chunks, g))
    expected = rebuild_keys_batched(key_slots, x["u_pages"], x["table"], x["sv"], x["rotary"], miss_chunks,
                                    miss_slots, num_miss, x["slot_ids"], C, **x["landmarks"])
    got = key_slots.clone()
    written = expected != key_slots
    got[written] = float("nan")  # poison the outputs
    rebuild_keys(x["u_pages"], x["table"], x["sv"], x["inv_freq"], x["rotary"].attention_factor, interleaved,
                 miss_chunks, miss_slots, num_miss, x["slot_ids"], got, C, **x["landmarks"], **shape)
    assert_close(got, expected, dtype, "key slots")
    return expected, key_slots


def _check_candidates(num_chunks, Hkv, group, d, rank, m, C, page_tokens, dtype, device, **kwargs):
    g, x = _inputs(num_chunks, Hkv, d, rank, C, page_tokens, dtype, device, **kwargs)
    B = len(num_chunks)
    candidates, _, count = random_misses(B, Hkv, m, num_chunks, g)
    q = torch.randn(B, Hkv * group, d, generator=g).to(device, dtype)
    scale = d ** -0.5
    expected = candidate_logits_batched(x["u_pages"], x["table"], x["sv"], x["rotary"], candidates.to(device),
                                        count.to(device), x["slot_ids"], q, scale, C, **x["landmarks"])
    got = candidate_logits(x["u_pages"], x["table"], x["sv"], x["inv_freq"], x["rotary"].attention_factor,
                           kwargs.get("interleaved", False), candidates.to(device), count.to(device), x["slot_ids"],
                           q, scale, C, **x["landmarks"])
    scored = torch.arange(m, device=device) < count.to(device)[..., None]  # (B, Hkv, m)
    assert got.shape == (B, Hkv, group, m)
    assert torch.isinf(got[~scored[:, :, None].expand_as(got)]).all()
    assert_close(got[scored[:, :, None].expand_as(got)], expected[scored[:, :, None].expand_as(expected)], dtype,
                 "candidate logits")
    return got, count


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,landmark_kind,fp8", [(1, None, False), (3, "bounds", False), (4, "mean", False),
                                                     (6, "bounds", True)])
def test_candidate_logits(dtype, group, landmark_kind, fp8):
    """Each candidate's largest logit per query head of its group, from keys rebuilt and never stored: ragged
    counts (none in some rows), groups that do not fill a tile, partial rotary, landmarks met."""
    got, count = _check_candidates([37, 5, 70], Hkv=2, group=group, d=32, rank=40, m=12, C=4, page_tokens=16,
                                   dtype=dtype, device=DEVICE, rotary_dim=16, interleaved=True, seed=7 + group,
                                   landmark_kind=landmark_kind, fp8_landmarks=fp8)
    assert torch.isfinite(got).any() and (count < 12).any()


@pytest.mark.gpu
@pytest.mark.parametrize("landmark_kind", [None, "bounds"])
@pytest.mark.parametrize("context,batch", [(32 * 1024, 16), (128 * 1024, 3)])
def test_candidate_logits_llama(context, batch, landmark_kind):
    C = LLAMA["chunk_size"]
    _check_candidates(ragged_lengths(context // C, batch, seed=batch), LLAMA["num_kv_heads"],
                      LLAMA["num_q_heads"] // LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["rank"],
                      4 * LLAMA["budget_chunks"], C, 128, torch.bfloat16, "cuda", scaling=LLAMA3_SCALING,
                      landmark_kind=landmark_kind)
