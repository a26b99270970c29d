"""Invariant 1: our decoder on the dense cache reproduces Hugging Face transformers' logits, family by family:
a prompt's prefill, then 32 greedy decode steps fed the same tokens; and ragged batches equal each prompt alone."""
import copy

import pytest
import torch

from shadowkv_core.cache.base import CacheSpec
from shadowkv_core.cache.dense import DenseKVCache
from shadowkv_core.models import load_model
from support.model_factory import FAMILIES, assert_close_to, build_tiny_hf_model, decode, prefill

PROMPT_LEN, DECODE_STEPS = 24, 32  # phi3's longrope switches to its long factors at 32 tokens, mid-decode


# fp32 on CPU must match HF's fp32 within 1e-4 of the logit scale. bf16 on the GPU is judged against HF in fp32
# there: its error may be at most twice what HF's own bf16 forward makes (every op rounds; the two round differently).
PRECISIONS = [pytest.param("cpu", torch.float32, id="cpu-fp32"),
              pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)]
FP32_REL = 1e-4


def make_cache(spec, num_blocks=32, block_size=8, dtype=torch.float32, device="cpu"):
    return DenseKVCache(CacheSpec.of(spec, dtype, device), num_blocks, block_size)


class HFReference:
    """HF's fp32 forward (the truth) and, for a low-precision run, HF's own forward in that dtype (the yardstick)."""

    def __init__(self, model, dtype):
        self.models = [model] if dtype == torch.float32 else [model, copy.deepcopy(model).to(dtype)]
        self.past = [None] * len(self.models)

    def __call__(self, input_ids):
        logits = []
        for i, model in enumerate(self.models):
            out = model(input_ids, past_key_values=self.past[i], use_cache=True)
            self.past[i] = out.past_key_values
            logits.append(out.logits[0].float())
        return logits[0], (logits[1] if len(logits) > 1 else None)


def assert_within_reference(ours, truth, low, what):
    scale = truth.abs().max().item()
    err = (ours.float() - truth).abs().max().item()
    bound = FP32_REL * scale if low is None else max(2 * (low - truth).abs().max().item(), FP32_REL * scale)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"
    top2 = truth.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * bound  # elsewhere the top two are a tie at this precision
    agree = ours.argmax(-1) == truth.argmax(-1)
    assert bool((agree | ~clear).all()), f"{what}: greedy token differs"


@pytest.mark.parametrize("device, dtype", PRECISIONS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_match_hf(family, device, dtype, tmp_path):
    reference = HFReference(build_tiny_hf_model(family, tmp_path).to(device), dtype)
    decoder, spec = load_model(str(tmp_path), dtype, device)
    cache = make_cache(spec, dtype=dtype, device=device)
    cache.manager.allocate(0, PROMPT_LEN, DECODE_STEPS)
    prompt = torch.randint(0, spec.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        truth, low = reference(prompt[None].to(device))
        assert_within_reference(prefill(decoder, cache, [prompt]), truth, low, f"{family} prefill")
        token = truth[-1].argmax().item()
        generated = []
        for step in range(DECODE_STEPS):
            ours = decode(decoder, cache, [token], [PROMPT_LEN + step])
            truth, low = reference(torch.tensor([[token]], device=device))
            assert_within_reference(ours, truth, low, f"{family} decode step {step}")
            token = truth[-1].argmax().item()
            generated.append(token)
    assert len(set(generated)) > 1, "degenerate test model: it repeats one token"


@pytest.mark.parametrize("family", ["llama3", "phi3", "qwen3"])
def test_ragged_batch_matches_each_prompt_alone(family, tmp_path):
    build_tiny_hf_model(family, tmp_path)
    decoder, spec = load_model(str(tmp_path), None, "cpu")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen) for n in (5, 40, 17)]  # 40 > phi3's 32
    batch_cache = make_cache(spec)
    for i, p in enumerate(prompts):
        batch_cache.manager.allocate(i, len(p), 4)
    batched = prefill(decoder, batch_cache, prompts)
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    tokens = batched[last].argmax(-1).tolist()
    batched_step = decode(decoder, batch_cache, tokens, [len(p) for p in prompts])
    for i, p in enumerate(prompts):
        cache = make_cache(spec)
        cache.manager.allocate(0, len(p), 4)
        alone = prefill(decoder, cache, [p])
        start = last[i] + 1 - len(p)
        assert_close_to(batched[start:last[i] + 1], alone, f"{family} prompt {i} prefill")
        assert_close_to(batched_step[i:i + 1], decode(decoder, cache, [tokens[i]], [len(p)]), f"{family} decode {i}")
