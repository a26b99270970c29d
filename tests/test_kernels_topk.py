import pytest
import torch

import kernels.topk
from test_kernels_utils import DEVICE, LLAMA, ragged_lengths
from kernels.topk import topk_indices
from shadowkv_core.shadowkv.reference import select_chunks


def _scores(lengths, n, g, holes=0.0, ties=False):
    """Landmark-score rows as the scoring kernel writes them (R, n): softmax-like probabilities, -inf past each row's
    length (padding) and at a share `holes` of its chunks (outliers); with `ties`, scores rounded to a few values,
    so that runs of equal scores straddle the k-th place."""
    scores = torch.rand(len(lengths), n, generator=g)
    if ties:
        scores = (scores * 8).floor() / 8
    for r, length in enumerate(lengths):
        scores[r, length:] = float("-inf")
        outliers = torch.randperm(max(length, 1), generator=g)[:int(length * holes)]
        scores[r, outliers] = float("-inf")
    return scores


def _stable_topk(scores, k):
    """The kernel's rule: by score descending, equal scores (-inf included) by lower index first."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def _check(scores, k):
    got = topk_indices(scores.to(DEVICE), k).cpu()
    expected = _stable_topk(scores, k)
    assert got.dtype == torch.int64 and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    bad = (got != expected).nonzero()
    assert len(bad) == 0, f"{len(bad)} of {got.numel()} indices differ, first at {bad[:8].tolist()}"
    # the reference breaks ties by the same rule (fp32 random rows of 16K hold a few equal scores)
    assert torch.equal(got, select_chunks(scores, k))


@pytest.mark.parametrize("n,k", [(50, 7), (300, 256), (257, 100), (600, 33)])
def test_topk_random_rows(n, k):
    g = torch.Generator().manual_seed(n + k)
    _check(torch.randn(3, n, generator=g), k)


@pytest.mark.parametrize("n,k", [(200, 64), (130, 100)])
def test_topk_padding_and_outliers(n, k):
    """-inf tails and holes; the short rows have fewer finite scores than k: their -inf places go by index."""
    g = torch.Generator().manual_seed(n)
    _check(_scores([n, n - 7, k // 2, 1, k], n, g, holes=0.2), k)


@pytest.mark.parametrize("n,k", [(160, 40), (97, 96)])
def test_topk_ties_straddle_k(n, k):
    g = torch.Generator().manual_seed(k)
    scores = _scores([n, n // 2, n - 3], n, g, holes=0.1, ties=True)
    scores[0, :] = 0.25  # a whole row of one score: the first k indices
    _check(scores, k)


@pytest.mark.parametrize("n,k", [(1, 1), (17, 1), (64, 64), (100, 100), (75, 13)])
def test_topk_odd_sizes(n, k):
    g = torch.Generator().manual_seed(n * k)
    _check(_scores([n, max(1, n // 3)], n, g), k)


def test_topk_signed_zeros_infinity_and_batch_dims():
    """-0.0 ties with +0.0 (by index), +inf ranks first; leading dims (B, Hkv) are kept."""
    g = torch.Generator().manual_seed(5)
    scores = -torch.rand(2, 3, 40, generator=g)
    scores[0, 0, ::3] = 0.0
    scores[0, 0, 1::3] = -0.0
    scores[1, 2, 7] = float("inf")
    scores[1, 1, 20:] = float("-inf")
    _check(scores, 30)


def test_topk_rows_longer_than_a_block(monkeypatch):
    """Rows past MAX_BLOCK are read a tile at a time (the last tile partial): shrink the block to test it here."""
    monkeypatch.setattr(kernels.topk, "MAX_BLOCK", 64)
    g = torch.Generator().manual_seed(9)
    _check(_scores([300, 150, 20], 300, g, holes=0.1), 50)
    _check(_scores([300, 299], 300, g, holes=0.1, ties=True), 70)


@pytest.mark.gpu
@pytest.mark.parametrize("context,batch", [(128 * 1024, 8), (128 * 1024, 32), (32 * 1024, 32), (244 * 1024, 4),
                                           (1024 * 1024, 1)])
def test_topk_llama(context, batch):
    """Real sizes: (B, Hkv, n_max) with ragged -inf tails (n_max the decode plan's power-of-two bucket) and outliers,
    k = the budget's chunks; then the same rows with ties."""
    n = context // LLAMA["chunk_size"]
    n_max = 1 << (n - 1).bit_length()
    lengths = [m for m in ragged_lengths(n, batch, seed=batch) for _ in range(LLAMA["num_kv_heads"])]
    g = torch.Generator().manual_seed(batch)
    for ties in (False, True):
        scores = _scores(lengths, n_max, g, holes=LLAMA["outliers"] / n, ties=ties)
        _check(scores.view(batch, LLAMA["num_kv_heads"], n_max), LLAMA["budget_chunks"])
