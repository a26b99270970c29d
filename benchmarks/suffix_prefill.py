"""Prefill of new tokens after a cached prefix (a conversation's later turn, a shared document's readers): one cold
prefill of a --prefix-token document, then prompts of that document and new tokens, alone and in batches of
readers, on an idle engine built from a Serve config (ShadowKV, the prefix cache on). Each batch size runs twice and
the second is reported (the first compiles what a new shape needs). A row: the readers, their new tokens each, the
seconds from adding them to their first tokens, and the prompt tokens served from the cache. With --profile (CUDA),
the last batch once more under torch.profiler: its kernels' device time by name (the costliest) and its host waits
(cudaStreamSynchronize calls).

    PYTHONPATH=. python -m benchmarks.suffix_prefill [--prefix 122880] [--readers 1 14] [--suffix 400 125] [--profile]
        [--shadowkv-set value_format=fp8 ...] [--prefill-step-tflop none]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from benchmarks.report import print_table, write_json
from benchmarks.workloads.runs import (AS_CONFIGURED, engine_config, model_dir, number_or_none,
                                      shadowkv_overridden, warm_up)
from shadowkv_core import LLMEngine, SamplingParams
from shadowkv_core import memory_model as mm

ROOT = Path(__file__).resolve().parents[1]

COLUMNS = ["batch", "readers", "new_tokens", "seconds", "hit_tokens"]
FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "prod.yaml"), help="the Serve config to build from")
    parser.add_argument("--model", default="llama-3.1-8b", help=f"{sorted(mm.PRESETS)}, tiny, or a checkpoint dir")
    parser.add_argument("--prefix", type=int, default=122880, help="the cached document's tokens")
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 14], help="prompts per batch, one batch each")
    parser.add_argument("--suffix", type=int, nargs="+", default=[400, 125], help="new tokens a prompt, per batch")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="the engine's slots (the config's is replaced)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="CUDA: profile the last batch once more")
    parser.add_argument("--shadowkv-set", nargs="+", default=None, metavar="FIELD=VALUE",
                        help="override fields of the config's shadowkv (ShadowKVConfig), e.g. value_format=fp8")
    parser.add_argument("--prefill-step-tflop", type=number_or_none, default=AS_CONFIGURED,
                        help="override the config's engine.prefill_step_tflop; none: each prompt prefilled whole")
    parser.add_argument("--out", default="suffix_prefill.json", help="relative paths land in benchmarks/results/")
    args = parser.parse_args(argv)
    if len(args.readers) != len(args.suffix):
        parser.error(f"--readers and --suffix pair up: {len(args.readers)} against {len(args.suffix)} values")
    return args


def app_args(args: argparse.Namespace) -> dict:
    """The Serve config's application args with the command line's overrides; a refused --shadowkv-set exits."""
    app = {**yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"],
           "max_num_seqs": args.max_num_seqs}
    if args.prefill_step_tflop is not AS_CONFIGURED:
        app["engine"] = {**app.get("engine", {}), "prefill_step_tflop": args.prefill_step_tflop}
    if args.shadowkv_set:
        try:
            app = shadowkv_overridden(app, args.shadowkv_set)
        except ValueError as error:
            raise SystemExit(f"suffix_prefill: {error}") from None
    return app


def first_tokens(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    """Seconds from adding the prompts to the step that gives each its first (only) token."""
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, FIRST_TOKEN)
    while engine.has_unfinished_requests():
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def profiled(engine: LLMEngine, prompts: list[list[int]]) -> dict:
    """The batch under torch.profiler: {"kernels": {name: device seconds} (the costliest), "host_waits": n}."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        first_tokens(engine, prompts, "profile")
    events = prof.key_averages()
    kernels = sorted(((e.key, e.device_time_total / 1e6) for e in events if e.device_time_total > 0),
                     key=lambda kv: -kv[1])[:10]
    waits = sum(e.count for e in events if e.key == "cudaStreamSynchronize")
    return {"kernels": dict(kernels), "host_waits": waits}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    app = app_args(args)
    model, dummy = model_dir(args.model, app["max_model_len"])
    engine = LLMEngine(engine_config(app, model, dummy, "shadowkv"))
    try:
        warm_up(engine)
        gen = torch.Generator().manual_seed(args.seed)

        def tokens(n: int) -> list[int]:
            return torch.randint(0, engine.spec.vocab_size, (n,), generator=gen).tolist()

        doc = tokens(args.prefix)
        rows = [{"batch": "cold", "readers": 1, "new_tokens": args.prefix,
                 "seconds": first_tokens(engine, [doc], "cold"), "hit_tokens": 0}]
        for readers, suffix in zip(args.readers, args.suffix):
            for repeat in range(2):
                prompts = [doc + tokens(suffix) for _ in range(readers)]
                hits = engine.stats()["prefix_hit_tokens"]
                seconds = first_tokens(engine, prompts, f"r{readers}-{repeat}")
            rows.append({"batch": "suffix", "readers": readers, "new_tokens": suffix, "seconds": seconds,
                         "hit_tokens": engine.stats()["prefix_hit_tokens"] - hits})
        profile_of = None
        if args.profile and torch.cuda.is_available():
            profile_of = {"readers": args.readers[-1], "new_tokens": args.suffix[-1],
                          **profiled(engine, [doc + tokens(args.suffix[-1]) for _ in range(args.readers[-1])])}
    finally:
        engine.close()
    path = write_json(args.out, rows, config=args.config, model=args.model, prefix=args.prefix,
                      max_num_seqs=args.max_num_seqs, shadowkv=app.get("shadowkv"),
                      prefill_step_tflop=app.get("engine", {}).get("prefill_step_tflop"), profile=profile_of)
    print(f"wrote {path}")
    print_table(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
