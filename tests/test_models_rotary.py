"""RotaryEmbedding against transformers' rotary classes and apply_rotary_pos_emb, for every rope type and layout,
at arbitrary (unsorted, sparse) positions as the ShadowKV cache uses them when it rebuilds keys."""
import pytest
import torch
from transformers import GlmConfig, LlamaConfig, Phi3Config, Qwen2Config
from transformers.models.glm import modeling_glm
from transformers.models.llama import modeling_llama
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen2 import modeling_qwen2

from shadowkv_core.models import ModelSpec, RotaryEmbedding

GEOMETRY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,  # Phi-4-mini style
                short_factor=[1.0 + 0.1 * i for i in range(6)], long_factor=[2.0 + 0.5 * i for i in range(6)])
CASES = {
    "default": (LlamaConfig, modeling_llama, dict(max_position_embeddings=64)),
    "linear": (LlamaConfig, modeling_llama, dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0))),
    "dynamic": (LlamaConfig, modeling_llama, dict(max_position_embeddings=32, rope_parameters=dict(
        rope_type="dynamic", rope_theta=1e4, factor=2.0))),
    "llama3": (LlamaConfig, modeling_llama, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "yarn": (Qwen2Config, modeling_qwen2, dict(max_position_embeddings=256, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=64))),
    "yarn_mscale": (LlamaConfig, modeling_llama, dict(max_position_embeddings=256, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64, mscale=0.7,
        mscale_all_dim=0.5, beta_fast=16, truncate=False))),
    "longrope": (Phi3Config, modeling_phi3, dict(max_position_embeddings=128, original_max_position_embeddings=32,
                                                 rope_parameters=LONGROPE)),
    "glm_interleaved_partial": (GlmConfig, modeling_glm, dict(head_dim=16)),
}


def hf_rotate(module, config, x, positions):
    """x (n, h, d) rotated by transformers at `positions`, through its (1, h, n, d) layout."""
    rotary = next(getattr(module, name) for name in dir(module) if name.endswith("RotaryEmbedding"))(config)
    x4 = x.transpose(0, 1)[None]  # (1, h, n, d)
    cos, sin = rotary(x4, positions[None])
    q, _ = module.apply_rotary_pos_emb(x4, x4, cos, sin)
    return q[0].transpose(0, 1)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("max_position", [20, 100])  # below / above the pretraining lengths of longrope, dynamic
def test_rotary_matches_transformers(case, max_position):
    config_class, module, kwargs = CASES[case]
    config = config_class(**GEOMETRY, **kwargs)
    spec = ModelSpec.from_hf_config(config.to_dict())
    gen = torch.Generator().manual_seed(0)
    positions = torch.randperm(max_position + 1, generator=gen)[:12]  # unsorted, sparse, includes large ones
    positions[0] = max_position
    x = torch.randn(12, 3, spec.head_dim, generator=gen)
    ours = RotaryEmbedding(spec, "cpu").apply(x, positions)
    ref = hf_rotate(module, config, x, positions)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[..., spec.rotary_dim:], x[..., spec.rotary_dim:]), "channels past rotary_dim must pass"


def test_per_token_seq_lens_choose_longrope_factors_per_sequence():
    config = Phi3Config(**GEOMETRY, **CASES["longrope"][2])
    rotary = RotaryEmbedding(ModelSpec.from_hf_config(config.to_dict()), "cpu")
    x, positions = torch.randn(4, 2, 16), torch.tensor([3, 4, 3, 4])
    short_seq = rotary.apply(x[:2], positions[:2], torch.tensor([5, 5]))
    long_seq = rotary.apply(x[2:], positions[2:], torch.tensor([40, 40]))
    both = rotary.apply(x, positions, torch.tensor([5, 5, 40, 40]))
    torch.testing.assert_close(both, torch.cat([short_seq, long_seq]), rtol=0, atol=0)
    assert not torch.allclose(short_seq, long_seq), "long factors must differ from short ones"


def test_rotary_keeps_dtype_and_computes_in_fp32():
    config = LlamaConfig(**GEOMETRY)
    rotary = RotaryEmbedding(ModelSpec.from_hf_config(config.to_dict()), "cpu")
    x, positions = torch.randn(5, 2, 16), torch.arange(1000, 1005)
    out = rotary.apply(x.bfloat16(), positions)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, rotary.apply(x.bfloat16().float(), positions).bfloat16(), rtol=0, atol=0)
