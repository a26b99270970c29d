"""The two sides of a KV cache and what they share.

A cache's manager (CacheManager) is its CPU bookkeeping: what each sequence holds (slots, blocks, pages), reserved
whole when the scheduler admits the sequence and returned when it ends; it never touches the device. The cache
(KVCache) is the device side: for each forward the decoder's attention layers hand it q, pre-RoPE k, post-RoPE k and
v, and it stores what it keeps (dense: post-RoPE k and v; ShadowKV: a factorisation of pre-RoPE k, landmarks, values
on the host) and returns the attention output. Tokens of all sequences of a forward are flattened ("ragged"): no
padding anywhere.
"""
from __future__ import annotations

import abc
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from kernels import MIN_HEAD_DIM

from ..config import AUTO, choose

# the stats that only grow (KVCache.stats: prefix cache lookups, hits and evictions, the shadow's chunk counts)
COUNTERS = ("prefix_hit_tokens", "prefix_query_tokens", "prefix_evictions", "chunks_selected_total",
            "chunk_hits_total", "chunks_fetched_total", "bytes_fetched_total")


@dataclass(frozen=True)
class CacheSpec:
    """What a cache is built for: the model's attention geometry, in one dtype on one device. prefill_chunk_tokens:
    queries attended at once in a prefill (bounds the score matrix). use_kernels: decode on the Triton kernels; "auto"
    does on CUDA, for heads the kernels take. prefill_attention: how a prefill chunk attends
    (attention.chunk_attention). kv_cache_dtype: the dense cache's, "auto" (dtype) or "fp8"."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    prefill_chunk_tokens: int = 8192
    use_kernels: bool | str = AUTO
    prefill_attention: str = AUTO
    kv_cache_dtype: str = AUTO

    def __post_init__(self):
        object.__setattr__(self, "device", torch.device(self.device))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")

    @classmethod
    def of(cls, spec, dtype: torch.dtype, device: torch.device | str, prefill_chunk_tokens: int = 8192,
           use_kernels: bool | str = AUTO, prefill_attention: str = AUTO,
           kv_cache_dtype: str = AUTO) -> CacheSpec:
        """From a model's ModelSpec."""
        return cls(spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attention_scale, dtype,
                   device, prefill_chunk_tokens, use_kernels, prefill_attention, kv_cache_dtype)

    @property
    def kernels(self) -> bool:
        return choose(self.use_kernels, self.device.type == "cuda" and self.head_dim >= MIN_HEAD_DIM)


@dataclass
class AttentionMetadata:
    """One forward over a ragged batch. Prefill forwards carry prompts past their cached prefixes (context_lens: the
    prefix's tokens, 0 for a prompt with none); decode forwards carry one token per sequence. Token i of the
    flattened batch belongs to the sequence whose [query_start, query_start + query_len) range holds it."""

    is_prefill: bool
    seq_ids: list[int]  # cache ids of the sequences, in batch order
    query_lens: list[int]  # new tokens per sequence in this forward
    context_lens: list[int]  # tokens already cached per sequence before this forward
    positions: torch.Tensor  # (T,) int64: absolute position of every token
    halved: bool = False  # one of a forward's two pipelined halves (halves())
    _halves: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def query_starts(self) -> list[int]:
        starts, total = [], 0
        for n in self.query_lens:
            starts.append(total)
            total += n
        return starts

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    def subset(self, index: list[int], positions: torch.Tensor, halved: bool = False) -> AttentionMetadata:
        """The forward of the sequences at `index` (batch order kept); positions: their tokens' (T_subset,)."""
        return AttentionMetadata(self.is_prefill, [self.seq_ids[i] for i in index],
                                 [self.query_lens[i] for i in index], [self.context_lens[i] for i in index],
                                 positions, halved)

    def halves(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """The batch's first and second halves of sequences (tokens follow their sequences), for a forward whose two
        halves are pipelined against each other; the whole forward is still finished with this metadata. The same two
        objects on every call: a cache's per-forward state (prepared before the forward) is held per object."""
        if self._halves is None:
            h = self.num_seqs // 2
            rows = sum(self.query_lens[:h])
            self._halves = (self.subset(list(range(h)), self.positions[:rows], halved=True),
                            self.subset(list(range(h, self.num_seqs)), self.positions[rows:], halved=True))
        return self._halves


class CacheManager(abc.ABC):
    """What each sequence holds, reserved whole at admission (nothing runs out mid-decode) and returned at its end."""

    @abc.abstractmethod
    def can_allocate(self, prompt_len: int, max_new_tokens: int, prompt_token_ids: list[int] | None = None) -> bool:
        """Whether a sequence of this shape fits in what is free now (prompt_token_ids: its prompt, whose cached
        prefix it would hold rather than reserve anew)."""

    def cached_prefix_len(self, prompt_len: int, max_new_tokens: int, prompt_token_ids: list[int] | None) -> int:
        """How many of the prompt's first tokens `allocate` would take from the prefix cache now (what its prefill
        skips). A manager without a prefix cache holds none."""
        return 0

    @abc.abstractmethod
    def fits_when_empty(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether a sequence of this shape could ever fit, with nothing else allocated."""

    @abc.abstractmethod
    def footprint(self, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
        """(device bytes, host bytes) that `allocate` reserves for a sequence of this shape."""

    @abc.abstractmethod
    def allocate(self, seq_id: int, prompt_len: int, max_new_tokens: int,
                 prompt_token_ids: list[int] | None = None) -> int:
        """Reserve everything the sequence will need up to prompt_len + max_new_tokens tokens; MemoryError, nothing
        reserved, if it does not fit. Returns how many of its first prompt tokens are cached already (a prefix that
        prompt_token_ids shares with an earlier prompt, where the manager keeps a prefix cache): its prefill starts
        there, and is never empty."""

    @abc.abstractmethod
    def free(self, seq_id: int, token_ids: list[int] | None = None) -> None:
        """Return everything the sequence holds; safe to call once per allocate. token_ids: its prompt and output
        tokens, whose cached blocks a prefix cache keeps for later prompts (None: keep nothing new, e.g. after a
        failed step)."""

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix no sequence holds; how many units that returned to the pools. A manager without
        a prefix cache holds none."""
        return 0

    @abc.abstractmethod
    def usage(self) -> dict[str, int]:
        """num_seqs, and gpu_/host_bytes_in_use and gpu_/host_bytes_total of the pools."""


class KVCache(abc.ABC):
    """The device side of a cache for every layer of one model on one device; buffers sized and allocated once.
    `manager` is its bookkeeping side: a sequence is allocated there before its first forward."""

    manager: CacheManager

    @abc.abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """q (T, Hq, d) post-RoPE; k_pre, k_rot, v (T, Hkv, d). Stores this forward's keys/values for `layer`
        and returns the attention output (T, Hq, d)."""

    def attend_begin(self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMetadata):
        """`attend` in two parts, for a caller that has other work to queue meanwhile: begin starts it (a cache
        with side streams leaves its host transfers in flight) and returns a handle; attend_end(handle) returns
        the output. Here: all of it at once."""
        return self.attend(layer, q, k_pre, k_rot, v, meta)

    def attend_end(self, handle) -> torch.Tensor:
        return handle

    # A prefill layer's attention in slices (Decoder layers' prefill_slices: the engine runs a long prompt's prefill a
    # few slices per step): prefill_begin, then prefill_attention over query chunks in any order, then prefill_end.
    def prefill_begin(self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
                      meta: AttentionMetadata) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Store what the cache keeps of this prefill forward's keys and values for `layer` now, and return each
        sequence's keys and values (context + n, Hkv, d) in batch order, its n queries being the last n of them.
        Shapes as in `attend`."""
        raise NotImplementedError(f"{type(self).__name__} prefills whole layers only")

    def prefill_read_bytes(self, layer: int, meta: AttentionMetadata) -> int:
        """Bytes that prefill_begin reads from host memory for `layer` (a cached prefix's values kept there), which
        the sliced prefill's budget counts beside its FLOPs. Here: none."""
        return 0

    def prefill_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          whole: bool = True) -> torch.Tensor:
        """Causal attention of a chunk of one sequence's queries (n_q, Hq, d), the last n_q of keys and values
        (n_k, Hkv, d), all of its queries or (whole False) a slice of them: attention.chunk_attention as this cache's
        prefill runs it."""
        raise NotImplementedError(f"{type(self).__name__} prefills whole layers only")

    def prefill_end(self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
                    meta: AttentionMetadata) -> None:
        """The cache's work on `layer` once every query of the forward has attended (ShadowKV: the layer's shadow)."""

    def prepare_forward(self, meta: AttentionMetadata) -> None:
        """Do a forward's host-side bookkeeping now, before its first layer (what its layers share: index tensors
        copied to the device once). Optional: attend does it on first use otherwise."""

    def compile_buckets(self, max_model_len: int) -> int:
        """Launch once, on placeholder inputs, each decode kernel whose compiled variant depends on a bucket of the
        batch's context (a compile-time size), for every bucket that sequences of up to max_model_len tokens reach,
        so that a batch that first reaches one does not wait for a compile (engine/warm_up.py). -> buckets launched.
        Here: none."""
        return 0

    def graph_inputs(self, meta: AttentionMetadata) -> tuple[Hashable, list[torch.Tensor]] | None:
        """For a prepared forward that a CUDA graph can replay (engine/cuda_graphs.py): (key, tensors). tensors: every
        per-forward device tensor its layers read or write (their contents change from step to step, their shapes
        do not within a key); key: what else its launches depend on (kernel shape buckets). A graph captured for one
        forward replays another of equal key and tensor shapes once their tensors are copied in. None: this forward
        must run eager (prefill, the reference path, host work inside the layers)."""
        return None

    @abc.abstractmethod
    def finish_forward(self, meta: AttentionMetadata) -> None:
        """Called once after all layers of a forward: the sequences' cached lengths advance by their query_lens."""

    @abc.abstractmethod
    def copy_sequence(self, src: int, dst: int) -> None:
        """Everything cached for sequence `src`, into `dst` (allocated for the same shape, no forward run yet)."""

    def step_stats(self) -> dict[str, float]:
        """Figures of the last finished decode step, where the cache has them."""
        return {}

    def stats(self) -> dict[str, float]:
        return {**self.manager.usage(), **self.step_stats()}

    def close(self) -> None:
        """Release what the garbage collector cannot (pinned host registrations); the cache is unusable after."""
