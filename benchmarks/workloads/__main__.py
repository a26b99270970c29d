"""The workload benchmark: what users run (scenarios.py), served by our engines, measured as users see it.

    PYTHONPATH=. python -m benchmarks.workloads --driver offline --scenarios doc_qa multi_turn \\
        --methods dense shadowkv --model llama-3.1-8b --out workloads.json
    PYTHONPATH=. python -m benchmarks.workloads --driver online --rates 0.05 0.1 0.2 --model llama-3.1-8b \\
        --out workloads_online.json

Methods: `shadowkv` is the engine as the Serve config (--config, configs/prod.yaml by default) ships it, or with the
fields --shadowkv-set names changed; `dense` the same config with full attention; offline, `hf_static` and
`hf_dynamic` are Hugging Face transformers (hf.py). --model: a geometry preset (random weights at its real shapes),
`tiny`, or a checkpoint directory. Offline, every conversation starts at t=0 through `LLMEngine` (offline.py,
runs.py), each (scenario, method) in a fresh process on CUDA after the engine's warm-up; online, through the service's
OpenAI API, streamed, the conversations arriving as a Poisson process at each of --rates (service.py, online.py).
Writes one row per run (the figures of metrics.py and the engine's) to --out under benchmarks/results/, a PNG beside
it (offline: the TTFT distributions; online: requests/min and goodput against the arrival rate), and a short table
last. --dump-workload writes the workloads' descriptions and runs nothing.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from benchmarks.report import print_table, write_json
from shadowkv_core import memory_model as mm
from shadowkv_core.models.geometry import model_spec

from .metrics import RequestRecord, summarize
from .plots import plot
from .runs import (AS_CONFIGURED, ENGINES, METHODS, model_dir, number_or_none, offline_runs,
                   shadowkv_overridden)
from .scenarios import SCENARIOS, describe, make_workload

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ["requests", "wall_s", "requests_per_min", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p99_ms",
           "goodput_per_min"]
COLUMNS = {"offline": ["scenario", "method", *FIGURES, "unfinished", "prefill_step_share", "outside_steps_s",
                       "peak_gpu_gib", "hit_rate"],
           "online": ["scenario", "method", "rate", "errors", *FIGURES, "peak_gpu_in_use_gib", "hit_rate"]}


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
    parser.add_argument("--driver", choices=("offline", "online"), default="offline")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(ENGINES))
    parser.add_argument("--config", default=str(ROOT / "configs" / "prod.yaml"), help="the Serve config to run")
    parser.add_argument("--model", default="llama-3.1-8b", help=f"{sorted(mm.PRESETS)}, tiny, or a checkpoint dir")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every token count (CPU: ~0.01)")
    parser.add_argument("--count-scale", type=float, default=1.0, help="multiplies every number of conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="override the config's engine.enable_prefix_caching (default: as configured)")
    parser.add_argument("--prefill-step-tflop", type=number_or_none, default=AS_CONFIGURED,
                        help="override the config's engine.prefill_step_tflop, the prefill work beside each decode "
                        "step; none: each prompt prefilled whole in one step (throughput before inter-token latency)")
    parser.add_argument("--prefill-step-ms", type=number_or_none, default=AS_CONFIGURED,
                        help="override the config's engine.prefill_step_ms, the step time a paced prefill budget aims "
                        "at; none: a fixed budget")
    parser.add_argument("--overlap-prefill", action=argparse.BooleanOptionalAction, default=None,
                        help="override the config's engine.overlap_prefill (prefill slices on a stream of their own)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="override the config's max_num_seqs, the sequences an engine runs at once")
    parser.add_argument("--host-cache-gib", type=float, default=None,
                        help="pinned host bytes for each engine's (each tensor-parallel rank's) values, instead of "
                             "the config's or its share of MemAvailable")
    parser.add_argument("--shadowkv-set", nargs="+", default=None, metavar="FIELD=VALUE",
                        help="override fields of the config's shadowkv (ShadowKVConfig), e.g. value_format=fp8; "
                        "the shadowkv method only")
    parser.add_argument("--events", action="store_true", help="keep every request's token events in the JSON")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="each run in a fresh process (default: on CUDA)")
    parser.add_argument("--warm-up", choices=("engine", "scenario", "none"), default="engine",
                        help="offline, our engines: before the timed run, the warm-up a replica runs when it starts "
                        "(shadowkv_core/engine/warm_up.py); or that and the scenario once with another seed (every "
                        "kernel compiled and batch shape captured first); or none (a replica started without it)")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="offline: stop each run this long after its start; what is open then counts as unfinished, "
                        "its work for nothing (a cut run's requests/min understates the engine)")
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="online: the conversations' arrival rates (first turns per second), one run each")
    parser.add_argument("--url", default=None, help="online: the service running there (loopback), one method")
    parser.add_argument("--max-in-flight", type=int, default=256, help="online: requests open at once, at most")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="online: each request's bound")
    parser.add_argument("--dump-workload", default=None, help="write the workloads' descriptions here and stop")
    parser.add_argument("--rate", type=float, default=None,
                        help="with --dump-workload: first turns per second (a Poisson process); none: all at t=0")
    parser.add_argument("--resummarize", default=None, metavar="RUN_JSON",
                        help="compute a run's figures again from its recorded events (--events), and stop")
    parser.add_argument("--ttft-bound-s", type=float, default=None, help="with --resummarize: goodput's TTFT bound")
    parser.add_argument("--itl-bound-ms", type=float, default=None, help="with --resummarize: goodput's ITL p99 bound")
    parser.add_argument("--out", default="workloads.json", help="relative paths land in benchmarks/results/")
    args = parser.parse_args(argv)
    if args.driver == "online" and not (args.rates or args.dump_workload or args.resummarize):
        parser.error("--driver online needs --rates")
    if args.driver == "online" and (set(args.methods) - set(ENGINES) or args.time_limit_s is not None):
        parser.error(f"--driver online serves {ENGINES}, each run bounded by --request-timeout-s")
    if args.url is not None and (args.driver != "online" or len(args.methods) != 1):
        parser.error("--url is the service of one method, online: name it with --methods")
    if args.shadowkv_set is not None and args.url is not None:
        parser.error("--shadowkv-set configures the engines this command starts, not a service at --url")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.resummarize:
        rows = resummarize(args.resummarize, args.ttft_bound_s, args.itl_bound_ms)
        print(f"wrote {write_json(args.out, rows, resummarized=args.resummarize)}")
        print_table(rows, COLUMNS[rows[0].get("driver", "offline")] if rows else [])
        return rows
    app_args = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]
    if args.max_num_seqs is not None:
        app_args = {**app_args, "max_num_seqs": args.max_num_seqs}
    overrides = {key: value for key, value in (("enable_prefix_caching", args.prefix_caching),
                                               ("overlap_prefill", args.overlap_prefill),
                                               ("host_cache_gib", args.host_cache_gib)) if value is not None}
    overrides.update({key: value for key, value in (("prefill_step_tflop", args.prefill_step_tflop),
                                                    ("prefill_step_ms", args.prefill_step_ms))
                      if value is not AS_CONFIGURED})
    app_args = {**app_args, "engine": {**app_args.get("engine", {}), **overrides}}
    if args.shadowkv_set:
        try:
            app_args = shadowkv_overridden(app_args, args.shadowkv_set)
        except ValueError as error:
            raise SystemExit(f"workloads: {error}") from None
    if args.dump_workload:
        vocab = model_spec(model_dir(args.model, app_args["max_model_len"])[0]).vocab_size
        dump = {s: describe(make_workload(s, args.seed, vocab, args.scale, args.count_scale, args.rate))
                for s in args.scenarios}
        Path(args.dump_workload).write_text(json.dumps(dump, indent=1) + "\n")
        return []
    if args.driver == "online":
        from .service import online_runs  # the Serve stack, which offline runs do without

        runs = online_runs(args, app_args)
    else:
        runs = offline_runs(args, app_args)
    rows, failures = [], []
    for kind, result in runs:
        (rows if kind == "row" else failures).append(result)
        path = write_json(args.out, rows, failures=failures, driver=args.driver, config=args.config,
                          model=args.model, url=args.url, scale=args.scale, count_scale=args.count_scale,
                          seed=args.seed)
    png = plot(rows, path.with_suffix(".png")) if rows else None
    print(f"wrote {path}, {png}")
    print_table(rows, COLUMNS[args.driver])
    return rows


if __name__ == "__main__":
    main()
