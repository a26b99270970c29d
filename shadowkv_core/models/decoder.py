"""The decoder: embeddings, decoder layers, final norm and lm_head over the flattened tokens of a ragged batch."""
from __future__ import annotations

import torch
from torch import nn

from ..cache.base import AttentionMetadata, KVCache
from ..parallel import TensorParallel, rank_spec
from .layers import DecoderLayer, RMSNorm, chunked
from .rotary import RotaryEmbedding
from .spec import ModelSpec


class Decoder(nn.Module):
    """Parameters are allocated uninitialised on `device` in `dtype` (no random init of billions of weights);
    `load_model` fills them from the checkpoint.

    With tp, this rank's shard (parallel.py): its layers hold `rank_spec`'s heads and intermediate, and the embedding,
    norms and lm_head are replicated, so every rank computes the same logits and samples the same tokens."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 prefill_chunk_tokens: int = 8192, tp: TensorParallel | None = None):
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.rank_spec = spec if tp is None else rank_spec(spec, tp.size)  # what this rank's layers and cache hold
        self.chunk_tokens = prefill_chunk_tokens
        self.rotary = RotaryEmbedding(spec, device)
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(self.rank_spec, i, self.rotary, prefill_chunk_tokens, tp)
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
        seq_lens = self.rope_seq_lens(meta)
        for layer in self.layers:
            h = layer(h, positions, seq_lens, cache, meta)
        return self.final_norm(h)

    def rope_seq_lens(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """What the layers take as seq_lens for a forward: None unless RoPE follows each sequence's length (longrope,
        dynamic); else (T,) per token its sequence's length after this forward, what that RoPE decides on, so that
        each sequence of a ragged batch is rotated exactly as it would be alone."""
        if not self.rotary.uses_seq_lens:
            return None
        device = meta.positions.device
        lengths = torch.tensor([c + q for c, q in zip(meta.context_lens, meta.query_lens)], device=device)
        return lengths.repeat_interleave(torch.tensor(meta.query_lens, device=device))

    def forward_halves(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       meta: AttentionMetadata) -> torch.Tensor:
        """forward, over the batch's two halves (AttentionMetadata.halves) software-pipelined layer by layer: while one
        half's attention waits for what its cache fetches from the host (begun on side streams), the other half's
        previous layer finishes (attention, MLP) and its next one begins. Same results per token as forward; the
        weights are read once per half."""
        metas = meta.halves()
        rows = metas[0].positions.shape[0]
        h = list(self.embed_tokens(input_ids).split([rows, input_ids.shape[0] - rows]))
        pos = [m.positions for m in metas]
        lens = [self.rope_seq_lens(m) for m in metas]
        layers = self.layers

        def begin(half: int, i: int):
            return layers[i].begin(h[half], pos[half], lens[half], cache, metas[half])

        first = begin(0, 0)
        second = None
        for i in range(len(layers)):
            if i:
                h[1] = layers[i - 1].end(h[1], second, cache)
            second = begin(1, i)
            h[0] = layers[i].end(h[0], first, cache)
            if i + 1 < len(layers):
                first = begin(0, i + 1)
        h[1] = layers[-1].end(h[1], second, cache)
        return self.final_norm(torch.cat(h))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return chunked(self.norm, h, self.chunk_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, hidden) -> logits (n, vocab) in fp32."""
        return self.lm_head(hidden).float()
