"""Automatic prefix caching: which units of a pool hold which prompt blocks, shared and reference-counted.

A block of `block_size` tokens is named by a chained hash, sha256(parent's hash | its tokens), so one name stands for
the block and everything before it (vLLM's automatic prefix caching). A pool's units (`allocator.BlockAllocator`) are
then in one of three states: free (in the allocator), referenced (held by one or more sequences; never evicted) or
cached and unreferenced (indexed by their hash, evictable, least recently released first). A sequence only writes
the units past its cached prefix, so an indexed unit, which holds whole blocks of a finished prefill, is never written.
CPU bookkeeping only."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from .allocator import BlockAllocator

ROOT = b""  # the parent of a prompt's first block
RECENT_PROMPTS = 64  # prompts whose block hashes are kept: the waiting line's, typically


def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT) -> Iterator[bytes]:
    """The chained hashes of the full blocks of token_ids, first to last, lazily (a lookup stops at its first miss).
    sha256, not Python's hash(): a collision would serve one prompt another's cache."""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", token_ids[start:start + block_size]).tobytes()).digest()
        yield parent


class PromptHashes:
    """The block hashes of recent prompts, computed once per prompt list: a waiting prompt is looked up at every
    admission pass and again when it is allocated."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._recent: OrderedDict[int, tuple[list[int], list[bytes]]] = OrderedDict()  # id -> (prompt, its hashes)

    def of(self, prompt_len: int, prompt_token_ids: list[int]) -> list[bytes]:
        if len(prompt_token_ids) != prompt_len:
            raise ValueError(f"prompt_token_ids: {len(prompt_token_ids)} tokens for a prompt of {prompt_len}")
        held = self._recent.get(id(prompt_token_ids))
        if held is None or held[0] is not prompt_token_ids:  # the entry holds its list, so the id is not reused
            held = (prompt_token_ids, list(block_hashes(prompt_token_ids, self.block_size)))
            self._recent[id(prompt_token_ids)] = held
            while len(self._recent) > RECENT_PROMPTS:
                self._recent.popitem(last=False)
        self._recent.move_to_end(id(prompt_token_ids))
        return held[1]


class PrefixIndex:
    """The units of `allocator`, reference-counted, and a map from block hash to the unit holding that block.

    With `enabled` False nothing is ever indexed: units go back to the allocator as soon as no sequence holds them.
    on_evict(block_hash, unit) is told of each unit an `alloc` evicts (a caller whose blocks span several pools drops
    the block's other units with `discard`)."""

    def __init__(self, allocator: BlockAllocator, enabled: bool,
                 on_evict: Callable[[bytes, int], None] | None = None):
        self.allocator = allocator
        self.enabled = enabled
        self.on_evict = on_evict
        self._refs: dict[int, int] = {}  # unit -> sequences holding it (absent: not held)
        self._unit_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # indexed, unreferenced: least recently released first
        self.evictions = 0

    @property
    def num_available(self) -> int:
        """Units an `alloc` may take now: free, or cached and unreferenced."""
        return self.allocator.num_free + len(self._evictable)

    @property
    def num_in_use(self) -> int:
        """Units some sequence holds."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Units in the index, referenced or not."""
        return len(self._hash_of)

    def refs(self, unit: int) -> int:
        return self._refs.get(unit, 0)

    def lookup(self, hashes: Iterator[bytes], max_blocks: int) -> list[int]:
        """The units holding the longest cached run of `hashes` from the first, at most max_blocks of them."""
        units: list[int] = []
        if not self.enabled:
            return units
        for h in hashes:
            if len(units) >= max_blocks or h not in self._unit_of:
                break
            units.append(self._unit_of[h])
        return units

    def get(self, block_hash: bytes) -> int | None:
        """The unit indexed as holding the block named block_hash, if any."""
        return self._unit_of.get(block_hash)

    def num_evictable_among(self, units: list[int]) -> int:
        """How many of `units` (a lookup's) sit unreferenced, so that acquiring them takes them from num_available."""
        return sum(u in self._evictable for u in units)

    def acquire(self, units: list[int]) -> None:
        """One more holder of each of these indexed units (a lookup's)."""
        for u in units:
            if u not in self._hash_of:
                raise ValueError(f"unit {u} is not in the prefix index")
            self._evictable.pop(u, None)
            self._refs[u] = self._refs.get(u, 0) + 1

    def alloc(self, n: int) -> list[int]:
        """n fresh units, each held once, evicting the least recently released cached units the free list lacks;
        a MemoryError (nothing allocated, nothing evicted) when fewer than n are available."""
        if n > self.num_available:
            raise MemoryError(f"need {n} {self.allocator.what}, {self.num_available} of {self.allocator.num_blocks} "
                              f"free or evictable")
        while self.allocator.num_free < n:
            unit, _ = self._evictable.popitem(last=False)
            block_hash = self._hash_of.pop(unit)
            del self._unit_of[block_hash]
            self.allocator.free([unit])
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(block_hash, unit)
        units = self.allocator.alloc(n)
        for u in units:
            self._refs[u] = 1
        return units

    def insert(self, block_hash: bytes, unit: int) -> bool:
        """Index a held unit as holding the block named block_hash (its contents final from now on); whether it was.
        A block already indexed keeps its unit (another sequence computed it first); this unit then stays private."""
        if unit not in self._refs:
            raise ValueError(f"unit {unit} is not held: only a held unit can be indexed")
        if not self.enabled or block_hash in self._unit_of or unit in self._hash_of:
            return False
        self._unit_of[block_hash] = unit
        self._hash_of[unit] = block_hash
        return True

    def discard(self, block_hash: bytes) -> None:
        """Forget the block named block_hash, if indexed: its unit returns to the allocator if no one holds it, else
        when its last holder releases it."""
        unit = self._unit_of.pop(block_hash, None)
        if unit is None:
            return
        del self._hash_of[unit]
        if self._evictable.pop(unit, 0) is None:
            self.allocator.free([unit])

    def is_indexed(self, unit: int) -> bool:
        return unit in self._hash_of

    def hash_of(self, unit: int) -> bytes:
        """The block hash an indexed unit is indexed under."""
        return self._hash_of[unit]

    def release(self, units: list[int]) -> None:
        """One holder fewer of each unit. A unit no one holds goes back to the allocator, or, if indexed, becomes
        evictable; released last to first, so that a prefix's tail is evicted before its head."""
        freed = []
        for u in reversed(units):
            left = self._refs[u] - 1
            if left:
                self._refs[u] = left
                continue
            del self._refs[u]
            if u in self._hash_of:
                self._evictable[u] = None
            else:
                freed.append(u)
        self.allocator.free(freed)

    def clear(self) -> int:
        """Drop every cached unit no sequence holds; returns how many. Held units keep their index entries."""
        units = list(self._evictable)
        for u in units:
            del self._unit_of[self._hash_of.pop(u)]
        self._evictable.clear()
        self.allocator.free(units)
        return len(units)
