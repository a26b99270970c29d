"""HybridCache: a ShadowKV engine's cache. Sequences whose prompt and generation fit in ShadowKVConfig.min_context
tokens stay in a dense cache (ShadowKV pays off on long contexts only); the others are kept in shadows. Each forward's
ragged batch is split between the two and the outputs are put back in batch order."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shadowkv_core.cache.base import AttentionMetadata, CacheManager, KVCache
from shadowkv_core.cache.dense import DenseKVCache, DenseManager
from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.shadowkv.cache import ShadowKVCache
from shadowkv_core.shadowkv.manager import ShadowKVManager
from shadowkv_core.transfers import to_device


class HybridManager(CacheManager):
    def __init__(self, config: ShadowKVConfig, dense: DenseManager, shadow: ShadowKVManager):
        self.config, self.dense, self.shadow = config, dense, shadow

    def _side(self, prompt_len: int, max_new_tokens: int) -> CacheManager:
        """Decided on the whole length: a short prompt with a long generation is kept in shadows from the start."""
        return self.dense if self.config.stays_dense(prompt_len, max_new_tokens) else self.shadow

    def can_allocate(self, prompt_len: int, max_new_tokens: int, prompt_token_ids: list[int] | None = None) -> bool:
        return self._side(prompt_len, max_new_tokens).can_allocate(prompt_len, max_new_tokens, prompt_token_ids)

    def cached_prefix_len(self, prompt_len: int, max_new_tokens: int, prompt_token_ids: list[int] | None) -> int:
        return self._side(prompt_len, max_new_tokens).cached_prefix_len(prompt_len, max_new_tokens, prompt_token_ids)

    def fits_when_empty(self, prompt_len: int, max_new_tokens: int) -> bool:
        return self._side(prompt_len, max_new_tokens).fits_when_empty(prompt_len, max_new_tokens)

    def footprint(self, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
        return self._side(prompt_len, max_new_tokens).footprint(prompt_len, max_new_tokens)

    def allocate(self, seq_id: int, prompt_len: int, max_new_tokens: int,
                 prompt_token_ids: list[int] | None = None) -> int:
        if seq_id in self.shadow.seqs or seq_id in self.dense.block_tables:
            raise ValueError(f"sequence {seq_id} is already allocated")
        return self._side(prompt_len, max_new_tokens).allocate(seq_id, prompt_len, max_new_tokens, prompt_token_ids)

    def free(self, seq_id: int, token_ids: list[int] | None = None) -> None:
        (self.shadow if seq_id in self.shadow.seqs else self.dense).free(seq_id, token_ids)

    def clear_prefix_cache(self) -> int:
        return self.dense.clear_prefix_cache() + self.shadow.clear_prefix_cache()

    def in_shadow(self, seq_id: int) -> bool:
        return seq_id in self.shadow.seqs

    def usage(self) -> dict[str, int]:
        dense, shadow = self.dense.usage(), self.shadow.usage()
        return {key: dense.get(key, 0) + shadow.get(key, 0) for key in {**shadow, **dense}}


@dataclass
class BatchSplit:
    """A forward's sequences split between the two caches: each side's metadata (None: no sequence there; the whole
    forward's own when every sequence is on that side) and, when both sides have sequences, the rows of the forward's
    tokens each holds."""

    dense_meta: AttentionMetadata | None
    dense_rows: torch.Tensor  # (T_dense,) int64
    shadow_meta: AttentionMetadata | None
    shadow_rows: torch.Tensor  # (T_shadow,) int64

    @property
    def mixed(self) -> bool:
        return self.dense_meta is not None and self.shadow_meta is not None


class HybridCache(KVCache):
    def __init__(self, config: ShadowKVConfig, dense: DenseKVCache, shadow: ShadowKVCache):
        self.dense, self.shadow = dense, shadow
        self.manager = HybridManager(config, dense.manager, shadow.manager)
        self._splits: dict[int, tuple[AttentionMetadata, BatchSplit]] = {}  # this forward's, by metadata object

    def _split(self, meta: AttentionMetadata) -> BatchSplit:
        """The same split serves every layer of a forward: built once per metadata object (held, so that its id cannot
        be reused by a later forward's metadata); a pipelined forward has one per half."""
        held = self._splits.get(id(meta))
        if held is not None and held[0] is meta:
            return held[1]
        in_shadow = [self.manager.in_shadow(seq_id) for seq_id in meta.seq_ids]
        if all(in_shadow) or not any(in_shadow):  # one side: the forward passes through as it is
            none = torch.empty(0, dtype=torch.int64)
            split = BatchSplit(None, none, meta, none) if all(in_shadow) else BatchSplit(meta, none, None, none)
        else:
            starts, sides = meta.query_starts, []
            for shadow in (False, True):
                index = [i for i, s in enumerate(in_shadow) if s == shadow]
                rows = [r for i in index for r in range(starts[i], starts[i] + meta.query_lens[i])]
                rows = to_device(rows, torch.int64, meta.positions.device)
                sides += [meta.subset(index, meta.positions[rows]), rows]
            split = BatchSplit(*sides)
        self._splits[id(meta)] = (meta, split)
        return split

    def attend(self, layer, q, k_pre, k_rot, v, meta):
        return self.attend_end(self.attend_begin(layer, q, k_pre, k_rot, v, meta))

    def attend_begin(self, layer, q, k_pre, k_rot, v, meta):
        split = self._split(meta)
        if not split.mixed:
            if split.shadow_meta is None:
                return self.dense.attend(layer, q, k_pre, k_rot, v, meta), None, None
            return None, None, self.shadow.attend_begin(layer, q, k_pre, k_rot, v, meta)
        out = torch.empty_like(q)  # (T, Hq, d)
        rows = split.dense_rows
        out[rows] = self.dense.attend(layer, q[rows], k_pre[rows], k_rot[rows], v[rows], split.dense_meta)
        rows = split.shadow_rows
        return out, rows, self.shadow.attend_begin(layer, q[rows], k_pre[rows], k_rot[rows], v[rows],
                                                   split.shadow_meta)

    def attend_end(self, handle):
        out, rows, pending = handle
        if pending is None:
            return out
        if out is None:
            return self.shadow.attend_end(pending)
        out[rows] = self.shadow.attend_end(pending)
        return out

    def prefill_begin(self, layer, q, k_pre, k_rot, v, meta):
        split = self._split(meta)
        if not split.mixed:
            side = self.dense if split.shadow_meta is None else self.shadow
            return side.prefill_begin(layer, q, k_pre, k_rot, v, meta)
        sides = {cache: iter(cache.prefill_begin(layer, q[rows], k_pre[rows], k_rot[rows], v[rows], sub))
                 for cache, sub, rows in self._sides(split)}
        return [next(sides[self.shadow if self.manager.in_shadow(s) else self.dense]) for s in meta.seq_ids]

    def prefill_read_bytes(self, layer, meta):
        shadow_meta = self._split(meta).shadow_meta
        return 0 if shadow_meta is None else self.shadow.prefill_read_bytes(layer, shadow_meta)

    def prefill_attention(self, q, keys, values, whole=True):
        return self.dense.prefill_attention(q, keys, values, whole)  # both sides' specs are the model's

    def prefill_end(self, layer, q, k_pre, k_rot, v, meta):
        split = self._split(meta)
        if split.shadow_meta is None:
            return
        rows = split.shadow_rows if split.mixed else slice(None)
        self.shadow.prefill_end(layer, q[rows], k_pre[rows], k_rot[rows], v[rows], split.shadow_meta)

    def _sides(self, split: BatchSplit):
        """(cache, its metadata, its rows) of each side the forward has sequences on."""
        return [(cache, sub, rows) for cache, sub, rows in ((self.dense, split.dense_meta, split.dense_rows),
                                                            (self.shadow, split.shadow_meta, split.shadow_rows))
                if sub is not None]

    def prepare_forward(self, meta: AttentionMetadata) -> None:
        for cache, sub, _ in self._sides(self._split(meta)):
            cache.prepare_forward(sub)

    def compile_buckets(self, max_model_len: int) -> int:
        return self.shadow.compile_buckets(max_model_len)

    def graph_inputs(self, meta: AttentionMetadata):
        split = self._split(meta)
        key, tensors = [], []
        for cache, sub, rows in self._sides(split):
            inputs = cache.graph_inputs(sub)
            if inputs is None:
                return None
            key.append(inputs[0])
            tensors += inputs[1] + ([rows] if split.mixed else [])
        return tuple(key), tensors

    def finish_forward(self, meta: AttentionMetadata) -> None:
        for cache, sub, _ in self._sides(self._split(meta)):
            cache.finish_forward(sub)
        self._splits.clear()

    def copy_sequence(self, src: int, dst: int) -> None:
        (self.shadow if self.manager.in_shadow(src) else self.dense).copy_sequence(src, dst)

    def step_stats(self) -> dict[str, float]:
        return self.shadow.step_stats()

    def close(self) -> None:
        self.shadow.close()
