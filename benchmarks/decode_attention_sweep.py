"""Sweep of the dense paged decode attention kernel's launch (kernels/decode_attention.py) over bf16 and fp8 pools:
keys per loop step (block_n) and programs per SM (the split), Llama-3.1-8B geometry (32 query heads, 8 KV heads, head
dim 128), 16-token pages in a shuffled block table. Every variant is checked against the bf16 kernel at its defaults
(the max |difference|: fp8's is its quantisation) and timed (median, triton.testing.do_bench); GB/s counts the keys,
values and (fp8) their scales read once. The fp8 defaults (decode_attention's block_n and programs per SM) come from
this sweep.

    PYTHONPATH=. python -m benchmarks.decode_attention_sweep [--batch 8 --context 122880] [--out PATH]
"""
from __future__ import annotations

import argparse
import functools

import torch
import triton

from benchmarks.report import print_table, write_json
from kernels.decode_attention import decode_attention
from shadowkv_core.shadowkv.reference import quantize_values


def sweep(args) -> list[dict]:
    B, Hq, Hkv, d, ctx, page = args.batch, 32, 8, 128, args.context, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = B * ctx // page
    table = torch.randperm(num_blocks, device="cuda", generator=g).int().view(B, ctx // page)
    k, v = (torch.randn(num_blocks * page, Hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
    (k8, ks), (v8, vs) = quantize_values(k, 1), quantize_values(v, 1)
    q = torch.randn(B, Hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    slots = torch.zeros(B, dtype=torch.int32, device="cuda")

    def run(fp8: bool, **launch):
        pool = [((k8 if fp8 else k).permute(1, 0, 2)[None], (v8 if fp8 else v).permute(1, 0, 2)[None], lens)]
        return decode_attention(q, pool, slots, d ** -0.5, ctx, page_table=table, page_size=page,
                                scales=(ks.T[None], vs.T[None]) if fp8 else None, **launch)

    reference = run(False).float()
    rows = []
    for fp8 in (True, False):
        nbytes = 2 * B * ctx * Hkv * (d + 4 if fp8 else 2 * d)
        for block_n in args.block_n:
            for per_sm in args.per_sm:
                blocks = triton.next_power_of_2(triton.cdiv(ctx, block_n))
                split = block_n * triton.cdiv(blocks * B * Hkv, per_sm * sms)
                fn = functools.partial(run, fp8, block_n=block_n, split_tokens=split)
                err = (fn().float() - reference).abs().max().item()
                ms = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
                rows.append(dict(fp8=fp8, block_n=block_n, per_sm=per_sm, ms=ms, gbps=nbytes / ms / 1e6,
                                 max_diff_vs_bf16=err))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=122_880)
    parser.add_argument("--block-n", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--per-sm", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--out", default="decode_attention_sweep.json", help="relative paths land in benchmarks/results/")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the sweep times a CUDA kernel: no GPU on this machine")
    rows = sweep(args)
    path = write_json(args.out, rows, batch=args.batch, context=args.context)
    print(f"\n{path}")
    print_table(rows, ["fp8", "block_n", "per_sm", "ms", "gbps", "max_diff_vs_bf16"])


if __name__ == "__main__":
    main()
