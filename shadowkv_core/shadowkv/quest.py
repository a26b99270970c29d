"""Quest-style chunk selection (Tang et al., ICML 2024), the baseline ShadowKV's landmarks are measured against.

Quest keeps, per chunk and KV head, the element-wise min and max of its post-RoPE keys, and scores a chunk by the
largest q·k any key inside those bounds could reach: sum over d of max(q_d·min_d, q_d·max_d). It is a selection
policy only: plugged into ShadowKVCache (`cache.chunk_scorer = QuestScorer()`), the chunks it picks are loaded and
attended as ShadowKV's own are; at full rank their keys are rebuilt exactly, as Quest reads them.

Shapes as in reference.py: n chunks, C chunk_size, Hq query heads, Hkv KV heads (G = Hq // Hkv), d head_dim.
"""
from __future__ import annotations

import torch

from shadowkv_core.shadowkv.manager import SequenceState


def chunk_bounds(k_rot: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise bounds of each chunk's keys. k_rot (n*C, Hkv, d) -> (k_min, k_max), each (n, Hkv, d)."""
    S, Hkv, d = k_rot.shape
    chunks = k_rot.view(S // chunk_size, chunk_size, Hkv, d)  # (n, C, Hkv, d)
    return chunks.amin(1), chunks.amax(1)


def quest_scores(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor, excluded: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Upper bound of each chunk's attention logit, per KV head (fp32).

    q (Hq, d), k_min / k_max (n, Hkv, d), excluded (Hkv, n) bool -> scores (Hkv, n): per query head the sum over d of
    max(q_d·min_d, q_d·max_d), times scale; the max over each GQA group; excluded chunks at -inf."""
    Hq, d = q.shape
    n, Hkv, _ = k_min.shape
    q = q.float().view(Hkv, Hq // Hkv, 1, d)  # (Hkv, G, 1, d)
    lo = q * k_min.float().permute(1, 0, 2)[:, None]  # (Hkv, G, n, d)
    hi = q * k_max.float().permute(1, 0, 2)[:, None]
    scores = torch.maximum(lo, hi).sum(-1).amax(1) * scale  # (Hkv, n)
    return scores.masked_fill(excluded, float("-inf"))


class QuestScorer:
    """ShadowKVCache's selection-policy hook: keeps the prompt chunks' bounds at prefill and scores with them."""

    def __init__(self):
        self.bounds: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (slot, layer) -> bounds

    def prefill(self, layer: int, st: SequenceState, q: torch.Tensor, k_rot: torch.Tensor, chunk_size: int,
                scale: float) -> None:
        """q (P, Hq, d), k_rot (P, Hkv, d): the whole prompt's; its first st.num_shadow chunks are the shadow's."""
        self.bounds[(st.slot, layer)] = chunk_bounds(k_rot[:st.num_shadow * chunk_size], chunk_size)

    def fold(self, st: SequenceState, k_rot: torch.Tensor, chunk_size: int) -> None:
        """The window's older half joins the shadow: its chunks' bounds follow. k_rot (L, h, Hkv, d), every layer."""
        for layer in range(k_rot.shape[0]):
            k_min, k_max = self.bounds[(st.slot, layer)]
            new_min, new_max = chunk_bounds(k_rot[layer], chunk_size)
            self.bounds[(st.slot, layer)] = torch.cat([k_min, new_min]), torch.cat([k_max, new_max])

    def scores(self, layer: int, st: SequenceState, q: torch.Tensor, excluded: torch.Tensor,
               scale: float) -> torch.Tensor:
        k_min, k_max = self.bounds[(st.slot, layer)]
        if k_min.shape[0] != st.num_shadow:
            raise ValueError(f"Quest bounds cover {k_min.shape[0]} shadow chunks, the sequence has {st.num_shadow}")
        return quest_scores(q, k_min, k_max, excluded, scale)
