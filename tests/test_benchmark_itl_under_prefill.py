"""benchmarks/itl_under_prefill.py on a tiny geometry on CPU, through its command line: the script runs end to end and
its counts hold (no speed is asserted): unlimited, the prompt prefills in one step; with a small budget over many, each
decode getting a token every step; with a step target far above any step's time, over fewer (the budget grows)."""
import json

from support.cli import run_module


def test_script_measures_itl_with_and_without_a_prefill_per_budget(tmp_path):
    out = tmp_path / "itl.json"
    run_module("benchmarks.itl_under_prefill", "--model", "tiny", "--device", "cpu", "--method", "dense",
               "--decode-batch", "2", "--decode-context", "64", "--decode-tokens", "600", "--prompt", "512",
               "--budgets", "none", "1e-5", "--step-ms", "none", "1e6", "--steps", "5", "--warmup-steps", "2",
               "--out", str(out), timeout_s=300)
    saved = json.loads(out.read_text())
    assert saved["environment"]["command"] and saved["args"]["prompt"] == 512
    unlimited, sliced, paced = saved["rows"]  # a target with no limit is not run
    assert [(r["budget_tflop"], r["step_ms"]) for r in saved["rows"]] == [(None, None), (1e-5, None), (1e-5, 1e6)]
    assert unlimited["prefill_steps"] == 1 and sliced["prefill_steps"] > 10
    assert sliced["mean_budget_tflop"] == 1e-5 and paced["mean_budget_tflop"] > 2e-5
    assert 1 < paced["prefill_steps"] < sliced["prefill_steps"] / 2
    for row in (unlimited, sliced, paced):
        assert row["decode_tokens_during_prefill"] == 2 * row["prefill_steps"]  # one token per decode per step
        assert row["itl_p99_ms"] >= row["itl_p50_ms"] > 0 and row["prefill_itl_p99_ms"] >= row["prefill_itl_p50_ms"]
        assert row["ttft_s"] > 0 and row["ttft_ratio"] == row["ttft_s"] / row["ttft_alone_s"]
        assert row["p99_over_p50"] == row["prefill_itl_p99_ms"] / row["itl_p50_ms"]
        assert "decodes_ended_early" not in row
