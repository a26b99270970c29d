"""Sampler: the next token of every sequence of a batch, on the logits' device, in one pass and without a host sync.

Greedy rows take the argmax. Sampled rows divide by their temperature, keep their top-k and then their nucleus (top-p)
and draw by the Gumbel-max trick: the argmax of logits + Gumbel noise is a draw from their softmax. The noise is not
drawn from a generator's stream but hashed from (the request's seed, the token's index in its output, the vocabulary
id): a request's tokens are the same whichever batch it decodes in, on the CPU and on CUDA, and a step can be sampled
while the one before it is still running (EngineConfig.async_decode), since no generator state lives on the host.
"""
from __future__ import annotations

import torch

from ..transfers import to_device
from .sequence import Sequence

_U32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # spreads consecutive vocabulary ids over the hash's input space


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32, C. Wellons: full avalanche) of int64 values in [0, 2^32). The products
    overflow int64 and wrap; only their low 32 bits are kept, which wrapping leaves exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _U32
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys (B, 3) int64 in [0, 2^32): (seed low, seed high, token index) per row -> (B, V) float32 standard Gumbel
    noise, a pure function of each row's key and the vocabulary id."""
    row = _mix32(_mix32(_mix32(keys[:, 0]) ^ keys[:, 1]) ^ keys[:, 2])
    ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    bits = _mix32((row[:, None] + ids[None, :] * _GOLDEN) & _U32) >> 8  # 24 uniform bits: float32 holds them exactly
    u = (bits.float() + 0.5) * 2.0 ** -24  # in (0, 1)
    return -torch.log(-torch.log(u))


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int,
                       any_top_p: bool) -> torch.Tensor:
    """logits (B, V) float32 with every id outside each row's top-k (top_k (B,), 0: off) and then outside its nucleus
    (the smallest set of most likely ids reaching top_p (B,) of the probability, 1: off) set to -inf. max_k (the
    largest top_k in use, 0 if none) and any_top_p come from the host, so that nothing here waits for the device."""
    if max_k:
        kth = torch.topk(logits, max_k, dim=-1).values.gather(1, (top_k - 1).clamp(min=0)[:, None])
        logits = logits.masked_fill((top_k[:, None] > 0) & (logits < kth), float("-inf"))
    if any_top_p:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p[:, None]  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence], token_index: list[int] | None = None) -> torch.Tensor:
    """logits (B, V) float32, one row per sequence in `seqs` order -> (B,) int64 tokens on the logits' device.
    token_index[i]: the index in its output of the token drawn for seqs[i] (default: its output's length)."""
    if all(seq.params.is_greedy for seq in seqs):
        return logits.argmax(dim=-1)
    B, V = logits.shape
    index = token_index or [len(seq.output_token_ids) for seq in seqs]
    params = [seq.params for seq in seqs]
    top_k = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    ints = to_device([[seq.seed & _U32 for seq in seqs], [seq.seed >> 32 & _U32 for seq in seqs], index, top_k],
                     torch.int64, logits.device)
    floats = to_device([[p.temperature or 1.0 for p in params], [p.top_p for p in params],
                        [float(p.is_greedy) for p in params]], torch.float32, logits.device)
    scaled = filter_top_k_top_p(logits / floats[0][:, None], ints[3], floats[1], max(top_k),
                                any(p.top_p < 1 for p in params))
    drawn = (scaled + gumbel_noise(ints[:3].T, V)).argmax(dim=-1)
    return torch.where(floats[2] > 0, logits.argmax(dim=-1), drawn)
