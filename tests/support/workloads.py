"""What the workload benchmark's tests check of a run's rows (benchmarks/workloads, offline and online drivers)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from support.cli import run_module

SMALL = ["--scale", "0.02", "--count-scale", "0.25"]  # every scenario on the CPU in seconds
SCENARIOS = ["doc_qa", "long_output", "multi_turn", "shared_doc", "mixed"]
METHODS = ["dense", "dense_fp8", "shadowkv"]


def dump(tmp_path, *args: str) -> dict:
    """The workloads' descriptions (--dump-workload) for the benchmark's `args`."""
    out = tmp_path / "dump.json"
    run_module("benchmarks.workloads", "--dump-workload", str(out), *args, timeout_s=300)
    return json.loads(out.read_text())


def run_key(row: dict) -> tuple:
    """(scenario, method), and the rate for an online run."""
    return (row["scenario"], row["method"], *([row["rate"]] if row["driver"] == "online" else []))


def check_run(rows: list[dict], runs: list[tuple], workloads: dict | None = None) -> None:
    """The rows are those of `runs` (run_key); every request got exactly its max_tokens (those of `workloads`, the
    --dump-workload descriptions, where given); turns carry the conversation; figures are the events'."""
    assert sorted(map(run_key, rows)) == sorted(runs)
    for row in rows:
        records = row["request_records"]
        assert row["requests"] == len(records) and row["errors"] == 0
        assert all(q["finish_reason"] == "length" and q["error"] is None for q in records)
        by_id = {q["request_id"]: q for q in records}
        for q in records:
            conversation, turn = map(int, q["request_id"][1:].split("-t"))
            if workloads is not None:
                assert q["output_tokens"] == workloads[row["scenario"]][conversation]["turns"][turn]["max_tokens"]
            if turn > 0:  # the prompt grew by the answer before it and its own question
                before = by_id[f"c{conversation}-t{turn - 1}"]
                assert q["prompt_tokens"] > before["prompt_tokens"] + before["output_tokens"]
                assert q["sent_s"] >= before["events"][-1][0]
        check_figures(row, records)
        if "steps" in row:  # offline: the slow steps, by what they held, are some of the steps
            assert set(row["slow_steps"]) <= {"graph_capture", "first_token", "express", "prefill", "decode_only"}
            assert sum(row["slow_steps"].values()) < row["steps"]
            assert 0 < row["decode_step_p50_ms"] <= row["decode_step_p99_ms"]
    shadow = [r for r in rows if r["method"] == "shadowkv"]
    assert all(0 <= r["hit_rate"] <= 1 for r in shadow) and all(r["hit_rate"] is None for r in rows
                                                                if r["method"] == "dense")


def check_figures(row: dict, records: list[dict]) -> None:
    ttft = [q["events"][0][0] - q["sent_s"] for q in records]
    itl = [(t - before) / n for q in records for (before, _), (t, n) in zip(q["events"], q["events"][1:])
           for _ in range(n)]
    output = sum(n for q in records for _, n in q["events"])
    assert output == sum(q["output_tokens"] for q in records)
    want = {"ttft_p50_s": np.percentile(ttft, 50), "ttft_p90_s": np.percentile(ttft, 90),
            "ttft_p99_s": np.percentile(ttft, 99), "itl_p50_ms": 1e3 * np.percentile(itl, 50),
            "itl_p99_ms": 1e3 * np.percentile(itl, 99), "output_tok_s": output / row["wall_s"],
            "requests_per_min": 60 * len(records) / row["wall_s"]}
    assert {k: row[k] for k in want} == pytest.approx(want)
    later = [t for q, t in zip(records, ttft) if q["turn"] > 0]
    assert row["later_turns_ttft_p50_s"] == (pytest.approx(np.percentile(later, 50)) if later else None)
    met = sum(t <= row["ttft_bound_s"] and (len(q["events"]) < 2 or 1e3 * np.percentile(
        [(b - a) / n for (a, _), (b, n) in zip(q["events"], q["events"][1:]) for _ in range(n)], 99)
        <= row["itl_bound_ms"]) for q, t in zip(records, ttft))
    assert row["goodput_per_min"] == pytest.approx(60 * met / row["wall_s"])
