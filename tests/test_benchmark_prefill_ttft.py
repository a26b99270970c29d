"""benchmarks/prefill_ttft.py through its command line at tiny sizes (its real run needs CUDA): a row per engine
method and attention and one for Hugging Face, each with the prompt's FLOPs and its ratio to HF's TTFT."""
import json

from support.cli import run_module


def test_prefill_ttft_benchmark_smoke(tmp_path):
    out = tmp_path / "prefill_ttft.json"
    run_module("benchmarks.prefill_ttft", "--model", "tiny", "--contexts", "300", "--device", "cpu", "--methods",
               "dense", "shadowkv", "hf", "--attentions", "sdpa", "sdpa_split", "--out", str(out), timeout_s=300)
    saved = json.loads(out.read_text())
    assert "--contexts 300" in saved["environment"]["command"] and not saved["failures"]
    rows = saved["rows"]
    assert [(r["method"], r["attention"]) for r in rows] == [
        ("dense", "sdpa"), ("dense", "sdpa_split"), ("shadowkv", "sdpa"), ("shadowkv", "sdpa_split"), ("hf", "sdpa")]
    flops = rows[0]["flops"]
    assert flops["total"] == flops["linear"] + flops["attention"] and flops["attention"] > 0
    assert all(r["flops"] == flops and r["ttft_s"] > 0 for r in rows)
    hf = rows[-1]["ttft_s"]
    assert all(abs(r["over_hf"] - r["ttft_s"] / hf) < 1e-9 for r in rows[:-1]) and "over_hf" not in rows[-1]
