"""benchmarks/prefill_workspace.py: its cases parse or are refused with the forms they take, and at tiny sizes on the
CPU (no allocator to read: the memory model's prediction only) every method runs every case, the suffix after a
prefix the engine really serves from its prefix cache."""
import argparse
import json

import pytest

from benchmarks.prefill_workspace import parse_case
from support.cli import run_module


def test_cases_parse_into_kind_prefix_and_new_tokens():
    assert parse_case("whole:300") == ("whole", 0, 300)
    assert parse_case("sliced:122880") == ("sliced", 0, 122880)
    assert parse_case("suffix:120000+2048") == ("suffix", 120000, 2048)


@pytest.mark.parametrize("text", ["whole", "whole:", "whole:1+2", "suffix:300", "suffix:+5", "sliced:x",
                                  "chunked:300", "whole:0", "suffix:10+0"])
def test_a_malformed_case_is_refused_with_the_forms_it_takes(text):
    with pytest.raises(argparse.ArgumentTypeError, match="whole:N|at least one new token"):
        parse_case(text)


def test_prefill_workspace_benchmark_smoke(tmp_path):
    out = tmp_path / "prefill_workspace.json"
    run_module("benchmarks.prefill_workspace", "--model", "tiny", "--device", "cpu", "--methods", "dense",
               "shadowkv", "--cases", "whole:300", "sliced:600", "suffix:512+40", "--decode-prompt", "64",
               "--decode-tokens", "100", "--out", str(out), timeout_s=300)
    saved = json.loads(out.read_text())
    assert not saved["failures"] and "--cases whole:300" in saved["environment"]["command"]
    rows = saved["rows"]
    assert [(r["method"], r["case"]) for r in rows] == [
        (m, c) for m in ("dense", "shadowkv") for c in ("whole:300", "sliced:600", "suffix:512+40")]
    for r in rows:
        assert r["predicted_gib"] > 0 and "measured_gib" not in r
        assert (r["hit_tokens"] > 0) == (r["kind"] == "suffix")  # only the suffix finds its prefix cached
    dense, shadow = rows[2], rows[5]
    assert dense["hit_tokens"] == 512 and 0 < shadow["hit_tokens"] <= 512  # the shadow's by whole pages
