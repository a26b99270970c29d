"""Build the engine's KV cache for a model, its pools sized by the memory model: dense paged, or ShadowKV with a
dense cache for sequences that fit in ShadowKVConfig.min_context tokens."""
from __future__ import annotations

import logging

import torch

from .. import memory_model as mm
from ..attention import KVCache
from ..config import EngineConfig
from ..dense_cache import DenseKVCache
from ..numa import placement_for_cuda_device
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
    workspace = (mm.prefill_workspace_bytes(g, config.shadowkv, config.max_prefill_tokens, config.prefill_chunk_tokens)
                 + mm.decode_workspace_bytes(g, config.max_num_seqs))
    return max(int(total * config.gpu_memory_utilization) - (total - free) - workspace, 0)


def host_cache_bytes(config: EngineConfig, wanted: int) -> int:
    """Pinned host bytes for values: configured, or what the GPU pages can use, capped by available memory."""
    if config.host_cache_gib is not None:
        return int(config.host_cache_gib * mm.GIB)
    if torch.device(config.device).type != "cuda":
        return CPU_CACHE_BYTES
    return min(wanted, int(mm.mem_available_bytes() * HOST_HEADROOM))


def _dense(config: EngineConfig, spec, dtype: torch.dtype, device: torch.device, num_blocks: int) -> DenseKVCache:
    return DenseKVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, num_blocks, config.block_size, dtype,
                        device, spec.attention_scale, config.prefill_chunk_tokens, config.use_kernels)


def build_cache(config: EngineConfig, spec, dtype: torch.dtype, device: torch.device, rotary) -> KVCache:
    g = mm.Geometry.from_spec(spec, dtype)
    budget = gpu_cache_bytes(config, spec, g, device)
    cfg = config.shadowkv
    if cfg is None:
        pools = mm.plan_pools(g, None, budget, 0, config.max_num_seqs, config.block_size)
        if pools.num_dense_blocks < 1:
            raise ValueError(f"gpu_cache_gib: {budget} bytes hold no KV block of "
                             f"{mm.dense_block_bytes(g, config.block_size)} bytes")
        return _dense(config, spec, dtype, device, pools.num_dense_blocks)
    cfg.check_model(spec.num_kv_heads, spec.head_dim)
    gpu_only = mm.plan_pools(g, cfg, budget, 0, config.max_num_seqs, config.block_size)
    host = host_cache_bytes(config, (gpu_only.num_gpu_pages - gpu_only.num_device_value_pages)
                            * mm.host_page_bytes(g, cfg))
    pools = mm.plan_pools(g, cfg, budget, host, config.max_num_seqs, config.block_size)
    if pools.num_gpu_pages < 1 or pools.num_host_pages < 1:
        raise ValueError(f"cache budget: {budget} GPU bytes and {host} host bytes hold {config.max_num_seqs} "
                         f"ShadowKV slots ({mm.slot_bytes(g, cfg)} bytes each) and their dense blocks but no shadow "
                         "page; lower max_num_seqs or raise gpu_cache_gib / host_cache_gib")
    placement = None
    if device.type == "cuda":  # the value shard and this replica's threads go to the GPU's NUMA node
        placement = placement_for_cuda_device(device)
        placement.pin_threads()
    logger.info("ShadowKV pools: %d slots, %d dense blocks, %d GPU pages, %d host and %d device value pages of %d "
                "tokens", pools.num_slots, pools.num_dense_blocks, pools.num_gpu_pages, pools.num_host_pages,
                pools.num_device_value_pages, mm.page_tokens(cfg))
    return ShadowKVCache(spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, cfg,
                         spec.attention_scale, rotary, dtype, device, pools.num_slots, pools.num_gpu_pages,
                         pools.num_host_pages, _dense(config, spec, dtype, device, pools.num_dense_blocks),
                         prefill_chunk_tokens=config.prefill_chunk_tokens,
                         placement=placement, use_kernels=config.use_kernels,
                         num_device_value_pages=pools.num_device_value_pages)
