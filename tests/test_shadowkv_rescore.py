"""ShadowKVConfig.rescore on the reference decode path: the landmarks' c·k best chunks per KV head are rescored by
their rebuilt keys. At full rank with every chunk a candidate, the choice is the exact one (each chunk's largest
logit, softmaxed per query head, the max over the GQA group); at any rank the chosen chunks are among the landmarks'
candidates."""
import pytest
import torch

from test_kernels_utils import rotary_for_tests
from shadowkv_core.cache.base import AttentionMetadata, CacheSpec
from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.memory_model import Pools
from shadowkv_core.shadowkv import decode
from shadowkv_core.shadowkv.cache import ShadowKVCache
from shadowkv_core.shadowkv.reference import select_chunks

L, HQ, HKV, D, C, BUDGET = 1, 8, 2, 32, 4, 6
SCALE = D ** -0.5


def _decode_once(config: ShadowKVConfig, prompt_len: int, seed: int):
    """One prefill and one decode step of one sequence -> (cache, its state, the prompt's post-RoPE keys (P, Hkv, d),
    the step's query (Hq, d), the chunks selected per KV head (Hkv, k) and the landmarks' scores (Hkv, n) that the
    rescoring started from)."""
    torch.manual_seed(seed)
    rotary = rotary_for_tests(D, device="cpu")
    spec = CacheSpec(L, HQ, HKV, D, SCALE, torch.float32, torch.device("cpu"), use_kernels=False)
    cache = ShadowKVCache(spec, config, Pools(num_slots=1, num_dense_blocks=0, num_gpu_pages=64, num_host_pages=64),
                          rotary)
    cache.manager.allocate(0, prompt_len, 2)
    positions = torch.arange(prompt_len)
    q, k_pre, v = (torch.randn(prompt_len, h, D) for h in (HQ, HKV, HKV))
    k_rot = rotary.apply(k_pre, positions)
    cache.attend(0, rotary.apply(q, positions), k_pre, k_rot, v, AttentionMetadata(True, [0], [prompt_len], [0],
                                                                                    positions))
    cache.finish_forward(AttentionMetadata(True, [0], [prompt_len], [0], positions))
    recorded = {}
    real = decode.rescore_candidates

    def spy(cache_, layer, st, q_, scores, k):
        recorded["landmarks"] = scores
        return real(cache_, layer, st, q_, scores, k)

    step_q = rotary.apply(torch.randn(1, HQ, D), torch.tensor([prompt_len]))
    new_k = torch.randn(1, HKV, D)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "rescore_candidates", spy)
        cache.attend(0, step_q, new_k, rotary.apply(new_k, torch.tensor([prompt_len])), torch.randn(1, HKV, D),
                     AttentionMetadata(False, [0], [1], [prompt_len], torch.tensor([prompt_len])))
    st = cache.manager.seqs[0]
    selected = cache.slots.resident[st.slot, 0]  # (Hkv, K): the first step's chunks fill the empty slots
    return cache, st, k_rot, step_q[0], selected, recorded["landmarks"]


@pytest.mark.parametrize("kind", ["bounds", "mean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_chunk_a_candidate_at_full_rank_chooses_by_the_exact_keys(kind, seed):
    config = ShadowKVConfig(rank=HKV * D, chunk_size=C, sparse_budget=BUDGET * C, outlier_chunks=3, local_chunks=2,
                            min_context=0, decode_window=8, page_chunks=4, device_value_share=0.0,
                            landmark_kind=kind, rescore=64)
    cache, st, k_rot, q, selected, _ = _decode_once(config, prompt_len=93, seed=seed)
    n = st.num_shadow
    excluded = cache.gpu.read_outliers(0, st.gpu_table, n)  # (Hkv, n)
    keys = k_rot[:n * C].view(n, C, HKV, D)
    logits = torch.einsum("hgd,nchd->hgnc", q.view(HKV, HQ // HKV, D), keys) * SCALE
    best = logits.amax(-1).masked_fill(excluded[:, None], float("-inf"))
    expected = best.softmax(-1).amax(1).topk(BUDGET, -1).indices  # (Hkv, k)
    for h in range(HKV):
        assert set(selected[h].tolist()) == set(expected[h].tolist()), f"KV head {h}"
    cache.close()


@pytest.mark.parametrize("rescore", [2, 3])
def test_chosen_chunks_are_among_the_landmarks_candidates_and_need_not_be_their_best(rescore):
    config = ShadowKVConfig(rank=12, chunk_size=C, sparse_budget=BUDGET * C, outlier_chunks=3, local_chunks=2,
                            min_context=0, decode_window=8, page_chunks=4, device_value_share=0.0, rescore=rescore)
    differs = 0
    for seed in range(4):
        cache, _, _, _, selected, landmarks = _decode_once(config, prompt_len=150, seed=seed)
        candidates = select_chunks(landmarks, rescore * BUDGET)
        by_landmarks = select_chunks(landmarks, BUDGET)
        for h in range(HKV):
            assert set(selected[h].tolist()) <= set(candidates[h].tolist()), f"seed {seed} KV head {h}"
            differs += set(selected[h].tolist()) != set(by_landmarks[h].tolist())
        cache.close()
    assert differs > 0, "rescoring never changed the landmarks' choice"


def test_rescore_must_be_zero_or_a_factor_of_two_or_more():
    for bad in (1, -2, True, 2.0):
        with pytest.raises(ValueError, match="rescore"):
            ShadowKVConfig(rank=8, rescore=bad)
