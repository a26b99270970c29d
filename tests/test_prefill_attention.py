"""Prefill attention of chunks (queries [s, e) against keys [0, e), causal on the diagonal), held to
shadowkv_core.attention.prefill_chunks_attention_ref: the Triton kernel on ragged batches (whole and split over the
keys), and the split SDPA and cuDNN candidates per sequence."""
import pytest
import torch

from test_kernels_utils import DEVICE, LLAMA, assert_close, ragged_lengths
from kernels.prefill_attention import _merge_splits_kernel, _prefill_kernel, choose_num_splits, prefill_attention
import shadowkv_core.attention as attention
from shadowkv_core.attention import (chunk_attention, prefill_attention_ref, prefill_attention_split,
                                     prefill_chunks_attention_ref)
from shadowkv_core.config import AUTO, PREFILL_ATTENTIONS

LSE_TOL = (1e-3, 1e-3)  # fp32 whatever the inputs' dtype
# (queries, keys) per sequence: a whole prompt (s = 0), chunks at odd starts, one query, a chunk longer than a block.
CHUNKS = [(37, 37), (21, 90), (1, 45), (50, 83)]


def _offsets(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).int().to(device)


def _inputs(chunks, Hq, Hkv, d, dtype, device, seed):
    """Packed q (total_q, Hq, d) and k, v (total_k, Hkv, d) as strided views, as a fused projection leaves them."""
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(n for n, _ in chunks), sum(e for _, e in chunks)
    q = torch.randn(total_q, 2 * Hq, d, generator=g).to(device, dtype)[:, :Hq]
    kv = torch.randn(total_k, 2, Hkv, d, generator=g).to(device, dtype)
    cu_q, cu_k = _offsets([n for n, _ in chunks], device), _offsets([e for _, e in chunks], device)
    return q, kv[:, 0], kv[:, 1], cu_q, cu_k


def _check(chunks, Hq, Hkv, d, dtype, device, seed=0, **launch):
    q, k, v, cu_q, cu_k = _inputs(chunks, Hq, Hkv, d, dtype, device, seed)
    scale = d ** -0.5
    want_out, want_lse = prefill_chunks_attention_ref(q, k, v, cu_q, cu_k, scale)
    out, lse = prefill_attention(q, k, v, cu_q, cu_k, max(n for n, _ in chunks), scale, return_lse=True, **launch)
    assert_close(out, want_out, dtype, "prefill attention")
    assert_close(lse, want_lse, dtype, "prefill attention lse", tol=LSE_TOL)


SMALL_BLOCKS = dict(block_m=32, block_n=16, num_warps=4, num_stages=1)  # the diagonal spans two key blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_attention_ragged_chunks(Hq, Hkv, d, dtype):
    _check(CHUNKS, Hq, Hkv, d, dtype, DEVICE, seed=Hq + d, **SMALL_BLOCKS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_attention_default_blocks(dtype):
    _check([(130, 301), (7, 7)], 4, 1, 128, dtype, DEVICE)


def test_prefill_attention_is_causal_on_the_diagonal():
    """Changing a sequence's last key and value moves its last query's output only: no query sees a later key."""
    chunks, scale = [(20, 53), (9, 9)], 64 ** -0.5
    q, k, v, cu_q, cu_k = _inputs(chunks, 4, 2, 64, torch.float32, DEVICE, seed=3)
    before = prefill_attention(q, k, v, cu_q, cu_k, 20, scale, **SMALL_BLOCKS)
    k, v = k.clone(), v.clone()
    k[52], v[52] = 3.0, -2.0
    after = prefill_attention(q, k, v, cu_q, cu_k, 20, scale, **SMALL_BLOCKS)
    assert torch.equal(after[:19], before[:19]) and torch.equal(after[20:], before[20:])
    assert not torch.allclose(after[19], before[19])


# Key splits on a ragged batch: a long prefix, a whole short prompt, a chunk of a few blocks, a chunk wider than the
# query block, one query of one key (with 5 splits all but the last split are empty for most of these).
SPLIT_CHUNKS = [(1, 397), (7, 7), (50, 61), (129, 290), (1, 1)]
SPLIT_BLOCKS = dict(block_m=64, block_n=16, num_warps=4, num_stages=1)  # 129 queries in 3 blocks: fewer programs


def _check_split(chunks, Hq, Hkv, d, dtype, device, num_splits, seed, num_sms=None, without_lse=False,
                 **launch):
    q, k, v, cu_q, cu_k = _inputs(chunks, Hq, Hkv, d, dtype, device, seed)
    scale = d ** -0.5
    want_out, want_lse = prefill_chunks_attention_ref(q, k, v, cu_q, cu_k, scale)
    max_q, max_k = max(n for n, _ in chunks), max(e for _, e in chunks)
    out, lse = prefill_attention(q, k, v, cu_q, cu_k, max_q, scale, return_lse=True, max_seqlen_k=max_k,
                                 num_splits=num_splits, num_sms=num_sms, **launch)
    name = f"prefill attention, {num_splits or 'auto'} splits"
    assert_close(out, want_out, dtype, name)
    assert_close(lse, want_lse, dtype, name + " lse", tol=LSE_TOL)
    if without_lse:
        assert_close(prefill_attention(q, k, v, cu_q, cu_k, max_q, scale, max_seqlen_k=max_k, num_splits=num_splits,
                                       num_sms=num_sms, **launch), want_out, dtype, name + " without lse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits,Hq,Hkv,d", [(1, 2, 2, 64), (2, 4, 1, 128), (3, 8, 1, 64), (5, 2, 2, 128),
                                                 (5, 8, 2, 64)])
def test_prefill_attention_key_splits(num_splits, Hq, Hkv, d, dtype):
    """Explicit splits, GQA ratios 1, 4 and 8: each split's share of a sequence's keys, empty ones merged away."""
    _check_split(SPLIT_CHUNKS, Hq, Hkv, d, dtype, DEVICE, num_splits, seed=num_splits + Hq, **SPLIT_BLOCKS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_attention_auto_splits(dtype):
    """num_splits=None on a grid of 4 heads x 1 query block x 3 sequences, given 4 times as many SMs, splits the
    keys 4 ways (one full wave), with and without the lse."""
    chunks, Hq = SPLIT_CHUNKS[:3], 4
    assert choose_num_splits(Hq, len(chunks), 50, 397, DEVICE, 64, 16, num_sms=48) == 4
    _check_split(chunks, Hq, 1, 128, dtype, DEVICE, None, seed=11, num_sms=48, without_lse=True, **SPLIT_BLOCKS)


def test_chunk_attention_passes_its_key_count(monkeypatch):
    """chunk_attention's Triton path bounds the keys by its own key count (a Python int, no sync), so a suffix after
    a long prefix can split: here the choice is forced to 3 splits, against the reference."""
    import kernels.prefill_attention as kernel
    seen = []
    monkeypatch.setattr(kernel, "choose_num_splits", lambda *a, **kw: seen.append(a[3]) or 3)
    q, k, v, cu_q, cu_k = _inputs([(20, 203)], 4, 1, 64, torch.float32, DEVICE, seed=5)
    want, _ = prefill_chunks_attention_ref(q, k, v, cu_q, cu_k, 0.125)
    assert_close(chunk_attention(q, k, v, 0.125, "triton"), want, torch.float32, "split chunk attention")
    assert seen == [203]


def test_auto_takes_triton_for_a_square_slice_short_of_the_whole_prompt(monkeypatch):
    """Under "auto" (where no kernel holds the scores) a square causal block goes to SDPA only when it is all of the
    sequence's queries; a sliced prefill's first slice (whole=False) goes to the Triton kernel. Both give the
    reference."""
    import kernels.prefill_attention as kernel
    monkeypatch.setattr(attention, "_scores_never_exist", lambda q: True)
    calls = []
    monkeypatch.setattr(attention, "prefill_attention",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or kernel.prefill_attention(*a, **kw))
    q, k, v, cu_q, cu_k = _inputs([(37, 37)], 4, 2, 64, torch.float32, DEVICE, seed=6)
    want, _ = prefill_chunks_attention_ref(q, k, v, cu_q, cu_k, 0.125)
    assert_close(chunk_attention(q, k, v, 0.125, AUTO), want, torch.float32, "whole square block")
    assert calls == []
    assert_close(chunk_attention(q, k, v, 0.125, AUTO, whole=False), want, torch.float32, "square slice")
    assert calls == [37]


def test_choose_num_splits():
    """The Llama-8B suffix prefill: one reader's 32 programs on 132 SMs split 4 ways (128 programs, one wave); a
    batch that fills the GPU, short keys, or no SM count (off CUDA) do not split."""
    assert choose_num_splits(32, 1, 125, 122_880, "cuda", num_sms=132) == 4
    assert choose_num_splits(32, 1, 50, 32_768, "cuda", num_sms=132) == 4
    assert choose_num_splits(32, 2, 125, 122_880, "cuda", num_sms=132) == 2
    assert choose_num_splits(32, 14, 125, 122_880, "cuda", num_sms=132) == 1
    assert choose_num_splits(32, 1, 400, 122_880, "cuda", num_sms=132) == 1
    assert choose_num_splits(32, 1, 125, 300, "cuda", num_sms=132) == 1
    assert choose_num_splits(32, 1, 125, 122_880, "cpu") == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_q,n_k,Hq,Hkv", [(37, 37, 4, 4), (21, 90, 8, 2), (1, 45, 8, 1), (50, 83, 16, 2)])
def test_prefill_attention_split(n_q, n_k, Hq, Hkv, dtype):
    q, k, v, cu_q, cu_k = _inputs([(n_q, n_k)], Hq, Hkv, 64, dtype, DEVICE, seed=n_k)
    want, _ = prefill_chunks_attention_ref(q, k, v, cu_q, cu_k, 0.125)
    assert_close(prefill_attention_split(q, k, v, 0.125), want, dtype, "split prefill attention")


def _llama_chunks(context: int, chunk: int, batch: int, seed: int) -> list[tuple[int, int]]:
    """One chunk of each of `batch` prompts: `chunk` queries (fewer at a prompt's end) at a ragged odd start."""
    return [(min(chunk, n), n) for n in ragged_lengths(context, batch, seed)]


@pytest.mark.gpu
@pytest.mark.parametrize("context,chunk,batch", [(2048, 2048, 1), (9000, 1531, 3), (6000, 4096, 2)])
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_attention_llama(context, chunk, batch, d):
    chunks = _llama_chunks(context, chunk, batch, seed=context)
    _check(chunks, LLAMA["num_q_heads"], LLAMA["num_kv_heads"], d, torch.bfloat16, "cuda", seed=batch)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, 5, None])
@pytest.mark.parametrize("Hq,Hkv,d", [(32, 8, 128), (32, 32, 128), (16, 2, 64)])
def test_prefill_attention_key_splits_llama(num_splits, Hq, Hkv, d):
    chunks = [(1, 9001), (50, 50), (129, 4099), (7, 3001)]
    _check_split(chunks, Hq, Hkv, d, torch.bfloat16, "cuda", num_splits, seed=Hq + d)


@pytest.mark.gpu
def test_prefill_attention_compiles_once_for_every_split_count():
    """The split count follows the batch's shape: every count above one, with and without lse, launches the kernels
    already compiled."""
    chunks = [(1, 9001), (129, 4099)]
    _check_split(chunks, 32, 8, 128, torch.bfloat16, "cuda", 2, seed=2, without_lse=True)
    device = torch.cuda.current_device()
    counts = [len(kernel.device_caches[device][0]) for kernel in (_prefill_kernel, _merge_splits_kernel)]
    for num_splits in (3, 5, 7, 11):
        _check_split(chunks, 32, 8, 128, torch.bfloat16, "cuda", num_splits, seed=num_splits, without_lse=True)
    assert [len(kernel.device_caches[device][0]) for kernel in (_prefill_kernel, _merge_splits_kernel)] == counts


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_prefill_attention_auto_splits_long_prefix(batch):
    """The suffix prefill's shape (125 queries after 122,880 keys per sequence): the automatic split gives the
    unsplit kernel's outputs and lse."""
    chunks = [(125, 122_880)] * batch
    q, k, v, cu_q, cu_k = _inputs(chunks, 32, 8, 128, torch.bfloat16, "cuda", seed=batch)
    scale = 128 ** -0.5
    want_out, want_lse = prefill_attention(q, k, v, cu_q, cu_k, 125, scale, return_lse=True, num_splits=1)
    out, lse = prefill_attention(q, k, v, cu_q, cu_k, 125, scale, return_lse=True, max_seqlen_k=122_880)
    assert_close(out, want_out, torch.bfloat16, "auto-split prefill attention")
    assert_close(lse, want_lse, torch.bfloat16, "auto-split prefill attention lse", tol=LSE_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("n_q,n_k", [(2048, 2048), (1531, 7777)])
def test_prefill_attention_split_llama(n_q, n_k):
    q, k, v, cu_q, cu_k = _inputs([(n_q, n_k)], LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"],
                                  torch.bfloat16, "cuda", seed=n_k)
    scale = LLAMA["head_dim"] ** -0.5
    want, _ = prefill_chunks_attention_ref(q, k, v, cu_q, cu_k, scale)
    assert_close(prefill_attention_split(q, k, v, scale), want, torch.bfloat16, "split prefill attention")


@pytest.mark.gpu
@pytest.mark.parametrize("n_q,n_k", [(2048, 2048), (1531, 7777), (1, 301)])
@pytest.mark.parametrize("Hq,Hkv,d", [(32, 8, 128), (32, 32, 128), (16, 2, 64)])
def test_prefill_attention_cudnn(n_q, n_k, Hq, Hkv, d):
    """The cuDNN split (EngineConfig.prefill_attention "cudnn"): GQA ratios 1, 4 and 8, a chunk at an odd offset,
    a whole prompt and a single query, against the reference."""
    q, k, v, cu_q, cu_k = _inputs([(n_q, n_k)], Hq, Hkv, d, torch.bfloat16, "cuda", seed=n_k + Hkv)
    want, _ = prefill_chunks_attention_ref(q, k, v, cu_q, cu_k, d ** -0.5)
    assert_close(chunk_attention(q, k, v, d ** -0.5, "cudnn"), want, torch.bfloat16, "cuDNN prefill attention")


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", [AUTO, *PREFILL_ATTENTIONS])
def test_prefill_attention_ref_whole_prompt_on_cuda(implementation, monkeypatch):
    """On CUDA in bf16 a long prompt goes to its implementation in one call (no query chunks), with the reference's
    outputs, for a whole prompt and for a suffix after a prefix."""
    calls = []
    one_chunk = attention.chunk_attention
    monkeypatch.setattr(attention, "chunk_attention", lambda *a: calls.append(a[0].shape[0]) or one_chunk(*a))
    for n_q, n_k in ((3001, 3001), (2500, 4099)):
        q, k, v, cu_q, cu_k = _inputs([(n_q, n_k)], 32, 8, 128, torch.bfloat16, "cuda", seed=n_q)
        want, _ = prefill_chunks_attention_ref(q, k, v, cu_q, cu_k, 128 ** -0.5)
        got = prefill_attention_ref(q, k, v, 128 ** -0.5, 512, implementation)
        assert_close(got, want, torch.bfloat16, f"{implementation} prefill attention, {n_q} of {n_k}")
    assert calls == [3001, 2500]
