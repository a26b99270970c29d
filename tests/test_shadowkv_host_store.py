"""HostValueStore: one region, handed out in pages; pinned with cudaHostRegister where CUDA is present."""
import pytest
import torch

from shadowkv_core.shadowkv.host_store import HostValueStore


def make_store(num_pages=6, pin=False):
    return HostValueStore(num_layers=2, num_pages=num_pages, page_tokens=8, num_kv_heads=2, head_dim=4,
                          dtype=torch.float32, pin=pin)


def test_pages_alloc_free_and_bytes():
    store = make_store()
    assert store.page_bytes == 2 * 8 * 2 * 4 * 4 and store.num_free == 6 and store.bytes_in_use == 0
    a = store.alloc(4)
    assert len(set(a)) == 4 and store.num_free == 2 and store.bytes_in_use == 4 * store.page_bytes
    with pytest.raises(MemoryError, match="need 3 pages of 8 tokens in the host value store, 2 of 6 free"):
        store.alloc(3)
    assert store.num_free == 2  # nothing allocated by the refusal
    store.free(a)
    assert store.num_free == 6 and store.bytes_in_use == 0


def test_write_then_gather_through_the_page_table():
    torch.manual_seed(0)
    store = make_store()
    pages = store.alloc(3)
    table = torch.tensor(pages[::-1])  # logical order differs from physical
    values = torch.randn(2, 20, 2, 4)  # (L, n, Hkv, d) tokens [2, 22)
    store.write(slice(None), table, 2, values)
    got = store.gather(1, table, chunk_ids=torch.tensor([1, 4]), heads=torch.tensor([0, 1]), chunk_size=4)
    torch.testing.assert_close(got, torch.stack([values[1, 2:6, 0], values[1, 14:18, 1]]))


@pytest.mark.gpu
def test_pinned_region_is_registered_and_read_by_the_gpu():
    store = make_store(pin=True)
    assert store.pinned
    store.values.fill_(3.0)
    torch.testing.assert_close(store.values.to("cuda", non_blocking=True).cpu(), store.values)
    store.close()
