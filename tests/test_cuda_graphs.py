"""Decode steps replayed from CUDA graphs (engine/cuda_graphs.py) give the eager path's tokens, for the dense cache,
ShadowKV (bf16 and fp8 host values, whole and pipelined batches, with and without a device value share) and batches
that mix the two and shrink as requests finish; async decode (EngineConfig.async_decode) gives sync decode's. On CPU:
the keys a graph is looked up by stay put from step to step."""
import pytest
import torch

from shadowkv_core import EngineConfig, LLMEngine, SamplingParams, ShadowKVConfig
from shadowkv_core.engine.cuda_graphs import DecodeGraphs
from shadowkv_core.tiny_model import build_tiny_model

# rank 16 of 32 and a 32-token budget: a real selection, misses every step; prompts under 64 tokens stay dense
SHADOW = dict(rank=16, chunk_size=4, sparse_budget=32, outlier_chunks=2, local_chunks=2, min_context=64,
              decode_window=16)
PROMPT_LENS = (300, 41, 180, 257)
MAX_TOKENS = (24, 17, 9, 30)  # the batch shrinks three times


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=2))


def run(engine: LLMEngine, temperature: float = 0) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(5)
    for i, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS)):
        prompt = torch.randint(0, 256, (n,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=m, temperature=temperature, top_p=0.9, seed=i,
                                                           ignore_eos=True))
    tokens = {}
    while len(tokens) < len(PROMPT_LENS):
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return tokens


def engine_of(path: str, device: str, shadowkv: dict | None, pipeline_min_batch: int = 0, **kwargs) -> LLMEngine:
    """pipeline_min_batch 0: no pipelined halves."""
    config = EngineConfig(pipeline_decode=pipeline_min_batch > 0, pipeline_min_batch=max(pipeline_min_batch, 2),
                          model=path, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                          max_num_seqs=4, max_model_len=1024, gpu_cache_gib=0.05, host_cache_gib=0.05,
                          use_kernels=True, shadowkv=ShadowKVConfig(**shadowkv) if shadowkv else None, **kwargs)
    return LLMEngine(config)


class KeyRecorder(DecodeGraphs):
    """Runs every forward eager and records the key a graph would be looked up by."""

    def run(self, input_ids, meta, metas):
        state = self.inputs(input_ids, meta, metas)
        self.keys.append(None if state is None else state[0])
        return self.forward(input_ids, meta)


@pytest.mark.parametrize("shadowkv", [None, SHADOW], ids=["dense", "shadowkv"])
def test_graph_keys_change_only_at_bucket_edges(tiny_path, shadowkv):
    engine = engine_of(tiny_path, "cpu", shadowkv)
    recorder = engine.runner.graphs = KeyRecorder(engine.runner._decode_forward, engine.cache)
    recorder.keys = []
    run(engine)
    steps = len(recorder.keys)
    assert steps >= max(MAX_TOKENS) - 1 and None not in recorder.keys
    # four batch sizes, and a few length buckets crossed: far fewer graphs than steps
    assert len(set(recorder.keys)) <= 8 < steps, (len(set(recorder.keys)), steps)


@pytest.mark.gpu
@pytest.mark.parametrize("shadowkv, kwargs", [
    (None, {}), (SHADOW, {}), ({**SHADOW, "value_format": "fp8"}, {}), (SHADOW, {"pipeline_min_batch": 2}),
    ({**SHADOW, "value_format": "fp8", "device_value_share": 0.5}, {"pipeline_min_batch": 2}),
], ids=["dense", "shadowkv", "shadowkv-fp8", "shadowkv-pipelined", "shadowkv-fp8-tiered-pipelined"])
def test_graph_decode_gives_the_eager_tokens_gpu(tiny_path, shadowkv, kwargs):
    eager = engine_of(tiny_path, "cuda", shadowkv, cuda_graphs=False, **kwargs)
    want = run(eager)
    eager_fetched = eager.cache.stats().get("chunks_fetched")
    eager.cache.close()
    del eager
    graphed = engine_of(tiny_path, "cuda", shadowkv, cuda_graphs=True, **kwargs)
    got = run(graphed)
    graphs = graphed.runner.graphs
    assert graphs.failed is None
    assert graphs.replays > 0 and graphs.captures >= 2
    assert got == want
    assert graphed.cache.stats().get("chunks_fetched") == eager_fetched  # the miss counter comes back from replays
    stats = graphed.stats()
    assert (stats["num_seqs"], stats["gpu_bytes_in_use"], stats["host_bytes_in_use"]) == (0, 0, 0)
    graphed.close()
    assert not graphs.graphs and graphs.pool is None  # a rank's captured collectives would hold its group


FP8_PIPELINED = ({**SHADOW, "value_format": "fp8"}, {"pipeline_min_batch": 2})


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("shadowkv, kwargs", [(None, {}), FP8_PIPELINED],
                         ids=["dense", "shadowkv-fp8-pipelined"])
def test_async_decode_gives_the_sync_tokens_gpu(tiny_path, shadowkv, kwargs, temperature):
    """Each step launched while the one before it runs, its inputs the tokens the device sampled: the tokens of
    steps read back one by one, graphs replayed, and nothing held once the engine drains."""
    sync = engine_of(tiny_path, "cuda", shadowkv, async_decode=False, **kwargs)
    want = run(sync, temperature)
    sync.close()
    engine = engine_of(tiny_path, "cuda", shadowkv, **kwargs)
    assert engine.async_decode  # the default on CUDA
    got = run(engine, temperature)
    while engine.has_unfinished_requests():
        engine.step()
    assert got == want and engine.runner.graphs.replays > 0
    stats = engine.stats()
    assert (stats["num_seqs"], stats["gpu_bytes_in_use"], stats["host_bytes_in_use"]) == (0, 0, 0)


@pytest.mark.gpu
def test_async_decode_gives_the_sync_logprobs_and_penalised_tokens_gpu(tiny_path):
    """On CUDA, the penalties' device counts include the token a step still in flight drew, and each token's logprobs
    are read back with it: async decode gives sync decode's tokens and logprobs; prompt logprobs come with the
    prefill."""
    def logprob_run(engine: LLMEngine) -> dict:
        gen = torch.Generator().manual_seed(6)
        for i, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS)):
            prompt = torch.randint(0, 256, (n,), generator=gen).tolist()
            engine.add_request(f"r{i}", prompt, SamplingParams(
                max_tokens=m, temperature=0.8 * (i % 2), seed=i, ignore_eos=True, logprobs=3, prompt_logprobs=2,
                frequency_penalty=0.7, repetition_penalty=1.2))
        outs = {}
        while len(outs) < len(PROMPT_LENS):
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        return outs

    sync = engine_of(tiny_path, "cuda", SHADOW, async_decode=False)
    want = logprob_run(sync)
    sync.close()
    engine = engine_of(tiny_path, "cuda", SHADOW)
    got = logprob_run(engine)
    assert engine.async_decode and not engine.counts.rows
    for request_id, out in want.items():
        assert got[request_id].token_ids == out.token_ids
        assert [lp.logprob for lp in got[request_id].logprobs] == pytest.approx([lp.logprob for lp in out.logprobs],
                                                                                abs=1e-3)
        assert [[t for t, _ in lp.top] for lp in got[request_id].logprobs] == [[t for t, _ in lp.top]
                                                                               for lp in out.logprobs]
        prompt = got[request_id].prompt_logprobs
        assert prompt[0] is None and len(prompt) == len(got[request_id].prompt_token_ids)
        assert all(lp.logprob <= lp.top[0][1] and (lp.rank == 1) == (lp.logprob == lp.top[0][1]) for lp in prompt[1:])
