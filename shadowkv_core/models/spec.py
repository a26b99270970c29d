"""ModelSpec: everything the decoder, the rotary embedding and the caches need from a Hugging Face config.json."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# architecture -> family; the family decides biases, norms, rotary layout and checkpoint names.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # Llama 2/3/3.1 and Yi (Llama architecture)
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "GlmForCausalLM": "glm",
    "Glm4ForCausalLM": "glm4",
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "glm": "GlmForCausalLM",
                "glm4": "Glm4ForCausalLM"}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")
_ROPE_ALIASES = {"su": "longrope"}  # early Phi-3 configs
_REQUIRED_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k, before RoPE
    post_norms: bool  # GLM-4-0414: extra norms after attention and after the MLP
    rope_theta: float
    rope_scaling: dict | None  # the scaling parameters with "rope_type"; None for plain RoPE
    partial_rotary_factor: float
    rope_interleaved: bool  # GLM: rotate pairs (2i, 2i+1) instead of (i, i + d/2)
    max_position_embeddings: int
    sliding_window: int | None
    torch_dtype: torch.dtype | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"] if self.rope_scaling else "default"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return self.head_dim ** -0.5

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelSpec:
        architecture = _architecture(cfg)
        family = ARCHITECTURES[architecture]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        attention_bias = cfg.get("attention_bias", family in ("glm", "glm4"))
        rope_theta, rope_scaling, partial = _rope(cfg)
        return cls(
            architecture=architecture, family=family,
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads, head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=family == "qwen2" or (family in ("llama", "qwen3", "glm", "glm4") and attention_bias),
            o_bias=family in ("llama", "qwen3") and attention_bias,
            mlp_bias=family == "llama" and cfg.get("mlp_bias", False),
            qk_norm=family == "qwen3", post_norms=family == "glm4",
            rope_theta=rope_theta, rope_scaling=rope_scaling, partial_rotary_factor=partial,
            rope_interleaved=family in ("glm", "glm4"),
            max_position_embeddings=cfg["max_position_embeddings"], sliding_window=_sliding_window(cfg, family),
            torch_dtype=_DTYPES.get(cfg.get("torch_dtype") or cfg.get("dtype")),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_token_ids(cfg.get("eos_token_id")))

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dimension head_dim*partial_rotary_factor = {self.rotary_dim} must be even "
                             f"and in (0, head_dim={self.head_dim}]")
        if self.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling[key]) != self.rotary_dim // 2:
                    raise ValueError(f"longrope {key} has {len(self.rope_scaling[key])} entries, "
                                     f"expected rotary_dim/2 = {self.rotary_dim // 2}")


def _architecture(cfg: dict) -> str:
    names = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type"), f"model_type={cfg.get('model_type')}")]
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise ValueError(f"unsupported architecture {names[0]!r}; supported: {', '.join(ARCHITECTURES)}")


def _rope(cfg: dict) -> tuple[float, dict | None, float]:
    """(theta, scaling parameters or None, partial rotary factor), from transformers 5's `rope_parameters` or the
    older `rope_theta` / `rope_scaling` / `partial_rotary_factor` top-level keys."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", legacy_type) or "default"
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None, partial
    if rope_type == "longrope" and "original_max_position_embeddings" in cfg:
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]  # Phi-3: top level wins
    if rope_type in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    missing = [key for key in _REQUIRED_ROPE_KEYS[rope_type] if params.get(key) is None]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)} in the config's rope parameters")
    return theta, {"rope_type": rope_type, **params}, partial


def _sliding_window(cfg: dict, family: str) -> int | None:
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    return cfg.get("sliding_window")


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
