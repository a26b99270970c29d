import logging

import pytest
import torch

from shadowkv_core.numa import NumaPlacement, load_libnuma, node_cpus, parse_cpulist, placement_for_gpu

BUS_ID = "0000:41:00.0"


def fake_sysfs(root, node_lists, gpu_node):
    for node, cpulist in node_lists.items():
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(cpulist + "\n")
    dev = root / "bus/pci/devices" / BUS_ID
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(f"{gpu_node}\n")
    return root


class RecordingLibnuma:
    def __init__(self):
        self.calls = []

    def numa_tonode_memory(self, ptr, nbytes, node):
        self.calls.append((ptr.value, nbytes.value, node.value))


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []


def test_two_node_host_binds_store_and_threads_to_the_gpu_node(tmp_path, caplog):
    sysfs = fake_sysfs(tmp_path, {0: "0-15", 1: "16-31"}, gpu_node=1)
    with caplog.at_level(logging.INFO, logger="shadowkv_core.numa"):
        placement = placement_for_gpu(0, BUS_ID, sysfs, use_nvml=False)
    assert placement == NumaPlacement(1, tuple(range(16, 32)))
    assert "node 1" in caplog.text
    lib = RecordingLibnuma()
    assert placement.bind_memory(0x1000, 4096, lib)
    assert lib.calls == [(0x1000, 4096, 1)]
    pinned = []
    assert placement.pin_threads(lambda pid, cpus: pinned.append((pid, cpus)))
    assert pinned == [(0, set(range(16, 32)))]


def test_single_node_host_degrades_with_one_log_line(tmp_path, caplog):
    sysfs = fake_sysfs(tmp_path, {0: "0-7"}, gpu_node=-1)
    with caplog.at_level(logging.INFO, logger="shadowkv_core.numa"):
        placement = placement_for_gpu(0, BUS_ID, sysfs, use_nvml=False)
    assert placement.node is None and len(caplog.records) == 1 and "node 0" in caplog.records[0].getMessage()
    lib = RecordingLibnuma()
    assert not placement.bind_memory(0x1000, 4096, lib) and lib.calls == []
    assert not placement.pin_threads(lambda pid, cpus: None)


def test_unknown_gpu_node_on_a_multi_node_host_places_nothing(tmp_path):
    sysfs = fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"}, gpu_node=-1)
    assert placement_for_gpu(0, BUS_ID, sysfs, use_nvml=False).node is None


def test_this_machine_reads_its_real_topology():
    nodes = node_cpus()
    if not nodes:
        pytest.skip("this kernel exposes no NUMA nodes in sysfs")
    assert nodes and all(cpus for cpus in nodes.values())
    lib = load_libnuma()
    if lib is not None:  # a real bind on this host's node 0 is harmless
        region = torch.empty(1 << 20, dtype=torch.uint8)
        assert NumaPlacement(0, tuple(nodes[0])).bind_memory(region.data_ptr(), region.numel(), lib)


def test_host_value_store_binds_its_region_to_the_placement_node(tmp_path, monkeypatch):
    import shadowkv_core.shadowkv.host_store as host_store
    from shadowkv_core.shadowkv.host_store import HostValueStore

    lib = RecordingLibnuma()
    monkeypatch.setattr(host_store, "load_libnuma", lambda: lib)
    placement = placement_for_gpu(0, BUS_ID, fake_sysfs(tmp_path, {0: "0-15", 1: "16-31"}, gpu_node=1),
                                  use_nvml=False)
    store = HostValueStore(2, 4, 8, 2, 4, torch.float32, pin=False, placement=placement)
    (ptr, nbytes, node), = lib.calls
    assert node == 1 and store.numa_bound
    assert ptr <= store.values.data_ptr() and store.values.data_ptr() + store.values.nbytes <= ptr + nbytes
    assert ptr % 4096 == 0 and nbytes % 4096 == 0
