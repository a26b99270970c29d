"""Train the small long-context model this project ships (models/shadowkv-small), then score it densely.

A Llama-architecture decoder (RoPE theta 500K, GQA 3 query heads per KV head, RMSNorm, SwiGLU) over the byte-level
vocabulary, trained on one GPU with a length curriculum up to 16K tokens. Each step holds the same number of tokens:
rows of plain text (language-model loss on every token) and of the synthetic tasks of benchmarks/longctx_data.py
(language-model loss on the haystack, weighted down, plus the loss on the answer tokens). Optionally
(--key-rank-weight, off for the shipped model) a key low-rank regulariser: the share of each layer's pre-RoPE key
energy outside its top-r eigen-directions, r being the rank ShadowKV keeps (15.6 % of kv_heads*head_dim, as 160 is of
Llama-3-8B's 1024); and, off too, three terms at the answer positions: a landmark divergence (--landmark-weight: how
far the softmax over chunk landmarks, what ShadowKV selects chunks by, is from the dense attention's mass per chunk),
a rank attention divergence (--rank-attention-weight: attention over the rank-r keys against dense) and a rank logit
error (--rank-logit-weight: the logit error of the rank-r keys, weighted by dense attention). --key-proj-rank trains
each k_proj as a product of that rank (saved merged), so the pre-RoPE keys have that rank whatever the input. The log
reports every term at every log line either way; docs/accuracy.md says what they did. --init fine-tunes a saved model
instead of training from scratch (with --min-context, on the curriculum's longer stages only).
Deterministic given --seed and the corpus file. Data come from the training split and training seeds; the closing
evaluation (greedy, transformers, dense attention) from the held-out split and evaluation seeds.

    python -m benchmarks.longctx_data --write-corpus .cache/corpus.txt
    python -m benchmarks.train_small_model --corpus-file .cache/corpus.txt --out models/shadowkv-small
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.accuracy import CHUNK, LOCAL_CHUNKS, RANK_SHARE
from benchmarks.longctx_data import EOS, TASKS, TRAIN_SEED_BASE, answer_ids, make_sample, score, text_stream
from shadowkv_core.tiny_model import save_byte_tokenizer

# (row length in tokens, steps); every step holds --tokens-per-step tokens
CURRICULUM = ((512, 2000), (1024, 1500), (2048, 1000), (4096, 800), (8192, 600), (16384, 600))
ANSWER_SLOT = 80  # tokens kept free after a task prompt for its answer and EOS (longest answer: 67 + EOS)
TEXT_SHARE = 0.25  # share of rows that are plain text
LM_WEIGHT = 0.3  # weight of the language-model loss against the answer loss
EVAL_CONTEXTS = (1024, 2048, 4096, 8192, 16384)
KEY_SUBSPACE_ITERS = 4  # subspace iterations for the regulariser's top-r basis: its tail within 0.1 % of eigh's
LANDMARK_CHUNK = CHUNK  # the accuracy harness's ShadowKV chunk size
LANDMARK_WINDOW = LOCAL_CHUNKS * CHUNK  # its local chunks: the end of a prompt a decode step attends exactly


def model_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 262,
        "hidden_size": 384, "intermediate_size": 768, "num_hidden_layers": 6, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 257, "attention_bias": False, "mlp_bias": False,
    }


def build_model(seed: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in model_config().items() if k not in ("architectures", "torch_dtype")})
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(device)


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


def top_subspace(gram: torch.Tensor, rank: int, iters: int | None = None, oversample: int = 8) -> torch.Tensor:
    """Orthonormal bases of the top-`rank` eigen-directions of symmetric PSD matrices: gram (B, W, W) -> (B, W, rank).

    iters None: torch.linalg.eigh, exact (on CUDA it loops over the batch for W > 32: slow for training).
    iters n: n steps of subspace iteration from a fixed random start of rank+oversample columns, re-orthonormalised by
    Cholesky QR in fp64, then Rayleigh-Ritz (an eigh of (rank+oversample)² matrices, batched on CUDA up to 32):
    batched matrix products only, deterministic."""
    if iters is None:
        return torch.linalg.eigh(gram)[1][..., -rank:]  # ascending eigenvalues
    B, W, _ = gram.shape
    p = min(W, rank + oversample)
    g = gram.double()
    q = _orthonormal(g @ _random_start(W, p, g.device))
    for _ in range(iters):
        q = _orthonormal(g @ q)
    ritz = torch.linalg.eigh(q.transpose(1, 2) @ g @ q)[1][..., -rank:]  # (B, p, rank)
    return (q @ ritz).to(gram.dtype)


@functools.lru_cache(maxsize=None)
def _random_start(width: int, columns: int, device: torch.device) -> torch.Tensor:
    """A fixed random (width, columns) fp64 matrix, made once per device (no host-to-device copy per step)."""
    return torch.randn(width, columns, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(device)


def _orthonormal(y: torch.Tensor) -> torch.Tensor:
    """Cholesky QR (twice, for orthogonality) of y (B, W, p) fp64 -> Q (B, W, p) with Qᵀ Q = I, same column span."""
    for _ in range(2):
        gram = y.transpose(1, 2) @ y
        jitter = 1e-12 * gram.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None] * torch.eye(y.shape[2], device=y.device,
                                                                                          dtype=y.dtype)
        r = torch.linalg.cholesky_ex(gram + jitter, upper=True)[0]  # no host sync
        y = torch.linalg.solve_triangular(r, y, upper=True, left=False)
    return y


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


# ---------------------------------------------------------------- data

def task_row(rng: random.Random, length: int, seed: int, corpus_file: str | None):
    """(ids, lm_mask, answer_mask) of one task row; the masks mark the tokens whose prediction is scored."""
    sample = make_sample(rng.choice(TASKS), length - ANSWER_SLOT, seed, split="train", corpus_file=corpus_file)
    answer = answer_ids(sample)
    prompt, pad = len(sample.prompt_ids), length - len(sample.prompt_ids) - len(answer)
    ids = sample.prompt_ids + answer + [EOS] * pad
    lm_mask = [True] * (prompt - 1) + [False] * (length - prompt + 1)  # position t predicts ids[t + 1]
    answer_mask = [False] * (prompt - 1) + [True] * len(answer) + [False] * (pad + 1)
    return ids, lm_mask, answer_mask


class StepBatches(torch.utils.data.Dataset):
    """Item i is step i's rows, a function of (seed, i) alone, so loader workers build them in any order."""

    def __init__(self, stages: list[tuple[int, int]], args):
        self.lengths = [length for length, steps in stages for _ in range(steps)]
        self.seed, self.tokens_per_step, self.corpus_file = args.seed, args.tokens_per_step, args.corpus_file

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, step: int):
        """(ids (B, L) int64, lm_mask (B, L) bool, answer_mask (B, L) bool)."""
        length = self.lengths[step]
        rng = random.Random(f"batch:{self.seed}:{step}")
        rows = []
        for r in range(max(1, self.tokens_per_step // length)):
            row_seed = TRAIN_SEED_BASE + self.seed * 10_000_000 + step * 1000 + r
            if rng.random() < TEXT_SHARE:
                ids = text_stream(row_seed, length, self.corpus_file)
                rows.append((ids, [True] * (length - 1) + [False], [False] * length))
            else:
                rows.append(task_row(rng, length, row_seed, self.corpus_file))
        return tuple(torch.tensor(column) for column in zip(*rows))


def loss_fn(model, ids, lm_mask, answer_mask, capture: KeyCapture, rank: int, key_weight: float,
            key_iters: int | None = KEY_SUBSPACE_ITERS, measure: bool = True, landmark_weight: float = 0.0,
            rank_attention_weight: float = 0.0, rank_logit_weight: float = 0.0
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, terms): terms (detached) lm, answer, key tail (key_tail, averaged over layers and rows), landmark KL
    (landmark_divergence), rank attention KL (rank_attention_divergence) and rank logit error (rank_logit_error),
    the last three averaged over layers; each of the last four is computed when its weight is > 0 or `measure` (else
    0; the last three need a capture made with queries)."""
    capture.take()
    capture.take_queries()
    with torch.autocast("cuda" if ids.is_cuda else "cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits  # (B, L, V)
    keys, queries = capture.take(), capture.take_queries()
    zero = torch.zeros((), device=ids.device)
    terms = {"key tail": zero, "landmark KL": zero, "rank attention KL": zero, "rank logit error": zero}
    if key_weight > 0 or measure:
        with torch.set_grad_enabled(key_weight > 0 and torch.is_grad_enabled()):
            terms["key tail"] = key_tail(torch.cat(keys), rank, key_iters).mean()  # every layer's rows in one batch
    if queries:
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        cos, sin = (t[0] for t in model.model.rotary_emb(keys[0].float(), positions))
        heads = model.config.num_key_value_heads
        divergences = {
            "landmark KL": (landmark_weight, lambda q, k: landmark_divergence(q, k, answer_mask, cos, sin, heads)),
            "rank attention KL": (rank_attention_weight, lambda q, k: rank_attention_divergence(
                q, k, answer_mask, cos, sin, heads, rank, key_iters)),
            "rank logit error": (rank_logit_weight, lambda q, k: rank_logit_error(
                q, k, answer_mask, cos, sin, heads, rank, key_iters)),
        }
        for name, (weight, divergence) in divergences.items():
            if weight > 0 or measure:
                with torch.set_grad_enabled(weight > 0 and torch.is_grad_enabled()):
                    terms[name] = torch.stack([divergence(q, k) for q, k in zip(queries, keys)]).mean()
    targets = torch.roll(ids, -1, dims=1)
    token_loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")  # fp32 CE
    token_loss = token_loss.view_as(ids)
    # masked means, not boolean indexing: no host sync, so the CPU builds the next batch while the GPU works
    lm = (token_loss * lm_mask).sum() / lm_mask.sum().clamp(min=1)
    answer = (token_loss * answer_mask).sum() / answer_mask.sum().clamp(min=1)
    loss = (LM_WEIGHT * lm + answer + key_weight * terms["key tail"] + landmark_weight * terms["landmark KL"]
            + rank_attention_weight * terms["rank attention KL"] + rank_logit_weight * terms["rank logit error"])
    return loss, {"lm": lm.detach(), "answer": answer.detach(), **{k: v.detach() for k, v in terms.items()}}


# ---------------------------------------------------------------- training

def schedule(scale: float, max_context: int, min_context: int = 0) -> list[tuple[int, int]]:
    return [(length, max(1, round(steps * scale))) for length, steps in CURRICULUM
            if min_context <= length <= max_context]


def learning_rate(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, args, log) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=args.device == "cuda")
    batches = StepBatches(schedule(args.step_scale, args.max_context, args.min_context), args)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=args.workers,
                                         pin_memory=args.device == "cuda", prefetch_factor=4 if args.workers else None)
    capture, rank = KeyCapture(model, queries=True), key_rank(model.config)
    total, start = len(batches), time.time()
    for step, tensors in enumerate(loader):
        if time.time() - start > args.max_minutes * 60:
            log(f"time limit reached at step {step}/{total}: stopped early")
            capture.close()
            return {"steps": step, "planned_steps": total, "seconds": time.time() - start, "key_rank": rank}
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, total, args.lr)
        logged = step % args.log_every == 0 or step == total - 1
        loss, terms = loss_fn(model, *(t.to(args.device, non_blocking=True) for t in tensors), capture, rank,
                              args.key_rank_weight, None if args.key_subspace_iters < 0 else args.key_subspace_iters,
                              logged, args.landmark_weight, args.rank_attention_weight, args.rank_logit_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if logged:
            shown = " ".join(f"{name} {value.item():.3f}" for name, value in terms.items())
            log(f"step {step:5d}/{total} len {tensors[0].shape[1]:5d} {shown} (rank {rank}) "
                f"{time.time() - start:6.1f}s")
    capture.close()
    return {"steps": total, "planned_steps": total, "seconds": time.time() - start, "key_rank": rank}


# ---------------------------------------------------------------- dense evaluation and saving

@torch.no_grad()
def dense_eval(model, contexts, samples: int, device: str) -> list[dict]:
    """Greedy answers of the held-out samples (evaluation seeds 0..samples-1), one row per task and context."""
    rows = []
    for context in contexts:
        for task in TASKS:
            batch_samples = [make_sample(task, context, seed) for seed in range(samples)]
            texts = []
            per_batch = max(1, 65536 // context)
            for i in range(0, samples, per_batch):
                texts += greedy(model, [s.prompt_ids for s in batch_samples[i:i + per_batch]], device)
            value = sum(score(s, t) for s, t in zip(batch_samples, texts)) / len(texts)
            rows.append({"task": task, "context": context, "method": "dense", "budget": 1.0, "score": value,
                         "samples": len(texts)})
    return rows


def greedy(model, prompts: list[list[int]], device: str) -> list[str]:
    """Greedy completions of equal-length prompts (no padding, so SDPA stays causal without a mask)."""
    ids = torch.tensor(prompts, device=device)
    with torch.autocast("cuda" if ids.is_cuda else "cpu", dtype=torch.bfloat16):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER_SLOT,
                             do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
    return [bytes(t for t in row.tolist() if t < 256).decode("ascii", "replace") for row in out[:, ids.shape[1]:]]


def save(model, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    save_byte_tokenizer(out)


def model_card(command: str, info: dict, rows: list[dict]) -> str:
    table = "\n".join(f"| {r['task']} | {r['context']} | {r['score']:.1f} | {r['samples']} |" for r in rows)
    trained = f"Fine-tuned from the model then in `{info['init']}`" if info["init"] else "Trained"
    return f"""# shadowkv-small

A {info['parameters'] / 1e6:.1f}M-parameter Llama-architecture decoder over bytes (vocab 262), trained from scratch by
this project for retrieval over long contexts (up to 16K tokens) on licences, Debian copyright files and Python stdlib
sources plus the synthetic tasks of `benchmarks/longctx_data.py`. It knows nothing else: use it to measure what a
sparse KV cache keeps, not as an assistant. Weights in bfloat16.

{trained} with `{command}`
({info['steps']} of {info['planned_steps']} steps, {info['seconds']:.0f} s on {info['device']}).

Dense greedy scores (0-100) on held-out text and evaluation seeds, transformers, bfloat16:

| task | context | score | samples |
|---|---|---|---|
{table}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/shadowkv-small")
    parser.add_argument("--results", default="benchmarks/results/train_small_model.json", help="dense scores (JSON)")
    parser.add_argument("--corpus-file", default=None, help="frozen haystack text (longctx_data --write-corpus)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--tokens-per-step", type=int, default=65536)
    parser.add_argument("--max-context", type=int, default=CURRICULUM[-1][0], help="drop longer curriculum stages")
    parser.add_argument("--min-context", type=int, default=0, help="drop shorter curriculum stages")
    parser.add_argument("--init", default=None,
                        help="start from this saved model (fine-tuning) instead of from scratch")
    parser.add_argument("--step-scale", type=float, default=1.0, help="multiplies every stage's step count")
    parser.add_argument("--max-minutes", type=float, default=7.0, help="stop training (and say so) past this")
    parser.add_argument("--key-rank-weight", type=float, default=0.0,
                        help="weight of the key low-rank regulariser (0: none, the shipped model; 1 was tried)")
    parser.add_argument("--landmark-weight", type=float, default=0.0,
                        help="weight of the landmark divergence at answer positions (0: none)")
    parser.add_argument("--rank-attention-weight", type=float, default=0.0,
                        help="weight of the divergence of rank-r keys' attention from dense at answer positions")
    parser.add_argument("--rank-logit-weight", type=float, default=0.0,
                        help="weight of the attention-weighted logit error of rank-r keys at answer positions")
    parser.add_argument("--key-proj-rank", type=int, default=0,
                        help="train every k_proj as a product of this rank (0: full rank); saved merged")
    parser.add_argument("--key-subspace-iters", type=int, default=KEY_SUBSPACE_ITERS,
                        help="subspace iterations for the regulariser's basis (-1: exact eigh, slow on CUDA)")
    parser.add_argument("--log-every", type=int, default=100, help="steps between log lines")
    parser.add_argument("--workers", type=int, default=6, help="data loader processes")
    parser.add_argument("--eval-samples", type=int, default=20)
    parser.add_argument("--eval-contexts", type=int, nargs="+", default=list(EVAL_CONTEXTS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    command = "python -m benchmarks.train_small_model " + " ".join(sys.argv[1:])
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    if args.init:
        from transformers import AutoModelForCausalLM
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32).to(args.device)
    else:
        model = build_model(args.seed, args.device)
    if args.key_proj_rank:
        factorise_key_projections(model, args.key_proj_rank)
    info = train(model, args, log)
    merge_key_projections(model)
    info.update(init=args.init, key_proj_rank=args.key_proj_rank, key_rank_weight=args.key_rank_weight,
                landmark_weight=args.landmark_weight,
                rank_attention_weight=args.rank_attention_weight, rank_logit_weight=args.rank_logit_weight,
                device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                parameters=sum(p.numel() for p in model.parameters()))
    save(model.eval(), Path(args.out))  # before the evaluation, so a run cut short still leaves the weights
    rows = dense_eval(model, args.eval_contexts, args.eval_samples, args.device)
    (Path(args.out) / "README.md").write_text(model_card(command, info, rows))
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    result = {"command": command, **info, "versions": versions, "rows": rows}
    Path(args.results).write_text(json.dumps(result, indent=1))
    log(f"{'task':20s} " + " ".join(f"{c:>6d}" for c in args.eval_contexts))
    for task in TASKS:
        log(f"{task:20s} " + " ".join(f"{r['score']:6.1f}" for r in rows if r["task"] == task))


if __name__ == "__main__":
    main()
