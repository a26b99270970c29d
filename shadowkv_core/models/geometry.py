"""Model directories of a named geometry for random-weight runs (EngineConfig.load_format "dummy": only config.json
is read, the weights are drawn at load): Llama-3.1-8B's and a tiny one, as Hugging Face configs, with the ShadowKV
config the tiny one fits. Benchmarks time and size the engine at a real model's shapes without its weights; tests and
CPU rehearsals of those benchmarks use the tiny one."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..config import ShadowKVConfig
from .loader import read_config
from .spec import ModelSpec

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
TINY = {**LLAMA_31_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "torch_dtype": "float32"}
TINY_SHADOWKV = ShadowKVConfig(rank=16, sparse_budget=128, outlier_chunks=4, min_context=256, decode_window=32,
                               device_value_share=0.0)


def write_config(config: dict) -> str:
    """A new temporary model directory holding `config` as its config.json."""
    path = Path(tempfile.mkdtemp(prefix="geometry-"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def write_geometry(config: dict) -> str:
    """A model directory the service can serve: `config` as config.json, and a word-level tokenizer over its whole
    vocabulary ("t0" ... "t<vocab_size - 1>"), so that every generated token streams as one word of text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(write_config(config))
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return str(path)


def model_spec(model_dir: str) -> ModelSpec:
    """The ModelSpec of the model directory's config.json."""
    return ModelSpec.from_hf_config(read_config(Path(model_dir)))
