"""The workload benchmark's runs: an offline run (a method's engine built from a Serve config, warmed up, serving one
scenario; in a module of its own so that a fresh process, one per run on CUDA, can import it) and the offline runs one
after another, with what both drivers share: the model directory that --model names, a method's Serve application
args, the progress bar, a run's row and a failed run's record."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator

import torch
import yaml

from benchmarks.throughput import geometry_config, run_isolated
from shadowkv_core import EngineConfig, LLMEngine, SamplingParams
from shadowkv_core import memory_model as mm
from shadowkv_core.config import engine_fields, shadowkv_from
from shadowkv_core.engine.tensor_parallel import new_engine
from shadowkv_core.engine.warm_up import warm_up, warm_up_prompt
from shadowkv_core.models.geometry import TINY, model_spec, write_config, write_geometry

from . import hf
from .metrics import RequestRecord, summarize
from .offline import UNFINISHED, OfflineRun, peak_gpu_bytes
from .scenarios import SCENARIOS, make_workload

ENGINES = ("dense", "dense_fp8", "shadowkv")
METHODS = (*ENGINES, *hf.METHODS)


def model_dir(model: str, max_len: int, tokenizer: bool = False) -> tuple[str, bool]:
    """(a model directory, whether its weights are random): a geometry preset or `tiny` as a config-only directory
    (with `tokenizer`, a word-level one over its vocabulary beside it: a service streams every token as one word of
    text), else the checkpoint directory given."""
    write = write_geometry if tokenizer else write_config
    if model == "tiny":
        return write({**TINY, "max_position_embeddings": max(max_len, TINY["max_position_embeddings"])}), True
    if model in mm.PRESETS:
        return write(geometry_config(model, max_len)), True
    return str(Path(model).resolve()), False


def method_args(app_args: dict, model: str, dummy: bool, method: str) -> dict:
    """A Serve application's args serving `model` with `method`: dense turns ShadowKV off, dense_fp8 too and keeps
    the KV cache in fp8 (EngineConfig.kv_cache_dtype); random weights load as "dummy"."""
    args = {**app_args, "model": model}
    engine = {**app_args.get("engine", {}), **({"load_format": "dummy"} if dummy else {})}
    if method == "dense_fp8":
        engine["kv_cache_dtype"] = "fp8"
    if engine:
        args["engine"] = engine
    if method in ("dense", "dense_fp8"):
        args["shadowkv"] = None
    return args


AS_CONFIGURED = object()  # an override left out: the config's own value (not a string: argparse parses those)


def number_or_none(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def shadowkv_overridden(app_args: dict, settings: list[str]) -> dict:
    """app_args with its shadowkv's fields (a preset's or its own) changed by FIELD=VALUE settings, each value read
    as YAML; a field ShadowKVConfig lacks, a value it refuses or a config without shadowkv raises ValueError."""
    if app_args.get("shadowkv") is None:
        raise ValueError("--shadowkv-set: the config serves dense attention (its shadowkv is empty)")
    fields = dict(vars(shadowkv_from(app_args["shadowkv"])))
    for setting in settings:
        name, equals, value = setting.partition("=")
        if not equals or name not in fields:
            raise ValueError(f"--shadowkv-set {setting!r}: FIELD=VALUE with FIELD one of {sorted(fields)}")
        fields[name] = yaml.safe_load(value)
    shadowkv_from(fields)  # refused values fail here, before any engine starts
    return {**app_args, "shadowkv": fields}


def engine_config(app_args: dict, model: str, dummy: bool, method: str) -> EngineConfig:
    return EngineConfig(**engine_fields(method_args(app_args, model, dummy, method), model))


def warm_up_on_scenario(engine: LLMEngine, args: argparse.Namespace, scenario: str) -> None:
    """The scenario once, untimed, drawn with another seed (no prompt of the timed run is cached by it), then the
    prefix cache cleared and the counters reset, as the engine's warm-up leaves them: every kernel the timed run
    launches is compiled and every batch shape it decodes captured before it starts, as on a replica that has served
    for a while."""
    workload = make_workload(scenario, args.seed + 1, engine.spec.vocab_size, args.scale, args.count_scale)
    OfflineRun(engine, workload, progress(f"{scenario} warm-up", workload), args.time_limit_s).run()
    engine.clear_prefix_cache()
    engine.reset_counters()


def run_offline(args: argparse.Namespace, app_args: dict, scenario: str, method: str) -> dict:
    """One scenario through one fresh engine (a tensor-parallel group where the config's tensor_parallel_size asks for
    one) -> its row (and, with --events, each request's events)."""
    model, dummy = model_dir(args.model, app_args["max_model_len"])
    engine = new_engine(engine_config(app_args, model, dummy, method))
    try:
        warm_up_s = None if args.warm_up == "none" else warm_up(engine).seconds  # what a replica runs when it starts
        if args.warm_up == "scenario":
            warm_up_on_scenario(engine, args, scenario)
        workload = make_workload(scenario, args.seed, engine.spec.vocab_size, args.scale, args.count_scale)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        bar = progress(f"{scenario} {method}", workload)
        records, trace, wall = OfflineRun(engine, workload, bar, args.time_limit_s).run()
        shadowkv = None if engine.shadowkv is None else vars(engine.shadowkv)
        # the timed run's own counts (every warm-up resets them); prefix_cached_bytes is a level, as the run leaves it
        prefix = {k: v for k, v in engine.stats().items() if k.startswith("prefix_")}
        steps = trace.summary(wall, SCENARIOS[scenario].itl_bound_ms)
        return run_row(scenario, method, "offline", records, wall, args.events, **steps, **prefix,
                       prefix_caching=engine.config.enable_prefix_caching, max_num_seqs=engine.config.max_num_seqs,
                       prefill_step_tflop=engine.config.prefill_step_tflop,
                       prefill_step_ms=engine.config.prefill_step_ms, overlap_prefill=engine.streams is not None,
                       warm_up=args.warm_up, warm_up_s=warm_up_s,
                       peak_gpu_gib=peak_gpu_bytes() / 2**30, shadowkv=shadowkv, time_limit_s=args.time_limit_s,
                       tensor_parallel_size=engine.config.tensor_parallel_size,
                       host_cache_gib=engine.config.host_cache_gib,
                       unfinished=sum(r.error == UNFINISHED for r in records))
    finally:
        engine.close()


def run_hf(args: argparse.Namespace, app_args: dict, scenario: str, method: str) -> dict:
    """One scenario through Hugging Face transformers (hf.py), after a request of the engines' warm-up prompt -> its
    row."""
    model, dummy = model_dir(args.model, app_args["max_model_len"])
    vocab_size = model_spec(model).vocab_size
    workload = make_workload(scenario, args.seed, vocab_size, args.scale, args.count_scale)
    run = hf.HFRun(hf.load(model, dummy), method, workload, time_limit_s=args.time_limit_s)
    run.warm_up(warm_up_prompt(app_args["max_model_len"], vocab_size))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run.progress = progress(f"{scenario} {method}", workload)  # after the warm-up: the bar times the run alone
    records, wall = run.run()
    return run_row(scenario, method, "offline", records, wall, args.events, peak_gpu_gib=peak_gpu_bytes() / 2**30,
                   peak_host_gib=0.0, hit_rate=None, time_limit_s=args.time_limit_s,
                   unfinished=sum(r.error == UNFINISHED for r in records))


def offline_runs(args: argparse.Namespace, app_args: dict) -> Iterator[tuple[str, dict]]:
    """("row", its row) or ("failure", what failed) for each scenario and method, one after another."""
    isolate = torch.cuda.is_available() if args.isolate is None else args.isolate
    for scenario in args.scenarios:
        for method in args.methods:
            task = (run_hf if method in hf.METHODS else run_offline, args, app_args, scenario, method)
            try:
                result = "row", run_isolated(*task) if isolate else task[0](*task[1:])
            except Exception as exc:  # one failed run is recorded; the others still run
                result = failure(exc, scenario=scenario, method=method)
            yield result


def progress(label: str, workload: list):
    """A tqdm bar over the run's requests if tqdm is installed, else None (the run prints nothing per request)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=sum(len(c.turns) for c in workload), desc=label, file=sys.stderr)


def run_row(scenario: str, method: str, driver: str, records: list[RequestRecord], wall: float, events: bool,
            **extra) -> dict:
    """A run's row: the users' figures (metrics.summarize under the scenario's bounds), `extra`, and each request's
    record (with `events`, its token events too)."""
    spec = SCENARIOS[scenario]
    row = {"scenario": scenario, "method": method, "driver": driver,
           **summarize(records, wall, spec.ttft_bound_s, spec.itl_bound_ms), **extra}
    row["request_records"] = [r.to_json() if events else _brief(r) for r in records]
    return row


def _brief(record: RequestRecord) -> dict:
    return {"request_id": record.request_id, "sent_s": record.sent_s, "prompt_tokens": record.prompt_tokens,
            "output_tokens": record.output_tokens, "ttft_s": record.ttft_s, "end_to_end_s": record.end_to_end_s,
            "finish_reason": record.finish_reason, "error": record.error}


def failure(exc: Exception, **where) -> tuple[str, dict]:
    """("failure", where and what): a failed run, recorded (and said) while the others still run."""
    error = f"{type(exc).__name__}: {exc}"
    print(*where.values(), "failed:", error, file=sys.stderr)
    return "failure", {**where, "error": error}
