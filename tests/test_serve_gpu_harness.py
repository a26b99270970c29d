"""benchmarks/serve_gpu.py's CPU rehearsal, through its command line: the tiny geometry served from prod.yaml's args
with the CPU profile's overrides, against the engine alone; an overload burst; an autoscaling timeline from one
replica up and back. What is asserted is what the harness reads and counts, never how fast."""
import json
from pathlib import Path

import pytest
import yaml
from ray.serve.config import AutoscalingConfig

from serve_app.app import AppArgs, replica_options
from support.cli import run_module

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve_gpu")
    run_module("benchmarks.serve_gpu", "--cpu", "--out", str(out), "--budget-s", "150", "--tail-s", "30",
               timeout_s=400)
    return json.loads((out / "serve_gpu.json").read_text())


def test_every_phase_runs_within_its_budget(record):
    assert set(record["phases"]) == {"service_start", "engine_alone", "service", "timeline"}
    assert [name for name, p in record["phases"].items() if "error" in p] == [] and "watchdog" not in record


def test_app_args_are_prod_with_the_profile_overrides(record):
    prod = yaml.safe_load((ROOT / "configs" / "prod.yaml").read_text())["applications"][0]["args"]
    overrides, args = record["profile"]["overrides"], record["app_args"]
    assert {k: v for k, v in args.items() if k not in overrides and k != "model"} == \
        {k: v for k, v in prod.items() if k not in overrides and k != "model"}
    assert {k: args[k] for k in overrides if k != "engine"} == {k: v for k, v in overrides.items() if k != "engine"}
    assert args["engine"] == {**prod["engine"], **overrides["engine"]}  # merged key by key: prod's others kept
    assert args["engine"]["load_format"] == "dummy" and "max_prefill_tokens" in prod["engine"]
    autoscaling = AutoscalingConfig(**replica_options(AppArgs(**args))["autoscaling_config"])
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 2)
    assert (autoscaling.upscale_delay_s, autoscaling.downscale_delay_s) == (5, 15)


@pytest.mark.parametrize("phase", ["engine_alone", "service"])
def test_every_token_streams_as_one_word_and_is_counted(record, phase):
    profile, p = record["profile"], record["phases"][phase]
    assert len(p["streams"]) == len(p["ttft_s"]) == profile["batch"]
    assert [s["points"][-1][1] for s in p["streams"]] == [profile["max_tokens"]] * profile["batch"]
    assert p["output_tokens"] == profile["batch"] * profile["max_tokens"]
    assert p["ttft_s_mean"] > 0 and p["decode_tokens_per_s"] > 0 and p["decode_window_s"] > 0
    if phase == "service":
        assert [s["completion_tokens"] for s in p["streams"]] == [profile["max_tokens"]] * profile["batch"]


def test_the_burst_beyond_capacity_is_refused_and_the_admitted_complete(record):
    args, burst = record["app_args"], record["phases"]["timeline"]["overload"]
    n = args["max_num_seqs"] + args["max_waiting"] + record["profile"]["burst_extra"]
    refused = [r for r in burst["replies"] if r["status"] == 429]
    assert burst["requests"] == len(burst["replies"]) == n and burst["other_statuses"] == []
    assert burst["admitted"] + len(refused) == n and burst["admitted"] >= args["max_num_seqs"]
    assert burst["admitted_completed"] == burst["admitted"]
    assert burst["refused_by_edge"] == sum(r["edge"] for r in refused)
    assert burst["refused_by_edge"] + burst["refused_by_ingress_at_once"] + burst["refused_after_bounded_wait"] == \
        len(refused)
    assert burst["retry_after_on_every_429"] and all(r["retry_after"] for r in refused)
    assert burst["drained"]["running"] == burst["drained"]["gpu_bytes_in_use"] == 0


def test_the_timeline_keeps_the_most_requests_each_replica_reported(record):
    timeline = record["phases"]["timeline"]
    per_replica = timeline["requests_per_replica"]
    assert per_replica and all(name.endswith(" cpu") for name in per_replica)  # "<replica id> <device>"
    assert sum(per_replica.values()) >= timeline["responses_by_status"]["200"]  # each 200 was some replica's
    assert 1 <= timeline["final_replicas"] <= timeline["max_replicas"] <= 2
    assert timeline["events"]["load_start_s"] < timeline["events"]["load_stop_s"]
