import pytest
import torch
import triton

from test_kernels_utils import DEVICE, LLAMA, ragged_lengths
from kernels.select_topk import topk_indices
from shadowkv_core.shadowkv.reference import select_chunks


def _scores(rows_lengths, n, device, g, ties=False):
    """Landmark-score rows as the scoring kernel writes them: softmax probabilities, -inf past each sequence's
    chunks and at its outliers; with `ties`, runs of equal scores (repeated chunks)."""
    scores = torch.rand(len(rows_lengths), n, generator=g)
    for r, length in enumerate(rows_lengths):
        scores[r, length:] = float("-inf")
        holes = torch.randperm(max(length, 1), generator=g)[:length // 10]
        scores[r, holes] = float("-inf")
        if ties:
            same = torch.randperm(max(length, 1), generator=g)[:length // 3]
            scores[r, same] = scores[r, same[:1]]
    return scores.to(device)


def _check(rows_lengths, n, k, device, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    scores = _scores(rows_lengths, n, device, g, ties)
    got = topk_indices(scores, k)
    # value desc, index asc: the rule the kernel documents, which torch.topk agrees with wherever scores differ
    expected = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(got.cpu(), expected.cpu()), (got, expected)
    if not ties:
        finite = torch.isfinite(torch.gather(scores, 1, expected))
        assert torch.equal(got[finite].cpu(), select_chunks(scores, k)[finite].cpu())


@pytest.mark.parametrize("n,k", [(50, 7), (64, 64), (300, 256), (17, 1), (1000, 100)])
def test_topk_small(n, k):
    _check([n, n // 2, 3, n - 1], n, k, DEVICE, seed=n)


def test_topk_ties_straddle_k():
    _check([200, 150, 90], 200, 40, DEVICE, seed=3, ties=True)


def test_topk_rows_past_the_kernel_take_torch():
    _check([40_000, 33_000], 40_000, 16, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("context,batch", [(32 * 1024, 32), (128 * 1024, 8), (244 * 1024, 4)])
def test_topk_llama(context, batch):
    n = triton.next_power_of_2(context // LLAMA["chunk_size"])  # n_max: the decode plan's bucket
    lengths = [m for m in ragged_lengths(context // LLAMA["chunk_size"], batch, seed=batch)
               for _ in range(LLAMA["num_kv_heads"])]
    _check(lengths, n, LLAMA["budget_chunks"], "cuda", seed=batch)
    _check(lengths, n, LLAMA["budget_chunks"], "cuda", seed=batch + 1, ties=True)

