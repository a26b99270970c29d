"""ModelRunner: the device side of a step. Builds the ragged batch, runs the decoder, returns last-token logits."""
from __future__ import annotations

import torch

from ..attention import AttentionMetadata, KVCache
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Whole prompts of `seqs`, flattened; returns (B, vocab) float32 logits of each prompt's last token."""
        lens = [seq.prompt_len for seq in seqs]
        input_ids = torch.tensor([t for seq in seqs for t in seq.prompt_token_ids], dtype=torch.int64)
        positions = torch.cat([torch.arange(n) for n in lens])
        meta = AttentionMetadata(True, [s.seq_id for s in seqs], lens, [0] * len(seqs), positions.to(self.device))
        last = torch.tensor(lens).cumsum(0) - 1
        return self._forward(input_ids, meta, last)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One new token per sequence (its last sampled one); returns (B, vocab) float32 logits."""
        context = [seq.num_tokens - 1 for seq in seqs]
        input_ids = torch.tensor([seq.last_token_id for seq in seqs], dtype=torch.int64)
        meta = AttentionMetadata(False, [s.seq_id for s in seqs], [1] * len(seqs), context,
                                 torch.tensor(context, dtype=torch.int64, device=self.device))
        return self._forward(input_ids, meta, torch.arange(len(seqs)))

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, last: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids.to(self.device), meta.positions, self.cache, meta)  # (T, H)
        self.cache.finish_forward(meta)
        return self.model.compute_logits(hidden[last.to(self.device)])
