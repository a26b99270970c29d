"""Quest's chunk scores bound every key's logit in the chunk, are exact for one-token chunks, and plug into the
cache."""
import torch

from shadowkv_core import LLM, SamplingParams, ShadowKVConfig
from shadowkv_core.tiny_model import build_tiny_model

from shadowkv_core.shadowkv.quest import QuestScorer, chunk_bounds, quest_scores


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


def test_quest_scorer_in_the_cache_at_full_budget_and_rank_equals_dense(tmp_path):
    model = str(build_tiny_model(tmp_path / "tiny"))
    prompt, params = list(range(40, 240)) * 2, SamplingParams(max_tokens=8, temperature=0)
    dense = LLM(model=model).generate([prompt], params)[0].token_ids
    config = ShadowKVConfig(rank=32, chunk_size=8, sparse_budget=512, outlier_chunks=2, local_chunks=4, min_context=0,
                            decode_window=64)  # rank 32 = 2 KV heads x 16: exact keys; the budget takes every chunk
    llm = LLM(model=model, shadowkv=config)
    scorer = llm.engine.cache.shadow.chunk_scorer = QuestScorer()
    assert llm.generate([prompt], params)[0].token_ids == dense
    assert len(scorer.bounds) == 2  # one entry per layer of the one sequence
