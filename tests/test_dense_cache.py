import pytest
import torch

from shadowkv_core.attention import attention_ref
from shadowkv_core.cache.base import AttentionMetadata, CacheSpec
from shadowkv_core.cache.dense import DenseKVCache

HQ, HKV, D = 4, 2, 16


def make_cache(num_blocks=16, block_size=4, use_kernels=False):
    spec = CacheSpec(num_layers=2, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, scale=D ** -0.5,
                     prefill_chunk_tokens=5, use_kernels=use_kernels)
    return DenseKVCache(spec, num_blocks=num_blocks, block_size=block_size)


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


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "triton"])
def test_ragged_prefill_then_decode_matches_full_attention(use_kernels):
    torch.manual_seed(0)
    cache = make_cache(use_kernels=use_kernels)
    lens = [7, 3, 11]
    for i, n in enumerate(lens):
        cache.manager.allocate(i, n, 6)
    history = {i: ([], []) for i in range(len(lens))}  # layer-0 keys and values per sequence
    meta = AttentionMetadata(True, [0, 1, 2], lens, [0, 0, 0], torch.cat([torch.arange(n) for n in lens]))
    for step in range(6):
        q, k_pre, k_rot, v = random_qkv(sum(meta.query_lens))
        out = cache.attend(0, q, k_pre, k_rot, v, meta)
        for start, n, sid in zip(meta.query_starts, meta.query_lens, meta.seq_ids):
            history[sid][0].append(k_rot[start:start + n])
            history[sid][1].append(v[start:start + n])
            keys, values = torch.cat(history[sid][0]), torch.cat(history[sid][1])
            want = attention_ref(q[start:start + n], keys, values, D ** -0.5, causal=True)
            torch.testing.assert_close(out[start:start + n], want, atol=1e-5, rtol=1e-5)
        cache.finish_forward(meta)
        ctx = [cache.manager.lengths[s] for s in range(3)]
        meta = AttentionMetadata(False, [0, 1, 2], [1, 1, 1], ctx, torch.tensor(ctx))


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
