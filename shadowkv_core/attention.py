"""Exact attention of one sequence, the reference every cache's attention is held to (and uses off the kernels)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


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
