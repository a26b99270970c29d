"""Invariant 1: our decoder on the dense cache reproduces Hugging Face transformers' logits, family by family:
a prompt's prefill, then 32 greedy decode steps fed the same tokens; and ragged batches equal each prompt alone."""
import pytest
import torch

from model_factory import FAMILIES, assert_close_to, build_tiny_hf_model, decode, prefill
from shadowkv_core.dense_cache import DenseKVCache
from shadowkv_core.models import load_model

PROMPT_LEN, DECODE_STEPS = 24, 32  # phi3's longrope switches to its long factors at 32 tokens, mid-decode


# (device, dtype, tolerance as a share of the logit scale): fp32 on CPU; bf16 on the GPU, where HF and we round
# differently at every op.
PRECISIONS = [pytest.param("cpu", torch.float32, 1e-4, id="cpu-fp32"),
              pytest.param("cuda", torch.bfloat16, 4e-2, id="cuda-bf16", marks=pytest.mark.gpu)]


def make_cache(spec, num_blocks=32, block_size=8, dtype=torch.float32, device="cpu"):
    return DenseKVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, num_blocks, block_size, dtype,
                        device, spec.attention_scale)


def assert_same_greedy(ours, ref, rel, what):
    """The argmax must agree wherever the reference's top-2 margin exceeds twice the tolerance (else a tie)."""
    top2 = ref.float().topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * rel * ref.float().abs().max()
    agree = ours.argmax(-1) == ref.argmax(-1)
    assert bool((agree | ~clear).all()), f"{what}: greedy token differs"


@pytest.mark.parametrize("device, dtype, rel", PRECISIONS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_match_hf(family, device, dtype, rel, tmp_path):
    hf = build_tiny_hf_model(family, tmp_path).to(device, dtype)
    decoder, spec = load_model(str(tmp_path), dtype, device)
    cache = make_cache(spec, dtype=dtype, device=device)
    cache.allocate(0, PROMPT_LEN, DECODE_STEPS)
    prompt = torch.randint(0, spec.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(prompt[None].to(device), use_cache=True)
        assert_close_to(prefill(decoder, cache, [prompt]), out.logits[0], f"{family} prefill", rel)
        token, past = out.logits[0, -1].argmax().item(), out.past_key_values
        generated = []
        for step in range(DECODE_STEPS):
            ours = decode(decoder, cache, [token], [PROMPT_LEN + step])
            out = hf(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
            ref, past = out.logits[0], out.past_key_values
            assert_close_to(ours, ref, f"{family} decode step {step}", rel)
            assert_same_greedy(ours, ref, rel, f"{family} decode step {step}")
            token = ref[-1].argmax().item()
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
        batch_cache.allocate(i, len(p), 4)
    batched = prefill(decoder, batch_cache, prompts)
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    tokens = batched[last].argmax(-1).tolist()
    batched_step = decode(decoder, batch_cache, tokens, [len(p) for p in prompts])
    for i, p in enumerate(prompts):
        cache = make_cache(spec)
        cache.allocate(0, len(p), 4)
        alone = prefill(decoder, cache, [p])
        start = last[i] + 1 - len(p)
        assert_close_to(batched[start:last[i] + 1], alone, f"{family} prompt {i} prefill")
        assert_close_to(batched_step[i:i + 1], decode(decoder, cache, [tokens[i]], [len(p)]), f"{family} decode {i}")
