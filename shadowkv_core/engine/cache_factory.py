"""Build an engine's KV cache, its pools sized by the memory model: dense paged, or a hybrid of a dense cache (for
sequences that fit in ShadowKVConfig.min_context tokens) and the shadow."""
from __future__ import annotations

import dataclasses
import logging

import torch

from .. import memory_model as mm
from ..cache.base import CacheSpec, KVCache
from ..cache.dense import DenseKVCache
from ..config import AUTO, EngineConfig, ShadowKVConfig
from ..numa import placement_for_cuda_device
from ..shadowkv.cache import ShadowKVCache
from ..shadowkv.hybrid import HybridCache

logger = logging.getLogger(__name__)

CPU_CACHE_BYTES = mm.GIB  # default cache budget on CPU, device and host alike
HOST_HEADROOM = 0.8  # share of MemAvailable a default host store may take


def gpu_cache_bytes(config: EngineConfig, g: mm.Geometry, device: torch.device, max_model_len: int) -> int:
    """Bytes the caches may take on the device: configured, or what is free after the weights minus the
    memory model's workspace for the largest prefill the engine admits (largest_prefill_workspace_bytes) and the
    full batch's decode."""
    if config.gpu_cache_gib is not None:
        return int(config.gpu_cache_gib * mm.GIB)
    if device.type != "cuda":
        return CPU_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(device)
    workspace = (mm.largest_prefill_workspace_bytes(g, config.shadowkv, config.max_prefill_tokens, max_model_len,
                                                    config.prefill_chunk_tokens, config.enable_prefix_caching)
                 + mm.decode_workspace_bytes(g, config.max_num_seqs))
    return max(int(total * config.gpu_memory_utilization) - (total - free) - workspace, 0)


def host_cache_bytes(config: EngineConfig, wanted: int) -> int:
    """Pinned host bytes for one rank's values: configured, or what the GPU pages can use, capped by its share of
    available memory (the ranks of a tensor-parallel replica read MemAvailable at once, each before the others pin)."""
    if config.host_cache_gib is not None:
        return int(config.host_cache_gib * mm.GIB)
    if torch.device(config.device).type != "cuda":
        return CPU_CACHE_BYTES
    return min(wanted, int(mm.mem_available_bytes() * HOST_HEADROOM) // config.tensor_parallel_size)


def _host_wanted(g: mm.Geometry, cfg: ShadowKVConfig, gpu_budget: int, config: EngineConfig) -> int:
    """Host bytes the value pages of every GPU page of a budget's pools would take."""
    pools = mm.plan_pools(g, cfg, gpu_budget, 0, config.max_num_seqs, config.block_size)
    return (pools.num_gpu_pages - pools.num_device_value_pages) * mm.host_page_bytes(g, cfg)


def resolve_device_value_share(config: EngineConfig, g: mm.Geometry, gpu_budget: int,
                               max_model_len: int) -> ShadowKVConfig:
    """The ShadowKV config with an "auto" device_value_share replaced: on CUDA the share under which the pools hold
    the most sequences of max_model_len tokens (the largest such share: device memory left over holds values instead
    of lying idle); elsewhere 0 (the host is the device's own memory)."""
    cfg = config.shadowkv
    if cfg.device_value_share != AUTO:
        return cfg
    if torch.device(config.device).type != "cuda":
        return dataclasses.replace(cfg, device_value_share=0.0)
    host = host_cache_bytes(config, _host_wanted(g, dataclasses.replace(cfg, device_value_share=0.0), gpu_budget,
                                                 config))

    def held(c: ShadowKVConfig) -> int:
        pools = mm.plan_pools(g, c, gpu_budget, host, config.max_num_seqs, config.block_size)
        return pools.num_sequences(c, max_model_len)

    return dataclasses.replace(cfg, device_value_share=mm.best_device_value_share(cfg, held))


def build_cache(config: EngineConfig, spec, dtype: torch.dtype, device: torch.device, rotary,
                max_model_len: int) -> KVCache:
    g = mm.Geometry.from_spec(spec, dtype, config.kv_cache_dtype)
    budget = gpu_cache_bytes(config, g, device, max_model_len)
    cache_spec = CacheSpec.of(spec, dtype, device, config.prefill_chunk_tokens, config.use_kernels,
                              config.prefill_attention, config.kv_cache_dtype)
    if config.shadowkv is None:
        pools = mm.plan_pools(g, None, budget, 0, config.max_num_seqs, config.block_size)
        if pools.num_dense_blocks < 1:
            raise ValueError(f"gpu_cache_gib: {budget} bytes hold no KV block of "
                             f"{mm.dense_block_bytes(g, config.block_size)} bytes")
        return DenseKVCache(cache_spec, pools.num_dense_blocks, config.block_size, config.enable_prefix_caching)
    config.shadowkv.check_model(spec.num_kv_heads, spec.head_dim, spec.num_layers)
    cfg = resolve_device_value_share(config, g, budget, max_model_len)
    host = host_cache_bytes(config, _host_wanted(g, cfg, budget, config))
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
                "tokens (device value share %.3f)", pools.num_slots, pools.num_dense_blocks, pools.num_gpu_pages,
                pools.num_host_pages, pools.num_device_value_pages, mm.page_tokens(cfg), cfg.device_value_share)
    dense = DenseKVCache(cache_spec, pools.num_dense_blocks, config.block_size, config.enable_prefix_caching)
    return HybridCache(cfg, dense, ShadowKVCache(cache_spec, cfg, pools, rotary, placement,
                                                 config.enable_prefix_caching))
