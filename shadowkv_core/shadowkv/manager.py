"""ShadowKVManager: the shadow's CPU bookkeeping. Each sequence kept in shadows holds one slot, and as many GPU pages
(U rows, landmarks) as value pages, reserved at admission for its whole length (prompt + generation); value pages are
split between the host store and, for ShadowKVConfig.device_value_share, the device region (its first pages there,
as many as the region has free; the host store takes the rest).

Value page ids: host pages are 0 .. H - 1, device pages follow, H .. H + D - 1 (what host_store.HostValueStore and the
fetch kernel read them by).

Prefix caching: a page (page_chunks * chunk_size tokens) whose chunks are all in the shadow is the block of
cache/prefix.py. Its GPU page and its value page are indexed under the same chained hash, in one PrefixIndex per pool
(GPU pages, host value pages, device value pages), held and released together; evicting either drops the other. Each
indexed page names the ShadowRecord of the sequence that indexed it: the basis and outlier chunks that its U rows and
outlier flags belong to, copied to the host once that sequence's prefill has run.

Shared values move to the device: a host value page that an admission makes shared (held by two or more sequences,
a document its readers decode over together) moves to a free page of the device region, where every holder's decode
reads it from device memory instead of over PCIe; one copy still, and its host page goes back to the pool."""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shadowkv_core.cache.allocator import BlockAllocator
from shadowkv_core.cache.base import CacheManager
from shadowkv_core.cache.prefix import ROOT, PrefixIndex, PromptHashes, block_hashes
from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.memory_model import device_value_pages
from shadowkv_core.transfers import to_device


@dataclass(eq=False)
class ShadowRecord:
    """What adopting pages a sequence indexed takes beyond the pages: its slot's basis and exact outlier chunks, on the
    host (the slot is freed with the sequence). lineage: serials of this record and of those whose pages it adopted
    (their U rows are on the same basis, their outlier flags are among its outliers). pages: the sequence's GPU pages.
    outlier_counts[p]: the outlier chunks each KV head of each layer has in its first p pages; past them, all of them.
    On CUDA its tensors are pinned, so that adopting them copies to the device without waiting for it."""

    lineage: tuple[int, ...]
    pages: list[int]
    sv: tuple[torch.Tensor, ...]  # per layer (Hkv, r, d), at the layer's rank
    outlier_k: torch.Tensor  # (L, Hkv, O*C, d), each head's outlier chunks in ascending order
    outlier_v: torch.Tensor
    outlier_counts: torch.Tensor  # (pages + 1, L, Hkv) int64
    most_fewest: list[tuple[int, int]] = field(init=False, repr=False)  # outlier_counts[p]: (max, min)

    def __post_init__(self):
        per_page = self.outlier_counts.flatten(1)  # (pages + 1, L*Hkv)
        self.most_fewest = list(zip(per_page.amax(1).tolist(), per_page.amin(1).tolist()))

    def outliers_of(self, num_pages: int) -> torch.Tensor:
        """(L, Hkv): the outlier chunks each KV head of each layer has in the first num_pages pages."""
        return self.outlier_counts[min(num_pages, len(self.outlier_counts) - 1)]

    def outliers_in(self, num_pages: int) -> tuple[int, int]:
        """The most and the fewest outlier chunks a KV head of a layer has in the first num_pages pages."""
        return self.most_fewest[min(num_pages, len(self.most_fewest) - 1)]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Its host tensors: a record that adopted another's basis and outliers unchanged holds that record's own."""
        return *self.sv, self.outlier_k, self.outlier_v


@dataclass
class Factors:
    """A layer's key factorisation under way (prefill.start_factorization): reference.factorize_keys' U and SV, and on
    CUDA the event recorded on the stream that makes them, once they are made."""
    u: torch.Tensor
    sv: torch.Tensor
    done: torch.cuda.Event | None = None


@dataclass
class SequenceState:
    slot: int
    prompt_len: int
    gpu_pages: list[int]
    value_pages: list[int]
    gpu_table: torch.Tensor  # (num_pages,) int64 on the device
    value_table: torch.Tensor  # (num_pages,) int64 on the host
    num_shadow: int  # chunks in the shadow
    window_len: int  # exact tokens in the window
    num_outliers: int
    seq_len: int = 0
    cached: int = 0  # leading prompt tokens adopted from the prefix cache (whole pages): never written
    adopted: ShadowRecord | None = None  # their record, until the prefill has copied it into the slot
    record: ShadowRecord | None = None  # its own, once its prefill has run (prefix caching only)
    factors: Factors | None = None  # the layer's key factorisation under way in a cold prefill (prefill.py)


class ShadowKVManager(CacheManager):
    """Pools of slots, GPU pages, host value pages and device value pages, each unit `*_bytes` large. With
    prefix_caching, a prompt that starts with indexed pages holds them (and adopts their record) instead of
    prefilling them again."""

    def __init__(self, config: ShadowKVConfig, num_slots: int, slot_bytes: int, num_gpu_pages: int,
                 gpu_page_bytes: int, num_host_pages: int, num_device_value_pages: int, value_page_bytes: int,
                 device: torch.device, prefix_caching: bool = False):
        self.config, self.device = config, device
        self.page_tokens = config.page_chunks * config.chunk_size
        tokens = f"of {self.page_tokens} tokens"
        self.slots = BlockAllocator(num_slots, slot_bytes, "ShadowKV slots")
        self.gpu_pages = BlockAllocator(num_gpu_pages, gpu_page_bytes, f"GPU shadow pages {tokens}")
        self.host_pages = BlockAllocator(num_host_pages, value_page_bytes, f"pages {tokens} in the host value store")
        self.device_value_pages = BlockAllocator(num_device_value_pages, value_page_bytes,
                                                 f"pages {tokens} in the device value store")
        self.gpu_index = PrefixIndex(self.gpu_pages, prefix_caching, on_evict=self._drop)
        self.host_index, self.device_index = (
            PrefixIndex(pool, prefix_caching, on_evict=lambda h, _: self._drop(h, self.gpu_index.get(h)))
            for pool in (self.host_pages, self.device_value_pages))
        self.seqs: dict[int, SequenceState] = {}
        self.cached: dict[int, tuple[bytes, ShadowRecord]] = {}  # indexed GPU page -> (its hash, its record)
        self._record_pages: dict[int, int] = {}  # id of a record -> its pages in `cached`
        self._tensor_holds: dict[int, int] = {}  # storage of a record tensor -> those records holding it
        self._record_bytes = 0  # those records' tensors' bytes, each once: usage() runs every step, in O(1)
        self._prompt_hashes = PromptHashes(self.page_tokens)
        self._to_index: dict[int, list[bytes]] = {}  # hashes of a prompt's full pages, indexed once it is prefilled
        self._chain: dict[int, tuple[int, bytes]] = {}  # pages indexed after the prefill, and the last one's hash
        self._serials = itertools.count()
        # told (host pages, device page ids) of each move of shared values, to copy them before a step reads the ids
        self.on_move: Callable[[list[int], list[int]], None] | None = None
        self.hit_tokens = 0  # prompt tokens served from the prefix cache
        self.query_tokens = 0  # prompt tokens looked up

    @property
    def prefix_caching(self) -> bool:
        return self.gpu_index.enabled

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """GPU pages and, as many, value pages of one sequence."""
        return math.ceil((prompt_len + max_new_tokens) / self.page_tokens)

    # ---- the prefix cache ----

    def _value_index(self, page: int) -> tuple[PrefixIndex, int]:
        """The index of a value page id's pool, and its unit there."""
        host = self.host_pages.num_blocks
        return (self.host_index, page) if page < host else (self.device_index, page - host)

    def _drop(self, block_hash: bytes, gpu_page: int | None) -> None:
        """A page evicted from one pool's index leaves the others too: its GPU page and value page go together."""
        self._uncache(gpu_page)
        for index in (self.gpu_index, self.host_index, self.device_index):
            index.discard(block_hash)

    def _cache(self, gpu_page: int, block_hash: bytes, record: ShadowRecord) -> None:
        self._uncache(gpu_page)
        self.cached[gpu_page] = (block_hash, record)
        held = self._record_pages.get(id(record), 0)
        if not held:
            self._hold_tensors(record, 1)
        self._record_pages[id(record)] = held + 1

    def _uncache(self, gpu_page: int) -> None:
        _, record = self.cached.pop(gpu_page, (None, None))
        if record is None:
            return
        held = self._record_pages.pop(id(record)) - 1
        if held:
            self._record_pages[id(record)] = held
        else:
            self._hold_tensors(record, -1)

    def _hold_tensors(self, record: ShadowRecord, change: int) -> None:
        """A record enters (1) or leaves (-1) the cache: its tensors' bytes count while any cached record holds them."""
        for t in record.tensors:
            key = t.untyped_storage().data_ptr()
            before = self._tensor_holds.pop(key, 0)
            if before + change:
                self._tensor_holds[key] = before + change
            if not before or not before + change:  # its first holder came, or its last one went
                self._record_bytes += change * t.untyped_storage().nbytes()

    def _hashes(self, prompt_len: int, prompt_token_ids: list[int] | None) -> list[bytes]:
        if prompt_token_ids is None or not self.prefix_caching:
            return []
        return self._prompt_hashes.of(prompt_len, prompt_token_ids)

    def _cached_prefix(self, prompt_len: int, hashes: list[bytes]) -> tuple[list[int], ShadowRecord | None]:
        """The indexed GPU pages a prompt adopts, and their record: the longest run of its pages that one record
        describes (U rows on its basis, outlier flags its own), never the page of its last token (its logits need a
        forward). The slot keeps as many outliers for every KV head: a head with fewer in the run makes up the
        difference with chunks of the prompt's own shadow (prefill.py), so the run is cut to what those can make up."""
        run = self.gpu_index.lookup(iter(hashes), (prompt_len - 1) // self.page_tokens)
        middle = prompt_len // self.config.chunk_size - self.config.local_chunks
        n = len(run)
        while n:
            record = self.cached[run[n - 1]][1]
            valid = 0
            for page, mine in zip(run[:n], record.pages):
                if page != mine or self.cached[page][1].lineage[-1] not in record.lineage:
                    break
                valid += 1
            for p in range(valid, 0, -1):
                most, fewest = record.outliers_in(p)
                if most - fewest <= max(middle - p * self.config.page_chunks, 0):
                    return run[:p], record
            while n and self.cached[run[n - 1]][1] is record:  # next: the longest run another record ends
                n -= 1
        return [], None

    def _value_hits(self, hit: list[int]) -> list[int]:
        """The value page ids indexed beside indexed GPU pages."""
        pages = []
        for gpu_page in hit:
            h = self.cached[gpu_page][0]
            unit = self.host_index.get(h)
            pages.append(unit if unit is not None else self.host_pages.num_blocks + self.device_index.get(h))
        return pages

    def _shortfall(self, n: int, free: bool, hit: list[int] = ()) -> list[str]:
        """What a sequence of n pages lacks, in what is free now (or, free False, in the whole pools); hit: the
        indexed GPU pages it would adopt (their value pages with them), reserved anew by no one."""
        d = device_value_pages(self.config, n)
        if not free:
            room = [(self.slots.num_blocks, 1, "slots"), (self.gpu_pages.num_blocks, n, "GPU pages"),
                    (self.host_pages.num_blocks, n - min(d, self.device_value_pages.num_blocks), "host value pages")]
        else:
            h, values = len(hit), [self._value_index(v) for v in self._value_hits(hit)]

            def available(index: PrefixIndex, units: list[int]) -> int:
                return index.num_available - index.num_evictable_among(units)

            device = available(self.device_index, [u for i, u in values if i is self.device_index])
            room = [(self.slots.num_free, 1, "slots"), (available(self.gpu_index, hit), n - h, "GPU pages"),
                    (available(self.host_index, [u for i, u in values if i is self.host_index]),
                     n - h - min(max(d - h, 0), device), "host value pages")]
        return [f"{what} ({k} needed, {r} {'free' if free else 'in all'})" for r, k, what in room if k > r]

    def can_allocate(self, prompt_len: int, max_new_tokens: int, prompt_token_ids: list[int] | None = None) -> bool:
        hit, _ = self._cached_prefix(prompt_len, self._hashes(prompt_len, prompt_token_ids))
        return not self._shortfall(self.pages_needed(prompt_len, max_new_tokens), True, hit)

    def cached_prefix_len(self, prompt_len: int, max_new_tokens: int, prompt_token_ids: list[int] | None) -> int:
        hit, _ = self._cached_prefix(prompt_len, self._hashes(prompt_len, prompt_token_ids))
        return len(hit) * self.page_tokens

    def fits_when_empty(self, prompt_len: int, max_new_tokens: int) -> bool:
        return not self._shortfall(self.pages_needed(prompt_len, max_new_tokens), free=False)

    def footprint(self, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
        """(device bytes, host bytes) reserved by `allocate`: pages, plus the slot on the device."""
        n = self.pages_needed(prompt_len, max_new_tokens)
        d = device_value_pages(self.config, n)
        value = self.host_pages.unit_bytes
        return n * self.gpu_pages.unit_bytes + d * value + self.slots.unit_bytes, (n - d) * value

    def allocate(self, seq_id: int, prompt_len: int, max_new_tokens: int,
                 prompt_token_ids: list[int] | None = None) -> int:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already holds a ShadowKV slot")
        n = self.pages_needed(prompt_len, max_new_tokens)
        hashes = self._hashes(prompt_len, prompt_token_ids)
        hit, record = self._cached_prefix(prompt_len, hashes)
        short = self._shortfall(n, True, hit)
        if short:
            raise MemoryError(f"ShadowKV cache full for a sequence of {prompt_len}+{max_new_tokens} tokens: short of "
                              + ", ".join(short))
        C = self.config.chunk_size
        cached = len(hit) * self.page_tokens
        # the middle chunks; an adopted prefix is in the shadow whole
        num_shadow = max(prompt_len // C - self.config.local_chunks, cached // C)
        outliers = min(self.config.outlier_chunks, num_shadow) if record is None else record.outliers_in(len(hit))[0]
        hit_values = self._value_hits(hit)
        self.gpu_index.acquire(hit)  # first: the fresh pages must not evict the prefix being adopted
        for v in hit_values:
            index, unit = self._value_index(v)
            index.acquire([unit])
        fresh_device = min(max(device_value_pages(self.config, n) - len(hit), 0), self.device_index.num_available)
        gpu_pages = hit + self.gpu_index.alloc(n - len(hit))
        value_pages = hit_values + [self.host_pages.num_blocks + p for p in self.device_index.alloc(fresh_device)]
        value_pages += self.host_index.alloc(n - len(value_pages))
        self.seqs[seq_id] = SequenceState(
            slot=self.slots.alloc(1)[0], prompt_len=prompt_len, gpu_pages=gpu_pages, value_pages=value_pages,
            gpu_table=to_device(gpu_pages, torch.int64, self.device),
            value_table=torch.tensor(value_pages, dtype=torch.int64),
            num_shadow=num_shadow, window_len=prompt_len - num_shadow * C,
            num_outliers=outliers, seq_len=cached, cached=cached, adopted=record)
        if hashes:
            self._to_index[seq_id] = hashes
        if prompt_token_ids is not None and self.prefix_caching:
            self.hit_tokens += cached
            self.query_tokens += prompt_len
        self._move_shared_to_device(hit_values)
        return cached

    def _move_shared_to_device(self, values: list[int]) -> None:
        """Those of an admission's adopted value pages that lie on the host and are now shared move to free pages of
        the device region (none evicted for them), as many as it has: their index entries, their holders' counts and
        every holder's page table go with them, and on_move copies them."""
        host = self.host_pages.num_blocks
        shared = [v for v in values if v < host and self.host_index.refs(v) > 1]
        shared = shared[:self.device_value_pages.num_free]
        if not shared or self.on_move is None:
            return
        units = self.device_index.alloc(len(shared))  # free units only: nothing cached is evicted
        for v, unit in zip(shared, units):
            block_hash, holders = self.host_index.hash_of(v), self.host_index.refs(v)
            self.host_index.discard(block_hash)
            self.device_index.insert(block_hash, unit)
            self.device_index.acquire([unit] * (holders - 1))
            self.host_index.release([v] * holders)  # its last holder gone: back to the pool
        moved = {v: host + unit for v, unit in zip(shared, units)}
        for st in self.seqs.values():
            if any(p in moved for p in st.value_pages):
                st.value_pages = [moved.get(p, p) for p in st.value_pages]
                st.value_table = torch.tensor(st.value_pages, dtype=torch.int64)
        self.on_move(list(moved), list(moved.values()))

    def prefilled(self, seq_id: int, sv: tuple[torch.Tensor, ...], outlier_k: torch.Tensor, outlier_v: torch.Tensor,
                  outlier_counts: torch.Tensor) -> None:
        """A sequence's prefill has run (prefix caching only): keep its record (sv, outliers: its slot's, on the host)
        and index its prompt's full pages that lie in the shadow."""
        st = self.seqs[seq_id]
        lineage = (st.adopted.lineage if st.adopted is not None else ()) + (next(self._serials),)
        st.record = ShadowRecord(lineage, list(st.gpu_pages), sv, outlier_k, outlier_v, outlier_counts)
        st.adopted = None
        hashes = self._to_index.pop(seq_id, [])[:st.num_shadow * self.config.chunk_size // self.page_tokens]
        self._index_pages(st, hashes, 0)
        self._chain[seq_id] = (len(hashes), hashes[-1] if hashes else ROOT)

    def _index_pages(self, st: SequenceState, hashes, first: int) -> None:
        """Index the sequence's pages first, first + 1, ... under `hashes` (their contents final from now on)."""
        for i, h in enumerate(hashes, first):
            if self.gpu_index.insert(h, st.gpu_pages[i]):
                index, unit = self._value_index(st.value_pages[i])
                index.insert(h, unit)
                self._cache(st.gpu_pages[i], h, st.record)

    def free(self, seq_id: int, token_ids: list[int] | None = None) -> None:
        st = self.seqs.pop(seq_id)
        done, parent = self._chain.pop(seq_id, (0, ROOT))
        self._to_index.pop(seq_id, None)
        if token_ids is not None and st.record is not None:  # the pages its generated tokens filled, folded in
            end = min(st.num_shadow * self.config.chunk_size, len(token_ids)) // self.page_tokens * self.page_tokens
            self._index_pages(st, block_hashes(token_ids[done * self.page_tokens:end], self.page_tokens, parent), done)
        host = self.host_pages.num_blocks
        self.gpu_index.release(st.gpu_pages)
        self.device_index.release([p - host for p in st.value_pages if p >= host])
        self.host_index.release([p for p in st.value_pages if p < host])
        self.slots.free([st.slot])

    def clear_prefix_cache(self) -> int:
        dropped = sum(index.clear() for index in (self.gpu_index, self.host_index, self.device_index))
        for page in [page for page in self.cached if not self.gpu_index.is_indexed(page)]:
            self._uncache(page)
        return dropped

    def usage(self) -> dict[str, int]:
        """Pages some sequence holds are in use, each counted once however many share it; cached pages no sequence
        holds are not (an allocation evicts them). prefix_cached_bytes: indexed pages and their records (host)."""
        gpu_unit, value_unit = self.gpu_pages.unit_bytes, self.host_pages.unit_bytes
        cached_values = self.host_index.num_cached + self.device_index.num_cached
        return {"num_seqs": len(self.seqs),
                "gpu_bytes_in_use": self.slots.bytes_in_use + self.gpu_index.num_in_use * gpu_unit
                + self.device_index.num_in_use * value_unit,
                "gpu_bytes_total": sum(p.bytes_total for p in (self.slots, self.gpu_pages, self.device_value_pages)),
                "host_bytes_in_use": self.host_index.num_in_use * value_unit,
                "host_bytes_total": self.host_pages.bytes_total,
                "prefix_cached_bytes": self.gpu_index.num_cached * gpu_unit + cached_values * value_unit
                + self._record_bytes,
                "prefix_hit_tokens": self.hit_tokens, "prefix_query_tokens": self.query_tokens,
                "prefix_evictions": sum(i.evictions for i in (self.gpu_index, self.host_index, self.device_index))}
