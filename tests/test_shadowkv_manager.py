"""ShadowKVManager: the shadow's bookkeeping. A sequence holds one slot and as many GPU pages as value pages, its first
`device_value_share` of value pages in the device region (ids after the host's) as far as it has room; a refusal
takes nothing, names what ran out, and free returns everything."""
import re

import pytest
import torch

from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.shadowkv.manager import ShadowKVManager

PAGE_TOKENS = 8  # 2 chunks of 4 tokens


def make_manager(share=0.0, slots=3, gpu_pages=12, host_pages=6, device_pages=3):
    config = ShadowKVConfig(rank=4, chunk_size=4, sparse_budget=8, outlier_chunks=1, local_chunks=1, min_context=0,
                            decode_window=8, page_chunks=2, device_value_share=share)
    return ShadowKVManager(config, slots, 100, gpu_pages, 10, host_pages, device_pages, 7, torch.device("cpu"))


def test_a_sequence_holds_a_slot_and_its_pages_and_gives_them_back():
    manager = make_manager()
    assert manager.footprint(30, 10) == (5 * 10 + 100, 5 * 7)  # 40 tokens: 5 pages
    manager.allocate(0, 30, 10)
    st = manager.seqs[0]
    assert len(st.gpu_pages) == len(st.value_pages) == 5 and all(p < 6 for p in st.value_pages)
    assert st.value_table.tolist() == st.value_pages and st.gpu_table.tolist() == st.gpu_pages
    assert (st.num_shadow, st.window_len, st.num_outliers) == (30 // 4 - 1, 30 - 6 * 4, 1)
    usage = manager.usage()
    assert (usage["gpu_bytes_in_use"], usage["host_bytes_in_use"]) == manager.footprint(30, 10)
    manager.free(0)
    usage = manager.usage()
    assert (usage["num_seqs"], usage["gpu_bytes_in_use"], usage["host_bytes_in_use"]) == (0, 0, 0)
    assert manager.gpu_pages.num_free == 12 and manager.host_pages.num_free == 6 and manager.slots.num_free == 3


def test_device_value_share_puts_a_sequences_first_pages_in_the_device_region():
    manager = make_manager(share=0.5)
    manager.allocate(0, 30, 10)  # 5 pages: 2 on the device (the share rounds down), 3 on the host
    pages = manager.seqs[0].value_pages
    assert all(p >= 6 for p in pages[:2]) and all(p < 6 for p in pages[2:])
    assert manager.device_value_pages.num_free == 1 and manager.host_pages.num_free == 3
    assert manager.footprint(30, 10) == (5 * 10 + 2 * 7 + 100, 3 * 7)
    manager.free(0)
    assert manager.device_value_pages.num_free == 3 and manager.host_pages.num_free == 6


def test_a_sequence_the_device_region_is_short_for_takes_host_value_pages_instead():
    manager = make_manager(share=0.5, device_pages=1)
    manager.allocate(0, 30, 10)  # 5 pages: 2 wanted on the device, where one is free
    pages = manager.seqs[0].value_pages
    assert pages[0] >= 6 and all(p < 6 for p in pages[1:])
    assert manager.device_value_pages.num_free == 0 and manager.host_pages.num_free == 2
    manager.free(0)
    assert manager.device_value_pages.num_free == 1 and manager.host_pages.num_free == 6


@pytest.mark.parametrize("pools,missing", [((1, 3), "short of host value pages (4 needed, 3 free)"),
                                           ((3, 2), "short of host value pages (3 needed, 2 free)")])
def test_a_refusal_names_what_ran_out_and_takes_nothing(pools, missing):
    device_pages, host_pages = pools
    manager = make_manager(share=0.5, device_pages=device_pages, host_pages=host_pages)
    prompt, new = 30, 10  # 5 pages: 2 on the device, 3 on the host
    free = [p.num_free for p in (manager.slots, manager.gpu_pages, manager.host_pages, manager.device_value_pages)]
    assert not manager.can_allocate(prompt, new)
    with pytest.raises(MemoryError, match=re.escape(missing) + "$"):
        manager.allocate(0, prompt, new)
    assert free == [p.num_free for p in (manager.slots, manager.gpu_pages, manager.host_pages,
                                         manager.device_value_pages)]
    assert not manager.seqs


def test_slots_bound_the_sequences_and_an_id_is_held_once():
    manager = make_manager(slots=1)
    manager.allocate(0, 8, 0)
    with pytest.raises(ValueError, match="already"):
        manager.allocate(0, 8, 0)
    with pytest.raises(MemoryError, match="short of slots"):
        manager.allocate(1, 8, 0)
    assert manager.fits_when_empty(8, 0) and not manager.fits_when_empty(13 * PAGE_TOKENS, 0)
