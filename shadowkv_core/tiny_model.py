"""A tiny random-weight Llama checkpoint with a byte-level tokenizer, written in Hugging Face format.

It stands in for a real model wherever none can be downloaded: engine and service tests (configs/local.yaml serves
the small model this project ships). Its outputs are meaningless; its shapes and file layout are real."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_byte_tokenizer(path: str | Path) -> int:
    """Write a byte-level tokenizer (256 byte tokens, then SPECIAL_TOKENS) to `path`; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    byte_to_char = {b: c for b, c in enumerate(sorted(alphabet, key=_byte_of))}
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|eos|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(path))
    return len(fast)


def _byte_of(char: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256 + rank."""
    code = ord(char)
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def tiny_llama_config(vocab_size: int, **overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": 256, "eos_token_id": 257,
    }
    config.update(overrides)
    return config


def random_llama_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d, nq, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def normal(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    weights = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": normal(vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(nq * d, h), p + "self_attn.k_proj.weight": normal(nkv * d, h),
            p + "self_attn.v_proj.weight": normal(nkv * d, h), p + "self_attn.o_proj.weight": normal(h, nq * d),
            p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        })
    return weights


def build_tiny_model(path: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Write config.json, model.safetensors and the byte-level tokenizer files to `path` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = save_byte_tokenizer(path)
    config = tiny_llama_config(vocab_size, **config_overrides)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_llama_weights(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
