"""Benchmark of prefill attention, one layer at Llama-3.1-8B geometry (32 query heads, 8 KV heads, head dim 128,
bf16): a prompt's causal attention by each implementation the engine can run (EngineConfig.prefill_attention,
through shadowkv_core.attention.chunk_attention), in two forms:
  chunked  the prompt in chunks of `--chunk` queries, each against the keys up to its end (a suffix after a cached
           prefix, or a prefill sliced across steps, is such a chunk)
  whole    the whole prompt in one call (the engine's form on CUDA in half precision: attention.prefill_attention_ref)
Implementations:
  sdpa        SDPA: a square causal block (a whole prompt) by its flash kernel, a chunk with a causal_lower_right bias
  sdpa_split  SDPA's flash kernel on the keys before the chunk and on its causal diagonal, merged by log-sum-exp
  cudnn       the same split by SDPA's cuDNN kernel (CUDA only)
  triton      kernels/prefill_attention.py at its default launch; `triton_bM_nN_wW_sS` rows try other launches
              (`--triton-launches`), whole prompts only
Each is first checked against shadowkv_core.attention.prefill_chunks_attention_ref on the first and last rows of
the prompt's first and last chunks; then timed (median, triton.testing.do_bench) and the prompt's attention FLOPs
over the time give TFLOP/s.

    PYTHONPATH=. python -m benchmarks.prefill_attention [--out prefill_attention.json]
    (as a module: run as a script, this file would shadow the kernels package)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton

from benchmarks.report import print_table, write_json
from kernels.prefill_attention import prefill_attention
from shadowkv_core.attention import chunk_attention, prefill_chunks_attention_ref
from shadowkv_core.config import PREFILL_ATTENTIONS

TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}  # (atol, rtol), the kernel tests' own
DEFAULT_LAUNCHES = ["128,128,8,3", "128,128,8,2", "128,64,4,3", "64,64,4,3", "128,128,4,3"]


def bench(fn) -> float:
    """Median milliseconds of fn: triton.testing.do_bench on CUDA, a few wall-clock calls elsewhere (a smoke run)."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def chunk_bounds(prompt: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, prompt)) for s in range(0, prompt, chunk)]


def attention_flops(s: int, e: int, num_q_heads: int, head_dim: int) -> int:
    """Two matmuls of 2 FLOPs per multiply-add over the (query, key) pairs a causal chunk [s, e) computes."""
    n = e - s
    return 4 * num_q_heads * head_dim * (n * s + n * (n + 1) // 2)


def triton_launch(spec: str):
    """'block_m,block_n,num_warps,num_stages' -> (row name, attention function of (q, k, v, scale))."""
    bm, bn, w, s = (int(x) for x in spec.split(","))

    def attend(q, k, v, scale):
        cu_q, cu_k = torch.tensor([[0, q.shape[0]], [0, k.shape[0]]], dtype=torch.int32).to(q.device)
        return prefill_attention(q, k, v, cu_q, cu_k, q.shape[0], scale, block_m=bm, block_n=bn, num_warps=w,
                                 num_stages=s)
    return f"triton_b{bm}_n{bn}_w{w}_s{s}", attend


def max_error(attend, q, k, v, s: int, e: int, rows: int, scale: float) -> float:
    """Largest |out - reference| / (atol + rtol |reference|) over the chunk's first and last `rows` queries: <= 1
    passes. Each slice is itself a chunk (queries the last of their keys), so the reference takes it as is."""
    atol, rtol = TOLERANCES[q.dtype]
    out = attend(q[s:e], k[:e], v[:e], scale).float()
    worst = 0.0
    for lo, hi in ((s, min(s + rows, e)), (max(e - rows, s), e)):
        cu = torch.tensor([[0, hi - lo], [0, hi]], dtype=torch.int32, device=q.device)
        want, _ = prefill_chunks_attention_ref(q[lo:hi], k[:hi], v[:hi], cu[0], cu[1], scale)
        got = out[lo - s:hi - s]
        worst = max(worst, ((got - want.float()).abs() / (atol + rtol * want.float().abs())).max().item())
    return worst


def candidates(args, device: str) -> list[tuple[str, object, tuple[str, ...]]]:
    """(name, attend(q, k, v, scale), forms) of every implementation to time."""
    out = [(name, lambda q, k, v, scale, n=name: chunk_attention(q, k, v, scale, n), ("chunked", "whole"))
           for name in PREFILL_ATTENTIONS if name != "cudnn" or device == "cuda"]
    return out + [(*triton_launch(spec), ("whole",)) for spec in args.triton_launches]


def run_prompt(prompt: int, args, dtype, device) -> list[dict]:
    g = torch.Generator(device).manual_seed(prompt)
    q = torch.randn(prompt, args.q_heads, args.head_dim, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(prompt, args.kv_heads, args.head_dim, generator=g, device=device, dtype=dtype)
            for _ in range(2))
    scale = args.head_dim ** -0.5
    chunks = chunk_bounds(prompt, args.chunk)
    flops = sum(attention_flops(s, e, args.q_heads, args.head_dim) for s, e in chunks)
    rows = []
    for name, attend, forms in candidates(args, device):
        try:
            err = max(max_error(attend, q, k, v, s, e, args.check_rows, scale) for s, e in {chunks[0], chunks[-1]})
        except RuntimeError as exc:  # a backend this device or build lacks: a row that says so
            rows.append(dict(prompt=prompt, method=name, form="-", error=str(exc).splitlines()[0][:200]))
            continue
        if err > 1:
            raise SystemExit(f"{name} differs from the reference at prompt {prompt}: error {err:.3g} x tolerance")
        for form in forms:
            if form == "chunked":
                chunk_ms = [bench(lambda: attend(q[s:e], k[:e], v[:e], scale)) for s, e in chunks]
            else:
                chunk_ms = [bench(lambda: attend(q, k, v, scale))]
            total = sum(chunk_ms)
            rows.append(dict(prompt=prompt, method=name, form=form, chunk=args.chunk, chunks=len(chunk_ms),
                             time_ms=total, chunk_ms=chunk_ms, flops=flops, tflops=flops / total / 1e9,
                             error_over_tolerance=err))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="prefill_attention.json", help="relative paths land in benchmarks/results/")
    parser.add_argument("--prompts", type=int, nargs="+", default=[32 * 1024, 122_880])
    parser.add_argument("--chunk", type=int, default=8192, help="queries per chunk (EngineConfig.prefill_chunk_tokens)")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--check-rows", type=int, default=128, help="queries checked at each end of a chunk")
    parser.add_argument("--triton-launches", nargs="*", default=DEFAULT_LAUNCHES,
                        help="block_m,block_n,num_warps,num_stages of the Triton kernel to try on whole prompts")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # Triton's CPU interpreter gets bf16 wrong
    start = time.time()
    rows = [row for prompt in args.prompts for row in run_prompt(prompt, args, dtype, device)]
    path = write_json(args.out, rows, dtype=str(dtype), q_heads=args.q_heads, kv_heads=args.kv_heads,
                      head_dim=args.head_dim, chunk=args.chunk, seconds=time.time() - start)
    print(f"\n{path}: {dtype}, {args.q_heads}/{args.kv_heads} heads, head dim {args.head_dim}, chunks of {args.chunk}")
    print_table(rows, ["prompt", "method", "form", "time_ms", "tflops", "error_over_tolerance"])


if __name__ == "__main__":
    main()
