"""Quest's chunk scores bound every key's logit in the chunk, are exact for one-token chunks, and plug into the cache."""
import torch

from shadowkv_core.shadowkv.quest import chunk_bounds, quest_scores


def _inputs(n=12, C=8, Hq=6, Hkv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(Hq, d, generator=gen), torch.randn(n * C, Hkv, d, generator=gen)


def test_scores_bound_every_logit_in_the_chunk():
    q, k = _inputs()
    k_min, k_max = chunk_bounds(k, 8)
    none = torch.zeros(2, 12, dtype=torch.bool)
    bound = quest_scores(q, k_min, k_max, none, scale=0.25)  # (Hkv, n)
    logits = torch.einsum("hgd,nchd->hgnc", q.view(2, 3, 16), k.view(12, 8, 2, 16)) * 0.25  # (Hkv, G, n, C)
    assert (logits.amax(-1).amax(1) <= bound + 1e-5).all()


def test_one_token_chunks_score_their_exact_logit():
    q, k = _inputs(C=1)
    k_min, k_max = chunk_bounds(k, 1)
    excluded = torch.zeros(2, 12, dtype=torch.bool)
    excluded[1, 3] = True
    scores = quest_scores(q, k_min, k_max, excluded, scale=1.0)
    exact = torch.einsum("hgd,nhd->hgn", q.view(2, 3, 16), k).amax(1)
    assert scores[1, 3] == float("-inf")
    excluded_free = ~excluded
    torch.testing.assert_close(scores[excluded_free], exact[excluded_free])
