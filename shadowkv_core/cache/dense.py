"""Dense paged KV cache: post-RoPE keys and values of every token, in fixed-size blocks addressed through a
per-sequence block table (the vLLM layout). Used for full attention and for sequences too short for ShadowKV.

kv_cache_dtype "fp8": e4m3 with one fp32 scale per token and KV head, so that an appended token never rescales nor
saturates the tokens already in its block; attention reads them dequantised to the model's dtype. The scales are
stored per layer (Hkv, rows): the decode kernel reads a block's keys' scales of one head in one coalesced load. Keys
are stored as token rows; values a block at a time with the block's tokens contiguous per dimension (blocks, Hkv, d,
block_size), the decode kernel's K-major operand (kernels/decode_attention.paged_fp8_decode_attention). Every code
in the pool is finite (zeros at first, then what the quantiser writes): the kernel reads whole blocks and weighs the
codes past a sequence's end by zero."""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
import triton

from kernels.decode_attention import decode_attention, paged_fp8_decode_attention
from kernels.store_fp8 import store_fp8

from ..attention import chunk_attention, prefill_attention_ref
from ..shadowkv.reference import FP8, dequantize_tokens, quantize_values
from ..transfers import to_device
from .allocator import BlockAllocator, commit_host_pages
from .base import AttentionMetadata, CacheManager, CacheSpec, KVCache
from .prefix import ROOT, PrefixIndex, PromptHashes, block_hashes


class DenseManager(CacheManager):
    """Each sequence's block table and cached length. With prefix_caching, full blocks of finished prefills (and, when
    a sequence ends, of its generated tokens) stay indexed by their chained hash (cache/prefix.py) and a new prompt
    that starts with them holds them too instead of prefilling them again."""

    def __init__(self, num_blocks: int, block_size: int, block_bytes: int, prefix_caching: bool = False):
        self.block_size = block_size
        self.blocks = BlockAllocator(num_blocks, block_bytes, f"KV blocks of {block_size} tokens")
        self.index = PrefixIndex(self.blocks, prefix_caching)
        self.block_tables: dict[int, list[int]] = {}
        self.table_tensors: dict[int, torch.Tensor] = {}  # (blocks,) int32 on the host, for the decode plan
        self.lengths: dict[int, int] = {}
        self.shared_tokens: dict[int, int] = {}  # leading tokens held in indexed blocks: never written
        self._to_index: dict[int, list[bytes]] = {}  # hashes of a prompt's full blocks, indexed once it is prefilled
        self._chain: dict[int, tuple[int, bytes]] = {}  # blocks indexed after the prefill, and the last one's hash
        self._prompt_hashes = PromptHashes(block_size)
        self.hit_tokens = 0  # prompt tokens served from the prefix cache
        self.query_tokens = 0  # prompt tokens looked up: of the sequences allocated with their token ids

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _hashes(self, prompt_len: int, prompt_token_ids: list[int] | None) -> Iterator[bytes]:
        if prompt_token_ids is None or not self.index.enabled:
            return iter(())
        return iter(self._prompt_hashes.of(prompt_len, prompt_token_ids))

    def _cached_prefix(self, prompt_len: int, hashes: Iterator[bytes]) -> list[int]:
        """The indexed blocks a prompt starts with; never its last token's block (its logits need a forward)."""
        return self.index.lookup(hashes, (prompt_len - 1) // self.block_size)

    def _fits(self, hit: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(hit) <= \
            self.index.num_available - self.index.num_evictable_among(hit)

    def can_allocate(self, prompt_len: int, max_new_tokens: int, prompt_token_ids: list[int] | None = None) -> bool:
        hit = self._cached_prefix(prompt_len, self._hashes(prompt_len, prompt_token_ids))
        return self._fits(hit, prompt_len + max_new_tokens)

    def cached_prefix_len(self, prompt_len: int, max_new_tokens: int, prompt_token_ids: list[int] | None) -> int:
        return len(self._cached_prefix(prompt_len, self._hashes(prompt_len, prompt_token_ids))) * self.block_size

    def fits_when_empty(self, prompt_len: int, max_new_tokens: int) -> bool:
        return self.blocks_needed(prompt_len + max_new_tokens) <= self.blocks.num_blocks

    def footprint(self, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
        return self.blocks_needed(prompt_len + max_new_tokens) * self.blocks.unit_bytes, 0

    def allocate(self, seq_id: int, prompt_len: int, max_new_tokens: int,
                 prompt_token_ids: list[int] | None = None) -> int:
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already holds cache blocks")
        hashes = list(self._hashes(prompt_len, prompt_token_ids))
        hit = self._cached_prefix(prompt_len, iter(hashes))
        if not self._fits(hit, prompt_len + max_new_tokens):
            raise MemoryError(f"need {self.blocks_needed(prompt_len + max_new_tokens) - len(hit)} "
                              f"{self.blocks.what} beyond {len(hit)} cached, {self.index.num_available} of "
                              f"{self.blocks.num_blocks} free or evictable")
        self.index.acquire(hit)  # first: the fresh blocks must not evict the prefix being adopted
        table = hit + self.index.alloc(self.blocks_needed(prompt_len + max_new_tokens) - len(hit))
        cached = len(hit) * self.block_size
        self.block_tables[seq_id] = table
        self.table_tensors[seq_id] = torch.tensor(table, dtype=torch.int32)
        self.lengths[seq_id] = self.shared_tokens[seq_id] = cached
        if hashes:
            self._to_index[seq_id] = hashes
        if prompt_token_ids is not None and self.index.enabled:
            self.hit_tokens += cached
            self.query_tokens += prompt_len
        return cached

    def free(self, seq_id: int, token_ids: list[int] | None = None) -> None:
        if token_ids is not None and self.index.enabled:
            self._index_tokens(seq_id, token_ids)
        self.index.release(self.block_tables.pop(seq_id))
        del self.lengths[seq_id], self.table_tensors[seq_id], self.shared_tokens[seq_id]
        self._to_index.pop(seq_id, None)
        self._chain.pop(seq_id, None)

    def _index_tokens(self, seq_id: int, token_ids: list[int]) -> None:
        """Index the full blocks of a sequence's cached tokens (token_ids: its prompt and output, of which the cache
        holds the first lengths[seq_id]) not indexed after its prefill."""
        done, parent = self._chain.get(seq_id, (0, ROOT))
        end = min(self.lengths[seq_id], len(token_ids)) // self.block_size * self.block_size
        table = self.block_tables[seq_id]
        for i, h in enumerate(block_hashes(token_ids[done * self.block_size:end], self.block_size, parent), done):
            self.index.insert(h, table[i])

    def clear_prefix_cache(self) -> int:
        return self.index.clear()

    def check_writable(self, seq_id: int, start: int) -> None:
        """A forward writes a sequence's tokens from `start` on: never into the blocks it shares."""
        if start < self.shared_tokens[seq_id]:
            raise RuntimeError(f"sequence {seq_id}: a write at token {start} would change its cached prefix "
                               f"({self.shared_tokens[seq_id]} tokens, shared)")

    def advance(self, seq_ids: list[int], num_tokens: list[int]) -> None:
        for seq_id, n in zip(seq_ids, num_tokens):
            self.lengths[seq_id] += n
            hashes = self._to_index.pop(seq_id, None)
            if hashes is not None:  # its prefill has run: its prompt's full blocks are final
                table = self.block_tables[seq_id]
                for i, h in enumerate(hashes):
                    self.index.insert(h, table[i])
                self._chain[seq_id] = (len(hashes), hashes[-1])
                self.shared_tokens[seq_id] = len(hashes) * self.block_size

    def token_rows(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Row indices into the flattened pool of the sequence's tokens [start, end), on the host."""
        first = start // self.block_size  # only the blocks these tokens occupy: a decode token's one block
        table = torch.tensor(self.block_tables[seq_id][first:-(-end // self.block_size)], dtype=torch.int64)
        pos = torch.arange(start, end)
        return table[pos // self.block_size - first] * self.block_size + pos % self.block_size

    def usage(self) -> dict[str, int]:
        """Blocks some sequence holds are in use, each counted once however many share it; cached blocks no
        sequence holds are not (an allocation evicts them)."""
        unit = self.blocks.unit_bytes
        return {"num_seqs": len(self.block_tables), "gpu_blocks_used": self.index.num_in_use,
                "gpu_bytes_in_use": self.index.num_in_use * unit, "gpu_bytes_total": self.blocks.bytes_total,
                "host_bytes_in_use": 0, "host_bytes_total": 0,
                "prefix_cached_bytes": self.index.num_cached * unit, "prefix_hit_tokens": self.hit_tokens,
                "prefix_query_tokens": self.query_tokens, "prefix_evictions": self.index.evictions}


class DenseKVCache(KVCache):
    def __init__(self, spec: CacheSpec, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.spec = spec
        shape = (spec.num_layers, num_blocks * block_size, spec.num_kv_heads, spec.head_dim)  # blocks as token rows
        self.fp8 = spec.kv_cache_dtype == "fp8"
        self.k = torch.zeros(shape, dtype=FP8 if self.fp8 else spec.dtype, device=spec.device)
        self.block_size = block_size
        v_shape = (shape[0], num_blocks, shape[2], shape[3], block_size) if self.fp8 else shape
        self.v = torch.zeros(v_shape, dtype=self.k.dtype, device=spec.device)
        scales_shape = (shape[0], shape[2], shape[1])  # (L, Hkv, rows) fp32
        self.k_scales = torch.ones(scales_shape, device=spec.device) if self.fp8 else None
        self.v_scales = torch.ones(scales_shape, device=spec.device) if self.fp8 else None
        commit_host_pages(self.k, self.v)
        token_bytes = spec.head_dim * self.k.dtype.itemsize + (4 if self.fp8 else 0)  # one KV head's K or V
        block_bytes = 2 * spec.num_layers * block_size * spec.num_kv_heads * token_bytes
        self.manager = DenseManager(num_blocks, block_size, block_bytes, prefix_caching)
        self._forward_state: dict[tuple[str, int], tuple[AttentionMetadata, object]] = {}  # see _per_forward

    def _rows(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        return to_device(self.manager.token_rows(seq_id, start, end), torch.int64, self.k.device)

    def _per_forward(self, meta: AttentionMetadata, key: str, build):
        """What every layer of a forward shares, built once per metadata object (a pipelined forward has one per
        half). Held with the object, not by its id alone: a forward that failed never reached finish_forward, and a
        new object may reuse a freed one's id."""
        held = self._forward_state.get((key, id(meta)))
        if held is None or held[0] is not meta:
            held = self._forward_state[key, id(meta)] = (meta, build())
        return held[1]

    def _write_rows(self, meta: AttentionMetadata) -> torch.Tensor:
        def build():
            rows = []
            for s, c, n in zip(meta.seq_ids, meta.context_lens, meta.query_lens):
                self.manager.check_writable(s, c)
                rows.append(self.manager.token_rows(s, c, c + n))
            return to_device(torch.cat(rows), torch.int64, self.k.device)

        return self._per_forward(meta, "rows", build)

    def stored_values(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """The values of the pool's token rows (n,) as stored: (n, Hkv, d) in the pool's dtype."""
        if not self.fp8:
            return self.v[layer, rows]
        return self.v[layer][rows // self.block_size, :, :, rows % self.block_size]

    def _set_values(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        if not self.fp8:
            self.v[layer, rows] = values
        else:
            self.v[layer][rows // self.block_size, :, :, rows % self.block_size] = values

    def _store(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (n, Hkv, d) into the pool's rows (n,); fp8: quantised, each token and KV head its own scale, a value
        that is not finite stored as 0 so that every code stays finite (kernels.store_fp8 on the kernel path)."""
        if not self.fp8:
            self.k[layer, rows], self.v[layer, rows] = k, v
        elif self.spec.kernels:
            store_fp8(k, v, rows, self.k[layer], self.v[layer], self.k_scales[layer], self.v_scales[layer])
        else:
            self.k[layer, rows], k_scales = quantize_values(k, 1)  # chunks of one token: (n, Hkv)
            v_codes, v_scales = quantize_values(torch.where(torch.isfinite(v), v, 0), 1)
            self._set_values(layer, rows, v_codes)
            self.k_scales[layer, :, rows], self.v_scales[layer, :, rows] = k_scales.T, v_scales.T

    def _load(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (n, Hkv, d) of the pool's rows (n,), in the model's dtype."""
        if not self.fp8:
            return self.k[layer, rows], self.v[layer, rows]
        return (dequantize_tokens(self.k[layer, rows], self.k_scales[layer, :, rows].T, self.spec.dtype),
                dequantize_tokens(self.stored_values(layer, rows), self.v_scales[layer, :, rows].T, self.spec.dtype))

    def attend(self, layer, q, k_pre, k_rot, v, meta):
        if self.spec.kernels and not meta.is_prefill:
            self._store(layer, self._write_rows(meta), k_rot, v)
            return self._decode_fast(layer, q, meta)
        out = torch.empty_like(q)
        for start, n, (keys, values) in zip(meta.query_starts, meta.query_lens,
                                            self.prefill_begin(layer, q, k_pre, k_rot, v, meta)):
            out[start:start + n] = prefill_attention_ref(q[start:start + n], keys, values, self.spec.scale,
                                                         self.spec.prefill_chunk_tokens, self.spec.prefill_attention)
        return out

    def prefill_begin(self, layer, q, k_pre, k_rot, v, meta):
        """Also the reference decode path's: a sequence with a context attends over its blocks, this forward's
        tokens written first."""
        self._store(layer, self._write_rows(meta), k_rot, v)
        keys = []
        for start, n, seq_id, ctx in zip(meta.query_starts, meta.query_lens, meta.seq_ids, meta.context_lens):
            if ctx == 0:
                keys.append((k_rot[start:start + n], v[start:start + n]))
                continue
            rows = self._per_forward(meta, f"context_rows/{seq_id}",  # every layer reads the same rows
                                     lambda s=seq_id, e=ctx + n: self._rows(s, 0, e))
            keys.append(self._load(layer, rows))
        return keys

    def prefill_attention(self, q, keys, values, whole=True):
        return chunk_attention(q, keys, values, self.spec.scale, self.spec.prefill_attention, whole)

    def _decode_plan(self, meta: AttentionMetadata):
        """(block table (B, blocks), key counts (B,), slot ids (B,), max_len) of a decode forward, on the device. The
        table's width and max_len are rounded up to powers of two (the kernel's own length bucket): the shapes a
        captured CUDA graph is keyed on then change rarely, not every step."""
        def plan():
            tables = [self.manager.table_tensors[s] for s in meta.seq_ids]
            table = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
            table = F.pad(table, (0, triton.next_power_of_2(table.shape[1]) - table.shape[1]))
            dev = self.k.device
            return (to_device(table, torch.int32, dev), to_device([c + 1 for c in meta.context_lens], torch.int32, dev),
                    torch.zeros(len(meta.seq_ids), dtype=torch.int32, device=dev),
                    triton.next_power_of_2(max(meta.context_lens) + 1))

        return self._per_forward(meta, "decode_plan", plan)

    def _decode_fast(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One token per sequence, all sequences in one launch: q (B, Hq, d) -> (B, Hq, d)."""
        table, lens, slots, max_len = self._decode_plan(meta)
        if self.fp8:
            return paged_fp8_decode_attention(q.contiguous(), self.k[layer], self.v[layer],
                                              (self.k_scales[layer], self.v_scales[layer]), lens, table,
                                              self.spec.scale, max_len)
        pool = (self.k[layer].permute(1, 0, 2)[None], self.v[layer].permute(1, 0, 2)[None], lens)  # (1, Hkv, rows, d)
        return decode_attention(q.contiguous(), [pool], slots, self.spec.scale, max_len, page_table=table,
                                page_size=self.manager.block_size)

    def _graphable(self, meta: AttentionMetadata) -> bool:
        return self.spec.kernels and not meta.is_prefill

    def prepare_forward(self, meta: AttentionMetadata) -> None:
        self._write_rows(meta)
        if self._graphable(meta):
            self._decode_plan(meta)

    def graph_inputs(self, meta: AttentionMetadata):
        if not self._graphable(meta):
            return None
        table, lens, slots, max_len = self._decode_plan(meta)
        return ("dense", max_len), [self._write_rows(meta), table, lens, slots]

    def finish_forward(self, meta):
        self.manager.advance(meta.seq_ids, meta.query_lens)
        self._forward_state.clear()

    def copy_sequence(self, src: int, dst: int) -> None:
        length = self.manager.lengths[src]
        rows_src, rows_dst = self._rows(src, 0, length), self._rows(dst, 0, length)
        scales = [self.k_scales, self.v_scales] if self.fp8 else []
        for layer in range(self.k.shape[0]):  # one layer at a time: no whole-cache temporary
            self.k[layer, rows_dst] = self.k[layer, rows_src]
            self._set_values(layer, rows_dst, self.stored_values(layer, rows_src))
            for pool in scales:  # (Hkv, rows)
                pool[layer, :, rows_dst] = pool[layer, :, rows_src]
        self.manager.lengths[dst] = length
