"""Inter-token latency of running decodes while a long prompt prefills (issue 28), per prefill step budget
(EngineConfig.prefill_step_tflop) and step target (prefill_step_ms), random weights of a real geometry (Llama-3.1-8B
by default).

One engine holds `--decode-batch` decoding requests of `--decode-context` tokens and room for one `--prompt`-token
prompt. First the prompt's TTFT alone (an idle engine: its whole prefill in one step, whatever the budget). Then per
budget and target (the engine's config swapped between runs, the pacer's scale reset; "none": no limit, no target):
the decodes start (one prefilled, the others forked from it), `--steps` steps run with no prefill, then the prompt is
submitted and the engine steps until its first token. A token's arrival is the return of the step() that hands it out (after its read back: with async decode
each token comes out one step later, as a server would stream it), and a request's ITL the time between two of its
arrivals; no sync is added. Reported per budget: ITL p50/p99 with no prefill and while the prompt prefills, the ratio
of the latter's p99 to the former's p50 (the acceptance: <= 3), the prompt's TTFT beside the decodes and its ratio to
TTFT alone (the prefill's cost), the steps it took, the decode tokens produced meanwhile and, with a target, the
mean budget of the prompt's steps.

    PYTHONPATH=. python -m benchmarks.itl_under_prefill [--method dense] [--decode-batch 8] [--decode-context 8192]
        [--prompt 122880] [--budgets none 12 6 3] [--step-ms none 40] [--steps 64]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from benchmarks.report import print_table, write_json
from benchmarks.throughput import (METHODS, dtype_for, geometry_config, method_geometry, method_setup,
                                   percentile, random_prompt, warm_up)
from shadowkv_core import EngineConfig, LLMEngine, SamplingParams, ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.models.geometry import TINY_SHADOWKV, model_spec, write_config

COLUMNS = ["method", "budget_tflop", "step_ms", "mean_budget_tflop", "decode_batch", "itl_p50_ms", "itl_p99_ms",
           "prefill_itl_p50_ms", "prefill_itl_p99_ms", "p99_over_p50", "ttft_s", "ttft_alone_s", "ttft_ratio",
           "prefill_steps", "decode_tokens_during_prefill"]
WARM_UP_TOKENS = 4  # throughput.warm_up's request: the prompt's length less one, and 4 tokens


def build_engine(args: argparse.Namespace, config_dir: str, g: mm.Geometry, cfg: ShadowKVConfig | None,
                 options: dict) -> LLMEngine:
    """An engine whose pools hold the decodes and the prompt (the memory model's sizes for each shape, summed)."""
    shapes = ((args.decode_batch, args.decode_context, args.decode_tokens), (1, args.prompt, WARM_UP_TOKENS))
    if cfg is None:
        gpu, host = sum(n * mm.engine_seq_bytes(g, None, c, new).gpu for n, c, new in shapes), 0
    else:
        gpu, host = (sum(parts) for parts in zip(*(mm.pool_budget_for(g, cfg, n, c, new) for n, c, new in shapes)))
    return LLMEngine(EngineConfig(
        model=config_dir, device=args.device, dtype=str(dtype_for(args.device)).removeprefix("torch."),
        load_format="dummy", shadowkv=cfg, max_num_seqs=args.decode_batch + 1,
        max_model_len=max(args.decode_context + args.decode_tokens, args.prompt + WARM_UP_TOKENS),
        max_prefill_tokens=max(args.prompt, args.decode_context), enable_prefix_caching=False,  # every run prefills
        gpu_cache_gib=gpu / mm.GIB, host_cache_gib=host / mm.GIB or None,
        overlap_prefill="auto" if args.overlap_prefill is None else args.overlap_prefill, **options))


def step_until(engine: LLMEngine, arrivals: dict[str, list[float]], done, limit: int | None = None,
               budgets: list[float] | None = None) -> int:
    """Step until done() (checked before each step) or `limit` steps; each token's arrival time, per request, into
    `arrivals`, and each step's prefill budget beside decodes into `budgets`. Returns the steps run."""
    steps = 0
    while not done() and (limit is None or steps < limit):
        if budgets is not None:
            budgets.append(engine.pacer.budget(engine.config))
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            arrivals.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
    return steps


def gaps_ms(arrivals: dict[str, list[float]], ids: list[str], after: float) -> list[float]:
    """Each request's inter-token times (ms) whose later token arrived after `after`."""
    return [1e3 * (b - a) for i in ids for a, b in zip(arrivals[i], arrivals[i][1:]) if b > after]


def prefill_alone(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds to the prompt's first token on an idle engine."""
    start = time.perf_counter()
    engine.add_request("alone", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    step_until(engine, {}, lambda: "alone" not in engine.requests)
    return time.perf_counter() - start


def measure(engine: LLMEngine, args: argparse.Namespace, budget: float | None, step_ms: float | None,
            prompt: list[int], decode_prompt: list[int], ttft_alone: float) -> dict:
    engine.config = dataclasses.replace(engine.config, prefill_step_tflop=budget, prefill_step_ms=step_ms)
    engine.pacer.scale = 1.0
    ids = [f"d{i}" for i in range(args.decode_batch)]
    engine.add_request(ids[0], decode_prompt, SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True))
    arrivals: dict[str, list[float]] = {}
    step_until(engine, arrivals, lambda: ids[0] in arrivals)
    for i in ids[1:]:
        engine.fork(ids[0], i)
    step_until(engine, arrivals, lambda: False, args.warmup_steps)
    idle_from = time.perf_counter()
    step_until(engine, arrivals, lambda: False, args.steps)
    counted = {i: len(arrivals[i]) for i in ids}
    idle = gaps_ms(arrivals, ids, idle_from)
    idle_tokens = sum(t > idle_from for i in ids for t in arrivals[i])
    submitted = time.perf_counter()
    engine.add_request("prompt", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    budgets: list[float] = []
    steps = step_until(engine, arrivals, lambda: "prompt" in arrivals, budgets=budgets)
    ttft = arrivals["prompt"][0] - submitted
    busy = gaps_ms(arrivals, ids, submitted)
    during = sum(len(arrivals[i]) - counted[i] for i in ids)
    ran_out = [i for i in ids if i not in engine.requests]  # decodes that ended before the prompt's first token
    for i in ids:
        engine.abort(i)
    engine.drain_in_flight()
    row = {"method": args.method, "model": args.model, "budget_tflop": budget, "step_ms": step_ms,
           "mean_budget_tflop": None if budget is None else sum(budgets) / len(budgets) / 1e12,
           "decode_batch": args.decode_batch,
           "overlap_prefill": engine.streams is not None,
           "decode_context": args.decode_context, "prompt": args.prompt,
           "itl_p50_ms": percentile(idle, 0.5), "itl_p99_ms": percentile(idle, 0.99),
           "prefill_itl_p50_ms": percentile(busy, 0.5), "prefill_itl_p99_ms": percentile(busy, 0.99),
           "prefill_itl_max_ms": max(busy), "ttft_s": ttft, "ttft_alone_s": ttft_alone, "ttft_ratio": ttft / ttft_alone,
           "prefill_steps": steps, "decode_tokens_during_prefill": during,
           "decode_tok_s": idle_tokens / (submitted - idle_from),
           "decode_tok_s_during_prefill": during / ttft}
    row["p99_over_p50"] = row["prefill_itl_p99_ms"] / row["itl_p50_ms"]
    if ran_out:
        row["decodes_ended_early"] = ran_out
    return row


def parse_budget(text: str) -> float | None:
    return None if text.lower() in ("none", "inf", "unlimited") else float(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b", choices=[*mm.PRESETS, "tiny"], help="geometry")
    parser.add_argument("--method", default="dense", choices=[m for m in METHODS if not m.startswith("hf")])
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--decode-context", type=int, default=8192, help="each decode's prompt tokens")
    parser.add_argument("--decode-tokens", type=int, default=8192,
                        help="each decode's max_tokens: enough to outlast the slowest prefill")
    parser.add_argument("--prompt", type=int, default=122880, help="the long prompt's tokens")
    parser.add_argument("--budgets", type=parse_budget, nargs="+", default=[None, 12.0, 6.0, 3.0],
                        help="prefill_step_tflop values; none: no limit")
    parser.add_argument("--step-ms", type=parse_budget, nargs="+", default=[None],
                        help="prefill_step_ms values, each run with every budget; none: a fixed budget")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed with no prefill")
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--overlap-prefill", action=argparse.BooleanOptionalAction, default=None,
                        help="EngineConfig.overlap_prefill (default: auto)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="itl_under_prefill.json", help="relative paths land in benchmarks/results/")
    args = parser.parse_args(argv)
    if min(args.warmup_steps, args.steps, args.decode_batch) < 1:
        parser.error("--warmup-steps, --steps and --decode-batch must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    config_dir = write_config(geometry_config(args.model, max(args.prompt, args.decode_context + args.decode_tokens)))
    g = mm.Geometry.from_spec(model_spec(config_dir), dtype_for(args.device))
    cfg, options = method_setup(args.method, TINY_SHADOWKV if args.model == "tiny" else ShadowKVConfig())
    engine = build_engine(args, config_dir, method_geometry(g, args.method), cfg, options)
    try:
        warm_up(engine, args.prompt)
        prompt = random_prompt(g.vocab_size, args.prompt)
        decode_prompt = random_prompt(g.vocab_size, args.decode_context)
        prefill_alone(engine, prompt)  # the long prompt's own shapes compiled and cached
        ttft_alone = prefill_alone(engine, prompt)
        rows = []
        for budget, step_ms in ((b, t) for b in args.budgets for t in args.step_ms if b is not None or t is None):
            rows.append(measure(engine, args, budget, step_ms, prompt, decode_prompt, ttft_alone))
            print_table(rows[-1:], COLUMNS)
            if "decodes_ended_early" in rows[-1]:
                print(f"budget {budget}, target {step_ms}: decodes ended before the prompt's first token; raise "
                      "--decode-tokens", file=sys.stderr)
    finally:
        engine.close()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    path = write_json(args.out, rows, device=device, args=vars(args))
    print_table(rows, COLUMNS)
    print(path)
    return {"rows": rows}


if __name__ == "__main__":
    main()
