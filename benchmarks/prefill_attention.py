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

`--short-queries` runs instead the case set "short queries over a long prefix" (a prefix-cache suffix prefill: each of
`--readers` sequences has its own cached prefix of `--prefix-keys` keys and `--short-query-counts` new queries, all in
one ragged launch of the Triton kernel): num_splits=1 against the automatic key split (the split count it chose in the
row); the unsplit kernel's outputs checked against the reference on the first reader's last `--check-rows` queries,
the split's against the unsplit kernel's on every query.

    PYTHONPATH=. python -m benchmarks.prefill_attention [--out prefill_attention.json]
    PYTHONPATH=. python -m benchmarks.prefill_attention --short-queries [--out prefill_attention_short_queries.json]
    (as a module: run as a script, this file would shadow the kernels package)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton

from benchmarks.report import print_table, write_json
from kernels.prefill_attention import choose_num_splits, prefill_attention
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


def run_short_queries(prefix: int, n_q: int, readers: int, args, dtype, device) -> list[dict]:
    """`readers` sequences of n_q queries after their own prefix of `prefix` keys, in one launch: rows for
    num_splits=1 and for the automatic split."""
    g = torch.Generator(device).manual_seed(prefix + n_q + readers)
    n_k = prefix + n_q
    q = torch.randn(readers * n_q, args.q_heads, args.head_dim, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(readers * n_k, args.kv_heads, args.head_dim, generator=g, device=device, dtype=dtype)
            for _ in range(2))
    cu_q, cu_k = (torch.arange(0, readers + 1, dtype=torch.int32, device=device) * n for n in (n_q, n_k))
    scale = args.head_dim ** -0.5
    flops = readers * attention_flops(prefix, n_k, args.q_heads, args.head_dim)
    auto = choose_num_splits(args.q_heads, readers, n_q, n_k, torch.device(device), num_sms=args.num_sms)

    def attend(num_splits):
        return prefill_attention(q, k, v, cu_q, cu_k, n_q, scale, max_seqlen_k=n_k, num_splits=num_splits,
                                 num_sms=args.num_sms)
    atol, rtol = TOLERANCES[dtype]
    lo = n_q - min(args.check_rows, n_q)  # the first reader's last queries, a chunk the reference takes as is
    cu = torch.tensor([[0, n_q - lo], [0, n_k]], dtype=torch.int32, device=device)
    want, _ = prefill_chunks_attention_ref(q[lo:n_q], k[:n_k], v[:n_k], cu[0], cu[1], scale)
    unsplit = attend(1).float()
    errors = {1: ((unsplit[lo:n_q] - want.float()).abs() / (atol + rtol * want.float().abs())).max().item(),
              None: ((attend(None).float() - unsplit).abs() / (atol + rtol * unsplit.abs())).max().item()}
    if max(errors.values()) > 1:
        raise SystemExit(f"prefix {prefix}, {n_q} queries, {readers} readers: num_splits=1 against the reference, "
                         f"the automatic split against num_splits=1, errors {errors} x tolerance")
    rows = []
    for method, num_splits in (("triton_splits1", 1), ("triton_auto", None)):
        ms = bench(lambda: attend(num_splits))
        rows.append(dict(prefix=prefix, queries=n_q, readers=readers, method=method,
                         num_splits=auto if num_splits is None else 1, time_ms=ms, flops=flops,
                         tflops=flops / ms / 1e9, error_over_tolerance=errors[num_splits]))
    for row in rows:
        row["speedup"] = rows[0]["time_ms"] / row["time_ms"]  # over num_splits=1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="relative paths land in benchmarks/results/ (default prefill_attention.json, "
                                      "prefill_attention_short_queries.json with --short-queries)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[32 * 1024, 122_880])
    parser.add_argument("--chunk", type=int, default=8192, help="queries per chunk (EngineConfig.prefill_chunk_tokens)")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--check-rows", type=int, default=128, help="queries checked at each end of a chunk")
    parser.add_argument("--triton-launches", nargs="*", default=DEFAULT_LAUNCHES,
                        help="block_m,block_n,num_warps,num_stages of the Triton kernel to try on whole prompts")
    parser.add_argument("--short-queries", action="store_true",
                        help="run only the case set 'short queries over a long prefix' (key splits)")
    parser.add_argument("--prefix-keys", type=int, nargs="+", default=[122_880, 32_768],
                        help="--short-queries: each reader's cached prefix")
    parser.add_argument("--short-query-counts", type=int, nargs="+", default=[50, 125, 400],
                        help="--short-queries: new queries per reader")
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 14, 32],
                        help="--short-queries: sequences in one launch, each with its own prefix")
    parser.add_argument("--num-sms", type=int, help="--short-queries: the SM count the automatic split assumes "
                                                    "(default the device's; off CUDA no split)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # Triton's CPU interpreter gets bf16 wrong
    start = time.time()
    if args.short_queries:
        rows = [row for prefix in args.prefix_keys for n_q in args.short_query_counts for readers in args.readers
                for row in run_short_queries(prefix, n_q, readers, args, dtype, device)]
        path = write_json(args.out or "prefill_attention_short_queries.json", rows, dtype=str(dtype),
                          q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                          seconds=time.time() - start)
        print(f"\n{path}: {dtype}, {args.q_heads}/{args.kv_heads} heads, head dim {args.head_dim}, "
              "short queries over a long prefix")
        print_table(rows, ["prefix", "queries", "readers", "method", "num_splits", "time_ms", "tflops", "speedup"])
        return
    rows = [row for prompt in args.prompts for row in run_prompt(prompt, args, dtype, device)]
    path = write_json(args.out or "prefill_attention.json", rows, dtype=str(dtype), q_heads=args.q_heads,
                      kv_heads=args.kv_heads, head_dim=args.head_dim, chunk=args.chunk, seconds=time.time() - start)
    print(f"\n{path}: {dtype}, {args.q_heads}/{args.kv_heads} heads, head dim {args.head_dim}, chunks of {args.chunk}")
    print_table(rows, ["prompt", "method", "form", "time_ms", "tflops", "error_over_tolerance"])


if __name__ == "__main__":
    main()
