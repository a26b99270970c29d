"""DESIGN.md's performance model: the time a decode step cannot beat, from the bytes it must move and the copy
bandwidths of the device (device-to-device for HBM, one pinned host-to-device copy for PCIe). Pure functions of the
geometry, the ShadowKV config, the hit rate and those bandwidths: no GPU needed; benchmarks/throughput.py measures the
bandwidths and the hit rate and compares each step with its floor.

CLI: the floor at the memory model's largest batch for each device value share, from a run's measured figures:
    python -m shadowkv_core.perf_model --hit-rate H --gpu-bytes G --host-bytes B --copy-gbps C --h2d-gbps P \
        [--context 122880] [--shares 0.1875 0.375 0.5] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from . import memory_model as mm
from .config import VALUE_FORMATS, ShadowKVConfig


def kv_bytes(g: mm.Geometry, context: int) -> int:
    """Keys and values of one sequence, every layer, as the dense cache keeps them (fp8: with their scales)."""
    return context * mm.dense_block_bytes(g, 1)


def dense_floor_s(g: mm.Geometry, context: int, batch: int, copy_bps: float) -> float:
    """Dense roofline: the weights and every sequence's K and V read once per step."""
    return (g.weight_bytes + batch * kv_bytes(g, context)) / copy_bps


def infinite_memory_tok_s(g: mm.Geometry, context: int, copy_bps: float) -> float:
    """Full attention with unbounded memory: the dense roofline as the batch grows without end (weights amortised,
    every sequence's K and V read once per token)."""
    return copy_bps / kv_bytes(g, context)


def shadowkv_floor_parts(g: mm.Geometry, cfg: ShadowKVConfig, context: int, batch: int, hit_rate: float,
                         copy_bps: float, h2d_bps: float) -> dict[str, float]:
    """Seconds of one decode step's bytes, by where they move: `hbm_s` per layer and sequence, every chunk's landmark
    (as the GPU pages store it: fp8 landmarks with their scales, and the outlier flags), exact K and V of outliers,
    selected chunks and local window, missed chunks' U rows, and the device_value_share of the missed chunks' values
    (their pages in device memory); `pcie_s` the rest of the missed chunks' values (as the host stores them: fp8 values
    move their chunk's scales too); `weights_s` the weights, once."""
    M, C, K, O = g.kv_width * g.dtype_bytes, cfg.chunk_size, cfg.budget_chunks, cfg.outlier_chunks
    misses = (1 - hit_rate) * K  # per KV head
    chunk_u = C * cfg.rank * g.dtype_bytes
    landmark = mm.gpu_page_bytes(g, cfg) / (g.num_layers * cfg.page_chunks) - chunk_u  # one chunk, every KV head
    hbm = landmark * context / C + 2 * M * ((K + O) * C + cfg.local_chunks * C)
    hbm += misses * g.num_kv_heads * C * cfg.rank * g.dtype_bytes
    chunk_values = mm.host_page_bytes(g, cfg) / (g.num_layers * cfg.page_chunks)  # one chunk, every KV head
    hbm += cfg.device_value_share * misses * chunk_values
    pcie = (1 - cfg.device_value_share) * misses * chunk_values
    per_step = g.num_layers * batch
    return {"hbm_s": per_step * hbm / copy_bps, "pcie_s": per_step * pcie / h2d_bps,
            "weights_s": g.weight_bytes / copy_bps}


def shadowkv_floor_s(g: mm.Geometry, cfg: ShadowKVConfig, context: int, batch: int, hit_rate: float,
                     copy_bps: float, h2d_bps: float) -> float:
    """The larger of the step's HBM and PCIe bytes' times (shadowkv_floor_parts), plus the weights once."""
    return _floor(shadowkv_floor_parts(g, cfg, context, batch, hit_rate, copy_bps, h2d_bps))


def _floor(parts: dict[str, float]) -> float:
    return max(parts["hbm_s"], parts["pcie_s"]) + parts["weights_s"]


def share_table(g: mm.Geometry, cfg: ShadowKVConfig, context: int, shares: list[float], hit_rate: float,
                gpu_bytes: int, host_bytes: int, max_new_tokens: int, copy_bps: float, h2d_bps: float) -> list[dict]:
    """Per device_value_share: the memory model's largest batch and the floor of a step at that batch. A larger share
    holds fewer sequences (once the device binds) but moves fewer bytes over PCIe per token."""
    rows = []
    for share in shares:
        shared = dataclasses.replace(cfg, device_value_share=share)
        batch = mm.capacity(g, shared, gpu_bytes, host_bytes, [context], max_new_tokens)
        parts = shadowkv_floor_parts(g, shared, context, max(batch, 1), hit_rate, copy_bps, h2d_bps)
        floor = _floor(parts)
        rows.append({"device_value_share": share, "batch": batch, "floor_ms": 1e3 * floor, "floor_tok_s": batch / floor,
                     **{k.removesuffix("_s") + "_ms": 1e3 * v for k, v in parts.items()}})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description="ShadowKV's floor at each device value share")
    parser.add_argument("--model", default="llama-3.1-8b", help=f"a preset ({', '.join(mm.PRESETS)}) or a config.json")
    parser.add_argument("--context", type=int, default=122880)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1875, 0.25, 0.3125, 0.375, 0.4375, 0.5])
    parser.add_argument("--hit-rate", type=float, required=True, help="share of a step's chunks already resident")
    parser.add_argument("--gpu-bytes", type=int, required=True, help="the memory plan's device bytes")
    parser.add_argument("--host-bytes", type=int, required=True, help="the memory plan's host bytes")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--value-format", choices=VALUE_FORMATS, default="fp8")
    parser.add_argument("--landmark-format", choices=VALUE_FORMATS, default="fp8")
    parser.add_argument("--copy-gbps", type=float, required=True, help="device-to-device copy ceiling")
    parser.add_argument("--h2d-gbps", type=float, required=True, help="pinned host-to-device copy ceiling")
    parser.add_argument("--out", default=None, help="also write the rows here (JSON)")
    args = parser.parse_args(argv)
    g = mm.load_geometry(args.model)
    cfg = ShadowKVConfig(value_format=args.value_format, landmark_format=args.landmark_format)
    rows = share_table(g, cfg, args.context, args.shares, args.hit_rate, args.gpu_bytes, args.host_bytes,
                       args.max_new_tokens, args.copy_gbps * 1e9, args.h2d_gbps * 1e9)
    for r in rows:
        print(" ".join(f"{k} {v:.4g}" for k, v in r.items()))
    if args.out:
        command = "python -m shadowkv_core.perf_model " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(args.out).write_text(json.dumps({"command": command, "note": "a model, not a measurement",
                                              "args": vars(args), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
