"""ModelRunner: the device side of a step. Builds the ragged batch, runs the decoder, returns last-token logits.

A prefill is a PrefillJob: its prompts advance a few slices of a layer per engine step (DecoderLayer.prefill_slices:
projection rows, attention query chunks, the cache's layer work, MLP rows), as many as the step's FLOP budget buys,
so one long prompt never stalls the running decodes for a whole layer, let alone its whole prefill."""
from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from ..cache.base import AttentionMetadata, KVCache
from ..models.prefill_cost import PrefillBudget
from ..transfers import to_device
from .cuda_graphs import DecodeGraphs
from .sampler import token_logprobs
from .sequence import Sequence

PROMPT_LOGITS_ELEMENTS = 1 << 24  # prompt logprobs: logits computed a slice of rows at a time, rows × vocab at most


@dataclass
class PrefillJob:
    seqs: list[Sequence]
    meta: AttentionMetadata
    hidden: torch.Tensor  # (T, hidden) after layers [0, next_layer)
    budget: PrefillBudget
    next_layer: int = 0
    layer: Generator[None, None, torch.Tensor] | None = None  # layer next_layer's prefill_slices, once begun
    # once every layer has run: {index in seqs: sampler.token_logprobs of its prompt tokens after the first}, for the
    # sequences that ask for prompt logprobs
    prompt_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]

    def flops_left(self, num_layers: int) -> float:
        """Estimated FLOPs of the layers still to run (the one under way counted whole)."""
        per_layer = sum(self.budget.prompt(c, n) for c, n in zip(self.meta.context_lens, self.meta.query_lens))
        return per_layer * (num_layers - self.next_layer)

    def without(self, seq: Sequence) -> PrefillJob | None:
        """The job less one sequence (aborted mid-prefill); None if it was the last. The layer under way starts over
        (what it wrote to the cache for the others is written again, the same)."""
        keep = [i for i, s in enumerate(self.seqs) if s is not seq]
        if not keep:
            return None
        starts, lens = self.meta.query_starts, self.meta.query_lens
        rows = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in keep]).to(self.hidden.device)
        meta = self.meta.subset(keep, self.meta.positions[rows])
        return PrefillJob([self.seqs[i] for i in keep], meta, self.hidden[rows], self.budget, self.next_layer)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device, pipeline_min_batch: int = 0,
                 cuda_graphs: bool = False):
        self.model = model
        self.cache = cache
        self.device = device
        self.pipeline_min_batch = pipeline_min_batch  # decode batches this large in two pipelined halves; 0: never
        # Decode forwards replayed from CUDA graphs (CUDA only; RoPE whose frequencies follow each sequence's length
        # computes them inside the forward, so it runs eager).
        self.graphs = DecodeGraphs(self._decode_forward, cache) \
            if cuda_graphs and device.type == "cuda" and not model.rotary.uses_seq_lens else None

    @property
    def num_layers(self) -> int:
        return self.model.spec.num_layers

    @torch.inference_mode()
    def start_prefill(self, seqs: list[Sequence]) -> PrefillJob:
        """Embed the prompts of `seqs` past their cached prefixes, flattened; no layer has run yet."""
        cached = [seq.num_cached_tokens for seq in seqs]
        lens = [seq.prompt_len - c for seq, c in zip(seqs, cached)]
        input_ids = torch.tensor([t for seq, c in zip(seqs, cached) for t in seq.prompt_token_ids[c:]],
                                 dtype=torch.int64)
        positions = to_device(torch.cat([torch.arange(c, c + n) for c, n in zip(cached, lens)]), torch.int64,
                              self.device)
        meta = AttentionMetadata(True, [s.seq_id for s in seqs], lens, cached, positions)
        return PrefillJob(seqs, meta, self.model.embed_tokens(to_device(input_ids, torch.int64, self.device)),
                          PrefillBudget(self.model.rank_spec))

    @torch.inference_mode()
    def advance_prefill(self, job: PrefillJob, flops: float | None) -> torch.Tensor | None:
        """Run slices of the job's prefill worth about `flops` (estimated: models/prefill_cost.py; at least one slice;
        None: all that is left); once it has run every layer, (B, vocab) float32 logits of each prompt's last token
        (and the job's prompt_logprobs), else None."""
        job.budget.grant(math.inf if flops is None else flops)
        while job.next_layer < self.num_layers and job.budget.left > 0:
            if job.layer is None:
                job.layer = self.model.layers[job.next_layer].prefill_slices(
                    job.hidden, job.meta.positions, self.model.rope_seq_lens(job.meta), self.cache, job.meta,
                    job.budget)
                next(job.layer)  # to its first slice
            try:
                next(job.layer)  # one slice, and whatever follows it up to the next
            except StopIteration as done:
                job.hidden, job.next_layer, job.layer = done.value, job.next_layer + 1, None
        if job.next_layer < self.num_layers:
            return None
        self.cache.finish_forward(job.meta)
        job.prompt_logprobs = {i: self._prompt_logprobs(job, i) for i, seq in enumerate(job.seqs)
                               if seq.params.prompt_logprobs is not None}
        last = torch.tensor(job.meta.query_lens).cumsum(0) - 1
        return self.model.compute_logits(self.model.final_norm(job.hidden[to_device(last, torch.int64, self.device)]))

    def _prompt_logprobs(self, job: PrefillJob, i: int) -> torch.Tensor:
        """token_logprobs of job.seqs[i]'s prompt tokens after the first, each from the logits of the position
        before it; the logits are computed a slice at a time, so a long prompt never holds all of them."""
        seq, start = job.seqs[i], job.meta.query_starts[i]
        k = seq.params.prompt_logprobs
        targets = torch.tensor(seq.prompt_token_ids[1:], dtype=torch.int64).to(self.device)
        rows = max(1, PROMPT_LOGITS_ELEMENTS // self.model.spec.vocab_size)
        parts = [torch.empty(0, 2 + 2 * k, dtype=torch.float64, device=self.device)]
        for a in range(0, len(targets), rows):
            hidden = job.hidden[start + a:start + min(a + rows, len(targets))]
            logits = self.model.compute_logits(self.model.final_norm(hidden))
            parts.append(token_logprobs(logits, targets[a:a + rows], k))
        return torch.cat(parts)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], prev_tokens: torch.Tensor | None = None,
               prev_rows: list[int] | None = None) -> torch.Tensor:
        """One new token per sequence; returns (B, vocab) float32 logits. A sequence's input is its last token, or,
        where prev_rows[i] >= 0, row prev_rows[i] of the device tensor prev_tokens: the token that a step still
        running sampled for it, counted in its context though not yet in its output (LLMEngine's async decode).
        Nothing here waits for the device."""
        rows = prev_rows or [-1] * len(seqs)
        context = [seq.num_tokens - 1 + (row >= 0) for seq, row in zip(seqs, rows)]
        ints = to_device([[seq.last_token_id for seq in seqs], rows, context], torch.int64, self.device)
        input_ids = ints[0] if prev_tokens is None else \
            torch.where(ints[1] >= 0, prev_tokens[ints[1].clamp(min=0)], ints[0])
        meta = AttentionMetadata(False, [s.seq_id for s in seqs], [1] * len(seqs), context, ints[2])
        metas = meta.halves() if self._pipelined(meta) else (meta,)
        for m in metas:
            self.cache.prepare_forward(m)
        if self.graphs is None:
            logits = self._decode_forward(input_ids, meta)
        else:
            logits = self.graphs.run(input_ids, meta, metas)
        self.cache.finish_forward(meta)
        return logits

    def _pipelined(self, meta: AttentionMetadata) -> bool:
        return 2 <= self.pipeline_min_batch <= meta.num_seqs

    def _decode_forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        forward = self.model.forward_halves if self._pipelined(meta) else self.model
        return self.model.compute_logits(forward(input_ids, meta.positions, self.cache, meta))  # (B, vocab)
