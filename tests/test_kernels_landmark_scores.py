import pytest
import torch

from test_kernels_utils import DEVICE, LLAMA, assert_close, page_tables, ragged_lengths
from kernels.landmark_scores import (MAX_BLOCKS_PER_PROGRAM, PROGRAMS_PER_SM, blocks_per_program,
                                      landmark_scores)
from shadowkv_core.shadowkv.batched_reference import landmark_scores_batched
from shadowkv_core.shadowkv.reference import quantize_values


def _inputs(num_chunks, Hq, Hkv, d, max_outliers, page_chunks, dtype, device, seed):
    """Landmark pages, some chunks flagged as outliers (up to max_outliers per KV head), and stray flags on the
    padding pages past each sequence's chunks, which must not matter."""
    g = torch.Generator().manual_seed(seed)
    B = len(num_chunks)
    table, num_pages = page_tables(num_chunks, page_chunks, g)
    landmarks = torch.randn(num_pages, page_chunks, Hkv, d, generator=g).to(device, dtype)
    q = torch.randn(B, Hq, d, generator=g).to(device, dtype)
    flags = (torch.rand(num_pages, page_chunks, Hkv, generator=g) < 0.5).to(torch.uint8)
    for b, n in enumerate(num_chunks):
        rows = torch.arange(n)
        page, offset = table[b].cpu()[rows // page_chunks].long(), rows % page_chunks
        flags[page, offset] = 0
        o = min(max_outliers, n // 2)
        for h in range(Hkv):
            ids = torch.randperm(n, generator=g)[:o]
            flags[page[ids], offset[ids], h] = 1
    return (q, landmarks.to(device), table.to(device), torch.tensor(num_chunks, dtype=torch.int32, device=device),
            flags.to(device))


def _check(num_chunks, Hq, Hkv, d, max_outliers, page_chunks, dtype, device, seed=0, fp8=False, q_mult=1.0, **tile):
    """fp8: landmarks quantised per chunk and KV head; the reference scores their fp32 dequantised values. q times
    q_mult. tile: the kernel's block_n, per_program."""
    args = _inputs(num_chunks, Hq, Hkv, d, max_outliers, page_chunks, dtype, device, seed)
    args = ((args[0].float() * q_mult).to(dtype),) + args[1:]
    n_max = max(num_chunks) + 3  # a bucket larger than the longest sequence
    scale = d ** -0.5
    if fp8:
        magnitude = torch.exp(0.5 * torch.randn(*args[1].shape[:3], 1, device=device))  # rows of unlike size
        lm8, lm_scales = quantize_values(args[1].float() * magnitude, 1)
        expected = landmark_scores_batched(args[0], lm8.float() * lm_scales[..., None], *args[2:], n_max, scale)
        got = landmark_scores(args[0], lm8, *args[2:], n_max, scale, landmark_scales=lm_scales, **tile)
    else:
        expected = landmark_scores_batched(*args, n_max, scale)
        got = landmark_scores(*args, n_max, scale, **tile)
    # fp32 softmax either way: only the order of the fp32 sums differs.
    assert_close(got, expected, dtype, "landmark scores", tol=(1e-6, 1e-4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_chunks,Hq,Hkv", [([37, 5, 70], 8, 2), ([1, 19], 6, 3), ([64], 4, 4)])
def test_landmark_scores_small(num_chunks, Hq, Hkv, dtype):
    _check(num_chunks, Hq, Hkv, 32, 6, 4, dtype, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_landmark_scores_fp8_landmarks_scale_each_chunk(dtype):
    _check([37, 5, 70], 8, 2, 32, 6, 4, dtype, DEVICE, seed=2, fp8=True)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("per_program", [1, 2, 3])
def test_landmark_scores_several_blocks_a_program(per_program, fp8):
    """Programs that score several blocks of chunks in turn, their softmax partials carried from block to block:
    sequences that end inside a program's blocks and before its last, one whose later programs see no chunk at all,
    and the bucket's last block past every sequence."""
    _check([37, 5, 70, 1], 8, 2, 32, 6, 4, torch.float16, DEVICE, seed=3, fp8=fp8, block_n=16,
           per_program=per_program)


def test_blocks_per_program_leave_every_multiprocessor_its_programs():
    """Fewer, longer programs only where the grid stays wide: never fewer than PROGRAMS_PER_SM programs a
    multiprocessor where one block a program had that many, never more than MAX_BLOCKS_PER_PROGRAM blocks each."""
    for num_sms in (1, 78, 132):
        for programs in range(1, 40 * num_sms, 7):
            per = blocks_per_program(programs, num_sms)
            assert 1 <= per <= MAX_BLOCKS_PER_PROGRAM
            assert -(-programs // per) >= min(programs, PROGRAMS_PER_SM * num_sms)
        assert blocks_per_program(PROGRAMS_PER_SM * num_sms * MAX_BLOCKS_PER_PROGRAM, num_sms) == MAX_BLOCKS_PER_PROGRAM


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("context,batch", [(32 * 1024, 16), (128 * 1024, 4)])
def test_landmark_scores_llama(context, batch, fp8, width):
    """width: landmark numbers per KV head in head dims; 2 is bounds landmarks (centre and half-range), which the
    kernel scores as landmarks twice as wide against their [q, |q|] query."""
    C = LLAMA["chunk_size"]
    num_chunks = ragged_lengths(context // C, batch, seed=batch)
    _check(num_chunks, LLAMA["num_q_heads"], LLAMA["num_kv_heads"], width * LLAMA["head_dim"], LLAMA["outliers"], 16,
           torch.bfloat16, "cuda", fp8=fp8)


@pytest.mark.gpu
def test_landmark_scores_fp8_query_beyond_fp16_llama():
    """A bf16 q beyond fp16's range: the fp16 dot takes q scaled by a power of two."""
    C = LLAMA["chunk_size"]
    num_chunks = ragged_lengths(8 * 1024 // C, 3, seed=3)
    _check(num_chunks, LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["outliers"], 16,
           torch.bfloat16, "cuda", fp8=True, q_mult=1e5)
