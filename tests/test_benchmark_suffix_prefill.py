"""benchmarks/suffix_prefill.py through its command line on the CPU (the shipped model's config, small sizes): a
cold row, then a row per batch of readers whose prompts each take the document's cached pages."""
import json

from support.cli import run_module


def test_suffix_prefill_benchmark_smoke(tmp_path):
    out = tmp_path / "suffix_prefill.json"
    run_module("benchmarks.suffix_prefill", "--config", "configs/local.yaml", "--model", "tiny", "--prefix", "1200",
               "--readers", "1", "3", "--suffix", "20", "9", "--max-num-seqs", "4", "--out", str(out),
               timeout_s=300)
    saved = json.loads(out.read_text())
    assert "--prefix 1200" in saved["environment"]["command"] and saved["profile"] is None
    cold, one, three = saved["rows"]
    assert (cold["batch"], cold["new_tokens"], cold["hit_tokens"]) == ("cold", 1200, 0)
    assert [(r["readers"], r["new_tokens"]) for r in (one, three)] == [(1, 20), (3, 9)]
    cached = one["hit_tokens"]  # whole pages of the document's shadow: the same for every reader
    assert 0 < cached <= 1200 and three["hit_tokens"] == 3 * cached
    assert all(r["seconds"] > 0 for r in saved["rows"])


def test_readers_and_suffixes_must_pair_up(tmp_path):
    result = run_module("benchmarks.suffix_prefill", "--readers", "1", "2", "--suffix", "5", check=False,
                        timeout_s=120)
    assert result.returncode != 0 and "pair up" in result.stderr


def test_suffix_prefill_with_the_workloads_overrides(tmp_path):
    """--shadowkv-set and --prefill-step-tflop as the workload benchmark takes them: the engine serves the formats
    set (fp8 values and landmarks) with whole prefills, and the JSON says so; a field ShadowKVConfig lacks is refused
    before any engine starts."""
    out = tmp_path / "suffix_prefill.json"
    run_module("benchmarks.suffix_prefill", "--config", "configs/local.yaml", "--model", "tiny", "--prefix", "1200",
               "--readers", "2", "--suffix", "9", "--max-num-seqs", "4", "--shadowkv-set", "value_format=fp8",
               "landmark_format=fp8", "--prefill-step-tflop", "none", "--out", str(out), timeout_s=300)
    saved = json.loads(out.read_text())
    assert saved["shadowkv"]["value_format"] == saved["shadowkv"]["landmark_format"] == "fp8"
    assert saved["prefill_step_tflop"] is None
    cold, two = saved["rows"]
    assert cold["hit_tokens"] == 0 and 0 < two["hit_tokens"] <= 2 * 1200 and two["hit_tokens"] % 2 == 0
    refused = run_module("benchmarks.suffix_prefill", "--config", "configs/local.yaml", "--model", "tiny",
                         "--shadowkv-set", "no_such_field=1", check=False, timeout_s=120)
    assert refused.returncode != 0 and "no_such_field" in refused.stderr
