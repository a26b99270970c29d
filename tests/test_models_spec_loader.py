"""ModelSpec parsing (transformers 5 and older config layouts) and the loader's behaviour and errors."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shadowkv_core.cache.base import AttentionMetadata, CacheSpec
from shadowkv_core.cache.dense import DenseKVCache
from shadowkv_core.models import ModelSpec, load_model, load_tokenizer
from shadowkv_core.tiny_model import build_tiny_model
from support.model_factory import build_tiny_hf_model

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)


def spec_of(architecture, **cfg):
    return ModelSpec.from_hf_config({"architectures": [architecture], **BASE, **cfg})


def test_family_features():
    qwen2 = spec_of("Qwen2ForCausalLM")
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    qwen3 = spec_of("Qwen3ForCausalLM", head_dim=128, tie_word_embeddings=True)
    assert qwen3.qk_norm and qwen3.head_dim == 128 and qwen3.tie_word_embeddings and not qwen3.qkv_bias
    glm = spec_of("GlmForCausalLM", head_dim=16, partial_rotary_factor=0.5, torch_dtype="bfloat16")
    assert glm.rope_interleaved and glm.rotary_dim == 8 and glm.qkv_bias and glm.torch_dtype == torch.bfloat16
    assert spec_of("Glm4ForCausalLM", head_dim=16).post_norms
    llama = spec_of("LlamaForCausalLM", attention_bias=True, eos_token_id=[7, 8])
    assert llama.qkv_bias and llama.o_bias and llama.eos_token_ids == (7, 8) and llama.head_dim == 16
    assert llama.attention_scale == 16 ** -0.5
    assert ModelSpec.from_hf_config({"model_type": "mistral", **BASE}).architecture == "MistralForCausalLM"


def test_legacy_rope_layouts():
    llama31 = spec_of("LlamaForCausalLM", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    assert llama31.rope_theta == 500000.0 and llama31.rope_type == "llama3"
    assert llama31.rope_scaling["original_max_position_embeddings"] == 8192
    phi3 = spec_of("Phi3ForCausalLM", original_max_position_embeddings=4096, rope_scaling={
        "type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    assert phi3.rope_type == "longrope" and phi3.rope_scaling["original_max_position_embeddings"] == 4096
    assert spec_of("LlamaForCausalLM", rope_scaling=None).rope_scaling is None


def test_unknown_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM.*Phi3ForCausalLM"):
        spec_of("GPT2LMHeadModel")


def test_unknown_or_incomplete_rope_is_refused():
    with pytest.raises(ValueError, match=r"'mrope'.*llama3.*longrope"):
        spec_of("Qwen2ForCausalLM", rope_scaling={"rope_type": "mrope"})
    with pytest.raises(ValueError, match="low_freq_factor"):
        spec_of("LlamaForCausalLM", rope_scaling={"rope_type": "llama3", "factor": 8.0})


def test_mistral_sliding_window_is_refused_at_load(tmp_path):
    build_tiny_hf_model("mistral", tmp_path, sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window=64"):
        load_model(str(tmp_path), None, "cpu")


def test_missing_files_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path), None, "cpu")
    build_tiny_hf_model("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(str(tmp_path), None, "cpu")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(str(tmp_path / "absent"), None, "cpu")


def test_sharded_checkpoint_loads_and_a_missing_shard_is_named(tmp_path):
    hf = build_tiny_hf_model("qwen2", tmp_path / "whole")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    whole, _ = load_model(str(tmp_path / "whole"), None, "cpu")
    sharded, _ = load_model(str(tmp_path / "sharded"), None, "cpu")
    for (name, a), b in zip(whole.state_dict().items(), sharded.state_dict().values()):
        assert torch.equal(a, b), name
    shards[0].unlink()
    with pytest.raises(FileNotFoundError, match=shards[0].name):
        load_model(str(tmp_path / "sharded"), None, "cpu")


def test_shape_mismatch_and_missing_tensor_are_named(tmp_path):
    build_tiny_hf_model("llama", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    save_file({**tensors, name: tensors[name][:-1]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}.*\(31, 64\).*\(32, 64\)"):
        load_model(str(tmp_path), None, "cpu")
    save_file({k: v for k, v in tensors.items() if k != name}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.weight"):
        load_model(str(tmp_path), None, "cpu")


def test_dtype_defaults_to_the_checkpoint_and_can_be_overridden(tmp_path):
    build_tiny_hf_model("qwen3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    decoder, spec = load_model(str(tmp_path), None, "cpu")
    assert spec.torch_dtype == torch.bfloat16 and decoder.embed_tokens.weight.dtype == torch.bfloat16
    assert decoder.lm_head.weight is decoder.embed_tokens.weight  # tied
    decoder, _ = load_model(str(tmp_path), torch.float32, "cpu")
    assert decoder.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("family", ["glm4", "phi3"])
def test_chunked_prefill_equals_unchunked(family, tmp_path):
    build_tiny_hf_model(family, tmp_path)
    prompt = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(3))
    logits = []
    for chunk_tokens in (8192, 7):
        decoder, spec = load_model(str(tmp_path), None, "cpu", prefill_chunk_tokens=chunk_tokens)
        cache = DenseKVCache(CacheSpec.of(spec, torch.float32, "cpu", prefill_chunk_tokens=chunk_tokens), 8, 8)
        cache.manager.allocate(0, 45, 1)
        meta = AttentionMetadata(True, [0], [45], [0], torch.arange(45))
        logits.append(decoder.compute_logits(decoder(prompt, torch.arange(45), cache, meta)))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_tokenizer_and_model_of_a_local_checkpoint(tmp_path):
    build_tiny_model(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.decode(tokenizer.encode("hello", add_special_tokens=False)) == "hello"
    decoder, spec = load_model(str(tmp_path), None, "cpu")
    assert spec.family == "llama" and decoder.embed_tokens.weight.shape == (spec.vocab_size, spec.hidden_size)
