"""A replica's warm-up (shadowkv_core/engine/warm_up.py): it compiles the decode's landmark scoring and top-k for every
chunk-count bucket, runs a whole prefill, a prefill sliced beside a decode and a prompt over a cached prefix, then
leaves the engine as a fresh one is (every pool, the prefix cache empty, every counter at zero) and a request after it
gets the tokens it gets on a fresh engine; start_engine runs it when config.warm_up asks. On the GPU: a batch that
reaches a longer bucket after it compiles nothing."""
import dataclasses

import pytest
import torch

from shadowkv_core import EngineConfig, LLMEngine, SamplingParams, ShadowKVConfig
from shadowkv_core.cache.base import COUNTERS
from shadowkv_core.engine.tensor_parallel import start_engine
from kernels.landmark_scores import _logits_kernel, _scores_kernel
from kernels.topk import _topk_kernel
from shadowkv_core.engine.warm_up import warm_up, warm_up_prompt
from shadowkv_core.shadowkv import fast_decode
from shadowkv_core.models.prefill_cost import PrefillBudget
from shadowkv_core.tiny_model import build_tiny_model

SHADOW = ShadowKVConfig(rank=16, chunk_size=4, sparse_budget=32, outlier_chunks=2, local_chunks=2, min_context=32,
                        decode_window=16)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3))


def config(tiny_path, shadowkv, **kwargs):
    return EngineConfig(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.03, shadowkv=shadowkv,
                        **kwargs)


def sliced(engine):
    """The engine with a step budget of a few projection rows: a prompt beside a decode prefills over many steps."""
    rows = PrefillBudget(engine.model.rank_spec).projection_row * 16
    engine.config = dataclasses.replace(engine.config, prefill_step_tflop=rows / 1e12)
    return engine


def pools(engine):
    """What the cache's pools hold (free and used blocks, slots, host pages, cached bytes), less the counters."""
    return {k: v for k, v in engine.cache.manager.usage().items() if k not in COUNTERS}


def counters(engine):
    return {k: v for k, v in engine.stats().items() if k in COUNTERS}


def greedy_tokens(engine, prompt):
    engine.add_request("after", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    out = []
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.request_id == "after"]
    return out[-1].token_ids


@pytest.mark.parametrize("shadowkv", [None, SHADOW], ids=["dense", "shadowkv"])
def test_warm_up_runs_each_path_and_leaves_the_engine_as_a_fresh_one(tiny_path, shadowkv):
    engine = sliced(LLMEngine(config(tiny_path, shadowkv)))
    before = pools(engine)
    done = warm_up(engine)
    assert done.second_prompt_steps > 2  # sliced beside the first prompt's decode, not whole in one step
    first = warm_up_prompt(engine.max_model_len, engine.spec.vocab_size)
    page = engine.config.block_size if shadowkv is None else shadowkv.chunk_size * shadowkv.page_chunks
    assert 0 < done.cached_tokens <= len(first) and done.cached_tokens % page == 0  # the first prompt's pages
    assert done.steps > done.second_prompt_steps
    assert not engine.has_unfinished_requests() and not engine.requests
    assert pools(engine) == before
    assert counters(engine) == {k: 0 for k in counters(engine)} and "prefix_hit_tokens" in counters(engine)
    engine.close()


@pytest.mark.parametrize("shadowkv", [None, SHADOW], ids=["dense", "shadowkv"])
def test_a_request_after_the_warm_up_gets_the_tokens_of_a_fresh_engine(tiny_path, shadowkv):
    """The prompt shares the warm-up's first prompt's opening tokens: had its cached prefix survived, it would be
    adopted and counted."""
    prompt = warm_up_prompt(512, 256)[:100] + torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(5)
                                                            ).tolist()
    fresh = LLMEngine(config(tiny_path, shadowkv))
    expected = greedy_tokens(fresh, prompt)
    fresh.close()
    warmed = sliced(LLMEngine(config(tiny_path, shadowkv)))
    warm_up(warmed)
    assert greedy_tokens(warmed, prompt) == expected
    assert warmed.stats()["prefix_query_tokens"] == len(prompt)  # the counters count the request, not the warm-up
    assert warmed.stats()["prefix_hit_tokens"] == 0  # nothing of the warm-up was left cached
    warmed.close()


def test_start_engine_warms_up_when_the_config_asks(tiny_path, caplog):
    """auto: on CUDA only; true runs it on the CPU too (and logs it); the counters start at zero either way."""
    ran = {}
    for option in (True, False, "auto"):
        caplog.clear()
        with caplog.at_level("INFO", logger="shadowkv_core.engine.tensor_parallel"):
            engine = start_engine(config(tiny_path, SHADOW, warm_up=option))
        ran[option] = any(r.getMessage().startswith("warm-up:") for r in caplog.records)
        assert set(counters(engine).values()) == {0}
        engine.close()
    assert ran == {True: True, False: False, "auto": torch.cuda.is_available()}


def test_reset_counters_counts_what_follows(tiny_path):
    """After a reset the counters hold only the requests after it: a prompt over a cached prefix counts its lookup
    and its hits, not the request that cached them."""
    engine = LLMEngine(config(tiny_path, SHADOW))
    first = warm_up_prompt(512, 256)
    greedy_tokens(engine, first)
    assert engine.stats()["prefix_query_tokens"] == len(first)
    engine.reset_counters()
    greedy_tokens(engine, first + [1, 2, 3])
    stats = engine.stats()
    assert stats["prefix_query_tokens"] == len(first) + 3 and 0 < stats["prefix_hit_tokens"] <= len(first)
    assert stats["chunks_selected_total"] > 0
    engine.reset_counters()
    assert set(counters(engine).values()) == {0}
    engine.close()


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_warm_up_option_is_checked(tiny_path, bad):
    with pytest.raises(ValueError, match="warm_up must be 'auto' or true or false"):
        config(tiny_path, None, warm_up=bad)


def test_compile_buckets_scores_every_chunk_bucket_a_request_can_reach(tiny_path, monkeypatch):
    """From half the chunks of the shortest sequence kept in shadows (min_context 32 / chunk 4 / 2 = 4) to those of
    max_model_len (512 / 4 = 128), each power of two once, the top-k over the budget's chunks where they fit."""
    launched = []

    def scores(q, landmarks, table, num_chunks, flags, n_max, scale, landmark_scales=None):
        launched.append(n_max)
        return torch.full((1, landmarks.shape[2], n_max), float("-inf"))

    def topk(scores, k):
        launched[-1] = (launched[-1], k)
        return torch.zeros(*scores.shape[:-1], k, dtype=torch.int64)

    monkeypatch.setattr(fast_decode, "landmark_scores", scores)
    monkeypatch.setattr(fast_decode, "topk_indices", topk)
    engine = LLMEngine(config(tiny_path, SHADOW, use_kernels=True))
    assert engine.compile_buckets() == 6
    assert launched == [(4, 4), (8, 8), (16, 8), (32, 8), (64, 8), (128, 8)]  # budget: 32 / 4 = 8 chunks
    monkeypatch.undo()
    assert engine.compile_buckets() == 6  # the kernels themselves (in the interpreter), on the placeholders
    engine.close()
    assert LLMEngine(config(tiny_path, SHADOW)).compile_buckets() == 0  # the reference path on the CPU
    assert LLMEngine(config(tiny_path, None, use_kernels=True)).compile_buckets() == 0  # dense: no chunk bucket


@pytest.mark.gpu
def test_a_longer_bucket_after_the_buckets_are_compiled_compiles_nothing_gpu(tiny_path):
    """Prompts whose chunk counts fall in ever longer buckets, decoded one after another and together, launch the
    variants compile_buckets compiled on placeholders: the kernels' specialisation is the engine's."""
    engine = LLMEngine(EngineConfig(model=tiny_path, device="cuda", dtype="bfloat16", max_num_seqs=4,
                                    max_model_len=4096, gpu_cache_gib=0.1, host_cache_gib=0.1, shadowkv=SHADOW))
    assert engine.compile_buckets() == 9  # 4 .. 4096 / 4 = 1024 chunks
    device = torch.cuda.current_device()
    kernels = (_logits_kernel, _scores_kernel, _topk_kernel)
    compiled = [len(k.device_caches[device][0]) for k in kernels]
    gen = torch.Generator().manual_seed(7)
    for i, n in enumerate((100, 700, 1500, 3000)):
        engine.add_request(str(i), torch.randint(0, 256, (n,), generator=gen).tolist(),
                           SamplingParams(max_tokens=6 + 4 * i, ignore_eos=True))
        for _ in range(3):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert [len(k.device_caches[device][0]) for k in kernels] == compiled
    engine.close()
