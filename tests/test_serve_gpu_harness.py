"""benchmarks/serve_gpu.py and benchmarks/autoscale_timeline.py's helpers, on CPU without Ray: prod.yaml's args with a
profile's overrides, and the arithmetic of streams, bursts and timelines."""
import pytest
from ray.serve.config import AutoscalingConfig

from benchmarks.autoscale_timeline import requests_per_replica, summary
from benchmarks.serve_gpu import CPU, GPU, app_args, burst_summary, summarize_streams
from serve_app.app import AppArgs, replica_options
from serve_app.metrics import ServiceMetrics


@pytest.mark.parametrize("profile", [GPU, CPU], ids=["two-h200", "cpu-rehearsal"])
def test_app_args_are_prod_with_the_profile_overrides(profile):
    args = AppArgs(**app_args(profile, "/models/geometry"))
    assert args.served_model_name == "llama-3.1-8b-instruct" and args.model == "/models/geometry"
    assert args.engine["load_format"] == "dummy" and args.engine["max_prefill_tokens"] == 32768  # prod's, kept
    autoscaling = AutoscalingConfig(**replica_options(args)["autoscaling_config"])
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 2)
    assert (autoscaling.upscale_delay_s, autoscaling.downscale_delay_s) == (5, 15)


def test_streams_give_ttft_and_the_rate_while_every_request_decodes():
    streams = [{"sent": 0.0, "points": [(1.0, 1), (2.0, 2), (3.0, 3), (4.0, 4)]},
               {"sent": 0.0, "points": [(2.0, 1), (3.0, 2), (4.0, 3), (5.0, 4)]}]
    s = summarize_streams(streams)
    assert s["ttft_s"] == [1.0, 2.0] and s["ttft_s_mean"] == 1.5
    assert s["decode_window_s"] == 2.0 and s["decode_tokens_per_s"] == 2.0  # (4 - 2) + (3 - 1) tokens in [2, 4]
    assert s["output_tokens"] == 8 and s["output_tokens_per_s"] == 1.6


def test_burst_summary_tells_edge_refusals_from_the_ingress_ones_at_once_or_after_the_wait():
    def reply(status, s, edge=False, retry="1", tokens=None):
        return {"status": status, "s": s, "sent_s": 0.001, "edge": edge, "retry_after": retry,
                "completion_tokens": tokens}
    replies = [reply(200, 30.0, retry=None, tokens=16), reply(200, 31.0, retry=None, tokens=16),
               reply(429, 0.05, edge=True), reply(429, 0.09, edge=True), reply(429, 0.07), reply(429, 2.1),
               reply(503, 0.1, retry=None)]
    s = burst_summary(replies, max_wait_s=2.0, max_tokens=16)
    assert (s["admitted"], s["admitted_completed"]) == (2, 2)
    assert (s["refused_by_edge"], s["refused_by_ingress_at_once"], s["refused_after_bounded_wait"]) == (2, 1, 1)
    assert s["edge_429_ms"] == {"p50": 90.0, "p99": 90.0, "max": 90.0}
    assert (s["refused_at_once"], s["other_statuses"]) == (3, [503])
    assert s["refused_at_once_ms"]["max"] == 90.0 and s["retry_after_on_every_429"]
    assert s["admitted_s"] == [30.0, 31.0] and s["send_spread_ms"] == 1.0


def test_timeline_reads_requests_per_replica_and_keeps_the_most_each_reported():
    reports = [{"replica": "a", "device": "gpu0", "num_requests": 3}, {"replica": "b", "device": "gpu1",
                                                                       "num_requests": 5}]
    counts = requests_per_replica(ServiceMetrics().render(reports, 0, 0).decode())
    assert counts == {"a gpu0": 3.0, "b gpu1": 5.0}
    timeline = [{"t_s": 0, "replicas": 2.0, "requests_per_replica": counts},
                {"t_s": 1, "replicas": 1.0, "requests_per_replica": {"a gpu0": 4.0}}, {"t_s": 2, "error": "x"}]
    s = summary({"timeline": timeline, "responses_by_status": {200: 9}})
    assert s["max_replicas"] == 2.0 and s["final_replicas"] == 1.0
    assert s["requests_per_replica"] == {"a gpu0": 4.0, "b gpu1": 5.0}
