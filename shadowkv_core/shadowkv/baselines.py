"""Two eviction baselines and an oracle as selection policies of the shadow (`ShadowKVCache.chunk_scorer`), as quest.py
is one.

- StreamingLLM (Xiao et al., ICLR 2024): the attention sinks, the first `sink_chunks` chunks, and the most recent
  chunks; its window of recent tokens continues into the cache's exact window.
- SnapKV (Li et al., 2024): the chunks that the prompt's last `window` queries attend to most, chosen once at prefill.
  Per KV head, each key's votes are its attention summed over the window's queries and averaged over the GQA group;
  a chunk's score is the sum of its keys' votes (the paper pools votes over neighbouring tokens: here the chunk).
  Chunks that generation folds into the shadow are never chosen: the choice is the prompt's, as in the paper.
- The chunk oracle: each chunk scored by the largest logit any of its keys gets from the query, max over the GQA
  group. It keeps every key of the prompt, so it is no method a server could run: it is what the best choice of
  chunks by their keys would keep, the ceiling a landmark or a bound is measured against.

All pick from the shadow's chunks, so the budget counts what ShadowKV's counts. The chunks they pick are loaded and
attended as ShadowKV's own are; benchmarks/accuracy.py runs them without outlier chunks and with the outliers' tokens
added to their budget, so that every method attends as many tokens.

Shapes as in reference.py: P prompt tokens, n chunks, C chunk_size, Hq query heads, Hkv KV heads, d head_dim.
"""
from __future__ import annotations

import torch

from shadowkv_core.shadowkv.manager import SequenceState


def streaming_scores(num_chunks: int, num_kv_heads: int, sink_chunks: int, excluded: torch.Tensor) -> torch.Tensor:
    """(Hkv, n) fp32: the sinks above every other chunk, the others by recency (the newest highest); excluded
    (Hkv, n) bool at -inf."""
    scores = torch.arange(num_chunks, dtype=torch.float32, device=excluded.device)
    scores[:sink_chunks] += num_chunks
    return scores.expand(num_kv_heads, num_chunks).masked_fill(excluded, float("-inf"))


def snapkv_votes(q: torch.Tensor, k_rot: torch.Tensor, num_chunks: int, chunk_size: int, window: int,
                 scale: float) -> torch.Tensor:
    """SnapKV's votes per chunk. q (P, Hq, d), k_rot (P, Hkv, d) -> (Hkv, n) fp32: the causal attention of the last
    `window` queries over the whole prompt, summed over those queries, averaged over each GQA group, summed over
    each of the first n chunks' tokens."""
    P, Hq, d = q.shape
    Hkv = k_rot.shape[1]
    w = min(window, P)
    q_win = q[P - w:].float().view(w, Hkv, Hq // Hkv, d)  # (w, Hkv, G, d)
    logits = torch.einsum("whgd,phd->hgwp", q_win, k_rot.float()) * scale  # (Hkv, G, w, P)
    future = torch.arange(P, device=q.device)[None] > torch.arange(P - w, P, device=q.device)[:, None]  # (w, P)
    votes = logits.masked_fill(future, float("-inf")).softmax(-1).sum(2).mean(1)  # (Hkv, P)
    return votes[:, :num_chunks * chunk_size].view(Hkv, num_chunks, chunk_size).sum(-1)


class StreamingScorer:
    """StreamingLLM's policy: it reads nothing at prefill or fold, only how many chunks the shadow holds."""

    def __init__(self, sink_chunks: int = 1):
        if sink_chunks < 0:
            raise ValueError(f"sink_chunks must be >= 0, got {sink_chunks}")
        self.sink_chunks = sink_chunks

    def prefill(self, layer: int, st: SequenceState, q: torch.Tensor, k_rot: torch.Tensor, chunk_size: int,
                scale: float) -> None:
        """Recency and sinks need nothing of the prompt."""

    def fold(self, st: SequenceState, k_rot: torch.Tensor, chunk_size: int) -> None:
        """Folded chunks are the newest: their rank follows from st.num_shadow."""

    def scores(self, layer: int, st: SequenceState, q: torch.Tensor, excluded: torch.Tensor,
               scale: float) -> torch.Tensor:
        return streaming_scores(st.num_shadow, excluded.shape[0], self.sink_chunks, excluded)


class SnapKVScorer:
    """SnapKV's policy: the prompt chunks' votes, kept per (slot, layer) at prefill."""

    def __init__(self, window: int = 32):
        if window < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        self.window = window
        self.votes: dict[tuple[int, int], torch.Tensor] = {}  # (slot, layer) -> (Hkv, n) of the prompt's shadow

    def prefill(self, layer: int, st: SequenceState, q: torch.Tensor, k_rot: torch.Tensor, chunk_size: int,
                scale: float) -> None:
        """q (P, Hq, d), k_rot (P, Hkv, d): the whole prompt's; its first st.num_shadow chunks are the shadow's."""
        self.votes[(st.slot, layer)] = snapkv_votes(q, k_rot, st.num_shadow, chunk_size, self.window, scale)

    def fold(self, st: SequenceState, k_rot: torch.Tensor, chunk_size: int) -> None:
        """Folded chunks get no votes (scores puts them at -inf): SnapKV chooses once, at prefill."""

    def scores(self, layer: int, st: SequenceState, q: torch.Tensor, excluded: torch.Tensor,
               scale: float) -> torch.Tensor:
        votes = self.votes[(st.slot, layer)]  # (Hkv, n_prompt)
        folded = votes.new_full((votes.shape[0], st.num_shadow - votes.shape[1]), float("-inf"))
        return torch.cat([votes, folded], 1).masked_fill(excluded, float("-inf"))


def max_logit_scores(q: torch.Tensor, keys: torch.Tensor, excluded: torch.Tensor, scale: float) -> torch.Tensor:
    """Each chunk's largest logit. q (Hq, d), keys (n, C, Hkv, d), excluded (Hkv, n) bool -> (Hkv, n) fp32: per query
    head the max over the chunk's keys of q·k·scale, then the max over each GQA group; excluded at -inf."""
    Hq, d = q.shape
    Hkv = keys.shape[2]
    logits = torch.einsum("hgd,nchd->hgnc", q.float().view(Hkv, Hq // Hkv, d), keys.float()) * scale
    return logits.amax(-1).amax(1).masked_fill(excluded, float("-inf"))


class ChunkOracleScorer:
    """The chunk oracle: every shadow chunk's post-RoPE keys, kept per (slot, layer) at prefill and fold."""

    def __init__(self):
        self.keys: dict[tuple[int, int], torch.Tensor] = {}  # (slot, layer) -> (n, C, Hkv, d)

    def prefill(self, layer: int, st: SequenceState, q: torch.Tensor, k_rot: torch.Tensor, chunk_size: int,
                scale: float) -> None:
        """k_rot (P, Hkv, d): the whole prompt's; its first st.num_shadow chunks are the shadow's."""
        self.keys[(st.slot, layer)] = k_rot[:st.num_shadow * chunk_size].unflatten(0, (st.num_shadow, chunk_size))

    def fold(self, st: SequenceState, k_rot: torch.Tensor, chunk_size: int) -> None:
        """k_rot (L, h, Hkv, d): the window's folded tokens, every layer."""
        for layer in range(k_rot.shape[0]):
            folded = k_rot[layer].unflatten(0, (-1, chunk_size))
            self.keys[(st.slot, layer)] = torch.cat([self.keys[(st.slot, layer)], folded])

    def scores(self, layer: int, st: SequenceState, q: torch.Tensor, excluded: torch.Tensor,
               scale: float) -> torch.Tensor:
        return max_logit_scores(q, self.keys[(st.slot, layer)], excluded, scale)
