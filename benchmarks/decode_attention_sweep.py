"""Sweep of the dense paged decode attention kernel (kernels/decode_attention.py) over its launches, for its bf16
pool and its fp8 pool (issue #29), in one run: Llama-3.1-8B geometry by default (32 query heads, 8 KV heads, head
dim 128), pages in a shuffled block table (`--page`, default each pool's engine default: 16 tokens for bf16, 64 for
fp8), every sequence `--context` keys, at each `--batch`.

Variants (VARIANTS): the bf16 pool (kernels.decode_attention); the fp8 pool with one scale per token and KV head,
stored (Hkv, rows), and values stored a page at a time (pages, Hkv, d, page), as the dense cache stores them
(kernels.paged_fp8_decode_attention). The fp8 kernel's other variants (per-page scales, e4m3 dots, keys-major dots,
token-major values) were measured and removed: docs/benchmarks.md, benchmarks/results/decode_attention_fp8_variants.json
and fp8_decode_experiments/.
Each variant's launches: block_n x programs per SM x num_warps at the kernel's default num_stages, then num_stages at
its best of those. Every launch is first checked against the reference (fp32, the variant's dequantised
pool) on the first `--check-seqs` sequences (max_err: max |difference| over max |reference|, at most TOLERANCE;
rel_err: the difference's norm over the reference's; err_vs_bf16: max_err against the bf16 pool's reference, what
the output loses to fp8 in all; a failure ends the run: SystemExit with the error), then timed (median,
triton.testing.do_bench). GB/s counts the bytes the step needs: keys, values and their scales, each read once. The
table printed last holds each variant's best launch at each batch; the JSON (written after every variant), every
launch.

    PYTHONPATH=. python -m benchmarks.decode_attention_sweep [--batch 8 13 --context 122880] [--out PATH]

Without CUDA it runs in Triton's interpreter (TRITON_INTERPRET=1, fp16, wall-clock times of one call: a check that
every variant runs, not a measurement), e.g. --batch 2 --context 40 --q-heads 4 --kv-heads 2 --head-dim 32
--block-n 16 --per-sm 1 --num-warps 4 --num-stages 2.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined
import triton  # noqa: E402
from triton.compiler.errors import CompilationError  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from benchmarks.report import print_table, write_json  # noqa: E402
from kernels.decode_attention import decode_attention, paged_fp8_decode_attention  # noqa: E402
from shadowkv_core.config import default_block_size  # noqa: E402
from shadowkv_core.shadowkv.batched_reference import dense_decode_attention_batched  # noqa: E402
from shadowkv_core.shadowkv.reference import quantize_values  # noqa: E402

VARIANTS = ("bf16", "fp8")
TOLERANCE = 2e-2  # max |difference| over max |reference| allowed: q's dtype rounds the dequantised keys and values


class Pools:
    """One batch's pools (rows, Hkv, d): bf16 keys and values, their fp8 copies with per-token scales, and the
    reference's inputs for the first sequences."""

    def __init__(self, args, batch: int, device: str, dtype: torch.dtype, page: int):
        g = torch.Generator(device=device).manual_seed(batch)
        Hkv, d, ctx = args.kv_heads, args.head_dim, args.context
        pages = -(-ctx // page)
        num_blocks = batch * pages
        self.page = page
        self.table = torch.randperm(num_blocks, device=device, generator=g).int().view(batch, pages)
        self.k, self.v = (torch.randn(num_blocks * page, Hkv, d, device=device, generator=g).to(dtype) for _ in "kv")
        self.q = torch.randn(batch, args.q_heads, d, device=device, generator=g).to(dtype)
        self.lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.fp8 = (quantize_values(self.k, 1), quantize_values(self.v, 1))  # scales (rows, Hkv)
        self.batch, self.ctx, self.Hkv, self.d = batch, ctx, Hkv, d
        self._bf16_reference: dict[int, torch.Tensor] = {}

    def attention(self, variant: str, **launch):
        """The variant's kernel over this batch's pool, at the launch given: a callable."""
        if variant == "bf16":
            return functools.partial(decode_attention, self.q, [(self.k.permute(1, 0, 2)[None],
                                     self.v.permute(1, 0, 2)[None], self.lens)], torch.zeros_like(self.lens),
                                     self.d ** -0.5, self.ctx, page_table=self.table, page_size=self.page, **launch)
        (k8, ks), (v8, vs) = self.fp8
        v_pages = v8.view(-1, self.page, self.Hkv, self.d).permute(0, 2, 3, 1).contiguous()  # the cache's layouts
        return functools.partial(paged_fp8_decode_attention, self.q, k8, v_pages, (ks.T.contiguous(),
                                 vs.T.contiguous()), self.lens, self.table, self.d ** -0.5, self.ctx, **launch)

    def reference(self, variant: str, n: int) -> torch.Tensor:
        """fp32 attention of the first n sequences over the variant's (dequantised) pool, on their pages only."""
        pages = self.table[:n].flatten().long()
        rows = (pages[:, None] * self.page + torch.arange(self.page, device=pages.device)).flatten()
        table = torch.arange(len(pages), dtype=torch.int32, device=pages.device).view(n, -1)
        if variant == "bf16":
            k, v, scales = self.k[rows].float(), self.v[rows].float(), None
        else:
            (k8, ks), (v8, vs) = self.fp8
            k, v, scales = k8[rows], v8[rows], (ks[rows], vs[rows])
        return dense_decode_attention_batched(self.q[:n].float(), k, v, table, self.lens[:n], self.page,
                                              self.d ** -0.5, scales=scales)

    def bf16_reference(self, n: int) -> torch.Tensor:
        """reference over the bf16 pool, which the fp8 ones quantise: what a variant's output loses to fp8."""
        if n not in self._bf16_reference:
            self._bf16_reference[n] = self.reference("bf16", n)
        return self._bf16_reference[n]

    def bytes_needed(self, variant: str) -> int:
        keys = self.batch * self.ctx * self.Hkv
        if variant == "bf16":
            return 2 * keys * self.d * self.k.element_size()
        return 2 * keys * self.d + 2 * 4 * keys


def _time(fn, args) -> float:
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _measure(pools: Pools, variant: str, expected: torch.Tensor, args, block_n: int, per_sm: int, num_warps: int,
             num_stages: int | None) -> dict:
    row = dict(variant=variant, batch=pools.batch, page=pools.page, block_n=block_n, per_sm=per_sm,
               num_warps=num_warps, num_stages=num_stages or "default")
    launch = dict(block_n=block_n, programs_per_sm=per_sm, num_warps=num_warps)
    fn = pools.attention(variant, **launch if num_stages is None else launch | dict(num_stages=num_stages))
    try:
        got = fn()[:len(expected)].float()
    except (OutOfResources, CompilationError, RuntimeError, AssertionError) as e:  # a launch the GPU cannot hold,
        # Triton's passes, or a block that does not cover whole pages
        print(f"{variant} batch {pools.batch} {row}: does not compile ({type(e).__name__}: {str(e)[:200]})")
        return dict(row, error=f"{type(e).__name__}: {str(e)[:200]}")
    diff = (got - expected).abs()
    err = diff.max().item() / expected.abs().max().item()  # the outputs' scale shrinks with the context
    tol = TOLERANCE
    if not err <= tol:  # NaN fails too
        raise SystemExit(f"{variant} {row}: differs from the reference on the first {len(expected)} sequences: max "
                         f"|diff| / max |ref| {err:.4g} > {tol} (max |ref| {expected.abs().max().item():.4g})")
    ms = _time(fn, args)
    exact = pools.bf16_reference(len(expected))
    return dict(row, ms=ms, gbps=pools.bytes_needed(variant) / ms / 1e6, max_err=err,
                rel_err=(diff.norm() / expected.norm()).item(),
                err_vs_bf16=(got - exact).abs().max().item() / exact.abs().max().item())


def best_launches(rows: list[dict]) -> list[dict]:
    """The fastest launch of each (variant, batch)."""
    best = {}
    for r in rows:
        key = (r["variant"], r["batch"])
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    return list(best.values())


def sweep(args, device: str, dtype: torch.dtype, save) -> list[dict]:
    """Every variant at every batch; save(rows) after each, so that a run cut short keeps what it measured."""
    rows, start = [], time.perf_counter()
    for batch in args.batch:
        for variant in args.variants:
            pools = Pools(args, batch, device, dtype, args.page or default_block_size("fp8" if variant == "fp8"
                                                                                       else "auto"))
            expected = pools.reference(variant, min(args.check_seqs, batch))
            measured = [_measure(pools, variant, expected, args, block_n, per_sm, warps, None)
                        for block_n in args.block_n for per_sm in args.per_sm for warps in args.num_warps]
            timed = [r for r in measured if "ms" in r]
            if timed:
                best = min(timed, key=lambda r: r["ms"])
                measured += [_measure(pools, variant, expected, args, best["block_n"], best["per_sm"],
                                      best["num_warps"], stages) for stages in args.num_stages]
            rows += measured
            save(rows)
            done = [r for r in measured if "ms" in r]
            if done:
                best = min(done, key=lambda r: r["ms"])
                print(f"{variant} batch {batch}: best {best['ms']:.3f} ms ({best['gbps']:.0f} GB/s) at block_n "
                      f"{best['block_n']}, {best['per_sm']}/SM, {best['num_warps']} warps, {best['num_stages']} "
                      f"stages ({time.perf_counter() - start:.0f} s in)", flush=True)
            del pools
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 13])
    parser.add_argument("--context", type=int, default=122_880)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=None, help="tokens a page (default: the engine's for the pool)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--block-n", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--per-sm", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--num-warps", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--num-stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--check-seqs", type=int, default=2, help="sequences checked against the reference")
    parser.add_argument("--warmup", type=int, default=10, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=30, help="do_bench repetitions, ms")
    parser.add_argument("--out", default="decode_attention_launches.json",
                        help="relative paths land in benchmarks/results/")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 is wrong
    start = time.perf_counter()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"

    def save(rows: list[dict]) -> Path:
        return write_json(args.out, rows, argv=sys.argv, device=name, context=args.context,
                          best=best_launches(rows), seconds=time.perf_counter() - start)

    rows = sweep(args, device, dtype, save)
    path = save(rows)
    print(f"\n{path} ({time.perf_counter() - start:.0f} s)")
    print_table(best_launches(rows), ["variant", "batch", "page", "ms", "gbps", "block_n", "per_sm", "num_warps",
                                      "num_stages", "max_err", "rel_err", "err_vs_bf16"])


if __name__ == "__main__":
    main()
