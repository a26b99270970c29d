"""ShadowKV core: config, model loading and decoder, dense and ShadowKV caches, the PyTorch reference of every
decode step, the engine (sequence, scheduler, runner, sampler), the memory model and NUMA placement.

May import torch, transformers (model loading only) and `kernels`; never ray or `serve_app`: the engine runs and is
benchmarked without Ray Serve.
"""
from .config import EngineConfig, ShadowKVConfig
from .engine import LLMEngine, RequestOutput, SamplingParams
from .llm import LLM

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "ShadowKVConfig"]
