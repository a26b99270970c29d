"""Decoder building blocks over flattened ragged tokens (T = all tokens of a forward, no batch dimension).

Long prefills run their per-token work in chunks of `chunk_tokens` so that activations (the MLP's intermediate,
RoPE's fp32 temporaries) stay bounded whatever the prompt length. On CUDA the norms, SwiGLU's gate and RoPE run as
fused Triton kernels (kernels/), each tested against the PyTorch code here."""
from __future__ import annotations

from collections.abc import Callable, Generator

import torch
import torch.nn.functional as F
from torch import nn

from kernels.rmsnorm import rms_norm
from kernels.swiglu import silu_mul

from ..attention import query_chunk_limit
from ..cache.base import AttentionMetadata, KVCache
from ..parallel import TensorParallel
from .prefill_cost import PrefillBudget
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


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 statistics, weight applied after casting back: transformers' order, exact in every dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate of the fused gate/up output (T, 2I) -> (T, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return rms_norm_reference(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual (T, dim) -> (norm(residual + x), residual + x), the sum in x's dtype."""
        if x.is_cuda:
            return rms_norm(x, self.weight, self.eps, residual)
        total = residual + x
        return self(total), total


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over the tensor-parallel ranks: each rank's partial product is
    summed by one all-reduce, then the (replicated) bias is added once. Without tp, nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel | None):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(x)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class MLP(nn.Module):
    """spec: the rank's geometry (parallel.rank_spec): gate/up column-parallel, down_proj row-parallel."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None):
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, spec.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * intermediate)
        return self.down_proj(silu_mul(gate_up) if gate_up.is_cuda else silu_mul_reference(gate_up))


class Attention(nn.Module):
    """spec: the rank's geometry (parallel.rank_spec): its query and KV heads column-parallel, o_proj row-parallel."""

    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding, chunk_tokens: int,
                 tp: TensorParallel | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.rotary = rotary
        self.chunk_tokens = chunk_tokens
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, spec.hidden_size, spec.o_bias, tp)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.end(self.begin(x, positions, seq_lens, cache, meta), cache)

    def begin(self, x: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None, cache: KVCache,
              meta: AttentionMetadata):
        """Project and hand the layer's tokens to the cache (KVCache.attend_begin); -> a handle for `end`."""
        if x.shape[0] <= self.chunk_tokens:
            q, k_pre, k_rot, v = self.project(x, positions, seq_lens)
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
            q[s:e], k_pre[s:e], k_rot[s:e], v[s:e] = self.project(
                x[s:e], positions[s:e], None if seq_lens is None else seq_lens[s:e])
        return q, k_pre, k_rot, v

    def project(self, x: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None):
        """q (t, Hq, d) post-RoPE, k_pre (t, Hkv, d) pre-RoPE (after k_norm), k_rot post-RoPE, v (t, Hkv, d)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (t, Hkv, d)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        q_rot, k_rot = self.rotary.apply_pair(self._query_heads(q), k, positions, seq_lens)
        return q_rot, k, k_rot, v

    def _query_heads(self, q: torch.Tensor) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)  # (t, Hq, d)
        return q if self.q_norm is None else self.q_norm(q)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding, chunk_tokens: int,
                 tp: TensorParallel | None = None):
        super().__init__()
        self.chunk_tokens = chunk_tokens
        self.self_attn = Attention(spec, layer_idx, rotary, chunk_tokens, tp)
        self.mlp = MLP(spec, tp)
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

    def end(self, h: torch.Tensor, handle, cache: KVCache) -> torch.Tensor:
        attn = self._post_attention(self.self_attn.end(handle, cache))
        if h.shape[0] <= self.chunk_tokens:  # one chunk (a decode step): the residual add fused into the norm
            normed, h = self.post_attention_layernorm.add_and_norm(attn, h)
            return self._mlp_out(h, normed)
        return chunked(self._mlp_block, h + attn, self.chunk_tokens)

    def prefill_slices(self, h: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None, cache: KVCache,
                       meta: AttentionMetadata, budget: PrefillBudget) -> Generator[None, None, torch.Tensor]:
        """This layer's prefill over h (T, hidden) in slices, pausing (yield) before each, so that an engine runs a
        long prompt's a few slices per step between decode steps: the norm and the q/k/v projection by row chunks,
        the cache's prefill_begin, each sequence's causal attention by query chunks (against its keys up to the
        chunk's end), the cache's prefill_end, then o_proj, the residual and the MLP by row chunks. Chunks are at
        most chunk_tokens long (attention's: attention.query_chunk_limit) and sized to what `budget` has left.
        Returns the layer's output (T, hidden), a new tensor: h is left as it was (a job can restart the layer
        without one of its sequences). Held between slices: q, k_pre, k_rot, v, the attention output and the
        output rows so far."""
        attn, n, limit = self.self_attn, h.shape[0], self.chunk_tokens
        layer = attn.layer_idx
        q = h.new_empty(n, attn.num_heads, attn.head_dim)
        k_pre, k_rot, v = (h.new_empty(n, attn.num_kv_heads, attn.head_dim) for _ in range(3))

        def project(s: int, e: int) -> None:
            q[s:e], k_pre[s:e], k_rot[s:e], v[s:e] = attn.project(
                self.input_layernorm(h[s:e]), positions[s:e], None if seq_lens is None else seq_lens[s:e])

        yield from budget.run_slices(n, limit, lambda s, e: (e - s) * budget.projection_row, project)
        begun = []  # each sequence's keys and values, cached prefix first
        yield from budget.run_whole(budget.host_read(cache.prefill_read_bytes(layer, meta)),
                                    lambda: begun.extend(cache.prefill_begin(layer, q, k_pre, k_rot, v, meta)))
        out = torch.empty_like(q)
        for start, rows, (keys, values) in zip(meta.query_starts, meta.query_lens, begun):
            yield from self._attention_slices(q[start:start + rows], keys, values, out[start:start + rows], cache,
                                              budget)
        yield
        cache.prefill_end(layer, q, k_pre, k_rot, v, meta)
        del q, k_pre, k_rot, v, keys, values  # the attention output is all the rest needs
        h_out = torch.empty_like(h)

        def output(s: int, e: int) -> None:
            a = self._post_attention(attn.o_proj(out[s:e].reshape(e - s, attn.q_size)))
            h_out[s:e] = self._mlp_block(h[s:e] + a)

        yield from budget.run_slices(n, limit, lambda s, e: (e - s) * budget.output_row, output)
        return h_out

    def _attention_slices(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
                          cache: KVCache, budget: PrefillBudget) -> Generator[None, None, None]:
        """One sequence's causal attention into out by query chunks (unlimited, as prefill_attention_ref takes them):
        q (n, Hq, d), the last n of keys and values."""
        before, n = keys.shape[0] - q.shape[0], q.shape[0]  # the cached prefix's keys

        def attend(s: int, e: int) -> None:
            out[s:e] = cache.prefill_attention(q[s:e], keys[:before + e], values[:before + e], e - s == n)

        yield from budget.run_slices(q.shape[0], query_chunk_limit(q, self.chunk_tokens),
                                     lambda s, e: budget.attention(before + s, e - s), attend)

    def _post_attention(self, attn: torch.Tensor) -> torch.Tensor:
        return attn if self.post_self_attn_layernorm is None else self.post_self_attn_layernorm(attn)

    def _mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        return self._mlp_out(h, self.post_attention_layernorm(h))

    def _mlp_out(self, h: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """h + the MLP of h's norm."""
        out = self.mlp(normed)
        if self.post_mlp_layernorm is not None:
            out = self.post_mlp_layernorm(out)
        return h + out
