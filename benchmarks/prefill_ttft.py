"""Time to first token of one long prompt on an idle engine, in one run: our engines (dense and ShadowKV methods of
benchmarks/throughput.py) by each prefill attention implementation (EngineConfig.prefill_attention), and Hugging
Face transformers with SDPA (its default attention; flash-attn is not installed), random weights of a real geometry.

Each row: the prompt's FLOPs (the linear layers at 2 per weight per token, causal attention at 4 per query-key pair
per head dim, the logits of one token), the achieved TFLOP/s and its share of `--ceiling-tflops` (the bf16 matrix
rate the device sustains); on CUDA, torch's peak memory over the prefill beside the memory model's prediction for the
engine (peak_allocated_gib, peak_reserved_gib, predicted_gib: weights, prefill workspace, decode logits, CUDA context
and pools); with `--profile-contexts`, one more prefill under torch.profiler gives the device time by group
(attention kernels, matrix multiplies by projection, the rest). Each configuration runs in a fresh process on
CUDA, the prefix cache off (every prefill cold), after a warm-up prompt.

    PYTHONPATH=. python -m benchmarks.prefill_ttft [--contexts 32768 122880] [--methods dense shadowkv_fp8lm hf]
        [--attentions sdpa triton cudnn]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import hf_baseline
from benchmarks.report import print_table, write_json
from benchmarks.throughput import (ENGINE_METHODS, build_engine, dtype_for, geometry_config, method_geometry,
                                   method_setup, prefill, random_prompt, release, run_isolated, warm_up)
from shadowkv_core import SamplingParams, ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.config import AUTO, PREFILL_ATTENTIONS
from shadowkv_core.models.geometry import TINY_SHADOWKV, model_spec, write_config

COLUMNS = ["context", "method", "attention", "ttft_s", "tflops", "of_ceiling", "profile_s"]
ATTENTION_KERNELS = ("flash", "fmha", "cudnn", "_prefill_kernel", "attention", "Attention", "sdpa")  # name parts
GEMM_KERNELS = ("gemm", "nvjet", "xmma", "cutlass")


def prompt_flops(g: mm.Geometry, tokens: int) -> dict:
    """FLOPs of one prompt's prefill by part: {"linear", "attention", "total"}."""
    q, kv = g.num_q_heads * g.head_dim, g.num_kv_heads * g.head_dim
    per_layer = g.hidden_size * (q + 2 * kv) + q * g.hidden_size + 3 * g.hidden_size * g.intermediate_size
    linear = 2 * per_layer * g.num_layers * tokens + 2 * g.hidden_size * g.vocab_size
    attention = 4 * g.num_q_heads * g.head_dim * tokens * (tokens + 1) // 2 * g.num_layers
    return {"linear": linear, "attention": attention, "total": linear + attention}


def device_time_by_group(run_once) -> dict[str, float]:
    """Seconds of device time by kernel group of one call of run_once under torch.profiler: attention, matrix
    multiplies, and the rest (norms, RoPE, SwiGLU, copies, ShadowKV's factorisation and offload)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_once()
        torch.cuda.synchronize()
    groups: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        group = "attention" if any(k in event.name for k in ATTENTION_KERNELS) else \
            "gemm" if any(k in event.name.lower() for k in GEMM_KERNELS) else "other"
        groups[group] = groups.get(group, 0.0) + event.device_time_total / 1e6
    return groups


def run_engine(run: dict, method: str, attention: str) -> dict:
    g, context, device, args = method_geometry(run["geometry"], method), run["context"], run["device"], run["args"]
    cfg, options = method_setup(method, run["shadowkv"])
    engine = build_engine(run["config_dir"], g, cfg, context, 1, 8, device, prefill_attention=attention,
                          enable_prefix_caching=False, **options)
    try:
        warm_up(engine, context)
        prompt = random_prompt(g.vocab_size, context)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        row = {"context": context, "method": method, "attention": attention,
               "ttft_s": prefill(engine, prompt, 2, device)}
        if device == "cuda":  # the memory model's whole GPU need (CUDA context included) beside torch's peak
            fixed = mm.fixed_gpu_bytes(g, cfg, context, engine.config.prefill_chunk_tokens)
            row.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / mm.GIB,
                       peak_reserved_gib=torch.cuda.max_memory_reserved() / mm.GIB,
                       predicted_gib=fixed / mm.GIB + engine.config.gpu_cache_gib)
        while engine.has_unfinished_requests():
            engine.step()
        if context in args.profile_contexts and device == "cuda":
            def once():
                engine.add_request("p", prompt[::-1], SamplingParams(max_tokens=1, ignore_eos=True))
                while engine.has_unfinished_requests():
                    engine.step()
            row["profile_s"] = device_time_by_group(once)
        return row
    finally:
        engine.close()
        del engine
        release(device)


def run_hf(run: dict) -> dict:
    g, context, device = run["geometry"], run["context"], run["device"]
    model = hf_baseline.load(run["config_dir"], dtype_for(device), device)
    try:
        prompt = random_prompt(g.vocab_size, context)
        hf_baseline.prefill(model, prompt[:min(context, 8192) - 1], device)  # warm-up, as the engines have
        seconds, _, _ = hf_baseline.prefill(model, prompt, device)
        row = {"context": context, "method": "hf", "attention": "sdpa", "ttft_s": seconds}
        if context in run["args"].profile_contexts and device == "cuda":
            row["profile_s"] = device_time_by_group(lambda: model(input_ids=torch.tensor([prompt], device=device),
                                                                  use_cache=True, logits_to_keep=1))
        return row
    finally:
        del model
        release(device)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", choices=[*mm.PRESETS, "tiny"], help="geometry")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 122880])
    parser.add_argument("--methods", nargs="+", default=["dense", "shadowkv_fp8lm", "hf"],
                        choices=[*ENGINE_METHODS, "shadowkv_fp8lm", "hf"])
    parser.add_argument("--attentions", nargs="+", default=[AUTO], choices=[AUTO, *PREFILL_ATTENTIONS],
                        help="EngineConfig.prefill_attention values to time")
    parser.add_argument("--profile-contexts", type=int, nargs="*", default=[])
    parser.add_argument("--ceiling-tflops", type=float, default=790.0, help="the device's sustained bf16 matrix rate")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="prefill_ttft.json", help="relative paths land in benchmarks/results/")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    config_dir = write_config(geometry_config(args.model, max(args.contexts) + 8))
    g = mm.Geometry.from_spec(model_spec(config_dir), dtype_for(args.device))
    cfg = TINY_SHADOWKV if args.model == "tiny" else ShadowKVConfig()
    attentions = [a for a in args.attentions if a != "cudnn" or cuda]
    rows, failures = [], []
    start = time.time()
    for context in args.contexts:
        run = dict(context=context, geometry=g, shadowkv=cfg, args=args, config_dir=config_dir, device=args.device)
        flops = prompt_flops(g, context)
        for method in args.methods:
            for attention in (["sdpa"] if method == "hf" else attentions):
                task = (run_hf, run) if method == "hf" else (run_engine, run, method, attention)
                try:
                    row = run_isolated(*task) if cuda else task[0](*task[1:])
                except Exception as exc:  # one failed configuration is recorded; the others still run
                    failures.append({"context": context, "method": method, "attention": attention,
                                     "error": f"{type(exc).__name__}: {exc}"})
                    print(f"{context} {method} {attention} failed: {failures[-1]['error']}", file=sys.stderr)
                    continue
                row.update(device=torch.cuda.get_device_name() if cuda else "cpu", model=args.model,
                           flops=flops, tflops=flops["total"] / row["ttft_s"] / 1e12)
                row["of_ceiling"] = row["tflops"] / args.ceiling_tflops
                rows.append(row)
                print_table([row], COLUMNS)
        for row in rows:
            hf = next((r for r in rows if r["method"] == "hf" and r["context"] == row["context"]), None)
            if hf is not None and row is not hf:
                row["over_hf"] = row["ttft_s"] / hf["ttft_s"]
        path = write_json(args.out, rows, failures=failures, ceiling_tflops=args.ceiling_tflops,
                          seconds=time.time() - start)
    print(f"wrote {path}")
    print_table(rows, [*COLUMNS[:-1], "over_hf"])
    return rows


if __name__ == "__main__":
    main()
