import pytest

from shadowkv_core.cache.allocator import BlockAllocator
from shadowkv_core.cache.prefix import PrefixIndex, block_hashes

# ---- block hashes and the index ------------------------------------------------------------------------------------
def test_block_hashes_chain_whole_blocks_only():
    a = list(block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4))
    assert len(a) == 2  # the ninth token fills no block
    assert list(block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)) == a
    b = list(block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4))
    assert b[0] != a[0] and b[1] != a[1]  # same second block, other prefix: another name
    assert list(block_hashes([5, 6, 7, 8], 4))[0] != a[1]


def test_index_refcounts_evicts_unreferenced_tail_first_and_never_a_held_unit():
    index = PrefixIndex(BlockAllocator(4, what="units"), enabled=True)
    hashes = list(block_hashes(list(range(12)), 4))
    units = index.alloc(3)
    for h, u in zip(hashes, units):
        index.insert(h, u)
    assert index.lookup(iter(hashes), 3) == units and index.lookup(iter(hashes), 2) == units[:2]
    index.acquire(units[:2])  # a second holder of the first two blocks
    index.release(units)
    assert [index.refs(u) for u in units] == [1, 1, 0] and index.num_available == 2
    with pytest.raises(MemoryError):
        index.alloc(3)
    assert index.lookup(iter(hashes), 3) == units and index.evictions == 0  # the refusal evicted nothing
    got = index.alloc(2)  # the free unit, and the only unreferenced cached one
    assert units[2] in got and index.evictions == 1 and index.lookup(iter(hashes), 3) == units[:2]
    index.release(units[:2])
    index.release(got)
    assert sorted(index.alloc(2)) == sorted(got) and index.evictions == 1  # free units go before cached ones
    index.release(got)
    assert index.clear() == 2 and index.allocator.num_free == 4 and index.num_cached == 0


def test_index_refuses_to_index_a_unit_no_one_holds_and_disabled_indexes_nothing():
    index = PrefixIndex(BlockAllocator(2), enabled=True)
    h = next(block_hashes([1, 2], 2))
    with pytest.raises(ValueError, match="not held"):
        index.insert(h, 0)
    with pytest.raises(ValueError, match="not in the prefix index"):
        index.acquire([0])
    off = PrefixIndex(BlockAllocator(2), enabled=False)
    (u,) = off.alloc(1)
    off.insert(h, u)
    off.release([u])
    assert off.lookup(iter([h]), 1) == [] and off.allocator.num_free == 2
