"""What the decoder's attention layers hand to a KV cache, and the reference attention every cache uses.

The decoder computes q, pre-RoPE k and v for the tokens of a forward, applies RoPE, and calls
`cache.attend(layer, q, k_pre, k_rot, v, meta)`. The cache stores what it keeps (dense: post-RoPE k and v;
ShadowKV: a factorisation of pre-RoPE k, landmarks of post-RoPE k, values on the host) and returns the attention
output. Tokens of all sequences of a forward are flattened ("ragged"): no padding anywhere.
"""
from __future__ import annotations

import abc
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels import MIN_HEAD_DIM


@dataclass
class AttentionMetadata:
    """One forward over a ragged batch. Prefill forwards carry whole prompts (context_lens all 0); decode forwards
    carry one token per sequence. Token i of the flattened batch belongs to the sequence whose
    [query_start, query_start + query_len) range holds it."""

    is_prefill: bool
    seq_ids: list[int]  # cache ids of the sequences, in batch order
    query_lens: list[int]  # new tokens per sequence in this forward
    context_lens: list[int]  # tokens already cached per sequence before this forward
    positions: torch.Tensor  # (T,) int64: absolute position of every token
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

    def halves(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """The batch's first and second halves of sequences (tokens follow their sequences), for a forward whose two
        halves are pipelined against each other; the whole forward is still finished with this metadata. The same two
        objects on every call: a cache's per-forward state (prepared before the forward) is held per object."""
        if self._halves is None:
            h = self.num_seqs // 2
            rows = sum(self.query_lens[:h])
            self._halves = tuple(AttentionMetadata(self.is_prefill, self.seq_ids[part], self.query_lens[part],
                                                   self.context_lens[part], positions)
                                 for part, positions in ((slice(0, h), self.positions[:rows]),
                                                         (slice(h, None), self.positions[rows:])))
        return self._halves


class KVCache(abc.ABC):
    """A cache for every layer of one model on one device. Buffers are sized and allocated once."""

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

    def prepare_forward(self, meta: AttentionMetadata) -> None:
        """Do a forward's host-side bookkeeping now, before its first layer (what its layers share: index tensors
        copied to the device once). Optional: attend does it on first use otherwise."""

    def graph_inputs(self, meta: AttentionMetadata) -> tuple[Hashable, list[torch.Tensor]] | None:
        """For a prepared forward that a CUDA graph can replay (engine/cuda_graphs.py): (key, tensors). tensors: every
        per-forward device tensor its layers read or write (their contents change from step to step, their shapes
        do not within a key); key: what else its launches depend on (kernel shape buckets). A graph captured for one
        forward replays another of equal key and tensor shapes once their tensors are copied in. None: this forward
        must run eager (prefill, the reference path, host work inside the layers)."""
        return None

    @abc.abstractmethod
    def can_allocate(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether a sequence of this shape fits in what is free now."""

    @abc.abstractmethod
    def fits_when_empty(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether a sequence of this shape could ever fit, with nothing else allocated."""

    @abc.abstractmethod
    def footprint(self, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
        """(device bytes, host bytes) that `allocate` reserves for a sequence of this shape."""

    @abc.abstractmethod
    def allocate(self, seq_id: int, prompt_len: int, max_new_tokens: int) -> None:
        """Reserve everything the sequence will need up to prompt_len + max_new_tokens tokens."""

    @abc.abstractmethod
    def free(self, seq_id: int) -> None:
        """Return everything the sequence holds; safe to call once per allocate."""

    @abc.abstractmethod
    def finish_forward(self, meta: AttentionMetadata) -> None:
        """Called once after all layers of a forward: the sequences' cached lengths advance by their query_lens."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters: sequences, bytes in use on GPU and host, and per-step figures where the cache has them."""

    def close(self) -> None:
        """Release what the garbage collector cannot (pinned host registrations); the cache is unusable after."""


def kernels_by_default(device: torch.device | str, head_dim: int) -> bool:
    """Whether a cache decodes on the Triton kernels when not told: on CUDA, for heads the kernels take."""
    return torch.device(device).type == "cuda" and head_dim >= MIN_HEAD_DIM


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Exact attention of one sequence. q (n_q, Hq, d); k, v (n_k, Hkv, d) with Hq a multiple of Hkv (GQA).

    causal: query i sits at position n_k - n_q + i and sees keys up to it (bottom-right aligned); otherwise every
    query sees every key. Math in the inputs' dtype, as SDPA does; returns (n_q, Hq, d)."""
    n_q, n_k = q.shape[0], k.shape[0]
    mask = None
    if causal and n_q > 1:
        mask = causal_lower_right(n_q, n_k) if n_q != n_k else None
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # (1, Hq, n_q, d)
        k.transpose(0, 1).unsqueeze(0),  # (1, Hkv, n_k, d)
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=causal and n_q > 1 and n_q == n_k, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          chunk_tokens: int) -> torch.Tensor:
    """Causal self-attention over one whole prompt, queries taken `chunk_tokens` at a time so that the score
    matrix of a long prompt never has to exist at once. Shapes as in `attention_ref` with n_q == n_k."""
    n = q.shape[0]
    if n <= chunk_tokens:
        return attention_ref(q, k, v, scale, causal=True)
    out = torch.empty_like(q)
    for start in range(0, n, chunk_tokens):
        end = min(start + chunk_tokens, n)
        out[start:end] = attention_ref(q[start:end], k[:end], v[:end], scale, causal=True)
    return out
