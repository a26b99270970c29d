"""Invariant 2, family by family: ShadowKV with full rank and a sparse budget covering the whole context reproduces
the dense path, on a ragged batch, through prefill and 32 decode steps that fold the generated window twice."""
import pytest
import torch

from shadowkv_core.cache.base import CacheSpec
from shadowkv_core.cache.dense import DenseKVCache
from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.memory_model import Pools
from shadowkv_core.models import load_model
from shadowkv_core.shadowkv.cache import ShadowKVCache
from support.model_factory import FAMILIES, assert_close_to, build_tiny_hf_model, decode, prefill

PROMPT_LENS, DECODE_STEPS = (37, 64, 45), 32  # all past phi3's 32-token longrope switch
PRECISIONS = [pytest.param("cpu", torch.float32, 1e-4, id="cpu-fp32"),
              pytest.param("cuda", torch.bfloat16, 4e-2, id="cuda-bf16", marks=pytest.mark.gpu)]


def caches(spec, dtype, device, rotary, landmark_kind="mean"):
    config = ShadowKVConfig(rank=spec.num_kv_heads * spec.head_dim, chunk_size=4, sparse_budget=4096,
                            outlier_chunks=2, local_chunks=2, min_context=0, decode_window=16, page_chunks=4,
                            device_value_share=0.0, landmark_kind=landmark_kind)
    cache_spec = CacheSpec.of(spec, dtype, device)
    shadow = ShadowKVCache(cache_spec, config, Pools(num_slots=3, num_dense_blocks=0, num_gpu_pages=32,
                                                     num_host_pages=32), rotary)
    return DenseKVCache(cache_spec, 64, 8), shadow


@pytest.mark.parametrize("landmark_kind", ["mean", "bounds"])
@pytest.mark.parametrize("device, dtype, rel", PRECISIONS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_budget_full_rank_shadowkv_equals_dense(family, device, dtype, rel, landmark_kind, tmp_path):
    build_tiny_hf_model(family, tmp_path)
    decoder, spec = load_model(str(tmp_path), dtype, device)
    dense, shadow = caches(spec, dtype, device, decoder.rotary, landmark_kind)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen) for n in PROMPT_LENS]
    for i, p in enumerate(prompts):
        dense.manager.allocate(i, len(p), DECODE_STEPS)
        shadow.manager.allocate(i, len(p), DECODE_STEPS)
    last = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    with torch.no_grad():
        want, got = prefill(decoder, dense, prompts), prefill(decoder, shadow, prompts)
        assert_close_to(got, want, f"{family} prefill", rel)
        tokens = want[last.to(want.device)].argmax(-1).tolist()
        for step in range(DECODE_STEPS):
            lens = [n + step for n in PROMPT_LENS]
            want, got = decode(decoder, dense, tokens, lens), decode(decoder, shadow, tokens, lens)
            assert_close_to(got, want, f"{family} decode step {step}", rel)
            tokens = want.argmax(-1).tolist()
    for i in range(len(prompts)):
        shadow.manager.free(i)
    stats = shadow.stats()
    assert (stats["num_seqs"], stats["gpu_bytes_in_use"], stats["host_bytes_in_use"]) == (0, 0, 0)
