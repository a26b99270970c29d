"""Exact attention of one sequence, the reference every cache's attention is held to (and uses off the kernels)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels.prefill_attention import HEAD_DIMS, prefill_attention
from shadowkv_core.config import AUTO
from shadowkv_core.transfers import to_device


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
                          chunk_tokens: int, implementation: str = "sdpa") -> torch.Tensor:
    """Causal attention of a prompt's queries, the last n_q of the keys (n_q == n_k for a whole prompt; fewer for
    a suffix after a cached prefix), taken `chunk_tokens` at a time so that the score matrix of a long prompt never
    has to exist at once, each chunk by `chunk_attention`; on CUDA in half precision every implementation is a
    flash-style kernel that never holds the scores, so the prompt goes in one call (one launch, one wave schedule, and
    a whole prompt is a square causal block, which SDPA's flash kernel takes without a mask). Shapes as in
    `attention_ref`."""
    n, limit = q.shape[0], query_chunk_limit(q, chunk_tokens)
    if n <= limit:
        return chunk_attention(q, k, v, scale, implementation)
    out = torch.empty_like(q)
    before = k.shape[0] - n
    for start in range(0, n, limit):
        end = min(start + limit, n)
        out[start:end] = chunk_attention(q[start:end], k[:before + end], v[:before + end], scale, implementation)
    return out


def query_chunk_limit(q: torch.Tensor, chunk_tokens: int) -> int:
    """The most of a prompt's queries q (n, Hq, d) that one chunk_attention call takes: all of them where no kernel
    holds the scores (CUDA, half precision), else chunk_tokens."""
    return q.shape[0] if _scores_never_exist(q) else chunk_tokens


def _scores_never_exist(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    implementation: str = "sdpa", whole: bool = True) -> torch.Tensor:
    """attention_ref(q, k, v, scale, causal=True), the queries being the last n_q of the keys, by one of
    config.PREFILL_ATTENTIONS (EngineConfig.prefill_attention), or "auto": "triton" for a chunk after earlier keys,
    or for any slice of a sequence's queries short of all of them (whole False: a sliced prefill's first slice is a
    square block too, of a size each layer's budget makes anew), on CUDA in half precision (head dims it takes), else
    "sdpa". "sdpa", attention_ref itself (SDPA with a causal_lower_right bias); "sdpa_split",
    prefill_attention_split by SDPA's flash kernel; "cudnn", the same split by its cuDNN kernel (CUDA); "triton",
    kernels/prefill_attention.py (CUDA, or Triton's interpreter; head dims 64 and 128), its keys split across programs
    where one chunk's grid leaves SMs idle (a short suffix after a long prefix)."""
    if implementation == AUTO:  # SDPA on a whole prompt's square causal block; chunks and slices the Triton kernel,
        # whose compiled launch serves every shape (cuDNN builds a plan per new query and key count)
        chunk = _scores_never_exist(q) and (k.shape[0] > q.shape[0] or not whole) and q.shape[-1] in HEAD_DIMS
        implementation = "triton" if chunk else "sdpa"
    if implementation == "sdpa_split":
        return prefill_attention_split(q, k, v, scale)
    if implementation == "cudnn":
        return prefill_attention_split(q, k, v, scale, _cudnn_with_lse)
    if implementation == "triton":
        cu_q, cu_k = to_device([[0, q.shape[0]], [0, k.shape[0]]], torch.int32, q.device)  # no wait for the stream
        return prefill_attention(q, k, v, cu_q, cu_k, q.shape[0], scale, max_seqlen_k=k.shape[0])
    return attention_ref(q, k, v, scale, causal=True)


def prefill_chunks_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 cu_seqlens_k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill chunks of a ragged batch, in kernels.prefill_attention's layout: sequence b's queries
    q[cu_q[b]:cu_q[b+1]] are the last of its keys k[cu_k[b]:cu_k[b+1]] (positions [e - n_q, e) of [0, e)) and see
    keys up to their own position. q (total_q, Hq, d); k, v (total_k, Hkv, d); cu_seqlens (B + 1,) ->
    out (total_q, Hq, d) in q's dtype, lse (total_q, Hq): math in fp32."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for b in range(cu_seqlens_q.shape[0] - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]))
        q_b, k_b, v_b = q[qs:qe].float(), k[ks:ke].float(), v[ks:ke].float()
        out[qs:qe] = attention_ref(q_b, k_b, v_b, scale, causal=True)
        lse[qs:qe] = _causal_lse(q_b, k_b, scale)
    return out, lse


def _causal_lse(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Log of each query's softmax denominator, causal as in attention_ref: q (n_q, Hq, d), k (n_k, Hkv, d) ->
    (n_q, Hq)."""
    n_q, n_k = q.shape[0], k.shape[0]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (n_k, Hq, d)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (Hq, n_q, n_k)
    hidden = torch.arange(n_k, device=q.device) > torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
    return scores.masked_fill(hidden, float("-inf")).logsumexp(-1).T


def prefill_attention_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            kernel=None) -> torch.Tensor:
    """attention_ref(q, k, v, scale, causal=True) without a mask: the keys before the queries' chunk (every query
    sees them all) and the chunk's own keys (a square causal block) in two calls of `kernel` (SDPA's flash kernel by
    default; `_cudnn_with_lse`), merged by their log-sum-exps; a whole prompt is one causal call.
    q (n_q, Hq, d); k, v (n_k, Hkv, d) with n_k >= n_q -> (n_q, Hq, d)."""
    kernel = kernel or _flash_with_lse
    start = k.shape[0] - q.shape[0]
    q4 = q.transpose(0, 1).unsqueeze(0)  # (1, Hq, n_q, d)
    if start == 0:
        if kernel is _flash_with_lse:
            return attention_ref(q, k, v, scale, causal=True)
        return kernel(q4, k, v, scale, causal=True)[0].squeeze(0).transpose(0, 1)
    out_before, lse_before = kernel(q4, k[:start], v[:start], scale, causal=False)
    out_diag, lse_diag = kernel(q4, k[start:], v[start:], scale, causal=True)
    lse = torch.logaddexp(lse_before, lse_diag)  # (1, Hq, n_q) fp32
    out = (out_before.float() * (lse_before - lse).exp()[..., None]
           + out_diag.float() * (lse_diag - lse).exp()[..., None])
    return out.to(q.dtype).squeeze(0).transpose(0, 1)


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash kernel SDPA dispatches to, called directly because the public function drops its log-sum-exp; it
    takes GQA as is (keys and values not repeated). On CUDA in fp32, the memory-efficient kernel instead.
    q (1, Hq, n_q, d); k, v (n_k, Hkv, d) -> out (1, Hq, n_q, d), lse (1, Hq, n_q) fp32."""
    k, v = (t.transpose(0, 1).unsqueeze(0) for t in (k, v))  # (1, Hkv, n_k, d)
    if q.is_cuda and q.dtype == torch.float32:  # flash takes half precision only: the memory-efficient kernel
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                          scale=scale)[:2]
        return out, lse[..., :q.shape[2]]  # its log-sum-exps come padded to a multiple of its block
    if q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cudnn_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """_flash_with_lse by SDPA's cuDNN kernel (CUDA only, fp16 or bf16), the keys and values repeated to the query
    heads (its GQA needs them so). Same shapes and outputs."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0) for t in (k, v))  # (1, Hq, n_k, d)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                   scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])
