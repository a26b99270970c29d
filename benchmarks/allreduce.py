"""All-reduce latency of a tensor-parallel decode step's messages: NCCL over the GPUs of one host, eager and replayed
from a CUDA graph (as a replica's decode runs them). A decode step of a model split over N ranks all-reduces two
(batch, hidden) bf16 vectors a layer (o_proj, down_proj), so a step pays 2 × layers of these.

    torchrun --standalone --nproc_per_node 4 -m benchmarks.allreduce [--kib 16 64 96 128 256] [--out allreduce.json]

Per size: microseconds per all-reduce, eager (50 timed after 5 untimed) and from a graph of 20 (5 replays timed after
one untimed). NCCL_PROTO, where set, is recorded with the rows. Without CUDA: gloo over the CPU, eager only.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from benchmarks.report import print_table, write_json


def per_call_s(fn, calls: int) -> float:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def time_size(kib: int, eager_calls: int = 50, graph_calls: int = 20, replays: int = 5) -> dict:
    cuda = torch.cuda.is_available()
    x = torch.randn(kib * 512, dtype=torch.bfloat16, device="cuda" if cuda else "cpu")  # kib KiB of bf16
    for _ in range(5):
        dist.all_reduce(x)
    eager = per_call_s(lambda: [dist.all_reduce(x) for _ in range(eager_calls)], eager_calls)
    if not cuda:
        return {"kib": kib, "eager_us": eager * 1e6, "graph_us": None}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_calls):
            dist.all_reduce(x)
    graph.replay()
    replayed = per_call_s(lambda: [graph.replay() for _ in range(replays)], replays * graph_calls)
    return {"kib": kib, "eager_us": eager * 1e6, "graph_us": replayed * 1e6}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kib", type=int, nargs="+", default=[16, 64, 80, 96, 128, 256])
    parser.add_argument("--out", default="allreduce.json", help="relative paths land in benchmarks/results/")
    args = parser.parse_args(argv)
    rank = int(os.environ["RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo")
    rows = [{"ranks": dist.get_world_size(), "nccl_proto": os.environ.get("NCCL_PROTO", "default"), **time_size(kib)}
            for kib in args.kib]
    dist.destroy_process_group()
    if rank == 0:
        print(f"wrote {write_json(args.out, rows)}")
        print_table(rows, ["ranks", "nccl_proto", "kib", "eager_us", "graph_us"])
    return rows


if __name__ == "__main__":
    main()
