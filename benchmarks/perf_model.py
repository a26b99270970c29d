"""DESIGN.md's performance model: the time a decode step cannot beat, from the bytes it must move and the copy
bandwidths measured on the device (device-to-device for HBM, one pinned host-to-device copy for PCIe)."""
from __future__ import annotations

from shadowkv_core import ShadowKVConfig
from shadowkv_core import memory_model as mm


def kv_bytes(g: mm.Geometry, context: int) -> int:
    """Keys and values of one sequence, every layer."""
    return 2 * g.num_layers * context * g.kv_width * g.dtype_bytes


def dense_floor_s(g: mm.Geometry, context: int, batch: int, copy_bps: float) -> float:
    """Dense roofline: the weights and every sequence's K and V read once per step."""
    return (g.weight_bytes + batch * kv_bytes(g, context)) / copy_bps


def infinite_memory_tok_s(g: mm.Geometry, context: int, copy_bps: float) -> float:
    """Full attention with unbounded memory: the dense roofline as the batch grows without end (weights amortised,
    every sequence's K and V read once per token)."""
    return copy_bps / kv_bytes(g, context)


def shadowkv_floor_s(g: mm.Geometry, cfg: ShadowKVConfig, context: int, batch: int, hit_rate: float,
                     copy_bps: float, h2d_bps: float) -> float:
    """Per layer and sequence: landmarks M*S/C, exact K and V of outliers, selected chunks and local window, missed
    chunks' U rows over HBM; missed chunks' values over PCIe (as the host stores them: fp8 values move their chunk's
    scales too), but for the device_value_share of them (their pages in device memory), read over HBM. The larger of
    the two, plus the weights once."""
    M, C, K, O = g.kv_width * g.dtype_bytes, cfg.chunk_size, cfg.budget_chunks, cfg.outlier_chunks
    misses = (1 - hit_rate) * K  # per KV head
    hbm = M * context / C + 2 * M * ((K + O) * C + cfg.local_chunks * C)
    hbm += misses * g.num_kv_heads * C * cfg.rank * g.dtype_bytes
    chunk_values = mm.host_page_bytes(g, cfg) / (g.num_layers * cfg.page_chunks)  # one chunk, every KV head
    hbm += cfg.device_value_share * misses * chunk_values
    pcie = (1 - cfg.device_value_share) * misses * chunk_values
    per_step = g.num_layers * batch
    return max(per_step * hbm / copy_bps, per_step * pcie / h2d_bps) + g.weight_bytes / copy_bps


def ceilings(device: str) -> tuple[float, float]:
    """(device copy, host-to-device) bytes/s measured now; on CPU nominal H200 figures (DESIGN.md)."""
    if device != "cuda":
        return 4.28e12, 55.2e9
    from benchmarks.kernels import ceilings as measure

    d2d, h2d = measure()
    return d2d * 1e9, h2d * 1e9
