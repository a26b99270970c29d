"""shadowkv_core/perf_model.py: the floor of a decode step from the bytes it must move, checked against the bytes
counted by hand for Llama-3.1-8B at 122880 tokens."""
import dataclasses
import json

import pytest

from shadowkv_core import ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.perf_model import dense_floor_s, infinite_memory_tok_s, main, shadowkv_floor_s

G8B = mm.PRESETS["llama-3.1-8b"]
WEIGHT_BYTES = 8_030_261_248 * 2  # Llama-3.1-8B's parameters in bf16
KV_WIDTH = 8 * 128  # KV heads x head_dim


def test_performance_model_at_122k():
    g, cfg = G8B, ShadowKVConfig(device_value_share=0.0, landmark_kind="mean")
    copy, h2d = 4.28e12, 55.2e9
    assert infinite_memory_tok_s(g, 122880, copy) == pytest.approx(265, rel=0.01)  # 16.1 GB of K+V per token
    assert 8 / dense_floor_s(g, 122880, 8, copy) < infinite_memory_tok_s(g, 122880, copy)
    # DESIGN.md: at a 60 % hit rate PCIe (~52 MiB per sequence per step) outweighs HBM; all hits leaves HBM only
    pcie_bound = shadowkv_floor_s(g, cfg, 122880, 8, 0.6, copy, h2d) - g.weight_bytes / copy
    assert pcie_bound == pytest.approx(8 * 0.4 * 256 * 8 * 32 * 2048 / h2d, rel=1e-6)
    assert shadowkv_floor_s(g, cfg, 122880, 8, 1.0, copy, h2d) < shadowkv_floor_s(g, cfg, 122880, 8, 0.6, copy, h2d)
    # fp8 values: one byte per value and a 4-byte scale per chunk and KV head over PCIe
    fp8 = dataclasses.replace(cfg, value_format="fp8")
    pcie_fp8 = shadowkv_floor_s(g, fp8, 122880, 8, 0.6, copy, h2d) - g.weight_bytes / copy
    assert pcie_fp8 == pytest.approx(8 * 0.4 * 256 * 8 * 32 * (1024 + 4) / h2d, rel=1e-6)
    # a device value share: that share of the misses' values read over HBM instead of PCIe
    tiered = dataclasses.replace(fp8, device_value_share=0.25)
    pcie_tiered = shadowkv_floor_s(g, tiered, 122880, 8, 0.6, copy, h2d) - g.weight_bytes / copy
    assert pcie_tiered == pytest.approx(0.75 * pcie_fp8, rel=1e-6)


def test_floor_at_each_device_value_share(tmp_path):
    """The CLI's share table: each row is the memory model's largest batch at that share and the floor there; a
    larger share moves fewer PCIe bytes per sequence and, once the device binds, holds no more sequences."""
    out = tmp_path / "shares.json"
    hit, gpu, host, copy_gbps, h2d_gbps = 0.021, 135098892288, 107037520691, 4226.8, 55.44
    rows = main(["--shares", "0.1875", "0.375", "0.5", "--hit-rate", str(hit), "--gpu-bytes", str(gpu),
                 "--host-bytes", str(host), "--copy-gbps", str(copy_gbps), "--h2d-gbps", str(h2d_gbps),
                 "--out", str(out)])
    fp8 = ShadowKVConfig(value_format="fp8", landmark_format="fp8", device_value_share=0.0)
    misses = (1 - hit) * 256  # of the 256 chunks a KV head selects
    chunk_values = 8 * KV_WIDTH + 8 * 4  # one chunk of every KV head, fp8, and its scales
    for r in rows:
        share, batch = r["device_value_share"], r["batch"]
        assert batch == mm.capacity(G8B, dataclasses.replace(fp8, device_value_share=share), gpu, host, [122880], 256)
        # per layer and sequence, by hand: every chunk's fp8 bounds landmark (centre and half-range) with its 8 heads'
        # scales and outlier flags, the exact K and V of the selected, outlier and local chunks, the missed chunks' U
        # rows (rank 160), and the missed values kept on the device
        hbm = (2 * KV_WIDTH + 8 * 4 + 8) * 122880 / 8 + 2 * 2 * KV_WIDTH * (256 + 48 + 4) * 8 + misses * 8 * 8 * 160 * 2
        hbm += share * misses * chunk_values
        pcie = (1 - share) * misses * chunk_values
        hbm_ms, pcie_ms = (1e3 * 32 * batch * b / (gbps * 1e9) for b, gbps in ((hbm, copy_gbps), (pcie, h2d_gbps)))
        weights_ms = 1e3 * WEIGHT_BYTES / (copy_gbps * 1e9)
        assert (r["hbm_ms"], r["pcie_ms"], r["weights_ms"]) == pytest.approx((hbm_ms, pcie_ms, weights_ms))
        floor_ms = max(hbm_ms, pcie_ms) + weights_ms
        assert r["floor_ms"] == pytest.approx(floor_ms) and r["floor_tok_s"] == pytest.approx(1e3 * batch / floor_ms)
    assert [r["batch"] for r in rows] == sorted((r["batch"] for r in rows), reverse=True)
    per_sequence = [r["pcie_ms"] / r["batch"] for r in rows]
    assert per_sequence == sorted(per_sequence, reverse=True) and per_sequence[0] > per_sequence[-1]
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["command"].startswith("python -m shadowkv_core.perf_model --shares")
