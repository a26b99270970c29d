"""Tensor parallelism inside one replica (Megatron-style): each of N ranks of one host holds 1/N of the attention
and KV heads and of the MLP's intermediate, and its own cache of its KV heads; the two row-parallel projections
(o_proj, down_proj) end in one all-reduce each. NCCL on GPUs, gloo on the CPU."""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from .config import ShadowKVConfig
from .models.spec import ModelSpec

COLLECTIVE_TIMEOUT_S = 60.0  # a rank that stops answering fails the others' collectives after this long
JOIN_TIMEOUT_S = 600.0  # how long the ranks may take to start (a process, its imports, its CUDA context)
# Workers wait for rank 0's next step as long as the replica idles; a lost peer still fails the wait at once (its
# sockets close).
CONTROL_TIMEOUT = datetime.timedelta(days=365)
_threads_outside: list[int] = []  # this process's intra-op threads before it joined a group, restored on leaving


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place in a replica's tensor-parallel group (the default process group)."""

    rank: int
    size: int
    control: dist.ProcessGroup | None = None  # gloo over the host, for broadcast: None in the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place; a timeout or a lost peer raises (the step's requests then fail)."""
        dist.all_reduce(x)
        return x

    def broadcast(self, obj):
        """Rank 0's obj on every rank, through the host: it neither waits for the work queued on the GPU (a step
        still in flight) nor times out while rank 0 has nothing to send."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def init_tensor_parallel(rank: int, size: int, rendezvous: str, device: str,
                         timeout_s: float = COLLECTIVE_TIMEOUT_S, join_timeout_s: float = JOIN_TIMEOUT_S,
                         peers_alive: Callable[[], bool] = lambda: True) -> TensorParallel:
    """Join the replica's group of `size` ranks through the file `rendezvous`: NCCL for CUDA devices, gloo elsewhere,
    and a gloo group for rank 0's broadcasts. The ranks first wait for each other up to join_timeout_s (or until
    peers_alive() is false), so that a rank slow to start does not fail the group's connection, which gives up after
    the collective timeout. This process's intra-op threads become its share of the host's CPUs (rank_threads) until
    it leaves."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)  # NCCL's communicator for this rank binds the current device
    store = dist.FileStore(rendezvous, size)
    store.set_timeout(datetime.timedelta(seconds=join_timeout_s))
    _wait_for_peers(store, size, join_timeout_s, peers_alive)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    if "OMP_NUM_THREADS" not in os.environ:
        _threads_outside.append(torch.get_num_threads())
        torch.set_num_threads(rank_threads(len(os.sched_getaffinity(0)), size))
    return TensorParallel(rank, size, control)


def _wait_for_peers(store: dist.Store, size: int, timeout_s: float, peers_alive: Callable[[], bool]) -> None:
    joined = store.add("joined", 1)
    deadline = time.monotonic() + timeout_s
    while joined < size:
        if not peers_alive():
            raise RuntimeError(f"a tensor-parallel rank exited before joining ({joined} of {size} joined)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{joined} of {size} tensor-parallel ranks joined within {timeout_s:g} s")
        time.sleep(0.05)
        joined = store.add("joined", 0)


def rank_threads(cpus: int, size: int) -> int:
    """Intra-op threads of one of `size` ranks on `cpus` CPUs. Each rank defaults to every CPU, and N ranks' thread
    pools then fight over them: a host op that goes parallel (a decode step's block table, once large enough) waits
    for threads the other ranks hold."""
    return max(1, cpus // size)


def leave_tensor_parallel(clean: bool) -> None:
    """This process leaves the group. clean: every rank leaves at once, each through this call (NCCL's shutdown waits
    for all of them, so a rank that first waits for its peers to exit never returns); otherwise a peer is lost, and
    NCCL's communicators are aborted instead, which waits for no one."""
    if not dist.is_initialized():
        return
    if clean or dist.get_backend() != "nccl":
        dist.destroy_process_group()
    else:
        dist.distributed_c10d._abort_process_group()
    if _threads_outside:  # rank 0 lives on in its caller's process
        torch.set_num_threads(_threads_outside.pop())


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r of a CUDA replica runs on cuda:r; on the CPU every rank shares the host."""
    dev = torch.device(device)
    return torch.device("cuda", rank) if dev.type == "cuda" else dev


def check_divisible(spec: ModelSpec, size: int) -> None:
    for name, value in (("num_key_value_heads", spec.num_kv_heads), ("num_attention_heads", spec.num_heads),
                        ("intermediate_size", spec.intermediate_size)):
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {name} ({value})")


def rank_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The geometry one rank of `size` computes and caches: its share of the heads and of the MLP's intermediate."""
    check_divisible(spec, size)
    return dataclasses.replace(spec, num_heads=spec.num_heads // size, num_kv_heads=spec.num_kv_heads // size,
                               intermediate_size=spec.intermediate_size // size)


def rank_shadowkv(cfg: ShadowKVConfig | None, size: int) -> ShadowKVConfig | None:
    """A rank's ShadowKV config: `rank` counts the replica's factorisation over all KV heads, so each rank factorises
    its own heads at rank/size (the same U bytes in all, no communication)."""
    if cfg is None or size == 1:
        return cfg
    for r in (cfg.rank, *(cfg.layer_ranks or ())):
        if r % size:
            raise ValueError(f"shadowkv rank {r} must be a multiple of tensor_parallel_size {size}: each rank "
                             "factorises its own KV heads at rank/tensor_parallel_size")
    layer_ranks = None if cfg.layer_ranks is None else tuple(r // size for r in cfg.layer_ranks)
    return dataclasses.replace(cfg, rank=cfg.rank // size, layer_ranks=layer_ranks)
