"""The eviction baselines and the chunk oracle (shadowkv/baselines.py) on hand-checkable cases, and every selection
policy in the cache: at a budget that takes every chunk and full rank each equals dense attention, through folds of
the decode window; at a small budget each keeps the chunks it says it keeps."""
import math

import pytest
import torch

from shadowkv_core import LLM, SamplingParams, ShadowKVConfig
from shadowkv_core.shadowkv.baselines import (ChunkOracleScorer, SnapKVScorer, StreamingScorer, max_logit_scores,
                                              snapkv_votes, streaming_scores)
from shadowkv_core.shadowkv.quest import QuestScorer
from shadowkv_core.shadowkv.reference import select_chunks
from shadowkv_core.tiny_model import build_tiny_model


def test_streaming_keeps_the_sinks_then_the_newest_chunks():
    excluded = torch.zeros(2, 6, dtype=torch.bool)
    excluded[1, 4] = True
    scores = streaming_scores(6, 2, sink_chunks=1, excluded=excluded)
    assert select_chunks(scores, 3).tolist() == [[0, 5, 4], [0, 5, 3]]
    assert select_chunks(streaming_scores(6, 2, 0, torch.zeros(2, 6, dtype=torch.bool)), 2).tolist() == [[5, 4]] * 2


def test_snapkv_votes_by_hand():
    """One head, d 1, q = 1, keys (0, ln 2, 0, 0), window 2: the query at position 2 gives (1, 2, 1) / 4, the one at
    3 gives (1, 2, 1, 1) / 5; summed, (0.45, 0.9, 0.45, 0.2); chunks of one token, the first two in the shadow."""
    q = torch.ones(4, 1, 1)
    k = torch.tensor([0.0, math.log(2), 0.0, 0.0]).view(4, 1, 1)
    votes = snapkv_votes(q, k, num_chunks=2, chunk_size=1, window=2, scale=1.0)
    torch.testing.assert_close(votes, torch.tensor([[0.45, 0.9]]))
    two = snapkv_votes(q, k, num_chunks=2, chunk_size=2, window=2, scale=1.0)  # chunks of two tokens
    torch.testing.assert_close(two, torch.tensor([[1.35, 0.65]]))


def test_snapkv_votes_equal_a_brute_force_with_gqa():
    gen = torch.Generator().manual_seed(0)
    P, Hq, Hkv, d, C, w = 40, 6, 2, 8, 4, 8
    q, k = torch.randn(P, Hq, d, generator=gen), torch.randn(P, Hkv, d, generator=gen)
    votes = snapkv_votes(q, k, num_chunks=8, chunk_size=C, window=w, scale=0.3)
    brute = torch.zeros(Hkv, P)
    for t in range(P - w, P):
        for h in range(Hq):
            brute[h // 3, :t + 1] += torch.softmax(k[:t + 1, h // 3] @ q[t, h] * 0.3, 0) / 3
    torch.testing.assert_close(votes, brute[:, :32].view(Hkv, 8, C).sum(-1))


def test_max_logit_scores_equal_a_brute_force_with_gqa():
    gen = torch.Generator().manual_seed(1)
    n, C, Hq, Hkv, d = 5, 4, 6, 2, 8
    q, keys = torch.randn(Hq, d, generator=gen), torch.randn(n, C, Hkv, d, generator=gen)
    excluded = torch.zeros(Hkv, n, dtype=torch.bool)
    excluded[0, 3] = True
    got = max_logit_scores(q, keys, excluded, scale=0.5)
    for h in range(Hkv):
        for c in range(n):
            best = max(float(keys[c, t, h] @ q[g] * 0.5) for t in range(C) for g in range(h * 3, h * 3 + 3))
            assert got[h, c].item() == (-math.inf if (h, c) == (0, 3) else pytest.approx(best, rel=1e-5))


def _config(budget: int) -> ShadowKVConfig:
    # rank 32 = 2 KV heads x 16: exact keys; a window of 16 folds every 8 generated tokens
    return ShadowKVConfig(rank=32, chunk_size=8, sparse_budget=budget, outlier_chunks=0, local_chunks=2,
                          min_context=0, decode_window=16)


@pytest.mark.parametrize("scorer", [QuestScorer, StreamingScorer, SnapKVScorer, ChunkOracleScorer])
def test_every_policy_at_full_budget_equals_dense_through_folds(tmp_path, scorer):
    model = str(build_tiny_model(tmp_path / "tiny"))
    prompt, params = list(range(40, 240)), SamplingParams(max_tokens=40, temperature=0)
    dense = LLM(model=model).generate([prompt], params)[0].token_ids
    llm = LLM(model=model, shadowkv=_config(budget=512))  # 64 chunks: every chunk, folded ones included
    llm.engine.cache.shadow.chunk_scorer = scorer()
    assert llm.generate([prompt], params)[0].token_ids == dense
    state = llm.engine.cache.shadow
    assert state.counts.stats()["hit_rate"] > 0  # the sparse path ran


@pytest.mark.parametrize("scorer", [QuestScorer, SnapKVScorer, ChunkOracleScorer])
def test_a_prompt_with_no_shadow_chunks_folds_into_a_policy_that_kept_nothing(tmp_path, scorer):
    """A prompt that fits its window leaves the shadow empty at prefill; the policy still starts the sequence (an
    empty record), so the first fold extends that and not another sequence's, and nothing is missing."""
    model = str(build_tiny_model(tmp_path / "tiny"))
    prompt, params = list(range(40, 52)), SamplingParams(max_tokens=40, temperature=0)
    dense = LLM(model=model).generate([prompt], params)[0].token_ids
    llm = LLM(model=model, shadowkv=_config(budget=512))
    llm.engine.cache.shadow.chunk_scorer = scorer()
    assert llm.generate([prompt], params)[0].token_ids == dense


@pytest.mark.parametrize("scorer, expected", [
    (StreamingScorer(sink_chunks=1), lambda n, votes: {0, n - 1, n - 2}),
    (SnapKVScorer(window=16), lambda n, votes: set(votes.topk(3).indices.tolist())),
])
def test_small_budget_keeps_what_the_policy_names(tmp_path, scorer, expected):
    model = str(build_tiny_model(tmp_path / "tiny"))
    llm = LLM(model=model, shadowkv=_config(budget=24))  # 3 chunks
    cache = llm.engine.cache.shadow
    cache.chunk_scorer = scorer
    llm.generate([list(range(40, 240))], SamplingParams(max_tokens=2, temperature=0))  # prefill and one step
    n = 200 // 8 - 2  # shadow chunks: the prompt less its 2 local chunks
    for layer in range(2):
        for head in range(2):
            votes = scorer.votes[(0, layer)][head] if isinstance(scorer, SnapKVScorer) else None
            assert set(cache.slots.resident[0, layer, head].tolist()) == expected(n, votes)
