"""Build the engine's KV cache for a model, its pools sized by the memory model: dense paged, or ShadowKV with a
dense cache for sequences shorter than ShadowKVConfig.min_context."""
from __future__ import annotations

import logging

import torch

from .. import memory_model as mm
from ..attention import KVCache
from ..config import EngineConfig
from ..dense_cache import DenseKVCache
from ..shadowkv.cache import ShadowKVCache

logger = logging.getLogger(__name__)

CPU_CACHE_BYTES = mm.GIB  # default cache budget on CPU, device and host alike
HOST_HEADROOM = 0.8  # share of MemAvailable a default host store may take


def gpu_cache_bytes(config: EngineConfig, spec, g: mm.Geometry, device: torch.device) -> int:
    """Bytes the caches may take on the device: configured, or what is free after the weights minus the
    memory model's workspace for the longest prefill."""
    if config.gpu_cache_gib is not None:
        return int(config.gpu_cache_gib * mm.GIB)
    if device.type != "cuda":
        return CPU_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(device)
    workspace = mm.prefill_workspace_bytes(g, config.shadowkv, config.max_prefill_tokens,
                                           config.prefill_chunk_tokens)
    return max(int(total * config.gpu_memory_utilization) - (total - free) - workspace, 0)


def host_cache_bytes(config: EngineConfig, wanted: int) -> int:
    """Pinned host bytes for values: configured, or what the GPU pages can use, capped by available memory."""
    if config.host_cache_gib is not None:
        return int(config.host_cache_gib * mm.GIB)
    if torch.device(config.device).type != "cuda":
        return CPU_CACHE_BYTES
    available = _mem_available_bytes()
    return min(wanted, int(available * HOST_HEADROOM))


def _mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def _dense(config: EngineConfig, spec, dtype: torch.dtype, device: torch.device, nbytes: int,
           required: bool = True) -> DenseKVCache:
    g = mm.Geometry.from_spec(spec, dtype)
    num_blocks = nbytes // mm.dense_block_bytes(g, config.block_size)
    if required and num_blocks < 1:
        raise ValueError(f"gpu_cache_gib: {nbytes} bytes hold no KV block of "
                         f"{mm.dense_block_bytes(g, config.block_size)} bytes")
    return DenseKVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, num_blocks, config.block_size, dtype,
                        device, spec.attention_scale, config.prefill_chunk_tokens)


def build_cache(config: EngineConfig, spec, dtype: torch.dtype, device: torch.device, rotary) -> KVCache:
    g = mm.Geometry.from_spec(spec, dtype)
    budget = gpu_cache_bytes(config, spec, g, device)
    cfg = config.shadowkv
    if cfg is None:
        return _dense(config, spec, dtype, device, budget)
    cfg.check_model(spec.num_kv_heads, spec.head_dim)
    slots = config.max_num_seqs * mm.slot_bytes(g, cfg)
    # Short sequences stay dense: their pool holds a full batch of them at min_context, at most a quarter.
    dense_bytes = min((budget - slots) // 4, mm.dense_seq_bytes(g, cfg.min_context, config.block_size)
                      * config.max_num_seqs)
    num_gpu_pages = (budget - slots - dense_bytes) // mm.gpu_page_bytes(g, cfg)
    if num_gpu_pages < 1:
        raise ValueError(f"gpu_cache_gib: {budget} bytes cannot hold {config.max_num_seqs} ShadowKV slots of "
                         f"{mm.slot_bytes(g, cfg)} bytes and any shadow page; lower max_num_seqs or raise the budget")
    num_host_pages = host_cache_bytes(config, num_gpu_pages * mm.host_page_bytes(g, cfg)) // mm.host_page_bytes(g, cfg)
    logger.info("ShadowKV pools: %d slots, %d GPU pages, %d host pages of %d tokens, dense %.2f GiB",
                config.max_num_seqs, num_gpu_pages, num_host_pages, mm.page_tokens(cfg), dense_bytes / mm.GIB)
    return ShadowKVCache(spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, cfg,
                         spec.attention_scale, rotary, dtype, device, config.max_num_seqs, num_gpu_pages,
                         num_host_pages, _dense(config, spec, dtype, device, dense_bytes, required=False),
                         page_chunks=cfg.page_chunks, prefill_chunk_tokens=config.prefill_chunk_tokens)
