"""The workload benchmark's online driver through its command line: every scenario sent to a local Serve app of
configs/local.yaml (one app per method, Ray started once), through the OpenAI API, streamed, on the tiny and the shipped
model. Each request gets exactly the tokens it asked for, counted from the usage its chunks carry; each turn of a
conversation carries the turns before it; the figures are those of the token timings recorded; the rows hold the
engine's own peak bytes and hit rate."""
import json

import pytest

from support.cli import run_module
from support.workloads import METHODS, SCENARIOS, SMALL, check_run, dump

pytestmark = pytest.mark.slow
RATE = 8.0  # conversations arriving per second


@pytest.mark.parametrize("model", ["tiny", "models/shadowkv-small"])
def test_the_online_driver_serves_every_scenario(tmp_path, model):
    out = tmp_path / "online.json"
    run_module("benchmarks.workloads", "--driver", "online", "--config", "configs/local.yaml", "--model", model,
               *SMALL, "--rates", str(RATE), "--max-in-flight", "4", "--events", "--out", str(out), timeout_s=900)
    saved = json.loads(out.read_text())
    assert not saved["failures"] and saved["driver"] == "online"
    workloads = dump(tmp_path, "--config", "configs/local.yaml", "--model", model, *SMALL)
    check_run(saved["rows"], [(s, m, RATE) for s in SCENARIOS for m in METHODS], workloads)
    for row in saved["rows"]:
        events = [n for q in row["request_records"] for _, n in q["events"]]
        assert len(events) > len(row["request_records"])  # answers stream in several events
        assert row["peak_gpu_in_use_gib"] > 0 and row["service_metrics"]["shadowkv_num_running"] == 0
