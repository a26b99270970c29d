"""benchmarks/prefill_attention.py through its command line at tiny sizes (its real run needs CUDA): every candidate
is checked, then timed on every chunk and on the whole prompt, and the FLOPs of the chunks add up to the whole
prompt's causal attention."""
import json

from support.cli import run_module


def test_prefill_attention_benchmark_smoke(tmp_path):
    out = tmp_path / "prefill_attention.json"
    run_module("benchmarks.prefill_attention", "--prompts", "40", "19", "--chunk", "16", "--q-heads", "4",
               "--kv-heads", "2", "--head-dim", "64", "--check-rows", "5", "--triton-launches", "16,16,4,1",
               "--out", str(out), timeout_s=300)
    saved = json.loads(out.read_text())
    assert "--prompts 40 19 --chunk 16" in saved["environment"]["command"] and saved["environment"]["device"]
    rows = saved["rows"]
    assert [(r["prompt"], r["method"], r["form"]) for r in rows] == [
        row for p in (40, 19) for row in [(p, m, f) for m in ("sdpa", "sdpa_split", "triton")
                                          for f in ("chunked", "whole")] + [(p, "triton_b16_n16_w4_s1", "whole")]]
    for r in rows:
        assert r["chunks"] == len(r["chunk_ms"]) == (-(-r["prompt"] // 16) if r["form"] == "chunked" else 1)
        assert r["flops"] == 4 * 4 * 64 * r["prompt"] * (r["prompt"] + 1) // 2
        assert 0 <= r["error_over_tolerance"] <= 1 and r["time_ms"] > 0


def test_prefill_attention_benchmark_short_queries_smoke(tmp_path):
    """--short-queries alone: num_splits=1 and the automatic split (given SMs enough to split) per case."""
    out = tmp_path / "short_queries.json"
    run_module("benchmarks.prefill_attention", "--short-queries", "--prefix-keys", "600", "--short-query-counts", "5",
               "--readers", "1", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--num-sms", "16",
               "--out", str(out), timeout_s=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["readers"], r["method"], r["num_splits"]) for r in rows] == [
        (1, "triton_splits1", 1), (1, "triton_auto", 2), (2, "triton_splits1", 1), (2, "triton_auto", 2)]
    for r in rows:
        assert r["prefix"] == 600 and r["queries"] == 5 and r["time_ms"] > 0
        assert r["flops"] == r["readers"] * 4 * 4 * 64 * (5 * 600 + 5 * 6 // 2)
        assert 0 <= r["error_over_tolerance"] <= 1
