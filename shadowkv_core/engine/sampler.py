"""Sampler: next token per sequence from its logits row and its own SamplingParams and generator."""
from __future__ import annotations

import torch

from .sequence import Sequence


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits (V,) float32 with everything outside the top-k / nucleus set to -inf."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits (B, V) float32, one row per sequence in `seqs` order."""
    greedy = logits.argmax(dim=-1).tolist()
    tokens = []
    for row, seq, best in zip(logits, seqs, greedy):
        params = seq.params
        if params.is_greedy:
            tokens.append(best)
            continue
        filtered = _filter_top_k_top_p(row / params.temperature, params.top_k, params.top_p)
        probs = torch.softmax(filtered, dim=-1).cpu()
        tokens.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    return tokens
