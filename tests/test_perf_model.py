"""shadowkv_core/perf_model.py: the floor of a decode step from the bytes it must move."""
import dataclasses
import json

import pytest

from shadowkv_core import ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.perf_model import dense_floor_s, infinite_memory_tok_s, main, shadowkv_floor_s


def test_performance_model_at_122k():
    g, cfg = mm.PRESETS["llama-3.1-8b"], ShadowKVConfig(device_value_share=0.0)
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
    rows = main(["--shares", "0.1875", "0.375", "0.5", "--hit-rate", "0.021", "--gpu-bytes", "135098892288",
                 "--host-bytes", "107037520691", "--copy-gbps", "4226.8", "--h2d-gbps", "55.44", "--out", str(out)])
    g = mm.PRESETS["llama-3.1-8b"]
    cfg = ShadowKVConfig(value_format="fp8", landmark_format="fp8", device_value_share=0.0)
    for r in rows:
        shared = dataclasses.replace(cfg, device_value_share=r["device_value_share"])
        assert r["batch"] == mm.capacity(g, shared, 135098892288, 107037520691, [122880], 256)
        floor = shadowkv_floor_s(g, shared, 122880, r["batch"], 0.021, 4226.8e9, 55.44e9)
        assert r["floor_ms"] == pytest.approx(1e3 * floor) and r["floor_tok_s"] == pytest.approx(r["batch"] / floor)
        assert r["floor_ms"] == pytest.approx(max(r["hbm_ms"], r["pcie_ms"]) + r["weights_ms"])
    assert [r["batch"] for r in rows] == sorted((r["batch"] for r in rows), reverse=True)
    per_sequence = [r["pcie_ms"] / r["batch"] for r in rows]
    assert per_sequence == sorted(per_sequence, reverse=True) and per_sequence[0] > per_sequence[-1]
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["command"].startswith("python -m shadowkv_core.perf_model --shares")
