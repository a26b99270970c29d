"""HostValueStore: one region addressed in pages (and a device region after it); pinned with cudaHostRegister where
CUDA is present. Which pages a sequence holds is the manager's (test_shadowkv_manager.py)."""
import pytest
import torch

from shadowkv_core.shadowkv.host_store import HostValueStore, page_runs
from shadowkv_core.shadowkv.pages import locate
from shadowkv_core.shadowkv.reference import quantize_values


def make_store(num_pages=6, pin=False, **kwargs):
    return HostValueStore(num_layers=2, num_pages=num_pages, page_tokens=8, num_kv_heads=2, head_dim=4,
                          dtype=torch.float32, pin=pin, **kwargs)


def test_page_bytes_are_what_the_region_holds_per_page():
    store = make_store()
    assert store.page_bytes == 2 * 8 * 2 * 4 * 4 == store.values.nbytes // 6


def test_write_then_gather_through_the_page_table():
    torch.manual_seed(0)
    store = make_store()
    table = torch.tensor([5, 1, 3])  # logical order differs from physical
    values = torch.randn(2, 20, 2, 4)  # (L, n, Hkv, d) tokens [2, 22)
    store.write(slice(None), table, 2, values)
    got = store.gather(1, table, chunk_ids=torch.tensor([1, 4]), heads=torch.tensor([0, 1]), chunk_size=4)
    torch.testing.assert_close(got, torch.stack([values[1, 2:6, 0], values[1, 14:18, 1]]))


def test_page_runs_merge_consecutive_physical_pages_only():
    # logical pages 0..4 -> physical 5, 6, 2, 3, 0; rows [3, 37) of pages of 8 rows
    assert page_runs([5, 6, 2, 3, 0], 3, 34, 8) == [(5, 3, 13), (2, 0, 16), (0, 0, 5)]
    assert page_runs([4], 1, 2, 8) == [(4, 1, 2)]
    assert page_runs([1, 2], 8, 0, 8) == []


@pytest.mark.parametrize("start,n", [(0, 48), (5, 30), (13, 1), (16, 17)])
def test_write_lands_every_row_where_the_page_table_says(start, n):
    torch.manual_seed(start)
    store = make_store(num_pages=8)
    table = torch.tensor([6, 7, 2, 3, 4, 0])  # runs and breaks
    values = torch.randn(2, n, 2, 4)
    store.write(slice(None), table, start, values)
    store.write(1, table, start, values[1] * 2)  # one layer
    page, offset = locate(table, torch.arange(start, start + n), 8)
    torch.testing.assert_close(store.values[0, page, offset], values[0])
    torch.testing.assert_close(store.values[1, page, offset], values[1] * 2)


def test_fp8_store_keeps_half_the_bytes_and_gathers_within_e4m3_precision():
    torch.manual_seed(2)
    model, fp8 = make_store(), make_store(value_format="fp8", chunk_size=4)
    assert fp8.page_bytes == 2 * (8 * 2 * 4 * 1 + 2 * 2 * 4)  # e4m3 values + an fp32 scale per chunk and head
    table = torch.tensor([4, 2, 0])
    values = torch.randn(2, 20, 2, 4) * torch.tensor([1e-3, 50.0])[:, None]  # heads of very different scales
    fp8.write(slice(None), table, 4, values)
    got = fp8.gather(1, table, chunk_ids=torch.tensor([1, 5, 3]), heads=torch.tensor([0, 1, 1]), chunk_size=4)
    want = torch.stack([values[1, 0:4, 0], values[1, 16:20, 1], values[1, 8:12, 1]])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2 ** -3, atol=0)  # e4m3: 3 mantissa bits, normal range
    with pytest.raises(ValueError, match="whole chunks of 4 tokens"):
        fp8.write(0, table, 2, values[0, :4])
    assert model.page_bytes == 2 * 8 * 2 * 4 * 4


def test_quantize_values_round_trip_and_zero_chunks():
    torch.manual_seed(3)
    v = torch.randn(3, 16, 2, 8) * torch.exp(3 * torch.randn(3, 4, 2, 1)).repeat_interleave(4, 1)
    v[0, :4, 1] = 0  # an all-zero chunk of one head
    q, scales = quantize_values(v, 4)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (3, 4, 2)
    per_chunk = q.float().unflatten(1, (4, 4)).abs().amax(dim=(2, 4))  # the largest code of each chunk and head
    assert torch.all((per_chunk == 448) | (scales == torch.finfo(torch.float32).tiny))
    back = (q.float().unflatten(1, (4, 4)) * scales[:, :, None, :, None]).flatten(1, 2)
    torch.testing.assert_close(back, v, rtol=2 ** -3, atol=1e-30)
    assert back[0, :4, 1].eq(0).all()


@pytest.mark.gpu
def test_write_from_the_device_is_seen_by_gather():
    torch.manual_seed(1)
    store = make_store(pin=True)
    table = torch.tensor([2, 1, 0])
    values = torch.randn(2, 24, 2, 4, device="cuda")
    store.write(slice(None), table, 0, values)
    got = store.gather(0, table, chunk_ids=torch.tensor([0, 5]), heads=torch.tensor([1, 0]), chunk_size=4)
    torch.testing.assert_close(got, torch.stack([values[0, 0:4, 1], values[0, 20:24, 0]]).cpu())
    store.close()


@pytest.mark.gpu
def test_pinned_region_is_registered_and_read_by_the_gpu():
    store = make_store(pin=True)
    assert store.pinned
    store.values.fill_(3.0)
    torch.testing.assert_close(store.values.to("cuda", non_blocking=True).cpu(), store.values)
    store.close()


@pytest.mark.parametrize("fp8", [False, True])
def test_host_bytes_count_the_pages_a_read_takes_from_the_host_region(fp8):
    """A read of a sequence's first tokens takes each of their pages (a part page whole) from where it lies: those
    in the device region cost no host bytes."""
    kw = dict(value_format="fp8", chunk_size=4) if fp8 else {}
    store = make_store(num_pages=4, num_device_pages=3, **kw)
    per_layer = store.page_bytes // 2
    table = torch.tensor([4, 1, 6, 0, 3])  # device pages 0 and 2 among host pages
    assert [store.host_bytes(table, n) for n in (8, 16, 24, 25, 32, 40)] == [
        0, per_layer, per_layer, 2 * per_layer, 2 * per_layer, 3 * per_layer]


@pytest.mark.parametrize("fp8", [False, True])
def test_device_region_pages_write_and_gather_as_the_host(fp8):
    """A sequence's first pages in the device region (ids after the host's), the rest on the host: writes across the
    boundary land in both regions, and gather returns what a host-only store returns."""
    torch.manual_seed(7)
    kw = dict(value_format="fp8", chunk_size=4) if fp8 else {}
    tiered, plain = make_store(num_pages=4, num_device_pages=3, **kw), make_store(num_pages=8, **kw)
    pages = [4, 5, 2, 0, 3]  # device pages 0 and 1, then host pages
    table, plain_table = torch.tensor(pages), torch.tensor([7, 1, 4, 2, 0])
    values = torch.randn(2, 36, 2, 4)  # tokens [4, 40): page 0 (device) to page 4 (host)
    for store, t in ((tiered, table), (plain, plain_table)):
        store.write(slice(None), t, 4, values)
    assert tiered.device_values[:, :2].float().abs().sum() > 0 and tiered.values[:, pages[2]].float().abs().sum() > 0
    chunks, heads = torch.tensor([1, 3, 4, 9, 2]), torch.tensor([0, 1, 1, 0, 1])
    for layer in range(2):
        got = tiered.gather(layer, table, chunks, heads, 4)
        torch.testing.assert_close(got, plain.gather(layer, plain_table, chunks, heads, 4), rtol=0, atol=0)
    spare = [6, 1]  # copy a device page to a host page and a host page to a device page
    tiered.copy_pages([pages[0], pages[2]], [spare[1], spare[0]])
    moved = torch.tensor([spare[1], pages[1], spare[0]])
    for layer in range(2):
        torch.testing.assert_close(tiered.gather(layer, moved, chunks[:3], heads[:3], 4),
                                   tiered.gather(layer, table, chunks[:3], heads[:3], 4), rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True])
def test_copied_pages_read_as_their_sources_between_every_pair_of_regions(fp8):
    """One copy_pages call over device -> device, device -> host, host -> device and host -> host pages (two of some,
    in an order their ids do not follow): each copy reads back exactly as its source, values and fp8 scales, and the
    sources and a page neither side names are as they were."""
    torch.manual_seed(3)
    kw = dict(value_format="fp8", chunk_size=4) if fp8 else {}
    store = make_store(num_pages=7, num_device_pages=6, **kw)
    src, dst = [7, 8, 9, 1, 2, 3], [11, 10, 4, 12, 5, 6]  # device ids start at 7
    store.write(slice(None), torch.tensor(src), 0, torch.randn(2, 48, 2, 4))
    before = [t.clone() for t in (store.values, store.device_values)]
    store.copy_pages(src, dst)
    chunks, heads = torch.arange(12).repeat_interleave(2), torch.tensor([0, 1]).repeat(12)
    for layer in range(2):
        torch.testing.assert_close(store.gather(layer, torch.tensor(dst), chunks, heads, 4),
                                   store.gather(layer, torch.tensor(src), chunks, heads, 4), rtol=0, atol=0)
    for region, was, pages in ((store.values, before[0], [0, 1, 2, 3]), (store.device_values, before[1], [0, 1, 2])):
        assert torch.equal(region[:, pages].view(torch.uint8), was[:, pages].view(torch.uint8))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fp8", [False, True])
def test_moved_pages_gather_from_the_device_region_as_from_the_host(fp8, device):
    """move_pages copies host pages (values and fp8 scales, runs and single pages) into device pages (on CUDA from
    the pinned region, asynchronously): a table naming the device pages gathers what the host table did; anything but
    host into device is refused."""
    torch.manual_seed(9)
    kw = dict(value_format="fp8", chunk_size=4) if fp8 else {}
    store = make_store(num_pages=6, num_device_pages=4, pin=device == "cuda", device=device, **kw)
    table = torch.tensor([2, 3, 5, 0])
    store.write(slice(None), table, 0, torch.randn(2, 32, 2, 4, device=device))
    store.move_pages([3, 2, 5], [7, 6, 9])  # 2, 3 -> device 0, 1 (one run); 5 -> device 3
    chunks, heads = torch.tensor([0, 3, 4, 6, 7]), torch.tensor([1, 0, 1, 0, 1])
    for layer in range(2):
        torch.testing.assert_close(store.gather(layer, torch.tensor([6, 7, 9, 0]), chunks, heads, 4),
                                   store.gather(layer, table, chunks, heads, 4), rtol=0, atol=0)
    for src, dst in (([6], [8]), ([1], [4])):
        with pytest.raises(ValueError, match="only host pages move"):
            store.move_pages(src, dst)
    store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gather_to_the_gpu_reads_each_region_where_it_lives(fp8):
    """gather(device="cuda") over pages in both regions (the device region on the GPU) returns what the host gather
    returns, on the GPU."""
    torch.manual_seed(8)
    kw = dict(value_format="fp8", chunk_size=4) if fp8 else {}
    store = make_store(num_pages=4, num_device_pages=3, pin=True, device="cuda", **kw)
    table = torch.tensor([4, 5, 2, 0, 3])
    store.write(slice(None), table, 4, torch.randn(2, 36, 2, 4, device="cuda"))
    chunks, heads = torch.tensor([1, 3, 4, 9, 2]), torch.tensor([0, 1, 1, 0, 1])
    for layer in range(2):
        got = store.gather(layer, table, chunks, heads, 4, device="cuda")
        assert got.is_cuda
        torch.testing.assert_close(got.cpu(), store.gather(layer, table, chunks, heads, 4), rtol=0, atol=0)
    store.close()
