"""What the small model's trainer measures and may train down, beside its language-model and answer losses: how far
ShadowKV's view of the keys is from the keys themselves.

The key tail (key_tail: the share of each layer's pre-RoPE key energy outside its top-r eigen-directions, r being
the rank ShadowKV keeps, key_rank), a factorised key projection (factorise_key_projections: every k_proj a product of
rank r, so its keys have that rank for any input), and three terms at the answer positions of a task row: the
landmark divergence (how far the softmax over chunk landmarks, what ShadowKV selects chunks by, is from the dense
attention's mass per chunk), the rank attention divergence (attention over the rank-r keys against dense) and the
rank logit error (the logit error of the rank-r keys, weighted by dense attention). KeyCapture collects the keys and
queries they read from a Hugging Face Llama's forward pass.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from shadowkv_core.shadowkv.reference import top_subspace

# The ShadowKV settings the small model is trained for; benchmarks/accuracy.py evaluates it with the same.
RANK_SHARE = 160 / 1024  # the paper's rank over Llama-3-8B's kv_heads*head_dim
CHUNK = 8  # tokens per chunk, as the paper
LOCAL_CHUNKS = 4  # chunks at the end of the prompt attended exactly

ANSWER_SLOT = 80  # tokens kept free after a task prompt for its answer and EOS (longest answer: 67 + EOS)
KEY_SUBSPACE_ITERS = 4  # subspace iterations for the top-r basis: few enough to stay cheap, enough to match eigh's tail
LANDMARK_CHUNK = CHUNK
LANDMARK_WINDOW = LOCAL_CHUNKS * CHUNK  # the end of a prompt a decode step attends exactly: no landmark stands for it


def key_rank(config) -> int:
    """The rank ShadowKV keeps of this model's pre-RoPE keys (all KV heads concatenated)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return max(1, round(RANK_SHARE * config.num_key_value_heads * head_dim))


class LowRankLinear(torch.nn.Module):
    """A bias-free linear map of rank <= `rank`, y = x downᵀ upᵀ, started from the truncated SVD of `weight`
    (out, in). `merged()` is the nn.Linear it equals, which is what is saved: the model stays a plain Llama."""

    def __init__(self, weight: torch.Tensor, rank: int):
        super().__init__()
        u, s, vh = torch.linalg.svd(weight.detach().float(), full_matrices=False)
        root = s[:rank].sqrt()
        self.down = torch.nn.Parameter(root[:, None] * vh[:rank])  # (rank, in)
        self.up = torch.nn.Parameter(u[:, :rank] * root)  # (out, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.down), self.up)

    def merged(self) -> torch.nn.Linear:
        linear = torch.nn.Linear(self.down.shape[1], self.up.shape[0], bias=False, device=self.up.device)
        with torch.no_grad():
            linear.weight.copy_(self.up @ self.down)
        return linear


def factorise_key_projections(model, rank: int) -> None:
    """Every layer's k_proj becomes a LowRankLinear of `rank`: its pre-RoPE keys then have rank <= `rank` for any
    input, rare tokens included (a penalty on the training keys' spectrum constrains only the keys it sees)."""
    for layer in model.model.layers:
        layer.self_attn.k_proj = LowRankLinear(layer.self_attn.k_proj.weight, rank)


def merge_key_projections(model) -> None:
    """Undo factorise_key_projections' modules (not its rank): plain nn.Linear k_proj, as transformers saves."""
    for layer in model.model.layers:
        if isinstance(layer.self_attn.k_proj, LowRankLinear):
            layer.self_attn.k_proj = layer.self_attn.k_proj.merged()


def key_tail(keys: torch.Tensor, rank: int, iters: int | None = None) -> torch.Tensor:
    """Share of each row's key energy outside its top-`rank` eigen-directions: ||K - K V Vᵀ||² / ||K||².

    keys (B, L, W) pre-RoPE keys, all KV heads concatenated (W = kv_heads*head_dim), as ShadowKV factorises them
    (shadowkv_core/shadowkv/reference.py factorize_keys: eigenvectors of KᵀK, uncentred) -> (B,) fp32. V is computed
    without gradient (top_subspace: exact with iters None, else that many subspace iterations); with V Vᵀ a
    projection the share is 1 - ||K V||² / ||K||², whose gradient moves energy into V's span."""
    k = keys.float()
    total = k.square().sum((1, 2)).clamp(min=1e-12)  # (B,)
    with torch.no_grad():
        top = top_subspace(k.transpose(1, 2) @ k, rank, iters).to(k.dtype)  # (B, W, r)
    return 1 - (k @ top).square().sum((1, 2)) / total


class KeyCapture:
    """Forward hooks on every layer's self_attn.k_proj (and with `queries`, q_proj) of a Hugging Face Llama: `keys`
    (and `queries`) hold their outputs, (B, L, W) each, from the latest forward pass."""

    def __init__(self, model, queries: bool = False):
        self.keys: list[torch.Tensor] = []
        self.queries: list[torch.Tensor] = []
        layers = model.model.layers
        self.handles = [layer.self_attn.k_proj.register_forward_hook(self._hook(self.keys)) for layer in layers]
        if queries:
            self.handles += [layer.self_attn.q_proj.register_forward_hook(self._hook(self.queries)) for layer in layers]

    @staticmethod
    def _hook(into: list):
        return lambda module, inputs, output: into.append(output)

    def take(self) -> list[torch.Tensor]:
        keys, self.keys[:] = list(self.keys), []
        return keys

    def take_queries(self) -> list[torch.Tensor]:
        queries, self.queries[:] = list(self.queries), []
        return queries

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x (..., d) as the trained Llama applies it (its rotate_half), cos/sin broadcast to x."""
    from transformers.models.llama.modeling_llama import rotate_half
    return x * cos + rotate_half(x) * sin


def low_rank(keys: torch.Tensor, rank: int, iters: int | None) -> torch.Tensor:
    """keys (B, L, W) fp32 -> their projection on each row's top-`rank` eigen-directions of KᵀK, as factorize_keys
    keeps them; the basis (top_subspace) carries no gradient, the keys do."""
    with torch.no_grad():
        basis = top_subspace(keys.transpose(1, 2) @ keys, rank, iters)  # (B, W, r)
    return (keys @ basis) @ basis.transpose(1, 2)


def answer_queries(queries: torch.Tensor, answer_mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   num_kv_heads: int, span: int = ANSWER_SLOT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The post-RoPE queries of each row's answer positions, grouped by KV head.

    queries (B, L, Hq*d) pre-RoPE; answer_mask (B, L) bool (a task row's answer positions follow each other; a text
    row has none); cos/sin (L, d) -> q (B, Hkv, G, A, d) fp32 at positions pos (B, A) (the `span` positions from each
    row's first answer position, clamped to the row) and weight (B, A): 1 where pos is an answer position, counted
    once."""
    B, L, _ = queries.shape
    d = cos.shape[-1]
    Hq = queries.shape[-1] // d
    first = answer_mask.int().argmax(1)  # (B,) first answer position (0 for text rows, whose weight is 0)
    pos = first[:, None] + torch.arange(span, device=queries.device)  # (B, A)
    weight = (answer_mask.gather(1, pos.clamp(max=L - 1)) & (pos < L)).float()
    pos = pos.clamp(max=L - 1)
    q = queries.float().view(B, L, Hq, d).gather(1, pos[..., None, None].expand(-1, -1, Hq, d))  # (B, A, Hq, d)
    q = rotate(q, cos[pos][:, :, None], sin[pos][:, :, None])
    return q.view(B, span, num_kv_heads, Hq // num_kv_heads, d).permute(0, 2, 3, 1, 4), pos, weight


def rotated_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """keys (B, L, Hkv*d) pre-RoPE -> (B, Hkv, L, d) fp32 post-RoPE."""
    B, L, _ = keys.shape
    return rotate(keys.float().view(B, L, num_kv_heads, -1).transpose(1, 2), cos, sin)


def causal_logits(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """q (B, Hkv, G, A, d) at positions pos (B, A), k (B, Hkv, L, d) -> scaled logits (B, Hkv, G, A, L), -inf past
    each query's position."""
    logits = torch.einsum("bhgad,bhld->bhgal", q, k) * q.shape[-1] ** -0.5
    future = torch.arange(k.shape[2], device=k.device) > pos[..., None]  # (B, A, L)
    return logits.masked_fill(future[:, None, None], float("-inf"))


def landmark_divergence(queries: torch.Tensor, keys: torch.Tensor, answer_mask: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, num_kv_heads: int, chunk: int = LANDMARK_CHUNK,
                        window: int = LANDMARK_WINDOW, span: int = ANSWER_SLOT) -> torch.Tensor:
    """How far ShadowKV's chunk scores are from the attention they stand for, at the answer positions of one layer.

    queries (B, L, Hq*d), keys (B, L, Hkv*d) pre-RoPE projections, answer_mask and span as in answer_queries;
    cos/sin (L, d) RoPE at positions 0..L-1. For each answer position t and query head: P, the dense attention's mass
    on each chunk of `chunk` tokens that ends `window` tokens or more before t (renormalised over those chunks; no
    gradient: the target), and Q, the softmax over the same chunks of the query against each chunk's landmark (mean
    post-RoPE key) — what ShadowKV ranks chunks by. Returns KL(P || Q) weighted by the mass P covers (attention that
    stays in the exact local window needs no landmark), averaged over answer positions and query heads: fp32, 0
    without answer positions."""
    B, L, _ = keys.shape
    q, pos, weight = answer_queries(queries, answer_mask, cos, sin, num_kv_heads, span)
    k = rotated_keys(keys, cos, sin, num_kv_heads)  # (B, Hkv, L, d)
    Hkv, G, d, n = q.shape[1], q.shape[2], q.shape[-1], L // chunk
    chunk_end = torch.arange(1, n + 1, device=keys.device) * chunk - 1  # (n,) last token of each chunk
    sparse = (chunk_end < pos[..., None] - window)[:, None, None]  # (B, 1, 1, A, n)
    with torch.no_grad():
        mass = causal_logits(q, k, pos).softmax(-1)
        mass = mass.view(B, Hkv, G, span, n, chunk).sum(-1) * sparse  # (B, Hkv, G, A, n)
        covered = mass.sum(-1)  # (B, Hkv, G, A)
        target = mass / covered[..., None].clamp(min=1e-9)
    landmarks = k.view(B, Hkv, n, chunk, d).mean(3)  # (B, Hkv, n, d)
    scores = (torch.einsum("bhgad,bhnd->bhgan", q, landmarks) * d ** -0.5).masked_fill(~sparse, -1e4)
    kl = (target * (target.clamp(min=1e-12).log() - scores.log_softmax(-1))).masked_fill(~sparse, 0).sum(-1)
    per_position = (kl * covered).sum((1, 2)) / (Hkv * G)  # (B, A)
    return (per_position * weight).sum() / weight.sum().clamp(min=1)


def rank_attention_divergence(queries: torch.Tensor, keys: torch.Tensor, answer_mask: torch.Tensor,
                              cos: torch.Tensor, sin: torch.Tensor, num_kv_heads: int, rank: int,
                              iters: int | None = KEY_SUBSPACE_ITERS, span: int = ANSWER_SLOT) -> torch.Tensor:
    """How far attention over ShadowKV's rank-`rank` keys is from dense attention, at the answer positions of one
    layer: KL(dense || rank-r) over each answer position's causal keys, averaged over answer positions and query
    heads (fp32, 0 without answer positions). The rank-r keys are each row's pre-RoPE keys (all KV heads
    concatenated) projected on the top-`rank` eigen-directions of their KᵀK (low_rank); the dense side is the target
    (no gradient). Unlike the key tail, which weighs every key's energy alike, this weighs the key error by what the
    queries that retrieve read of it."""
    q, pos, weight = answer_queries(queries, answer_mask, cos, sin, num_kv_heads, span)
    with torch.no_grad():
        target = causal_logits(q, rotated_keys(keys, cos, sin, num_kv_heads), pos).softmax(-1)
    low = rotated_keys(low_rank(keys.float(), rank, iters), cos, sin, num_kv_heads)
    log_low = causal_logits(q, low, pos).log_softmax(-1)
    kl = (target * (target.clamp(min=1e-30).log() - log_low.clamp(min=-1e4))).sum(-1)  # (B, Hkv, G, A); no 0·inf
    per_position = kl.mean((1, 2))  # (B, A)
    return (per_position * weight).sum() / weight.sum().clamp(min=1)


def rank_logit_error(queries: torch.Tensor, keys: torch.Tensor, answer_mask: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, num_kv_heads: int, rank: int, iters: int | None = KEY_SUBSPACE_ITERS,
                     span: int = ANSWER_SLOT) -> torch.Tensor:
    """The squared error rank-`rank` keys put into the attention logits of the answer positions of one layer, each
    key weighted by the dense attention it gets: sum_j p_j (q·(k_j - k_r,j) · scale)², averaged over answer
    positions and query heads (fp32, 0 without answer positions). Only the keys receive a gradient (queries,
    attention weights and the basis, as in rank_attention_divergence, are held fixed), so it cannot be lowered by
    making attention less sharp, only by moving what the retrieving queries read out of the discarded directions."""
    q, pos, weight = answer_queries(queries.detach(), answer_mask, cos, sin, num_kv_heads, span)
    with torch.no_grad():
        attn = causal_logits(q, rotated_keys(keys, cos, sin, num_kv_heads), pos).softmax(-1)  # (B, Hkv, G, A, L)
    k = keys.float()
    dropped = rotated_keys(k - low_rank(k, rank, iters), cos, sin, num_kv_heads)  # (B, Hkv, L, d)
    error = torch.einsum("bhgad,bhld->bhgal", q, dropped) * q.shape[-1] ** -0.5
    per_position = (attn * error.square()).sum(-1).mean((1, 2))  # (B, A)
    return (per_position * weight).sum() / weight.sum().clamp(min=1)
