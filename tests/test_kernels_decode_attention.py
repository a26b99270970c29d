import pytest
import torch

from test_kernels_utils import DEVICE, LLAMA, assert_close, page_tables, ragged_lengths, slot_ids_for
from kernels.decode_attention import decode_attention, paged_fp8_decode_attention
from shadowkv_core.shadowkv.batched_reference import (dense_decode_attention_batched,
                                                      sparse_decode_attention_batched)
from shadowkv_core.shadowkv.reference import quantize_values


def _ragged(g, B, hi, lo=0):
    return torch.randint(lo, hi + 1, (B,), generator=g, dtype=torch.int32)


def _check_sparse(B, Hq, Hkv, d, O_tokens, K_tokens, E, dtype, device, seed=0, **launch):
    """[outliers | selected | window] per slot, the slot layouts of shadowkv.slots.Slots (one layer)."""
    g = torch.Generator().manual_seed(seed)
    N = B + 2

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    outlier_k, outlier_v = rand(N, Hkv, O_tokens, d), rand(N, Hkv, O_tokens, d)
    sparse_k, sparse_v = rand(N, Hkv, K_tokens, d), rand(N, Hkv, K_tokens, d)
    window_k, window_v = rand(N, E, Hkv, d), rand(N, E, Hkv, d)  # token-major, as the slots store it
    lens = [_ragged(g, B, O_tokens), _ragged(g, B, K_tokens), _ragged(g, B, E, lo=1)]
    segments = [(outlier_k, outlier_v, lens[0].to(device)), (sparse_k, sparse_v, lens[1].to(device)),
                (window_k.transpose(1, 2), window_v.transpose(1, 2), lens[2].to(device))]
    q = rand(B, Hq, d)
    slot_ids = slot_ids_for(B, N, g).to(device)
    scale = d ** -0.5
    expected = sparse_decode_attention_batched(q, segments, slot_ids, scale)
    max_len = int(sum(n.max() for n in lens))
    got = decode_attention(q, segments, slot_ids, scale, max_len, **launch)
    assert_close(got, expected, dtype, "sparse decode attention")


def _check_dense(context_lens, Hq, Hkv, d, block_size, dtype, device, seed=0, **launch):
    g = torch.Generator().manual_seed(seed)
    table, num_blocks = page_tables(context_lens, block_size, g)
    k_pool = torch.randn(num_blocks * block_size, Hkv, d, generator=g).to(device, dtype)
    v_pool = torch.randn(num_blocks * block_size, Hkv, d, generator=g).to(device, dtype)
    q = torch.randn(len(context_lens), Hq, d, generator=g).to(device, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    table = table.to(device)
    scale = d ** -0.5
    expected = dense_decode_attention_batched(q, k_pool, v_pool, table, lens, block_size, scale)
    pool = (k_pool.permute(1, 0, 2)[None], v_pool.permute(1, 0, 2)[None], lens)  # (1, Hkv, rows, d)
    slot_ids = torch.zeros(len(context_lens), dtype=torch.int32, device=device)
    got = decode_attention(q, [pool], slot_ids, scale, max(context_lens), page_table=table, page_size=block_size,
                           **launch)
    assert_close(got, expected, dtype, "dense paged decode attention")


def _check_dense_fp8(context_lens, Hq, Hkv, d, block_size, dtype, device, seed=0, head_major=True, q_mult=1.0,
                     v_mult=None, tail=0.0, **launch):
    """fp8 pools with one scale per token and KV head (the dense cache's kv_cache_dtype fp8), values stored a page at
    a time (pages, Hkv, d, page): the kernel reads them dequantised, as the reference does. Scales (Hkv, rows), the
    cache's layout, or a (rows, Hkv) tensor's transpose without head_major. q times q_mult; sequence i's values
    times v_mult[i], and its output compared over v_mult[i] (the tolerance is absolute). tail: every code past a
    sequence's end in its last page is that value's code (finite: the kernel weighs them by zero)."""
    g = torch.Generator().manual_seed(seed)
    table, num_blocks = page_tables(context_lens, block_size, g)
    k_pool, k_scales = quantize_values(torch.randn(num_blocks * block_size, Hkv, d, generator=g).to(device), 1)
    v = torch.randn(num_blocks * block_size, Hkv, d, generator=g)
    v_mult = torch.ones(len(context_lens)) if v_mult is None else torch.tensor(v_mult, dtype=torch.float32)
    for i, n in enumerate(context_lens):
        pages = table[i, :-(-n // block_size)].long().cpu()
        rows = (pages[:, None] * block_size + torch.arange(block_size)).flatten()
        v[rows] *= v_mult[i]
        v[rows[n:]] = tail
    v_pool, v_scales = quantize_values(v.to(device), 1)
    q = (torch.randn(len(context_lens), Hq, d, generator=g) * q_mult).to(device, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    table = table.to(device)
    scale = d ** -0.5
    expected = dense_decode_attention_batched(q, k_pool, v_pool, table, lens, block_size, scale,
                                              scales=(k_scales, v_scales))
    v_pages = v_pool.view(num_blocks, block_size, Hkv, d).permute(0, 2, 3, 1).contiguous()
    if head_major:
        k_scales, v_scales = k_scales.T.contiguous(), v_scales.T.contiguous()
    else:  # a wider tensor's rows: the same strides, a row stride beyond the row
        k_scales, v_scales = (torch.cat([x.T, x.T], 1)[:, :x.shape[0]] for x in (k_scales, v_scales))
    got = paged_fp8_decode_attention(q, k_pool, v_pages, (k_scales, v_scales), lens, table, scale,
                                     max(context_lens), **launch)
    per_seq = v_mult.to(device)[:, None, None]
    assert_close(got.float() / per_seq, expected.float() / per_seq, dtype, "dense paged decode attention, fp8 pools")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,Hq,Hkv", [(3, 8, 2), (2, 6, 3), (1, 4, 4)])
def test_sparse_decode_attention_small(B, Hq, Hkv, dtype):
    _check_sparse(B, Hq, Hkv, 32, O_tokens=24, K_tokens=100, E=40, dtype=dtype, device=DEVICE,
                  block_n=16, split_tokens=32)  # several splits, blocks straddling the segments


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("context_lens,Hq,Hkv", [([70, 1, 33], 8, 2), ([129], 6, 3)])
def test_dense_decode_attention_small(context_lens, Hq, Hkv, dtype):
    _check_dense(context_lens, Hq, Hkv, 32, 16, dtype, DEVICE, block_n=16, split_tokens=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("context_lens,Hq,Hkv", [([70, 1, 33], 8, 2), ([129], 6, 3), ([17, 95, 48, 3, 64], 4, 4)])
def test_dense_decode_attention_fp8_small(context_lens, Hq, Hkv, dtype):
    _check_dense_fp8(context_lens, Hq, Hkv, 32, 16, dtype, DEVICE, block_n=16, split_tokens=48, num_stages=2)


FP8_VARIANTS = {  # the sweep's axes (benchmarks/decode_attention_sweep.py), pages, the scales' strides, the tails
    "rows_strided_scales": dict(head_major=False),
    "launch": dict(num_warps=8, num_stages=2, programs_per_sm=2),
    "pages_of_4_blocks_of_16": dict(block_size=4, block_n=16, split_tokens=32),
    "pages_of_32_one_a_block": dict(block_size=32, block_n=32, split_tokens=64),
    "large_finite_tails": dict(tail=1e4),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("context_lens,Hq,Hkv", [([129], 6, 3), ([17, 95, 48, 3, 64], 4, 4)])
@pytest.mark.parametrize("variant", list(FP8_VARIANTS))
def test_dense_decode_attention_fp8_variants(variant, context_lens, Hq, Hkv, dtype):
    """Odd block counts, ragged batches, GQA groups."""
    launch = dict(block_size=16, block_n=16, split_tokens=48, num_stages=2) | FP8_VARIANTS[variant]
    _check_dense_fp8(context_lens, Hq, Hkv, 32, launch.pop("block_size"), dtype, DEVICE, **launch)


def test_dense_decode_attention_fp8_block_must_cover_whole_pages():
    with pytest.raises(AssertionError, match="multiple of the page"):
        _check_dense_fp8([40], 4, 2, 32, 32, torch.float32, DEVICE, block_n=16)
    with pytest.raises(AssertionError, match="power of two"):  # whole pages of 24 a step, but 48 keys
        _check_dense_fp8([40], 4, 2, 32, 24, torch.float32, DEVICE, block_n=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_decode_attention_fp8_value_range(dtype):
    """Values from 1e-3 to 1e3 (fp16 weights times such scales would flush or overflow): each block's weights enter
    the dot over its largest scale."""
    _check_dense_fp8([70, 33, 129], 8, 2, 32, 16, dtype, DEVICE, v_mult=[1e-3, 1.0, 1e3], block_n=16,
                     split_tokens=48, num_stages=2)


@pytest.mark.gpu
def test_dense_decode_attention_fp8_range_llama():
    """A bf16 q beyond fp16's range and values far from 1: the fp16 dots take q scaled by a power of two."""
    lens = ragged_lengths(8 * 1024, 3, seed=3)
    _check_dense_fp8(lens, LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"], 64, torch.bfloat16,
                     "cuda", q_mult=1e5, v_mult=[1e-6, 1.0, 1e3], tail=1e4)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_sparse_decode_attention_llama(batch):
    C = LLAMA["chunk_size"]
    _check_sparse(batch, LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["outliers"] * C,
                  LLAMA["budget_chunks"] * C, 4 * C + 512, torch.bfloat16, "cuda", seed=batch)


@pytest.mark.gpu
@pytest.mark.parametrize("context,batch", [(32 * 1024, 8), (128 * 1024, 2)])
def test_dense_decode_attention_llama(context, batch):
    lens = ragged_lengths(context, batch, seed=batch)
    _check_dense(lens, LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"], 16, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("context,batch", [(32 * 1024, 8), (128 * 1024, 2)])
def test_dense_decode_attention_fp8_llama(context, batch):
    """The engine's fp8 blocks (default_block_size) and the kernel's default launch."""
    lens = ragged_lengths(context, batch, seed=batch)
    _check_dense_fp8(lens, LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"], 64, torch.bfloat16,
                     "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(FP8_VARIANTS))
def test_dense_decode_attention_fp8_variants_llama(variant):
    lens = ragged_lengths(32 * 1024, 8, seed=8)
    launch = dict(block_size=64) | FP8_VARIANTS[variant]
    _check_dense_fp8(lens, LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"], launch.pop("block_size"),
                     torch.bfloat16, "cuda", **launch)
