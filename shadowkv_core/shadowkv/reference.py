"""ShadowKV, one pure function per step: the executable documentation and the oracle of the Triton kernels.

Shapes: S tokens, C chunk_size, n chunks, Hq query heads, Hkv KV heads (G = Hq // Hkv per group), d head_dim,
r rank, K budget chunks, O outlier chunks. Math that loses precision in low precision (Gram matrix, eigh, RoPE,
rebuild, softmax over landmarks) runs in fp32; results come back in the inputs' dtype unless said otherwise.
"""
from __future__ import annotations

import functools

import torch

from shadowkv_core.attention import attention_ref


SUBSPACE_ITERS = 12  # factorize_keys' subspace iterations on KᵀK, a (Hkv·d)² matrix: none reads the keys again


def factorize_keys(k_pre: torch.Tensor, rank: int,
                   iters: int | None = SUBSPACE_ITERS) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-r factorisation of one layer's pre-RoPE keys, all KV heads concatenated.

    k_pre (S, Hkv, d) -> U (S, r) fp32, SV (Hkv, r, d) fp32, with k_pre[:, h] ~= U @ SV[h].
    K_cat (S, Hkv*d) = U V_rᵀ where V_r (Hkv*d, r) is an orthonormal basis of the top-r eigen-directions of
    K_catᵀ K_cat (the right singular vectors' span, without an SVD): top_subspace, by `iters` steps of subspace
    iteration without oversampling (randomized, as the ShadowKV authors' low-rank SVD; no eigh, so nothing waits for
    the device), or exactly by eigh with iters None. U = K_cat V_r. At r = Hkv*d the basis is the whole space and
    the rebuild exact."""
    S, Hkv, d = k_pre.shape
    k_flat = k_pre.reshape(S, Hkv * d)
    k_cat = k_flat.float()  # (S, Hkv*d)
    exact = iters is None or rank >= Hkv * d
    v_r = top_subspace(_gram(k_flat, k_cat)[None], rank, None if exact else iters, oversample=0)[0]  # (Hkv*d, r)
    u = k_cat @ v_r  # (S, r)
    sv = v_r.T.reshape(rank, Hkv, d).transpose(0, 1).contiguous()  # (Hkv, r, d)
    return u, sv


def top_subspace(gram: torch.Tensor, rank: int, iters: int | None = None, oversample: int = 8) -> torch.Tensor:
    """Orthonormal bases of the top-`rank` eigen-directions of symmetric PSD matrices: gram (B, W, W) -> (B, W, rank).

    iters None: torch.linalg.eigh, exact (on CUDA it loops over the batch for W > 32: slow for training).
    iters n: n steps of subspace iteration from a fixed random start of rank+oversample columns, re-orthonormalised by
    one Cholesky QR pass each in fp64 (two for the basis returned), then Rayleigh-Ritz (an eigh of (rank+oversample)²
    matrices, batched on CUDA up to 32): batched matrix products only, deterministic. With no oversampling
    Rayleigh-Ritz would only rotate the basis within its span: it is skipped, and nothing waits for the device
    (torch's eigh checks the solver's status on the host); the columns are then an orthonormal basis of the span, not
    its eigenvectors."""
    if iters is None:
        return torch.linalg.eigh(gram)[1][..., -rank:]  # ascending eigenvalues
    B, W, _ = gram.shape
    p = min(W, rank + oversample)
    g = gram.double()
    q = _orthonormal(g @ _random_start(W, p, g.device), 1 if iters else 2)
    for i in range(iters):
        q = _orthonormal(g @ q, 2 if i == iters - 1 else 1)
    if p == rank:
        return q.to(gram.dtype)
    ritz = torch.linalg.eigh(q.transpose(1, 2) @ g @ q)[1][..., -rank:]  # (B, p, rank)
    return (q @ ritz).to(gram.dtype)


@functools.lru_cache(maxsize=None)
def _random_start(width: int, columns: int, device: torch.device) -> torch.Tensor:
    """A fixed random (width, columns) fp64 matrix, made once per device (no host-to-device copy per step)."""
    return torch.randn(width, columns, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(device)


def _gram(k: torch.Tensor, k32: torch.Tensor) -> torch.Tensor:
    """kᵀk in fp32 for k (S, W) and its fp32 copy k32: bf16 keys on CUDA by a tensor-core product of their own with
    fp32 output (each product exact in fp32, the sums in fp32), else from k32."""
    if k.is_cuda and k.dtype == torch.bfloat16:
        return torch.mm(k.T, k, out_dtype=torch.float32)
    return k32.T @ k32


def _orthonormal(y: torch.Tensor, passes: int) -> torch.Tensor:
    """Cholesky QR of y (B, W, p) fp64 -> Q (B, W, p), same column span: Qᵀ Q = I to rounding with two passes; one
    pass leaves it near I, enough between subspace iterations. Columns are normalised before each pass, so that a
    direction the keys lack (a tiny column) is not lost to the jitter beside the large ones."""
    for _ in range(passes):
        y = y / y.norm(dim=1, keepdim=True).clamp_min(1e-300)
        gram = y.transpose(1, 2) @ y
        jitter = 1e-12 * gram.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None] * torch.eye(y.shape[2], device=y.device,
                                                                                          dtype=y.dtype)
        r = torch.linalg.cholesky_ex(gram + jitter, upper=True)[0]  # no host sync
        y = torch.linalg.solve_triangular(r, y, upper=True, left=False)
    return y


def project_keys(k_pre: torch.Tensor, sv: torch.Tensor) -> torch.Tensor:
    """U rows of new tokens on an existing basis (folding generated tokens into the shadow).

    k_pre (n, Hkv, d), SV (Hkv, r, d) -> U rows (n, r) fp32: K_cat V_r, V_r's rows being SV's rows per head."""
    return torch.einsum("nhd,hrd->nr", k_pre.float(), sv.float())


def chunk_landmarks(k_rot: torch.Tensor, chunk_size: int, kind: str = "mean") -> torch.Tensor:
    """Landmarks of each chunk's post-RoPE keys (ShadowKVConfig.landmark_kind). k_rot (n*C, Hkv, d) -> "mean":
    their mean (n, Hkv, d); "bounds": their per-dimension centre and half-range side by side (n, Hkv, 2d), which
    scoring_query's [q, |q|] turns into the bound q·centre + |q|·half-range >= q·k of every key k of the chunk."""
    S, Hkv, d = k_rot.shape
    chunks = k_rot.float().view(S // chunk_size, chunk_size, Hkv, d)  # (n, C, Hkv, d)
    if kind == "mean":
        return chunks.mean(1).to(k_rot.dtype)
    low, high = chunks.amin(1), chunks.amax(1)
    return torch.cat([(high + low) / 2, (high - low) / 2], -1).to(k_rot.dtype)


def scoring_query(q: torch.Tensor, kind: str) -> torch.Tensor:
    """The query a landmark of this kind is scored with: q (..., d) itself for a mean, [q, |q|] (..., 2d) for
    bounds (q·centre + |q|·half-range is, per dimension, the larger of q times either bound)."""
    return q if kind == "mean" else torch.cat([q, q.abs()], -1)


def find_outlier_chunks(k_rot: torch.Tensor, chunk_size: int, num_outliers: int) -> torch.Tensor:
    """Per KV head, the chunks whose tokens are worst approximated by their mean (whatever landmark is kept).

    k_rot (n*C, Hkv, d) -> chunk ids (Hkv, O) int64, ascending: the O chunks with the lowest minimum cosine
    similarity between a token and its chunk's mean."""
    S, Hkv, d = k_rot.shape
    chunks = k_rot.float().view(S // chunk_size, chunk_size, Hkv, d)  # (n, C, Hkv, d)
    cos = torch.cosine_similarity(chunks, chunks.mean(1, keepdim=True), dim=-1)  # (n, C, Hkv)
    worst = cos.amin(1).T  # (Hkv, n)
    ids = worst.topk(num_outliers, dim=-1, largest=False).indices  # (Hkv, O)
    return ids.sort(-1).values


def landmark_scores(q: torch.Tensor, landmarks: torch.Tensor, excluded: torch.Tensor, scale: float) -> torch.Tensor:
    """How much each chunk matters to one sequence's decode query, per KV head.

    q (Hq, d), landmarks (n, Hkv, d), excluded (Hkv, n) bool (outlier chunks, attended exactly anyway); bounds
    landmarks (n, Hkv, 2d) take scoring_query's q (Hq, 2d)
    -> scores (Hkv, n) fp32: softmax over the sequence's chunks of q·landmarksᵀ·scale per query head, excluded
    chunks at -inf, then the max over each GQA group. Excluded chunks score -inf, so top-k never picks them."""
    Hq, d = q.shape
    n, Hkv, _ = landmarks.shape
    q = q.float().view(Hkv, Hq // Hkv, d)  # (Hkv, G, d)
    logits = torch.einsum("hgd,nhd->hgn", q, landmarks.float()) * scale  # (Hkv, G, n)
    logits = logits.masked_fill(excluded[:, None, :], float("-inf"))
    scores = logits.softmax(-1).amax(1)  # (Hkv, n)
    return scores.masked_fill(excluded, float("-inf"))


def select_chunks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k chunks per KV head. scores (Hkv, n) -> chunk ids (Hkv, k) int64, by score descending; equal scores go
    to the lower chunk id (the first k of a stable sort), as kernels.topk does: torch.topk leaves ties unspecified,
    and a head whose scores are all equal (a uniform softmax) is all ties."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def assign_slots(resident: torch.Tensor, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable slots for this step's chunks: a hit keeps its slot and is neither rebuilt nor fetched.

    resident (Hkv, K) chunk id held by each slot since the last step, -1 for empty; selected (Hkv, k), k <= K,
    distinct ids per head -> new_resident (Hkv, K), miss_mask (Hkv, K) bool (slots that must be rebuilt/fetched).
    Per head, the j-th missed chunk (in `selected` order) goes to the j-th slot (in slot order) whose chunk is no
    longer selected; free slots left over become empty (-1)."""
    Hkv, k = selected.shape
    kept = (resident[:, :, None] == selected[:, None, :]).any(2)  # (Hkv, K) slot's chunk still selected
    is_miss = ~(selected[:, :, None] == resident[:, None, :]).any(2)  # (Hkv, k)
    misses_first = torch.argsort((~is_miss).to(torch.int8), dim=1, stable=True)  # (Hkv, k)
    miss_ids = selected.gather(1, misses_first)  # (Hkv, k): the misses first, in selected order
    miss_ids = torch.cat([miss_ids, selected.new_full((Hkv, 1), -1)], 1)  # (Hkv, k+1): column k is "empty"
    free = ~kept
    free_rank = free.long().cumsum(1) - 1  # (Hkv, K) index of each free slot among its head's free slots
    miss_mask = free & (free_rank < is_miss.sum(1, keepdim=True))
    incoming = miss_ids.gather(1, torch.where(miss_mask, free_rank, k))  # (Hkv, K)
    new_resident = torch.where(kept, resident, incoming)
    return new_resident, miss_mask


def rebuild_keys(u_rows: torch.Tensor, sv: torch.Tensor, positions: torch.Tensor, rotary,
                 rope_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Post-RoPE keys of M missed chunks from their U rows (fp32 math).

    u_rows (M, C, r), sv (M, r, d) the SV of the KV head each chunk is rebuilt for, positions (M, C) int64 true
    token positions -> keys (M, C, d) fp32 = RoPE(U[rows] · SV[h]). `rotary.apply(x (n, h, d), positions (n,))`
    rotates each token at its position; every (chunk, token) is passed as one token of one head. rope_lens (M, C):
    for RoPE whose frequencies depend on the sequence length (longrope, dynamic), the length each key was first
    rotated with, passed on as `apply`'s third argument."""
    M, C, _ = u_rows.shape
    d = sv.shape[-1]
    k_pre = torch.bmm(u_rows.float(), sv.float()).view(M * C, 1, d)  # (M*C, 1, d)
    if rope_lens is None:
        k_rot = rotary.apply(k_pre, positions.reshape(M * C))
    else:
        k_rot = rotary.apply(k_pre, positions.reshape(M * C), rope_lens.reshape(M * C))
    return k_rot.float().view(M, C, d)


def meet_landmarks(keys: torch.Tensor, landmarks: torch.Tensor, kind: str) -> torch.Tensor:
    """Rebuilt chunks moved onto their landmarks (ShadowKVConfig.landmark_rebuild). keys (M, C, d) fp32 post-RoPE,
    landmarks (M, d or 2d) of the same chunks' exact keys -> (M, C, d): "mean": shifted so that their mean is the
    landmark; "bounds": clamped into centre +- half-range, per key and dimension (no reduction over the chunk)."""
    d = keys.shape[-1]
    lm = landmarks.float()
    if kind == "mean":
        return keys + (lm - keys.mean(1))[:, None]
    centre, half = lm[:, None, :d], lm[:, None, d:]
    return torch.minimum(torch.maximum(keys, centre - half), centre + half)


def paged_rows(pages: torch.Tensor, page_table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of a paged buffer. pages (num_pages, page_rows, *row), page_table (seq_pages,) physical page of each
    logical page of one sequence, rows (*idx) logical row ids -> (*idx, *row)."""
    page_rows = pages.shape[1]
    return pages[page_table[rows // page_rows], rows % page_rows]


def gather_values(host_values: torch.Tensor, page_table: torch.Tensor, chunk_ids: torch.Tensor,
                  heads: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Values of M (chunk, KV head) pairs of one sequence and layer, read from the host store.

    host_values (num_pages, page_tokens, Hkv, d) one layer of the store, page_table (seq_pages,) int64, chunk_ids (M,),
    heads (M,) -> (M, C, d), on host_values' device (the caller moves them to the GPU slot)."""
    positions = chunk_ids[:, None] * chunk_size + torch.arange(chunk_size, device=chunk_ids.device)  # (M, C)
    page_tokens = host_values.shape[1]
    pages = page_table[positions // page_tokens]  # (M, C)
    return host_values[pages, positions % page_tokens, heads[:, None]]


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value


def quantize_values(v: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 values with one fp32 scale per chunk and KV head (the chunk is what a decode step fetches).

    v ([L,] n*C, Hkv, d) -> values, same shape, float8_e4m3fn, and scales ([L,] n, Hkv) fp32, with
    v ~= values * scale: each chunk's largest magnitude per head maps to FP8_MAX."""
    x = v.to(torch.float32, copy=True).unflatten(-3, (-1, chunk_size))  # ([L,] n, C, Hkv, d): the one fp32 copy
    # times the reciprocal, as CUDA divides a tensor by a number: the same scales on every device
    scales = (x.abs().amax(dim=(-3, -1)) * (1 / FP8_MAX)).clamp_min(torch.finfo(torch.float32).tiny)  # ([L,] n, Hkv)
    values = x.div_(scales[..., None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return values.flatten(-4, -3), scales


def dequantize_values(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (..., C, d) fp8, scales (...) fp32 -> (..., C, d) in dtype: fp32 product, one rounding (as the
    kernel)."""
    return (values.float() * scales[..., None, None]).to(dtype)


def dequantize_tokens(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (n, Hkv, d) fp8 with one scale per token and KV head, scales (n, Hkv) -> (n, Hkv, d) in dtype."""
    return dequantize_values(values.unsqueeze(-2), scales, dtype).squeeze(-2)  # chunks of one token: (n, Hkv, 1, d)


def gather_scales(host_scales: torch.Tensor, page_table: torch.Tensor, chunk_ids: torch.Tensor,
                  heads: torch.Tensor) -> torch.Tensor:
    """Scales of M (chunk, KV head) pairs of one sequence and layer: host_scales (num_pages, page_chunks, Hkv),
    page_table (seq_pages,), chunk_ids, heads (M,) -> (M,) fp32."""
    page_chunks = host_scales.shape[1]
    return host_scales[page_table[chunk_ids // page_chunks], chunk_ids % page_chunks, heads]


def sparse_decode_attention_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                scale: float) -> torch.Tensor:
    """One sequence's decode attention over its selected keys: q (Hq, d), keys/values (Hkv, n, d) (each KV head its
    own n keys: outliers | selected chunks | local + generated) -> (Hq, d). attention_ref semantics, GQA."""
    out = attention_ref(q[None], keys.transpose(0, 1), values.transpose(0, 1), scale, causal=False)  # (1, Hq, d)
    return out[0]
