"""Accuracy smoke on CPU through benchmarks/accuracy.py's command line: the shipped model finds a needle in 3K tokens,
with dense attention and with ShadowKV at a 1.56 % budget, on a handful of evaluation samples in the templates it was
trained on (the benchmark's full grid, and the held-out templates, are its own run)."""
import json

from support.cli import run_module


def test_needle_found_at_3k(tmp_path):
    run_module("benchmarks.accuracy", "--model", "models/shadowkv-small", "--device", "cpu", "--tasks", "niah_single",
               "--methods", "dense", "shadowkv", "--contexts", "3072", "--samples", "3", "--budgets", "0.0156",
               "--niah-contexts", "--templates", "ruler", "--out-dir", str(tmp_path), timeout_s=600)
    rows = json.loads((tmp_path / "accuracy.json").read_text())
    assert [(r["method"], r["budget"], r["samples"]) for r in rows] == [("dense", 1.0, 3), ("shadowkv", 0.0156, 3)]
    assert [r["score"] for r in rows] == [100.0, 100.0], rows
    assert 0 < rows[1]["hit_rate"] <= 1  # ShadowKV's sparse path ran
    assert all(r["scores"] == [100.0] * 3 and r["low"] < 100.0 == r["high"] for r in rows)  # Wilson's, 3 of 3
