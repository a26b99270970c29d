"""Triton kernels of the ShadowKV decode step and of prefill attention, one file per kernel: the `@triton.jit` body
and one launcher that checks shapes, strides and dtypes, nothing else (`online_softmax.py`: the step the attention
kernels share; `fp8.py`: their e4m3 inputs). Each kernel's PyTorch reference lives in `shadowkv_core`.

May import torch and triton only. (The name is fixed by the product; tests prove that Hugging Face transformers does
not mistake this package for its optional `kernels` dependency.)
"""
import functools

import torch

MIN_HEAD_DIM = 16  # tl.dot's smallest inner dimension: narrower heads take the PyTorch path


@functools.lru_cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device, which launchers size their grids by; 1 elsewhere (the interpreter runs one
    program at a time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
