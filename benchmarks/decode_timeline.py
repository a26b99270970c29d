"""Where a decode step's wall time goes: torch.profiler over decode steps replayed from their CUDA graph (the
engine and the batch shortcut of benchmarks/throughput.py), read back as a timeline. Per step: the host's phases
(the caches' preparation, the graph launch, the wait), the time to its first device operation (a copy counts), and
per CUDA stream its busy time by kernel group; for the value-fetch stream, its idle time before its first fetch,
between fetches and after its last. step_breakdown.py sums kernel time over eager steps; this shows the gaps between
kernels, which kernel sums cannot.

    PYTHONPATH=. python -m benchmarks.decode_timeline [--context 122880] [--batch 31] [--label NAME]
    PYTHONPATH=. python -m benchmarks.decode_timeline --analyse TRACE [--label NAME]   # a kept trace, no GPU

Each run adds (or replaces) its label's row in --out, so runs of different code compare side by side.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks import step_breakdown
from benchmarks import throughput as tp
from benchmarks.report import RESULTS, environment
from shadowkv_core import ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.models.geometry import model_spec, write_config

HOST_PHASES = {"timeline:step": "engine step", "timeline:prepare": "caches prepare the forward",
               "timeline:graph": "graph inputs, launch, outputs", "timeline:finish": "caches finish the forward"}
FETCH = "_fetch_values"


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals given in microseconds, in milliseconds."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def kernel_group(name: str) -> str:
    group = step_breakdown.kernel_group(name)
    if group is not None:
        return group
    return "copy" if name.startswith("Memcpy") else "gemm" if any(s in name for s in ("gemm", "nvjet")) else "other"


def analyse(events: list[dict]) -> list[dict]:
    """Chrome-trace events (torch.profiler's export, times in microseconds) -> one dict per engine step (the host
    ranges named as HOST_PHASES' keys), of the device work that starts inside it."""
    # the host's ranges only: the profiler also writes each range's span on the GPU (gpu_user_annotation)
    host = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in HOST_PHASES]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    steps = sorted((e for e in host if e["name"] == "timeline:step"), key=lambda e: e["ts"])
    out = []
    for step in steps:
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        work = sorted((k for k in device if t0 <= k["ts"] < t1), key=lambda k: k["ts"])
        if not work:
            continue
        end = max(k["ts"] + k["dur"] for k in work)
        phases = {}
        for e in host:
            if t0 <= e["ts"] < t1 and e["name"] != "timeline:step":
                phases.setdefault(e["name"], []).append(round(e["dur"] / 1e3, 3))
        streams = {}
        for k in work:
            s = streams.setdefault(str(k["args"].get("stream")), {"kernels": 0, "busy_ms": [], "groups_ms": {}})
            s["kernels"] += 1
            s["busy_ms"].append((k["ts"], k["ts"] + k["dur"]))
            group = kernel_group(k["name"])
            s["groups_ms"][group] = round(s["groups_ms"].get(group, 0.0) + k["dur"] / 1e3, 3)
        for s in streams.values():
            s["busy_ms"] = round(union_ms(s["busy_ms"]), 3)
        row = {"host_ms": round(step["dur"] / 1e3, 3), "host_phases_ms": phases,
               "first_device_work_ms": round((work[0]["ts"] - t0) / 1e3, 3),
               "device_busy_ms": round(union_ms([(k["ts"], k["ts"] + k["dur"]) for k in work]), 3),
               "streams": streams}
        fetches = [k for k in work if FETCH in k["name"]]
        if fetches:
            gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(fetches, fetches[1:])]
            row["fetch"] = {"kernels": len(fetches), "busy_ms": round(sum(k["dur"] for k in fetches) / 1e3, 3),
                            "idle_before_first_ms": round((fetches[0]["ts"] - t0) / 1e3, 3),
                            "idle_between_ms": round(sum(max(g, 0.0) for g in gaps) / 1e3, 3),
                            "idle_after_last_ms": round((t1 - fetches[-1]["ts"] - fetches[-1]["dur"]) / 1e3, 3)}
        out.append(row)
    return out


def traced(obj, name: str, label: str) -> None:
    """Wrap obj.name in a profiler range called `label`."""
    method = getattr(obj, name)

    def wrapper(*args, **kwargs):
        with record_function(label):
            return method(*args, **kwargs)
    setattr(obj, name, wrapper)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b", choices=list(mm.PRESETS))
    parser.add_argument("--context", type=int, default=122880)
    parser.add_argument("--batch", type=int, default=31)
    parser.add_argument("--method", default="shadowkv_fp8lm_tiered_pipelined",
                        choices=[*tp.ENGINE_METHODS, *tp.SYNC_METHODS])
    parser.add_argument("--tier-share", type=float, default=None,
                        help="device_value_share of a _tiered method (default: the memory model's best)")
    parser.add_argument("--steps", type=int, default=3, help="decode steps profiled")
    parser.add_argument("--label", default="current", help="this run's row in --out (replaced if there)")
    parser.add_argument("--out", default="decode_timeline.json", help="relative paths land in benchmarks/results/")
    parser.add_argument("--trace", default=None, help="also keep the chrome trace here")
    parser.add_argument("--analyse", default=None, metavar="TRACE",
                        help="profile nothing: read this chrome trace (one kept with --trace) into the label's row")
    return parser.parse_args(argv)


def trace_events(path: Path) -> list[dict]:
    trace = json.loads(path.read_text())
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def profiled_row(args: argparse.Namespace) -> dict:
    """Profile the decode steps on the GPU: the run's row, its steps read from the trace."""
    assert torch.cuda.is_available(), "the timeline is of CUDA streams and graphs"
    max_new = 256
    config_dir = write_config(tp.geometry_config(args.model, args.context + max_new))
    g = mm.Geometry.from_spec(model_spec(config_dir), torch.bfloat16)
    cfg = ShadowKVConfig()
    gpu = int(torch.cuda.mem_get_info()[1] * 0.9)
    host = int(mm.mem_available_bytes() * 0.8)
    tier = tp.tier_share_for(g, args.method, cfg, gpu, host, args.context, max_new, args.tier_share)
    shadow, options = tp.method_setup(args.method, cfg, tier)
    engine = tp.build_engine(config_dir, g, shadow, args.context, args.batch, max_new, "cuda", **options)
    try:
        tp.warm_up(engine, args.context)
        tp.prefill(engine, tp.random_prompt(g.vocab_size, args.context), max_new, "cuda")
        while len(engine.requests) < args.batch:
            engine.fork("r0", f"r{len(engine.requests)}")
        times, _ = tp.time_decode(engine, 8, 2)  # captures the graph; the timed steps replay it
        for obj, name, phase in ((engine, "step", "step"), (engine.cache, "prepare_forward", "prepare"),
                                 (engine.runner.graphs, "run", "graph"), (engine.cache, "finish_forward", "finish")):
            traced(obj, name, f"timeline:{phase}")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
    finally:
        engine.close()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.trace or Path(tmp) / "trace.json")
        prof.export_chrome_trace(str(path))
        steps = analyse(trace_events(path))
    row = {"label": args.label, "model": args.model, "context": args.context, "batch": args.batch,
           "method": args.method, "device_value_share": tier, "environment": environment(),
           "step_p50_ms": tp.percentile(times, 0.5) * 1e3, "decode_tok_s": args.batch * len(times) / sum(times),
           "steps": steps}
    print(f"{args.label}: {row['step_p50_ms']:.2f} ms a step, {row['decode_tok_s']:.1f} tok/s")
    return row


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.analyse:
        row = {"label": args.label, "trace": args.analyse, "steps": analyse(trace_events(Path(args.analyse)))}
    else:
        row = profiled_row(args)
    out = Path(args.out) if Path(args.out).is_absolute() else RESULTS / args.out
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    rows = [r for r in rows if r["label"] != args.label] + [row]
    out.write_text(json.dumps({"host_phases": HOST_PHASES, "rows": rows}, indent=1) + "\n")
    last = row["steps"][-1]
    print(f"{args.label}, last step: first device work after {last['first_device_work_ms']} ms, device busy "
          f"{last['device_busy_ms']} of {last['host_ms']} ms; fetch {last.get('fetch')}")
    return row


if __name__ == "__main__":
    main()
