"""benchmarks/decode_attention_sweep.py through its command line at tiny sizes (its real run needs CUDA): every
variant at every launch is checked against the reference and timed, and the best launches come last."""
import json

from support.cli import run_module


def test_decode_attention_sweep_smoke(tmp_path):
    from benchmarks.decode_attention_sweep import TOLERANCE, VARIANTS

    out = tmp_path / "decode_attention_sweep.json"
    done = run_module("benchmarks.decode_attention_sweep", "--batch", "2", "3", "--context", "40", "--q-heads", "4",
                      "--kv-heads", "2", "--head-dim", "32", "--page", "8", "--block-n", "16", "32", "--per-sm", "1",
                      "--num-warps", "1", "4", "--num-stages", "2", "--out", str(out), timeout_s=600)
    saved = json.loads(out.read_text())
    assert saved["argv"][1:4] == ["--batch", "2", "3"] and saved["device"]
    rows = saved["rows"]
    # per variant and batch: block_n x per_sm x num_warps, then num_stages at the best of those
    assert [(r["variant"], r["batch"]) for r in rows] == [(v, b) for b in (2, 3) for v in VARIANTS for _ in range(5)]
    for r in rows:
        assert r["ms"] > 0 and 0 <= r["max_err"] <= TOLERANCE and 0 <= r["err_vs_bf16"] <= 0.2 and r["gbps"] > 0, r
        assert r["page"] == 8
    assert {(r["variant"], r["batch"]) for r in saved["best"]} == {(v, b) for b in (2, 3) for v in VARIANTS}
    assert done.stdout.rstrip().splitlines()[-1].split()[0] == list(VARIANTS)[-1]  # the table comes last


def test_decode_attention_sweep_stops_on_a_wrong_result():
    import argparse

    import pytest
    import torch

    from benchmarks.decode_attention_sweep import TOLERANCE, Pools, _measure

    args = argparse.Namespace(context=20, q_heads=4, kv_heads=2, head_dim=32)
    pools = Pools(args, 2, "cpu", torch.float16, page=16)
    expected = pools.reference("fp8", 1)
    assert _measure(pools, "fp8", expected, args, 16, 1, 4, None)["max_err"] <= TOLERANCE
    with pytest.raises(SystemExit, match="differs from the reference"):
        _measure(pools, "fp8", expected + expected.abs().max(), args, 16, 1, 4, None)
