"""The model layer: config.json -> ModelSpec, rotary embedding, a lean decoder, and the safetensors loader."""
from .decoder import Decoder
from .loader import load_model, load_tokenizer
from .rotary import RotaryEmbedding
from .spec import ModelSpec

__all__ = ["Decoder", "ModelSpec", "RotaryEmbedding", "load_model", "load_tokenizer"]
