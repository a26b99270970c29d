"""The workload benchmark: what users run (scenarios.py), served by our engines, measured as users see it.

    PYTHONPATH=. python -m benchmarks.workloads --driver offline --scenarios doc_qa multi_turn \\
        --methods dense shadowkv --model llama-3.1-8b --out workloads.json

Methods: `shadowkv` is the engine as the Serve config (--config, configs/prod.yaml by default) ships it; `dense` the
same config with full attention. --model: a geometry preset (random weights at its real shapes), `tiny`, or a
checkpoint directory. Offline, every conversation starts at t=0 through `LLMEngine` (offline.py). Each (scenario,
method) runs in a fresh process on CUDA after a warm-up request. Writes one row per run (the figures of metrics.py and
the engine's trace) to --out under benchmarks/results/, a PNG of the TTFT distributions beside it, and a short table
last. --dump-workload writes the workloads' descriptions and runs nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import yaml

from benchmarks.report import print_table, write_json
from benchmarks.throughput import run_isolated
from shadowkv_core import memory_model as mm
from shadowkv_core.models.geometry import TINY

from .metrics import RequestRecord, summarize
from .runs import METHODS, run_offline
from .scenarios import SCENARIOS, describe, make_workload

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["scenario", "method", "requests", "wall_s", "requests_per_min", "output_tok_s", "ttft_p50_s", "ttft_p99_s",
           "itl_p99_ms", "goodput_per_min", "prefill_step_share", "peak_gpu_gib", "hit_rate"]


def plot(rows: list[dict], path: Path) -> Path | None:
    """The TTFT distribution of each run, one panel per scenario."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return None
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for r in rows:
            ttft = sorted(q["ttft_s"] for q in r["request_records"] if r["scenario"] == scenario and q["ttft_s"])
            if ttft:
                ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=r["method"],
                        color=f"C{METHODS.index(r['method'])}")
        ax.set(title=scenario, xlabel="time to first token (s)", ylabel="share of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def resummarize(path: str, ttft_bound_s: float | None, itl_bound_ms: float | None) -> list[dict]:
    """The rows of an earlier run kept with --events, their figures computed again from the recorded token events,
    under other latency bounds where given."""
    rows = []
    for row in json.loads(Path(path).read_text())["rows"]:
        records = [RequestRecord.from_json(q) for q in row["request_records"]]
        bounds = (ttft_bound_s or row["ttft_bound_s"], itl_bound_ms or row["itl_bound_ms"])
        rows.append({**row, **summarize(records, row["wall_s"], *bounds)})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver", choices=("offline",), default="offline")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--config", default=str(ROOT / "configs" / "prod.yaml"), help="the Serve config to run")
    parser.add_argument("--model", default="llama-3.1-8b", help=f"{sorted(mm.PRESETS)}, tiny, or a checkpoint dir")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every token count (CPU: ~0.01)")
    parser.add_argument("--count-scale", type=float, default=1.0, help="multiplies every number of conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--events", action="store_true", help="keep every request's token events in the JSON")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="each run in a fresh process (default: on CUDA)")
    parser.add_argument("--dump-workload", default=None, help="write the workloads' descriptions here and stop")
    parser.add_argument("--rate", type=float, default=None,
                        help="with --dump-workload: first turns per second (a Poisson process); none: all at t=0")
    parser.add_argument("--resummarize", default=None, metavar="RUN_JSON",
                        help="compute a run's figures again from its recorded events (--events), and stop")
    parser.add_argument("--ttft-bound-s", type=float, default=None, help="with --resummarize: goodput's TTFT bound")
    parser.add_argument("--itl-bound-ms", type=float, default=None, help="with --resummarize: goodput's ITL p99 bound")
    parser.add_argument("--out", default="workloads.json", help="relative paths land in benchmarks/results/")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.resummarize:
        rows = resummarize(args.resummarize, args.ttft_bound_s, args.itl_bound_ms)
        print(f"wrote {write_json(args.out, rows, resummarized=args.resummarize)}")
        print_table(rows, COLUMNS)
        return rows
    app_args = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]
    if args.dump_workload:
        vocab = mm.PRESETS[args.model].vocab_size if args.model in mm.PRESETS else TINY["vocab_size"]
        dump = {s: describe(make_workload(s, args.seed, vocab, args.scale, args.count_scale, args.rate))
                for s in args.scenarios}
        Path(args.dump_workload).write_text(json.dumps(dump, indent=1) + "\n")
        return []
    isolate = torch.cuda.is_available() if args.isolate is None else args.isolate
    rows, failures = [], []
    for scenario in args.scenarios:
        for method in args.methods:
            task = (run_offline, args, app_args, scenario, method)
            try:
                rows.append(run_isolated(*task) if isolate else task[0](*task[1:]))
            except Exception as exc:  # one failed run is recorded; the others still run
                failures.append({"scenario": scenario, "method": method, "error": f"{type(exc).__name__}: {exc}"})
                print(f"{scenario} {method} failed: {failures[-1]['error']}", file=sys.stderr)
            path = write_json(args.out, rows, failures=failures, config=args.config, model=args.model,
                              scale=args.scale, count_scale=args.count_scale, seed=args.seed)
    png = plot(rows, path.with_suffix(".png")) if rows else None
    print(f"wrote {path}, {png}")
    print_table(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
