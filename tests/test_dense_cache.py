import pytest
import torch

from shadowkv_core.attention import AttentionMetadata, attention_ref
from shadowkv_core.dense_cache import DenseKVCache

HQ, HKV, D = 4, 2, 16


def make_cache(num_blocks=16, block_size=4, use_kernels=False):
    return DenseKVCache(num_layers=2, num_kv_heads=HKV, head_dim=D, num_blocks=num_blocks, block_size=block_size,
                        dtype=torch.float32, device="cpu", scale=D ** -0.5, prefill_chunk_tokens=5,
                        use_kernels=use_kernels)


def random_qkv(t):
    return torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "triton"])
def test_ragged_prefill_then_decode_matches_full_attention(use_kernels):
    torch.manual_seed(0)
    cache = make_cache(use_kernels=use_kernels)
    lens = [7, 3, 11]
    for i, n in enumerate(lens):
        cache.allocate(i, n, 6)
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
        ctx = [cache.lengths[s] for s in range(3)]
        meta = AttentionMetadata(False, [0, 1, 2], [1, 1, 1], ctx, torch.tensor(ctx))


def test_allocation_is_refused_when_full_and_free_returns_everything():
    cache = make_cache(num_blocks=4, block_size=4)
    assert cache.can_allocate(10, 6)
    cache.allocate(0, 10, 6)  # 4 blocks
    assert not cache.can_allocate(1, 0)
    with pytest.raises(MemoryError):
        cache.allocate(1, 1, 0)
    assert cache.stats()["gpu_blocks_used"] == 4
    cache.free(0)
    stats = cache.stats()
    assert (stats["num_seqs"], stats["gpu_blocks_used"], stats["gpu_bytes_in_use"]) == (0, 0, 0)
    assert cache.footprint(10, 6) == (4 * cache.block_bytes, 0)
    assert cache.fits_when_empty(16, 0) and not cache.fits_when_empty(16, 1)
