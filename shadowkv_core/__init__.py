"""ShadowKV core: config, model loading and decoder, dense and ShadowKV caches, the PyTorch reference of every
decode step, the engine (sequence, scheduler, runner, sampler), the memory model and NUMA placement.

May import torch, transformers (model loading only) and `kernels`; never ray or `serve_app`: the engine runs and is
benchmarked without Ray Serve.
"""
import importlib

from .config import EngineConfig, ShadowKVConfig

_LAZY = {"LLM": ".llm", "LLMEngine": ".engine", "RequestOutput": ".engine", "SamplingParams": ".engine"}
__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "ShadowKVConfig"]


def __getattr__(name: str):
    # The engine is imported on first use, so that `python -m shadowkv_core.memory_model` and other light tools
    # do not load it (nor import their own module twice).
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
