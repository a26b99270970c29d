"""One run of the workload benchmark: a method's engine built from a Serve config, warmed up, serving one scenario;
a module of its own so that a fresh process (one per run on CUDA) can import it."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.throughput import geometry_config
from shadowkv_core import EngineConfig, LLMEngine, SamplingParams
from shadowkv_core import memory_model as mm
from shadowkv_core.config import engine_fields
from shadowkv_core.models.geometry import TINY, write_config

from .metrics import summarize
from .offline import OfflineRun, peak_gpu_bytes
from .scenarios import SCENARIOS, make_workload

METHODS = ("dense", "shadowkv")


def model_dir(model: str, max_len: int) -> tuple[str, bool]:
    """(a model directory, whether its weights are random): a geometry preset or `tiny` as a config-only directory,
    else the checkpoint directory given."""
    if model == "tiny":
        return write_config({**TINY, "max_position_embeddings": max(max_len, TINY["max_position_embeddings"])}), True
    if model in mm.PRESETS:
        return write_config(geometry_config(model, max_len)), True
    return str(Path(model).resolve()), False


def engine_config(app_args: dict, model: str, dummy: bool, method: str) -> EngineConfig:
    fields = engine_fields(app_args, model)
    if dummy:
        fields["load_format"] = "dummy"
    if method == "dense":
        fields["shadowkv"] = None
    return EngineConfig(**fields)


def warm_up(engine: LLMEngine) -> None:
    """Compile the kernels on a prompt of a quarter of the context (long enough to be kept in shadows)."""
    n = min(engine.max_model_len // 4, 8192)
    engine.add_request("warm-up", [i % engine.spec.vocab_size for i in range(n)],
                       SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run_offline(args: argparse.Namespace, app_args: dict, scenario: str, method: str) -> dict:
    """One scenario through one fresh engine -> its row (and, with --events, each request's events)."""
    model, dummy = model_dir(args.model, app_args["max_model_len"])
    engine = LLMEngine(engine_config(app_args, model, dummy, method))
    try:
        warm_up(engine)
        workload = make_workload(scenario, args.seed, engine.spec.vocab_size, args.scale, args.count_scale)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        records, trace, wall = OfflineRun(engine, workload, progress(scenario, method, workload)).run()
        spec = SCENARIOS[scenario]
        row = {"scenario": scenario, "method": method, "driver": "offline",
               **summarize(records, wall, spec.ttft_bound_s, spec.itl_bound_ms), **trace.summary(),
               "peak_gpu_gib": peak_gpu_bytes() / 2**30, "shadowkv": _shadowkv(engine)}
        row["request_records"] = [r.to_json() if args.events else _brief(r) for r in records]
        return row
    finally:
        engine.close()


def _shadowkv(engine: LLMEngine) -> dict | None:
    return None if engine.shadowkv is None else vars(engine.shadowkv)


def _brief(record) -> dict:
    return {"request_id": record.request_id, "sent_s": record.sent_s, "prompt_tokens": record.prompt_tokens,
            "output_tokens": record.output_tokens, "ttft_s": record.ttft_s, "end_to_end_s": record.end_to_end_s,
            "finish_reason": record.finish_reason, "error": record.error}


def progress(scenario: str, method: str, workload: list):
    """A tqdm bar over the run's requests if tqdm is installed, else None (the run prints nothing per request)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=sum(len(c.turns) for c in workload), desc=f"{scenario} {method}", file=sys.stderr)


