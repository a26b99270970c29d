"""benchmarks/decode_timeline.py's reading of a trace, through its command line on a synthetic chrome trace (its GPU
run needs CUDA): busy time as the union of overlapping kernels, per stream and group, and the value-fetch stream's
idle time around and between fetches."""
import json

from support.cli import run_module


def kernel(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def host(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"timeline:{name}", "ts": ts, "dur": dur}


def test_a_step_with_a_late_start_overlaps_and_gaps_between_fetches(tmp_path):
    events = [
        host("step", 0, 10_000), host("prepare", 100, 1_500), host("graph", 1_700, 8_000),
        kernel("_rms_norm_kernel", 2_000, 500, 7),  # the GPU's first work, 2 ms into the step
        kernel("_fetch_values_kernel", 3_000, 2_000, 9),
        kernel("_logits_kernel", 3_500, 1_000, 7),
        kernel("_fetch_values_kernel", 5_500, 2_000, 9),  # 0.5 ms after the first
        kernel("nvjet_sm90_gemm", 7_000, 2_000, 7),
        host("step", 20_000, 1_000), kernel("_rms_norm_kernel", 20_100, 100, 7),  # a second step, no fetch
        kernel("_rms_norm_kernel", 20_120, 50, 8),  # inside the one before it, on another stream
        kernel("_fetch_values_kernel", 40_000, 100, 9),  # in no step
        # the profiler's GPU span of a host range, which is not a step of its own
        dict(host("step", 2_000, 7_000), cat="gpu_user_annotation"),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "timeline.json"
    run_module("benchmarks.decode_timeline", "--analyse", str(trace), "--label", "synthetic", "--out", str(out),
               timeout_s=300)
    saved = json.loads(out.read_text())
    assert [r["label"] for r in saved["rows"]] == ["synthetic"]
    first, second = saved["rows"][0]["steps"]
    assert first["host_ms"] == 10.0 and first["first_device_work_ms"] == 2.0
    assert first["host_phases_ms"] == {"timeline:prepare": [1.5], "timeline:graph": [8.0]}
    assert first["device_busy_ms"] == 6.0  # 2.0-2.5, 3.0-5.0 and 5.5-9.0
    assert first["streams"]["9"] == {"kernels": 2, "busy_ms": 4.0, "groups_ms": {"value fetch": 4.0}}
    assert first["streams"]["7"]["groups_ms"] == {"other": 0.5, "scoring": 1.0, "gemm": 2.0}
    assert first["fetch"] == {"kernels": 2, "busy_ms": 4.0, "idle_before_first_ms": 3.0, "idle_between_ms": 0.5,
                              "idle_after_last_ms": 2.5}
    assert second["first_device_work_ms"] == 0.1 and "fetch" not in second
    assert second["device_busy_ms"] == 0.1  # the kernel inside another counts once
    assert second["streams"]["8"]["busy_ms"] == 0.05
