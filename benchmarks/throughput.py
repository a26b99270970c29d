"""Decode throughput and latency at long context: our dense path, ShadowKV and Hugging Face transformers, random
weights of a real geometry (Llama-3.1-8B by default), against DESIGN.md's performance model.

Per context: each engine is sized by the memory model for its largest batch (ShadowKV: host memory included); one
prompt is prefilled (TTFT: prefill of one sequence on an idle engine, ShadowKV's factorisation, landmarks, outliers
and host offload included), then its whole cache state is copied into the other sequences of the batch (a benchmark
shortcut: every sequence holds the same prompt, so every sequence selects the same chunks) and the batch decodes a
fixed number of steps at each batch size of the sweep (clones added as the batch grows). Step time = inter-token
latency of every sequence; tokens/s = batch / step time. The per-step breakdown comes from torch.profiler (device time
per kernel group). Ceilings are measured in the same run (device-to-device copy, pinned host-to-device copy).

    PYTHONPATH=. python -m benchmarks.throughput [--contexts 32768 61440 122880] [--methods dense shadowkv hf]
    (as a module: run as a script, benchmarks/kernels.py would shadow the kernels package)

Methods (METHODS): dense, dense_fp8 (EngineConfig.kv_cache_dtype fp8), shadowkv, shadowkv_fp8 (fp8 host values),
shadowkv_fp8lm (fp8 values and fp8 landmarks, ShadowKVConfig.landmark_format),
shadowkv[_fp8|_fp8lm][_mean|_rebuild|_rescore][_tiered][_pipelined]
(_mean: the paper's mean landmarks, ShadowKVConfig.landmark_kind "mean", where the default is bounds; _rebuild:
ShadowKVConfig.landmark_rebuild; _rescore: ShadowKVConfig.rescore at RESCORE;
_tiered: ShadowKVConfig.device_value_share from memory_model.best_device_value_share for the context and the
run's memory, so the device memory a host-bound batch leaves over holds values; _pipelined: Decoder.forward_halves),
hf (its dynamic cache), hf_static (its static cache; the ratios to HF take the faster of the two, and the ratios
to dense the faster of dense and dense_fp8); each
engine method with the suffix _eager runs without CUDA graphs, and with _sync without async decode
(EngineConfig.async_decode), at the batches that compare with it (8 and its largest).

--tensor-parallel N runs each engine as one replica of N GPUs (engine/tensor_parallel.py): it is sized, and its floor
taken, by one rank's geometry and ShadowKV config (parallel.rank_spec, rank_shadowkv), since every rank holds the same
share and the ranks step together; --host-gib is then each rank's, and no step breakdown is profiled (the profiler
sees rank 0's process alone).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks import hf_baseline, step_breakdown
from benchmarks.kernels import ceilings
from benchmarks.memory_model import non_torch_gpu_bytes
from benchmarks.report import RESULTS, print_table, write_json
from shadowkv_core import EngineConfig, LLMEngine, SamplingParams, ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.engine.tensor_parallel import TensorParallelEngine, new_engine
from shadowkv_core.models.geometry import LLAMA_31_8B, TINY, TINY_SHADOWKV, model_spec, write_config
from shadowkv_core.parallel import rank_shadowkv
from shadowkv_core.perf_model import dense_floor_s, infinite_memory_tok_s, shadowkv_floor_s

ENGINE_METHODS = ("dense", "dense_fp8", "shadowkv", "shadowkv_fp8", "shadowkv_pipelined", "shadowkv_fp8_pipelined",
                  "shadowkv_tiered_pipelined", "shadowkv_fp8_tiered_pipelined", "shadowkv_fp8lm_pipelined",
                  "shadowkv_fp8lm_tiered", "shadowkv_fp8lm_tiered_pipelined", "shadowkv_fp8lm_mean_tiered_pipelined",
                  "shadowkv_fp8lm_rebuild_tiered_pipelined", "shadowkv_fp8lm_rescore_tiered_pipelined")
RESCORE = 4  # a _rescore method's candidate factor (ShadowKVConfig.rescore)
SYNC_METHODS = tuple(f"{m}_sync" for m in ENGINE_METHODS)
METHODS = (*ENGINE_METHODS, *(f"{m}_eager" for m in ENGINE_METHODS), *SYNC_METHODS, "hf", "hf_static")
COLUMNS = ["context", "method", "batch", "decode_tok_s", "ttft_s", "itl_p50_ms", "itl_p99_ms", "peak_gpu_gib",
           "peak_host_gib", "hit_rate", "device_fetch_fraction", "x_floor"]


def geometry_config(name: str, max_len: int) -> dict:
    """A Hugging Face config of the named geometry (Llama architecture and RoPE; mm.PRESETS' sizes), positions up
    to max_len. Only the sizes matter for speed."""
    if name == "tiny":
        return {**TINY, "max_position_embeddings": max(max_len, 2048)}
    g = mm.PRESETS[name]
    return {**LLAMA_31_8B, "num_hidden_layers": g.num_layers, "num_attention_heads": g.num_q_heads,
            "num_key_value_heads": g.num_kv_heads, "head_dim": g.head_dim, "hidden_size": g.hidden_size,
            "intermediate_size": g.intermediate_size, "vocab_size": g.vocab_size,
            "max_position_embeddings": max(LLAMA_31_8B["max_position_embeddings"], max_len)}


# ---- engines --------------------------------------------------------------------------------------------------
def method_setup(method: str, cfg: ShadowKVConfig, tier_share: float = 0.0) -> tuple[ShadowKVConfig | None, dict]:
    """(the method's ShadowKV config, None for full attention; its engine options) from the run's ShadowKV config;
    a _mean method keeps the paper's mean landmarks, a _rebuild one moves rebuilt keys onto their landmarks
    (landmark_rebuild), a _rescore one rescores the landmarks' RESCORE·k candidates by their rebuilt keys (rescore), a
    _tiered one tier_share of each sequence's values on the
    device; _eager runs without CUDA graphs, _sync without async decode (each step read back before the next is
    launched)."""
    sync = method.endswith("_sync")
    method = method.removesuffix("_sync")
    base = method.removesuffix("_eager")
    pipelined = base.endswith("_pipelined")
    base = base.removesuffix("_pipelined")
    tiered = base.endswith("_tiered")
    base = base.removesuffix("_tiered")
    rescore = base.endswith("_rescore")
    base = base.removesuffix("_rescore")
    rebuild = base.endswith("_rebuild")
    base = base.removesuffix("_rebuild")
    mean = base.endswith("_mean")
    base = base.removesuffix("_mean")
    shadow = {"dense": None, "dense_fp8": None, "hf": None, "hf_static": None, "shadowkv": cfg,
              "shadowkv_fp8": dataclasses.replace(cfg, value_format="fp8"),
              "shadowkv_fp8lm": dataclasses.replace(cfg, value_format="fp8", landmark_format="fp8")}[base]
    if shadow is not None:
        shadow = dataclasses.replace(shadow, device_value_share=tier_share if tiered else 0.0,
                                     landmark_kind="mean" if mean else shadow.landmark_kind,
                                     landmark_rebuild=rebuild or shadow.landmark_rebuild,
                                     rescore=RESCORE if rescore else shadow.rescore)
    return shadow, {"cuda_graphs": not method.endswith("_eager"), "pipeline_decode": pipelined,
                    "pipeline_min_batch": 2, "async_decode": False if sync else "auto",
                    "kv_cache_dtype": "fp8" if base == "dense_fp8" else "auto"}


def method_geometry(g: mm.Geometry, method: str) -> mm.Geometry:
    """The geometry the memory model sizes a method's engine by: its dense cache's kv_cache_dtype."""
    return dataclasses.replace(g, kv_cache_dtype=method_setup(method, ShadowKVConfig())[1]["kv_cache_dtype"])


def build_engine(model: str, g: mm.Geometry, cfg: ShadowKVConfig | None, context: int, batch: int, max_new: int,
                 device: str, tp: int = 1, **options) -> LLMEngine | TensorParallelEngine:
    """An engine whose pools hold exactly `batch` sequences of context + max_new tokens (the memory model's sizes);
    with tp > 1 a replica of tp ranks, g being one rank's geometry and cfg the replica's ShadowKV config."""
    rank_cfg = rank_shadowkv(cfg, tp)
    if cfg is None:
        gpu, host = batch * mm.engine_seq_bytes(g, None, context, max_new).gpu, None
    else:
        gpu, host_bytes = mm.pool_budget_for(g, rank_cfg, batch, context, max_new)
        host = host_bytes / mm.GIB
    return new_engine(EngineConfig(model=model, device=device, dtype=str(dtype_for(device)).removeprefix("torch."),
                                   load_format="dummy", shadowkv=cfg, max_num_seqs=batch,
                                   max_model_len=context + max_new, max_prefill_tokens=context,
                                   gpu_cache_gib=gpu / mm.GIB, host_cache_gib=host, tensor_parallel_size=tp,
                                   **options))


def dtype_for(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def warm_up(engine: LLMEngine, context: int) -> None:
    """Compile and cache every kernel on a shorter prompt (long enough to be kept in shadows), then free it."""
    prompt = [i % engine.spec.vocab_size for i in range(min(context, 8192) - 1)]
    engine.add_request("warm-up", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def prefill(engine: LLMEngine, prompt: list[int], max_new: int, device: str, temperature: float = 0.0,
            top_p: float = 1.0) -> float:
    """Seconds to the first token of one request on an idle engine (greedy unless a temperature is given)."""
    sync(device)
    start = time.perf_counter()
    engine.add_request("r0", prompt, SamplingParams(max_tokens=max_new, temperature=temperature, top_p=top_p, seed=0,
                                                    ignore_eos=True))
    while not engine.requests["r0"].output_token_ids:
        engine.step()
    sync(device)
    return time.perf_counter() - start


def time_decode(engine: LLMEngine, steps: int, warmup: int) -> tuple[list[float], list[dict]]:
    """Step times (s) and engine stats of `steps` decode steps of the whole running batch, after `warmup` (>= 1)
    steps. A step is timed from the return of the step() before it to its own, as a server runs them (its stats
    read included): no sync in between, so that a step launched while the one before it runs (async decode)
    overlaps it as it would serving. A sync before the first timed step would drain that overlap and time the step
    after it at its host time alone."""
    assert warmup >= 1, "the first timed step needs one before it"
    times, stats = [], []
    last = 0.0
    for i in range(warmup + steps):
        engine.step()
        now = time.perf_counter()
        if i >= warmup:
            times.append(now - last)
            stats.append(engine.stats())
        last = now
    return times, stats


def fetch_figures(stats: list[dict]) -> dict:
    """The share of the timed steps' fetched chunks read from the device value region instead of the host
    (device_value_share)."""
    fetched = sum(s.get("chunks_fetched", 0) for s in stats)
    if not fetched:
        return {}
    return {"device_fetch_fraction": sum(s.get("chunks_from_device", 0) for s in stats) / fetched}


def random_prompt(vocab_size: int, context: int) -> list[int]:
    return torch.randint(0, vocab_size, (context,), generator=torch.Generator().manual_seed(context)).tolist()


def percentile(values: list[float], q: float) -> float:
    return float(torch.tensor(values, dtype=torch.float64).quantile(q))


# ---- one method at one context --------------------------------------------------------------------------------
def row_for(run: dict, method: str, batch: int, times: list[float], ttft: float, peak_gpu: int, peak_host: int,
            hit_rate: float | None, floor_s: float) -> dict:
    step = percentile(times, 0.5)
    return {"device": run["device"], "model": run["model"], "context": run["context"], "method": method,
            "batch": batch, "decode_tok_s": batch * len(times) / sum(times), "ttft_s": ttft,
            "itl_p50_ms": 1e3 * step, "itl_p99_ms": 1e3 * percentile(times, 0.99), "steps": len(times),
            "peak_gpu_gib": peak_gpu / mm.GIB, "peak_host_gib": peak_host / mm.GIB, "hit_rate": hit_rate,
            "floor_ms": 1e3 * floor_s, "x_floor": step / floor_s}


def run_engine(run: dict, method: str, batches: list[int], profile_at: set[int]) -> list[dict]:
    """Prefill one prompt, clone it up the batch sweep, time decode at each batch (and profile where asked)."""
    g, context, device, args = method_geometry(run["geometry"], method), run["context"], run["device_kind"], run["args"]
    cfg, options = method_setup(method, run["shadowkv"], run["tier_share"])
    tp = args.tensor_parallel
    engine = build_engine(run["config_dir"], g, cfg, context, max(batches), args.max_new_tokens, device, tp, **options)
    cfg = rank_shadowkv(cfg, tp)  # the floor is one rank's
    try:
        warm_up(engine, context)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        prompt = random_prompt(g.vocab_size, context)
        ttft = prefill(engine, prompt, args.max_new_tokens, device, args.temperature, args.top_p)
        rows = []
        for batch in batches:
            while len(engine.requests) < batch:
                engine.fork("r0", f"r{len(engine.requests)}")
            times, stats = time_decode(engine, args.steps, args.warmup_steps)
            hit = sum(s.get("hit_rate", 1.0) for s in stats) / len(stats) if cfg is not None else None
            floor = (dense_floor_s(g, context, batch, run["copy_bps"]) if cfg is None else
                     shadowkv_floor_s(g, cfg, context, batch, hit, run["copy_bps"], run["h2d_bps"]))
            peak_gpu = torch.cuda.max_memory_allocated() + non_torch_gpu_bytes() if device == "cuda" else 0
            row = row_for(run, method, batch, times, ttft, peak_gpu, engine.stats()["host_bytes_in_use"], hit, floor)
            row["engine_batch"] = max(batches)  # pools sized for this batch: peak GPU bytes are the engine's
            if device == "cuda":  # cudaMalloc calls that failed and were retried after freeing the allocator's cache
                row["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            if args.temperature:
                row["sampling"] = {"temperature": args.temperature, "top_p": args.top_p}
            if cfg is not None and cfg.device_value_share:
                row["device_value_share"] = cfg.device_value_share
            row.update(fetch_figures(stats) if cfg is not None else {})
            if tp > 1:
                row["tensor_parallel_size"] = tp
            elif batch in profile_at and args.profile_steps:
                row["breakdown_ms"] = step_breakdown.profile_steps(engine, args.profile_steps, device == "cuda")
            rows.append(row)
            print_table([row], COLUMNS)
        return rows
    finally:
        engine.close()
        del engine
        release(device)


def run_hf(run: dict, method: str, max_batch: int) -> list[dict]:
    """Hugging Face transformers: `hf` with its dynamic cache, `hf_static` with its static cache."""
    g, context, device, args = run["geometry"], run["context"], run["device_kind"], run["args"]
    model = hf_baseline.load(run["config_dir"], dtype_for(device), device)
    try:
        prompt = random_prompt(g.vocab_size, context)
        hf_baseline.prefill(model, prompt[:min(context, 8192) - 1], device)  # warm-up, as the engines have
        ttft, token, prefix = hf_baseline.prefill(model, prompt, device)
        release(device)
        results = hf_baseline.sweep(model, prefix, token, max_batch, args.steps, args.warmup_steps, device,
                                    static=method == "hf_static")
        rows = [row_for(run, method, b, times, ttft, peak, 0, None, dense_floor_s(g, context, b, run["copy_bps"]))
                for b, times, peak in results]
        print_table(rows, COLUMNS)
        return rows
    finally:
        del model
        release(device)


def run_isolated(fn, *args):
    """fn(*args) in a fresh process, its exception raised here. An engine's device memory then goes back to the
    driver with its process, its CUDA graphs' pool included: on an H200, a second _tiered engine built in the process
    of a first ran out of memory, the first's 36 GiB still reserved (tier_share_122k.json's failures)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def sweep_batches(largest: int, *extra: int) -> list[int]:
    """Powers of two below `largest`, the extra batches below it, and `largest`."""
    powers = {2 ** i for i in range(largest.bit_length()) if 2 ** i < largest}
    return sorted(powers | {b for b in extra if b < largest} | {largest})


# ---- summary, plot, main --------------------------------------------------------------------------------------
def summarize(rows: list[dict], copy_bps: float, geometries: dict) -> list[dict]:
    """Per model and context: the best row of each method (most tokens/s), and the ratios the acceptance names."""
    out = []
    for model, context in sorted({(r["model"], r["context"]) for r in rows}):
        best = {}
        for r in rows:
            if (r["model"], r["context"]) == (model, context) and \
                    r["decode_tok_s"] > best.get(r["method"], {}).get("decode_tok_s", 0):
                best[r["method"]] = r
        s = {"model": model, "context": context,
             "infinite_memory_tok_s": infinite_memory_tok_s(geometries[model], context, copy_bps)}
        for method, r in best.items():
            s[f"{method}_batch"], s[f"{method}_tok_s"] = r["batch"], r["decode_tok_s"]
            if r.get("device_value_share"):  # a _tiered method swept over shares: the share of its best row
                s[f"{method}_device_value_share"] = r["device_value_share"]
        sk = best.get("shadowkv")
        dense = max((best[m] for m in ("dense", "dense_fp8") if m in best), key=lambda r: r["decode_tok_s"],
                    default=None)
        if dense:
            s["dense_method"] = dense["method"]
        hf = max((best[m] for m in ("hf", "hf_static") if m in best), key=lambda r: r["decode_tok_s"], default=None)
        fastest = max((r for m, r in best.items() if m.startswith("shadowkv") and not m.endswith("_eager")),
                      key=lambda r: r["decode_tok_s"], default=None)
        if fastest and dense:
            s["best_shadowkv_method"] = fastest["method"]
            s["best_shadowkv_over_dense"] = fastest["decode_tok_s"] / dense["decode_tok_s"]
        if fastest and hf:
            s["best_shadowkv_over_hf"] = fastest["decode_tok_s"] / hf["decode_tok_s"]
        if fastest:
            s["best_shadowkv_over_infinite"] = fastest["decode_tok_s"] / s["infinite_memory_tok_s"]
        fp8 = best.get("shadowkv_fp8")
        if fp8 and dense:
            s["shadowkv_fp8_over_dense"] = fp8["decode_tok_s"] / dense["decode_tok_s"]
        if fp8 and sk:
            s["fp8_batch_over_bf16"] = fp8["batch"] / sk["batch"]
        here = {}  # method -> batch -> row, at this model and context
        for r in rows:
            if (r["model"], r["context"]) == (model, context):
                here.setdefault(r["method"], {})[r["batch"]] = r
        for method in ENGINE_METHODS:  # CUDA graphs against eager, async decode against sync, at the largest batch
            for suffix, name in (("_eager", "graph_speedup"), ("_sync", "async_speedup")):
                without, with_ = here.get(method + suffix, {}), here.get(method, {})
                if common := set(without) & set(with_):
                    b = max(common)
                    s[f"{method}_{name}_at_{b}"] = with_[b]["decode_tok_s"] / without[b]["decode_tok_s"]
        if sk and dense:
            s["shadowkv_over_dense"] = sk["decode_tok_s"] / dense["decode_tok_s"]
            s["prefill_overhead"] = sk["ttft_s"] / dense["ttft_s"] - 1
            s["dense_x_roofline"] = dense["x_floor"]
        if sk and hf:
            s["shadowkv_over_hf"] = sk["decode_tok_s"] / hf["decode_tok_s"]
        if sk:
            s["shadowkv_over_infinite"] = sk["decode_tok_s"] / s["infinite_memory_tok_s"]
        out.append(s)
    return out


def plot(rows: list[dict], summary: list[dict], path: Path) -> Path | None:
    """Throughput against batch, one panel per context; the infinite-memory full-attention bound dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib missing: no plot (replot from the JSON with --replot)", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, len(summary), figsize=(4.2 * len(summary), 3.6), squeeze=False)
    for ax, s in zip(axes[0], summary):
        for i, method in enumerate(METHODS):
            style = "osDvP^"[i % 6] + (":" if method.endswith(("_eager", "_sync")) else "-")
            pts = sorted((r["batch"], r["decode_tok_s"]) for r in rows
                         if (r["model"], r["context"], r["method"]) == (s["model"], s["context"], method))
            if pts:
                ax.plot(*zip(*pts), style, label=method)
        ax.axhline(s["infinite_memory_tok_s"], ls="--", c="gray", label="full attention, infinite memory")
        ax.set(title=f"{s['model']}, {s['context']:,} tokens", xlabel="batch", ylabel="decode tokens/s", xscale="log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def progress(tasks: list):
    """tqdm if it is installed, else one stderr line per task."""
    try:
        from tqdm import tqdm

        return tqdm(tasks, desc="throughput", file=sys.stderr)
    except ImportError:
        return (print(f"[{i + 1}/{len(tasks)}] {t}", file=sys.stderr) or t for i, t in enumerate(tasks))


def merge_decode_step(path: Path, rows: list[dict], context: int = 122880, batch: int = 8) -> dict | None:
    """The whole ShadowKV decode step (issue 5's `decode_step` row) into kernels.json, replacing an older one: the
    CUDA-graph ShadowKV method nearest its floor at this context and batch, with the eager one beside it."""
    found = [r for r in rows if r["method"].startswith("shadowkv") and not r["method"].endswith("_eager")
             and (r["context"], r["batch"]) == (context, batch)]
    if not found or not path.is_file():
        return None
    r = min(found, key=lambda x: x["x_floor"])
    row = {"kernel": "decode_step", "method": r["method"], "device": r["device"], "time_ms": r["itl_p50_ms"],
           "floor_ms": r["floor_ms"], "time_over_floor": r["x_floor"], "batch": batch, "context": context,
           "hit_rate": r["hit_rate"],
           "model": r["model"], "note": "whole step (all layers, weights, MLP, sampling), CUDA graphs, from "
                                         "benchmarks/throughput.py; floor per DESIGN.md at the measured hit rate"}
    eager = [x for x in rows if (x["method"], x["context"], x["batch"]) == ("shadowkv_eager", context, batch)]
    if eager:
        row["eager_ms"] = eager[0]["itl_p50_ms"]
    data = json.loads(path.read_text())
    data["rows"] = [x for x in data["rows"] if x.get("kernel") != "decode_step"] + [row]
    path.write_text(json.dumps(data, indent=1) + "\n")
    return row


def plan(method: str, dense_max: int, own_max: int) -> tuple[list[int], set[int]]:
    """Batches to time and those to profile: dense and HF up to their largest batch; ShadowKV's and dense_fp8 up to
    their own, through the dense largest batch and 8 (issue 5's decode step); an _eager method at 8 and its largest
    only."""
    if method.endswith("_eager"):
        return sorted({min(8, own_max), own_max}), set()
    if method.startswith(("shadowkv", "dense_fp8")):
        return sweep_batches(own_max, dense_max, 8), {dense_max, own_max, 8} - {0}
    return sweep_batches(dense_max), {dense_max} if method == "dense" else set()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b", choices=[*mm.PRESETS, "tiny"], help="geometry")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 61440, 122880])
    parser.add_argument("--methods", nargs="+", default=["dense", "shadowkv", "hf"], choices=METHODS)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
    parser.add_argument("--warmup-steps", type=int, default=2, help=">= 1: a timed step starts at the one before's end")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="steps under torch.profiler at the batches profiled (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="what each sequence reserves")
    parser.add_argument("--temperature", type=float, default=0.0, help="the requests' sampling (default: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-batch", type=int, default=1 << 20, help="cap on every batch (short runs)")
    parser.add_argument("--gpu-util", type=float, default=0.9, help="share of GPU memory the memory model may plan")
    parser.add_argument("--host-gib", type=float, default=None,
                        help="host budget of an engine, or of each rank (default 80%% of MemAvailable, shared by the "
                             "ranks)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="GPUs of one replica (engines only)")
    parser.add_argument("--tier-share", type=float, nargs="+", default=[None],
                        help="device_value_share of the _tiered methods, one run of each per value (default: the "
                             "memory model's best)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="each method (and share) in a fresh process (default: on CUDA)")
    parser.add_argument("--out", default="throughput.json", help="relative paths land in benchmarks/results/")
    parser.add_argument("--kernels-json", default=str(RESULTS / "kernels.json"),
                        help="where the decode_step row (ShadowKV, 122K, batch 8) is merged")
    parser.add_argument("--replot", default=None, help="only redraw the PNG from this JSON")
    args = parser.parse_args(argv)
    if args.warmup_steps < 1:
        parser.error("--warmup-steps must be >= 1 (a timed step is timed from the end of the step before it)")
    if args.tensor_parallel < 1 or (args.tensor_parallel > 1 and any(m.startswith("hf") for m in args.methods)):
        parser.error("--tensor-parallel: an integer >= 1, for our engines alone (Hugging Face runs on one GPU)")
    return args


def tier_share_for(g: mm.Geometry, method: str, cfg: ShadowKVConfig, gpu: int, host: int, context: int,
                   max_new: int, given: float | None) -> float:
    """A _tiered method's device_value_share: `given`, or the best for this context and memory (0 for the other
    methods)."""
    if "_tiered" not in method:
        return 0.0
    if given is not None:
        return given

    def held(c: ShadowKVConfig) -> int:
        return mm.capacity(g, c, gpu, host, [context], max_new)

    return mm.best_device_value_share(method_setup(method, cfg)[0], held)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.isolate = args.device == "cuda" if args.isolate is None else args.isolate
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        print(plot(data["rows"], data["summary"], Path(args.replot).with_suffix(".png")))
        return data
    cuda = args.device == "cuda"
    config_dir = write_config(geometry_config(args.model, max(args.contexts) + args.max_new_tokens))
    tp = args.tensor_parallel
    g = mm.Geometry.from_spec(model_spec(config_dir), dtype_for(args.device)).rank_share(tp)  # one rank's
    cfg = TINY_SHADOWKV if args.model == "tiny" else ShadowKVConfig()
    rank_cfg = rank_shadowkv(cfg, tp)
    copy_bps, h2d_bps = ceilings(args.device)
    gpu_total = int((torch.cuda.mem_get_info()[1] if cuda else 4 * mm.GIB) * args.gpu_util)
    host = int(args.host_gib * mm.GIB) if args.host_gib else int(mm.mem_available_bytes() * 0.8) // tp
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    rows, failures, summary = [], [], []
    out = Path(args.out) if Path(args.out).is_absolute() else RESULTS / args.out
    tasks = [(c, m, share) for c in args.contexts for m in args.methods
             for share in (args.tier_share if "_tiered" in m else [None])]
    for context, method, share in progress(tasks):
        tier_share = tier_share_for(g, method, rank_cfg, gpu_total, host, context, args.max_new_tokens, share)
        sized = ((g, None), (method_geometry(g, method), rank_shadowkv(method_setup(method, cfg, tier_share)[0], tp)))
        dense_max, own_max = (min(mm.capacity(geom, c, gpu_total, host, [context], args.max_new_tokens), args.max_batch)
                              for geom, c in sized)
        batches, profile_at = plan(method, dense_max, own_max)
        run = dict(device=device_name, model=args.model, context=context, geometry=g, shadowkv=cfg, args=args,
                   tier_share=tier_share,
                   config_dir=config_dir, device_kind=args.device, copy_bps=copy_bps, h2d_bps=h2d_bps)
        steps = len(batches) * (args.steps + args.warmup_steps) + len(profile_at) * args.profile_steps
        if not batches or batches[0] < 1 or steps >= args.max_new_tokens:
            failures.append({"context": context, "method": method, "error": f"batches {batches}, {steps} steps"})
            continue
        try:
            task = (run_hf, run, method, dense_max) if method.startswith("hf") else \
                (run_engine, run, method, batches, profile_at)
            rows += run_isolated(*task) if args.isolate else task[0](*task[1:])
        except Exception as exc:  # one failed configuration is recorded; the others still run
            failures.append({"context": context, "method": method, "tier_share": tier_share,
                             "error": f"{type(exc).__name__}: {exc}"})
            print(f"{context} {method} failed: {failures[-1]['error']}", file=sys.stderr)
        summary = summarize(rows, copy_bps, {**mm.PRESETS, args.model: g})
        path = write_json(out, rows, summary=summary, failures=failures, copy_gbps=copy_bps / 1e9,
                          h2d_gbps=h2d_bps / 1e9, gpu_plan_bytes=gpu_total, host_plan_bytes=host,
                          shadowkv=dataclasses.asdict(cfg), tensor_parallel_size=tp)
    png = plot(rows, summary, path.with_suffix(".png")) if rows else None
    decode_step = merge_decode_step(Path(args.kernels_json), rows) if args.model == "llama-3.1-8b" else None
    print(f"wrote {path}, {png}; decode_step row: {decode_step}")
    print_table(rows, COLUMNS)
    print_table(summary, list(dict.fromkeys(k for s in summary for k in s)))
    return {"rows": rows, "summary": summary, "failures": failures}


if __name__ == "__main__":
    main()
