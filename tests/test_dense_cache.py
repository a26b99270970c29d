import math

import pytest
import torch

from shadowkv_core.attention import attention_ref
from shadowkv_core.cache.base import AttentionMetadata, CacheSpec
from shadowkv_core.cache.dense import DenseKVCache
from shadowkv_core.config import EngineConfig
from shadowkv_core.shadowkv.reference import FP8_MAX, dequantize_tokens, quantize_values

HQ, HKV, D = 4, 2, 16
# e4m3 keeps 3 mantissa bits: a normal value rounds within half its spacing, 2^-4 of itself; a subnormal one (below
# 2^-6 in scaled units, spacing 2^-9) within 2^-10 scaled units.
E4M3_REL, E4M3_SUBNORMAL = 2.0 ** -4, 2.0 ** -10


def make_cache(num_blocks=16, block_size=4, use_kernels=False, kv_cache_dtype="auto"):
    spec = CacheSpec(num_layers=2, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, scale=D ** -0.5,
                     prefill_chunk_tokens=5, use_kernels=use_kernels, kv_cache_dtype=kv_cache_dtype)
    return DenseKVCache(spec, num_blocks=num_blocks, block_size=block_size)


def e4m3_error(x: torch.Tensor) -> torch.Tensor:
    """Largest error of x (n, Hkv, d) kept as e4m3 with one scale per token and KV head (its amax maps to FP8_MAX)."""
    scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
    return E4M3_REL * x.abs() + E4M3_SUBNORMAL * scale


def fp8_attention_bound(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> float:
    """How far attention over fp8-kept keys and values may move: each score by at most eps = scale * |q|.|dk|, so
    each weight by a factor within e^(+-2 eps) and the output by (e^(2 eps) - 1) max|v|, plus the values' own error."""
    group = q.shape[1] // keys.shape[1]
    dk = e4m3_error(keys).repeat_interleave(group, 1)  # (n_k, Hq, d)
    eps = D ** -0.5 * torch.einsum("qhd,khd->qhk", q.abs(), dk).max().item()
    return math.expm1(2 * eps) * values.abs().max().item() + e4m3_error(values).max().item() + 1e-5


def random_qkv(t):
    return torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)


@pytest.mark.parametrize("implementation, function", [("sdpa_split", "prefill_attention_split"),
                                                      ("triton", "prefill_attention")])
def test_prefill_attention_implementations_give_the_default_outputs(implementation, function, monkeypatch):
    """Whole prompts (chunked), then one more chunk of each after its context: the same outputs as "sdpa", through
    the implementation asked for."""
    import shadowkv_core.attention as attention
    calls = []
    fast = getattr(attention, function)
    monkeypatch.setattr(attention, function, lambda *a, **kw: calls.append(1) or fast(*a, **kw))
    torch.manual_seed(0)
    d = 64  # a head dim the Triton kernel takes
    caches = {name: DenseKVCache(CacheSpec(num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=d,
                                           scale=d ** -0.5, prefill_chunk_tokens=5, prefill_attention=name),
                                 num_blocks=16, block_size=4) for name in ("sdpa", implementation)}
    lens, more = [7, 3, 11], [4, 6, 1]
    for cache in caches.values():
        for i, (n, m) in enumerate(zip(lens, more)):
            cache.manager.allocate(i, n + m, 0)
    for meta in (AttentionMetadata(True, [0, 1, 2], lens, [0, 0, 0], torch.zeros(sum(lens), dtype=torch.long)),
                 AttentionMetadata(True, [0, 1, 2], more, lens, torch.zeros(sum(more), dtype=torch.long))):
        t = sum(meta.query_lens)
        q, k, v = torch.randn(t, HQ, d), torch.randn(t, HKV, d), torch.randn(t, HKV, d)
        outs = {name: cache.attend(0, q, k, k, v, meta) for name, cache in caches.items()}
        torch.testing.assert_close(outs[implementation], outs["sdpa"], atol=1e-5, rtol=1e-5)
        for cache in caches.values():
            cache.finish_forward(meta)
    assert calls


def ragged_forwards(cache, steps):
    """Prefill sequences of 7, 3 and 11 tokens, then one forward per entry of `steps` (new tokens of each sequence; a
    prefill over cached blocks where more than one); yields (step, seq_id, q, out, keys, values) of each sequence per
    forward, keys and values every one it was given, exact."""
    lens = [7, 3, 11]
    for i, n in enumerate(lens):
        cache.manager.allocate(i, n, sum(new[i] for new in steps))
    history = {i: ([], []) for i in range(len(lens))}  # layer-0 keys and values per sequence
    for step, new in enumerate([lens, *steps]):
        ctx = [cache.manager.lengths[s] for s in range(len(lens))]
        meta = AttentionMetadata(max(new) > 1, [0, 1, 2], new, ctx,
                                 torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, new)]))
        q, k_pre, k_rot, v = random_qkv(sum(new))
        out = cache.attend(0, q, k_pre, k_rot, v, meta)
        for start, n, sid in zip(meta.query_starts, meta.query_lens, meta.seq_ids):
            history[sid][0].append(k_rot[start:start + n])
            history[sid][1].append(v[start:start + n])
            yield (step, sid, q[start:start + n], out[start:start + n], torch.cat(history[sid][0]),
                   torch.cat(history[sid][1]))
        cache.finish_forward(meta)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "triton"])
def test_ragged_prefill_then_decode_matches_full_attention(use_kernels):
    torch.manual_seed(0)
    cache = make_cache(use_kernels=use_kernels)
    for _, _, q, out, keys, values in ragged_forwards(cache, [[1, 1, 1]] * 5):
        want = attention_ref(q, keys, values, D ** -0.5, causal=True)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "triton"])
def test_fp8_cache_attends_within_e4m3_error_of_full_attention(use_kernels):
    """Prefill (over its own exact keys), then a prefill over cached blocks (3, 2 and 1 new tokens), then decodes.
    Every output against fp32 attention over the exact keys and values, within the error e4m3 rounding allows, and
    (once read from the cache) against attention over the rounded ones; what the cache holds within e4m3's rounding
    of each token."""
    torch.manual_seed(0)
    cache = make_cache(use_kernels=use_kernels, kv_cache_dtype="fp8")
    given = {}
    for step, sid, q, out, keys, values in ragged_forwards(cache, [[3, 2, 1]] + [[1, 1, 1]] * 4):
        err = (out - attention_ref(q, keys, values, D ** -0.5, causal=True)).abs().max().item()
        assert err <= fp8_attention_bound(q, keys, values), (step, err)
        if step:  # read back from the cache: exactly attention over the e4m3-rounded keys and values
            rounded = [dequantize_tokens(*quantize_values(x, 1), torch.float32) for x in (keys, values)]
            torch.testing.assert_close(out, attention_ref(q, *rounded, D ** -0.5, causal=True), atol=1e-5, rtol=1e-5)
        given[sid] = keys, values
    for sid, (keys, values) in given.items():
        rows = cache.manager.token_rows(sid, 0, cache.manager.lengths[sid])
        for kept, scales, exact in ((cache.k[0, rows], cache.k_scales, keys),
                                    (cache.stored_values(0, rows), cache.v_scales, values)):
            held = dequantize_tokens(kept, scales[0, :, rows].T, torch.float32)  # scales (L, Hkv, rows)
            assert ((held - exact).abs() <= e4m3_error(exact) + 1e-7).all()


def test_fp8_append_into_a_partly_filled_block_leaves_its_tokens_untouched():
    cache = make_cache(block_size=4, kv_cache_dtype="fp8")
    cache.manager.allocate(0, 2, 2)
    meta = AttentionMetadata(True, [0], [2], [0], torch.arange(2))
    q, k_pre, k_rot, v = random_qkv(2)
    cache.attend(0, q, k_pre, k_rot, v, meta)
    cache.finish_forward(meta)
    rows = cache.manager.token_rows(0, 0, 2)

    def held():  # copies: indexed by a tensor of rows
        return [cache.k[0, rows].view(torch.uint8), cache.stored_values(0, rows).view(torch.uint8),
                cache.k_scales[0, :, rows], cache.v_scales[0, :, rows]]

    before = held()
    meta = AttentionMetadata(False, [0], [1], [2], torch.tensor([2]))
    q, k_pre, k_rot, v = random_qkv(1)
    cache.attend(0, q, k_pre, 100 * k_rot, 100 * v, meta)  # far beyond the block's earlier scales
    cache.finish_forward(meta)
    assert all(torch.equal(a, b) for a, b in zip(held(), before))
    new = cache.manager.token_rows(0, 2, 3)
    appended = dequantize_tokens(cache.k[0, new], cache.k_scales[0, :, new].T, torch.float32)
    assert ((appended - 100 * k_rot).abs() <= e4m3_error(100 * k_rot) + 1e-5).all()  # no saturation either


def test_fp8_copy_sequence_copies_values_and_scales():
    cache = make_cache(kv_cache_dtype="fp8")
    for _ in ragged_forwards(cache, [[1, 1, 1]]):
        pass
    length = cache.manager.lengths[2]
    cache.manager.allocate(5, length, 0)
    cache.copy_sequence(2, 5)
    src, dst = cache.manager.token_rows(2, 0, length), cache.manager.token_rows(5, 0, length)
    assert not set(src.tolist()) & set(dst.tolist())
    for layer in range(2):
        assert torch.equal(cache.k[layer, dst].view(torch.uint8), cache.k[layer, src].view(torch.uint8))
        assert torch.equal(cache.stored_values(layer, dst).view(torch.uint8),
                           cache.stored_values(layer, src).view(torch.uint8))
        for scales in (cache.k_scales, cache.v_scales):  # (L, Hkv, rows)
            assert torch.equal(scales[layer, :, dst], scales[layer, :, src])
    assert not torch.equal(cache.k_scales[0, :, src], torch.ones_like(cache.k_scales[0, :, src]))  # layer 0 written


def test_fp8_values_are_stored_a_block_at_a_time_each_dimension_s_tokens_contiguous():
    """(L, blocks, Hkv, d, block_size): the decode kernel's layout; stored_values reads the token rows back."""
    cache = make_cache(num_blocks=4, block_size=4, kv_cache_dtype="fp8")
    assert cache.v.shape == (2, 4, HKV, D, 4) and cache.k.shape == (2, 16, HKV, D)
    cache.manager.allocate(0, 6, 0)
    meta = AttentionMetadata(True, [0], [6], [0], torch.arange(6))
    q, k_pre, k_rot, v = random_qkv(6)
    cache.attend(0, q, k_pre, k_rot, v, meta)
    rows = cache.manager.token_rows(0, 0, 6)
    codes, _ = quantize_values(v, 1)
    for i, row in enumerate(rows.tolist()):
        assert torch.equal(cache.v[0, row // 4, :, :, row % 4].view(torch.uint8), codes[i].view(torch.uint8))
    assert torch.equal(cache.stored_values(0, rows).view(torch.uint8), codes.view(torch.uint8))


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "triton"])
def test_fp8_cache_holds_only_finite_codes_whatever_it_is_given(use_kernels):
    """The decode kernel reads whole blocks and weighs the codes past a sequence's end by zero: a NaN code left in a
    block by one sequence would reach the next one to hold it."""
    cache = make_cache(num_blocks=4, block_size=4, use_kernels=use_kernels, kv_cache_dtype="fp8")
    cache.manager.allocate(0, 3, 0)
    meta = AttentionMetadata(True, [0], [3], [0], torch.arange(3))
    q, k_pre, k_rot, v = random_qkv(3)
    v[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    cache.attend(0, q, k_pre, k_rot, v, meta)
    assert torch.isfinite(cache.v.float()).all()
    finite, _ = quantize_values(torch.where(torch.isfinite(v), v, 0), 1)  # the rest of the token as given
    assert torch.equal(cache.stored_values(0, cache.manager.token_rows(0, 0, 3)).view(torch.uint8),
                       finite.view(torch.uint8))


def test_default_block_size_follows_the_cache_dtype():
    """auto: 64 tokens a block with an fp8 cache (its decode kernel's pages), 16 otherwise; a number overrides it, a
    power of two with fp8."""
    assert EngineConfig(model="m").block_size == 16
    assert EngineConfig(model="m", kv_cache_dtype="fp8").block_size == 64
    assert EngineConfig(model="m", kv_cache_dtype="fp8", block_size=16).block_size == 16
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model="m", block_size=0)
    assert EngineConfig(model="m", block_size=48).block_size == 48  # a bf16 cache's kernel takes any block
    with pytest.raises(ValueError, match="power of two with kv_cache_dtype fp8"):
        EngineConfig(model="m", kv_cache_dtype="fp8", block_size=48)


def test_fp8_blocks_take_one_byte_per_element_plus_a_scale_per_token_and_kv_head():
    auto, fp8 = make_cache(num_blocks=4, block_size=4), make_cache(num_blocks=4, block_size=4, kv_cache_dtype="fp8")
    assert auto.manager.footprint(16, 0) == (2 * 2 * 16 * HKV * D * 4, 0)  # K and V, 2 layers, 16 tokens, fp32
    assert fp8.manager.footprint(16, 0) == (2 * 2 * 16 * HKV * (D + 4), 0)


def test_allocation_is_refused_when_full_and_free_returns_everything():
    cache = make_cache(num_blocks=4, block_size=4)
    manager = cache.manager
    assert manager.can_allocate(10, 6)
    manager.allocate(0, 10, 6)  # 4 blocks
    assert not manager.can_allocate(1, 0)
    with pytest.raises(MemoryError):
        manager.allocate(1, 1, 0)
    assert cache.stats()["gpu_blocks_used"] == 4
    manager.free(0)
    stats = cache.stats()
    assert (stats["num_seqs"], stats["gpu_blocks_used"], stats["gpu_bytes_in_use"]) == (0, 0, 0)
    block_bytes = (cache.k[:, :4].numel() + cache.v[:, :4].numel()) * 4  # K and V of 4 tokens, every layer, fp32
    assert manager.footprint(10, 6) == (4 * block_bytes, 0)
    assert manager.fits_when_empty(16, 0) and not manager.fits_when_empty(16, 1)
