"""Decoder building blocks over flattened ragged tokens (T = all tokens of a forward, no batch dimension).

Long prefills run their per-token work in chunks of `chunk_tokens` so that activations (the MLP's intermediate,
RoPE's fp32 temporaries) stay bounded whatever the prompt length."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, KVCache
from .rotary import RotaryEmbedding
from .spec import ModelSpec


def chunked(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """fn over token chunks of x (T, ...), written into one (T, ...) output."""
    n = x.shape[0]
    if n <= chunk_tokens:
        return fn(x)
    out = None
    for start in range(0, n, chunk_tokens):
        y = fn(x[start:start + chunk_tokens])
        if out is None:
            out = y.new_empty((n, *y.shape[1:]))
        out[start:start + chunk_tokens] = y
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, weight applied after casting back: transformers' order, exact in every dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, intermediate) each
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding, chunk_tokens: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.rotary = rotary
        self.chunk_tokens = chunk_tokens
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.end(self.begin(x, positions, seq_lens, cache, meta), cache)

    def begin(self, x: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None, cache: KVCache,
              meta: AttentionMetadata):
        """Project and hand the layer's tokens to the cache (KVCache.attend_begin); -> a handle for `end`."""
        if x.shape[0] <= self.chunk_tokens:
            q, k_pre, k_rot, v = self._project(x, positions, seq_lens)
        else:
            q, k_pre, k_rot, v = self._project_chunked(x, positions, seq_lens)
        return cache.attend_begin(self.layer_idx, q, k_pre, k_rot, v, meta)

    def end(self, handle, cache: KVCache) -> torch.Tensor:
        out = cache.attend_end(handle)  # (T, Hq, d)
        return chunked(self.o_proj, out.reshape(out.shape[0], self.q_size), self.chunk_tokens)

    def _project_chunked(self, x: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None):
        n = x.shape[0]
        q = x.new_empty(n, self.num_heads, self.head_dim)
        k_pre, k_rot, v = (x.new_empty(n, self.num_kv_heads, self.head_dim) for _ in range(3))
        for s in range(0, n, self.chunk_tokens):
            e = s + self.chunk_tokens
            q[s:e], k_pre[s:e], k_rot[s:e], v[s:e] = self._project(
                x[s:e], positions[s:e], None if seq_lens is None else seq_lens[s:e])
        return q, k_pre, k_rot, v

    def _project(self, x: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None):
        """q (t, Hq, d) post-RoPE, k_pre (t, Hkv, d) pre-RoPE (after k_norm), k_rot post-RoPE, v (t, Hkv, d)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (t, Hkv, d)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return self._query(q, positions, seq_lens), k, self.rotary.apply(k, positions, seq_lens), v

    def _query(self, q: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)  # (t, Hq, d)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return self.rotary.apply(q, positions, seq_lens)

    def query(self, x: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None) -> torch.Tensor:
        """The query part of the projection alone: (t, Hq, d) post-RoPE."""
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[:self.q_size]
        return self._query(F.linear(x, self.qkv_proj.weight[:self.q_size], bias), positions, seq_lens)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding, chunk_tokens: int):
        super().__init__()
        self.chunk_tokens = chunk_tokens
        self.self_attn = Attention(spec, layer_idx, rotary, chunk_tokens)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_self_attn_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if spec.post_norms else None
        self.post_mlp_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if spec.post_norms else None

    def forward(self, h: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.end(h, self.begin(h, positions, seq_lens, cache, meta), cache)

    def begin(self, h: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None, cache: KVCache,
              meta: AttentionMetadata):
        """The layer up to its cache's attention, begun (see KVCache.attend_begin); `end` does the rest."""
        return self.self_attn.begin(chunked(self.input_layernorm, h, self.chunk_tokens), positions, seq_lens, cache,
                                    meta)

    def speculative_query(self, h: torch.Tensor, positions: torch.Tensor,
                          seq_lens: torch.Tensor | None) -> torch.Tensor:
        """This layer's query of hidden states h that are not its input yet (the previous layer's input): residual
        streams change little from one layer to the next, so it approximates the query this layer will make."""
        return self.self_attn.query(self.input_layernorm(h), positions, seq_lens)

    def end(self, h: torch.Tensor, handle, cache: KVCache) -> torch.Tensor:
        attn = self.self_attn.end(handle, cache)
        if self.post_self_attn_layernorm is not None:
            attn = self.post_self_attn_layernorm(attn)
        h = h + attn
        return chunked(self._mlp_block, h, self.chunk_tokens)

    def _mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        out = self.mlp(self.post_attention_layernorm(h))
        if self.post_mlp_layernorm is not None:
            out = self.post_mlp_layernorm(out)
        return h + out
