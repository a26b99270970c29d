"""Peak prefill temporaries against the memory model (`shadowkv_core.memory_model.prefill_workspace_bytes`), by engine
and by prefill path, random weights of a real geometry, one engine per method (prefix caching on, two slots: a
sliced case's prompt and the request decoding beside it).

Cases: `whole:N` (an N-token prompt on an idle engine: prefilled in one step), `sliced:N` (the same prompt while a
short request decodes, so that it prefills in `--slice-tflop` slices beside the decode steps), `suffix:P+N` (a P-token
prompt runs first and stays in the prefix cache; then the same P tokens and N new ones, of which only the N are
prefilled). Each case measures torch's peak allocated bytes from the request's arrival to its first token over what
was allocated just before (pools, weights, graphs and any cached prefix are already there), beside what the memory
model predicts for what was prefilled (a cached prefix is reused by whole pages: `hit_tokens`); `ratio` is
measured over predicted (above 1: the model under-counts). `reserved_gib`: what torch's caching allocator took from
the device for the case (its free blocks returned before each), the allocated peak plus its fragmentation.

    PYTHONPATH=. python -m benchmarks.prefill_workspace [--methods dense dense_fp8 shadowkv shadowkv_fp8lm]
        [--cases whole:32768 whole:122880 sliced:122880 suffix:120000+2048]

Without CUDA it runs the same cases on the CPU with the memory model's prediction only (no allocator to read): a
check that every case runs (`--model tiny`).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.report import print_table, write_json
from benchmarks.throughput import (ENGINE_METHODS, build_engine, dtype_for, geometry_config, method_geometry,
                                   method_setup, release, run_isolated, warm_up)
from shadowkv_core import SamplingParams, ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.models.geometry import TINY_SHADOWKV, model_spec, write_config

KINDS = ("whole", "sliced", "suffix")


def parse_case(text: str) -> tuple[str, int, int]:
    """'whole:N', 'sliced:N' or 'suffix:P+N' -> (kind, prefix tokens, new tokens)."""
    kind, _, size = text.partition(":")
    if kind not in KINDS or not size:
        raise argparse.ArgumentTypeError(f"case {text!r}: expected whole:N, sliced:N or suffix:P+N")
    prefix, _, new = size.rpartition("+")
    if (kind == "suffix") != bool(prefix) or not new.isdigit() or (prefix and not prefix.isdigit()):
        raise argparse.ArgumentTypeError(f"case {text!r}: expected whole:N, sliced:N or suffix:P+N")
    prefix_tokens, new_tokens = int(prefix or 0), int(new)
    if new_tokens < 1:
        raise argparse.ArgumentTypeError(f"case {text!r}: at least one new token")
    return kind, prefix_tokens, new_tokens


def _tokens(vocab_size: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run_to_first_token(engine, request_id: str, prompt: list[int]) -> None:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while request_id in engine.requests:
        engine.step()


def _measured(engine, request_id: str, prompt: list[int], cuda: bool) -> tuple[int, int] | None:
    """torch's peak allocated bytes over what was allocated when the request arrived, until its first token, and
    the device memory its allocator reserved for them (its cached free blocks returned first, so that the growth
    is the case's own: what it takes from the device, fragmentation included)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
    _run_to_first_token(engine, request_id, prompt)
    if not cuda:
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved() - base_reserved


def run_method(run: dict, method: str) -> list[dict]:
    g, device, args = method_geometry(run["geometry"], method), run["device"], run["args"]
    cuda = device == "cuda"
    cfg, options = method_setup(method, run["shadowkv"])
    cases = args.cases
    longest = max(max(p + n for _, p, n in cases), args.decode_prompt + args.decode_tokens)
    engine = build_engine(run["config_dir"], g, cfg, longest, 2, 8, device, enable_prefix_caching=True,
                          prefill_step_tflop=args.slice_tflop, **options)
    rows = []
    try:
        warm_up(engine, min(longest, 8192))
        chunk = engine.config.prefill_chunk_tokens
        for i, (kind, prefix, new) in enumerate(cases):
            start = time.perf_counter()
            prompt = _tokens(g.vocab_size, prefix + new, seed=1000 + i)
            if kind == "suffix":
                _run_to_first_token(engine, f"prefix-{i}", prompt[:prefix])  # cached when it finishes
            if kind == "sliced":
                engine.add_request(f"decode-{i}", _tokens(g.vocab_size, args.decode_prompt, seed=i),
                                   SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True))
                while not engine.requests[f"decode-{i}"].output_token_ids:
                    engine.step()
            hits = engine.stats().get("prefix_hit_tokens", 0)
            measured = _measured(engine, f"case-{i}", prompt, cuda)
            hits = engine.stats().get("prefix_hit_tokens", 0) - hits
            if kind == "sliced":
                engine.abort(f"decode-{i}")
            while engine.has_unfinished_requests():
                engine.step()
            engine.clear_prefix_cache()
            # what was prefilled: a cached prefix is reused by whole pages
            predicted = mm.prefill_workspace_bytes(g, cfg, prefix + new - hits, chunk, hits)
            row = {"method": method, "case": f"{kind}:{f'{prefix}+' if prefix else ''}{new}", "kind": kind,
                   "prefix_tokens": prefix, "new_tokens": new, "hit_tokens": hits, "predicted_gib": predicted / mm.GIB,
                   "seconds": round(time.perf_counter() - start, 1)}
            if measured is not None:
                allocated, reserved = measured
                row.update(measured_gib=allocated / mm.GIB, ratio=allocated / predicted,
                           reserved_gib=reserved / mm.GIB, reserved_ratio=reserved / predicted)
            rows.append(row)
            print_table([row], ["method", "case", "hit_tokens", "measured_gib", "reserved_gib", "predicted_gib",
                                "ratio", "seconds"])
        return rows
    finally:
        engine.close()
        del engine
        release(device)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", choices=[*mm.PRESETS, "tiny"], help="geometry")
    parser.add_argument("--methods", nargs="+", default=["dense", "dense_fp8", "shadowkv", "shadowkv_fp8lm"],
                        choices=[*ENGINE_METHODS, "shadowkv_fp8lm"])
    parser.add_argument("--cases", nargs="+", type=parse_case,
                        default=[parse_case(c) for c in ("whole:8192", "whole:32768", "whole:122880",
                                                         "sliced:122880", "suffix:120000+2048",
                                                         "suffix:98304+32768")])
    parser.add_argument("--slice-tflop", type=float, default=6.0, help="prefill_step_tflop of the sliced cases")
    parser.add_argument("--decode-prompt", type=int, default=1024, help="prompt tokens of the request decoding beside "
                        "a sliced case")
    parser.add_argument("--decode-tokens", type=int, default=4096,
                        help="max_tokens of the request decoding beside a sliced case (more than its steps)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="prefill_workspace.json", help="relative paths land in benchmarks/results/")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    longest = max(max(p + n for _, p, n in args.cases), args.decode_prompt + args.decode_tokens)
    config_dir = write_config(geometry_config(args.model, longest + 16))
    g = mm.Geometry.from_spec(model_spec(config_dir), dtype_for(args.device))
    cfg = TINY_SHADOWKV if args.model == "tiny" else ShadowKVConfig()
    rows, failures, start = [], [], time.time()
    for method in args.methods:
        run = dict(geometry=g, shadowkv=cfg, args=args, config_dir=config_dir, device=args.device)
        try:
            rows += run_isolated(run_method, run, method) if cuda else run_method(run, method)
        except Exception as e:  # noqa: BLE001 -- one method's failure (e.g. out of memory) is recorded, not fatal
            failures.append({"method": method, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            print(f"{method} failed: {failures[-1]['error']}", flush=True)
        path = write_json(args.out, rows, argv=sys.argv, device=torch.cuda.get_device_name() if cuda else "cpu",
                          model=args.model, failures=failures, seconds=round(time.time() - start, 1))
    print(f"\nwrote {path}")
    print_table(rows, ["method", "case", "measured_gib", "reserved_gib", "predicted_gib", "ratio", "reserved_ratio"])
    return rows


if __name__ == "__main__":
    main()
