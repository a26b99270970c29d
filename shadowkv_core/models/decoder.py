"""The decoder: embeddings, decoder layers, final norm and lm_head over the flattened tokens of a ragged batch."""
from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionMetadata, KVCache
from .layers import DecoderLayer, RMSNorm, chunked
from .rotary import RotaryEmbedding
from .spec import ModelSpec


class Decoder(nn.Module):
    """Parameters are allocated uninitialised on `device` in `dtype` (no random init of billions of weights);
    `load_model` fills them from the checkpoint."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 prefill_chunk_tokens: int = 8192):
        super().__init__()
        self.spec = spec
        self.chunk_tokens = prefill_chunk_tokens
        self.rotary = RotaryEmbedding(spec, device)
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(spec, i, self.rotary, prefill_chunk_tokens)
                                        for i in range(spec.num_layers))
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.to(dtype).to_empty(device=device)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, hidden)."""
        h = self.embed_tokens(input_ids)  # (T, hidden)
        h = self.forward_layers(h, positions, cache, meta, 0, self.spec.num_layers)
        return self.final_norm(h)

    def forward_layers(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                       start: int, end: int) -> torch.Tensor:
        """Layers [start, end) over hidden states h (T, hidden): a long prefill runs a few layers per engine step,
        between decode steps, instead of stalling them."""
        seq_lens = self._rope_seq_lens(meta, positions.device) if self.rotary.uses_seq_lens else None
        for layer in self.layers[start:end]:
            h = layer(h, positions, seq_lens, cache, meta)
        return h

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return chunked(self.norm, h, self.chunk_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, hidden) -> logits (n, vocab) in fp32."""
        return self.lm_head(hidden).float()

    @staticmethod
    def _rope_seq_lens(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
        """(T,) per token: its sequence's length after this forward, what longrope/dynamic RoPE decide on, so
        that each sequence of a ragged batch is rotated exactly as it would be alone."""
        lengths = torch.tensor([c + q for c, q in zip(meta.context_lens, meta.query_lens)], device=device)
        return lengths.repeat_interleave(torch.tensor(meta.query_lens, device=device))
