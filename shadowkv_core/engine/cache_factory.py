"""Build the engine's KV cache for a model: dense paged, or ShadowKV with a dense cache for short sequences."""
from __future__ import annotations

import torch

from ..attention import KVCache
from ..config import EngineConfig
from ..dense_cache import DenseKVCache

GIB = 1 << 30
CPU_CACHE_GIB = 1.0
CUDA_WORKSPACE_BYTES = 2 * GIB  # activations of a prefill chunk, logits, allocator slack


def gpu_cache_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes the engine's caches may take on the device: configured, or what is free after the weights."""
    if config.gpu_cache_gib is not None:
        return int(config.gpu_cache_gib * GIB)
    if device.type != "cuda":
        return int(CPU_CACHE_GIB * GIB)
    free, total = torch.cuda.mem_get_info(device)
    used_elsewhere = total - free
    return max(int(total * config.gpu_memory_utilization) - used_elsewhere - CUDA_WORKSPACE_BYTES, 0)


def build_dense_cache(config: EngineConfig, spec, dtype: torch.dtype, device: torch.device,
                      cache_bytes: int) -> DenseKVCache:
    block_bytes = DenseKVCache.bytes_per_block(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                               config.block_size, dtype)
    num_blocks = cache_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(f"gpu_cache_gib: {cache_bytes} bytes hold no KV block of {block_bytes} bytes")
    return DenseKVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, num_blocks, config.block_size, dtype,
                        device, spec.attention_scale, config.prefill_chunk_tokens)


def build_cache(config: EngineConfig, spec, dtype: torch.dtype, device: torch.device, rotary) -> KVCache:
    cache_bytes = gpu_cache_bytes(config, device)
    if config.shadowkv is None:
        return build_dense_cache(config, spec, dtype, device, cache_bytes)
    raise NotImplementedError("ShadowKV cache wiring lands with shadowkv_core.shadowkv")
