"""Tensor parallelism on GPUs: two ranks over NCCL, each running the Triton kernels, CUDA graphs and async decode as a
GPU replica serves, give one GPU's greedy tokens. Apart from test_tensor_parallel.py, which needs the Serve stack: this
module imports the engine alone."""

import pytest
import torch

from shadowkv_core import LLM, SamplingParams, ShadowKVConfig
from support.model_factory import build_tiny_hf_model

VOCAB = 128
# rank 128 is full rank over the model's 2 KV heads of 64 dims (64 per rank of 2), and the budget covers every
# context here, so each rank's shadow of its one KV head is exact
FULL_SHADOW = ShadowKVConfig(rank=128, chunk_size=8, sparse_budget=4096, outlier_chunks=2, local_chunks=2,
                             min_context=0, decode_window=16, device_value_share=0.0)
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def kernel_path(tmp_path_factory):
    # head_dim 64 and a GQA group of 4 on each rank: shapes the Triton kernels take, so the GPU test runs them
    path = tmp_path_factory.mktemp("tiny64")
    build_tiny_hf_model("llama", path, seed=5, head_dim=64, hidden_size=256, num_attention_heads=8,
                        num_key_value_heads=2, intermediate_size=512, max_position_embeddings=2048)
    return str(path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("shadowkv", [None, FULL_SHADOW], ids=["dense", "shadowkv"])
def test_two_gpus_give_one_gpus_greedy_tokens(kernel_path, shadowkv):
    """NCCL, the Triton kernels, CUDA graphs and async decode on each rank (as a GPU replica serves): TP=2 over two
    GPUs gives TP=1's greedy tokens (fp32: only the all-reduce's summation order differs)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (301, 157, 640)]
    engine = dict(device="cuda", dtype="float32", max_num_seqs=4, max_model_len=1024, gpu_cache_gib=0.5,
                  host_cache_gib=0.5, shadowkv=shadowkv)
    one = LLM(model=kernel_path, **engine)
    try:
        want = [o.token_ids for o in one.generate(prompts, GREEDY)]
    finally:
        one.engine.close()
    llm = LLM(model=kernel_path, tensor_parallel_size=2, **engine)
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        dense_cache = getattr(llm.engine.cache, "dense", llm.engine.cache)  # a HybridCache's dense side, or the cache
        assert llm.engine.runner.graphs is not None and dense_cache.spec.kernels
    finally:
        llm.engine.close()
    assert got == want
