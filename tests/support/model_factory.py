"""Tiny random Hugging Face models of every supported family, built offline from transformers' config classes and
saved as config.json + safetensors, for equivalence tests against our decoder."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

from shadowkv_core.cache.base import AttentionMetadata

_GEOMETRY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 bos_token_id=1, eos_token_id=2, pad_token_id=None)

FAMILIES = {
    "llama": ("LlamaConfig", dict(head_dim=16)),
    "llama3": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "yi": ("LlamaConfig", dict(num_key_value_heads=1, rope_parameters=dict(rope_type="default", rope_theta=5e6))),
    "mistral": ("MistralConfig", dict(sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=64))),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(max_position_embeddings=128, original_max_position_embeddings=32, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(8)],
        long_factor=[2.0 + 0.5 * i for i in range(8)]))),
    "glm": ("GlmConfig", dict(head_dim=16, attention_bias=True, rms_norm_eps=1e-5)),
    "glm4": ("Glm4Config", dict(head_dim=16, attention_bias=True, rms_norm_eps=1e-5)),
}


def build_tiny_hf_model(family: str, path: str | Path, seed: int = 0, **overrides):
    """Save a tiny random fp32 model of `family` (a key of FAMILIES) to `path`; return the HF model in eval mode.

    Every parameter is random, norms and biases included (init's ones and zeros would hide mistakes in them)."""
    config_class, family_kwargs = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**_GEOMETRY, **family_kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    model.save_pretrained(path)
    return model.eval()


def prefill(decoder, cache, prompts):
    """Prefill prompts (token tensors) as sequences 0..n-1 of `cache`; logits of every prompt token."""
    device = next(decoder.parameters()).device
    lens = [len(p) for p in prompts]
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    meta = AttentionMetadata(True, list(range(len(prompts))), lens, [0] * len(prompts), positions)
    logits = decoder.compute_logits(decoder(torch.cat(prompts).to(device), positions, cache, meta))
    cache.finish_forward(meta)
    return logits


def decode(decoder, cache, tokens, cached_lens):
    """One decode step of sequences 0..n-1 fed `tokens`; logits (n, vocab)."""
    device = next(decoder.parameters()).device
    positions = torch.tensor(cached_lens, device=device)
    meta = AttentionMetadata(False, list(range(len(tokens))), [1] * len(tokens), list(cached_lens), positions)
    logits = decoder.compute_logits(decoder(torch.tensor(tokens, device=device), positions, cache, meta))
    cache.finish_forward(meta)
    return logits


def assert_close_to(ours, ref, what, rel=1e-4):
    err = (ours.float() - ref.float()).abs().max().item()
    bound = rel * ref.float().abs().max().item()
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g} ({rel:g} of the logit scale)"
