"""CUDA graphs of the decode forward: captured once per batch shape, replayed every step after.

Eager, a decode step launches a few dozen kernels per layer, and at long context and small batches the host's launch
time, not the GPU, sets the step time (docs/benchmarks.md's per-step breakdown). The caches do a forward's host-side
bookkeeping before its first layer (KVCache.prepare_forward) and name the device tensors it fills and the buckets
its kernels are compiled for (KVCache.graph_inputs). A forward whose key matches a captured graph copies its tensors
into the graph's (one launch), replays it, and copies them back (counters the layers write). A key not seen yet runs
eager, which compiles what it launches, and is captured then for the steps after; its result is the eager one.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from ..cache.base import AttentionMetadata, KVCache

logger = logging.getLogger(__name__)


@dataclass
class CapturedDecode:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # what the graph reads (and writes), in the order of DecodeGraphs.inputs
    logits: torch.Tensor  # (B, vocab) fp32, overwritten by every replay


class DecodeGraphs:
    """forward(input_ids, meta) -> (B, vocab) logits: the whole decode forward, the lm_head included. At most
    `max_graphs` graphs are held (least recently used dropped); they share one memory pool, since one runs at a time."""

    def __init__(self, forward: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor], cache: KVCache,
                 max_graphs: int = 32):
        self.forward = forward
        self.cache = cache
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[Hashable, CapturedDecode] = OrderedDict()
        self.pool = None  # the graphs' shared memory pool, made at the first capture
        self.captures = 0
        self.replays = 0
        self.failed: str | None = None  # why capturing stopped (then every forward runs eager)

    def inputs(self, input_ids: torch.Tensor, meta: AttentionMetadata,
               metas: tuple[AttentionMetadata, ...]) -> tuple[Hashable, list[torch.Tensor]] | None:
        """(key, tensors) of a prepared decode forward run over `metas` (the whole batch, or its pipelined halves);
        None if a cache cannot replay it."""
        states = [self.cache.graph_inputs(m) for m in metas]
        if any(state is None for state in states):
            return None
        tensors = [input_ids, meta.positions] + [t for _, ts in states for t in ts]
        key = (len(metas), tuple(k for k, _ in states), tuple((t.shape, t.dtype) for t in tensors))
        return key, tensors

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata,
            metas: tuple[AttentionMetadata, ...]) -> torch.Tensor:
        state = None if self.failed else self.inputs(input_ids, meta, metas)
        if state is None:
            return self.forward(input_ids, meta)
        key, tensors = state
        captured = self.graphs.get(key)
        if captured is None:
            logits = self.forward(input_ids, meta)
            self._capture(key, input_ids, meta, tensors)
            return logits
        self.graphs.move_to_end(key)
        torch._foreach_copy_(captured.inputs, tensors)
        captured.graph.replay()
        torch._foreach_copy_(tensors, captured.inputs)
        self.replays += 1
        return captured.logits.clone()

    def clear(self) -> None:
        """Drop every graph and their pool. A graph that captured a collective holds its process group: NCCL's
        shutdown of the group waits on it for ever."""
        self.graphs.clear()
        self.pool = None

    def _capture(self, key: Hashable, input_ids: torch.Tensor, meta: AttentionMetadata,
                 tensors: list[torch.Tensor]) -> None:
        """Record the forward just run eagerly (its kernels compiled), over its own tensors, which the graph keeps.
        Capture launches nothing: the caches' state is as the eager run left it."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (a server's stats) neither break nor join the capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = self.forward(input_ids, meta)
        except RuntimeError as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.warning("decode CUDA graph capture failed; decoding eager from now on: %s", self.failed)
            return
        self.graphs[key] = CapturedDecode(graph, tensors, logits)
        self.captures += 1
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        logger.debug("captured decode graph %d (batch %d, %d held)", self.captures, input_ids.shape[0],
                     len(self.graphs))
