"""NUMA placement of a replica: its GPU's node, that node's CPUs for its threads, that node's memory for its host
value shard. Reads sysfs (and NVML where present); binds memory through libnuma by ctypes. Where a host has one node
or no libnuma, placement degrades to a no-op with one log line."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the sysfs cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def node_cpus(sysfs: Path = Path("/sys")) -> dict[int, list[int]]:
    """CPUs of every online NUMA node; {} where sysfs shows no nodes."""
    root = sysfs / "devices/system/node"
    nodes = {}
    for entry in sorted(root.glob("node[0-9]*")):
        nodes[int(entry.name[4:])] = parse_cpulist((entry / "cpulist").read_text())
    return nodes


def cuda_pci_bus_id(device_index: int) -> str | None:
    """PCI address (domain:bus:device.function) of a CUDA device as this process numbers it; unlike the index, it
    names the same GPU to NVML and sysfs whatever CUDA_VISIBLE_DEVICES says."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    if not hasattr(props, "pci_bus_id"):
        return None
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def _nvml_numa_node(device_index: int, pci_bus_id: str | None) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = (pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id) if pci_bus_id
                      else pynvml.nvmlDeviceGetHandleByIndex(device_index))
            node = pynvml.nvmlDeviceGetNumaNodeId(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML absent, no driver, or a driver too old for the call: sysfs decides
        return None
    return node if node >= 0 else None


def _sysfs_numa_node(pci_bus_id: str | None, sysfs: Path) -> int | None:
    if not pci_bus_id:
        return None
    path = sysfs / "bus/pci/devices" / pci_bus_id.lower() / "numa_node"
    if not path.exists():
        return None
    node = int(path.read_text())
    return node if node >= 0 else None


def gpu_numa_node(device_index: int, pci_bus_id: str | None = None, sysfs: Path = Path("/sys"),
                  use_nvml: bool = True) -> int | None:
    """NUMA node of a GPU: NVML's answer, else the PCI device's numa_node in sysfs; None if neither knows."""
    node = _nvml_numa_node(device_index, pci_bus_id) if use_nvml else None
    return node if node is not None else _sysfs_numa_node(pci_bus_id, sysfs)


def load_libnuma():
    """libnuma through ctypes, or None where it is not installed or the kernel has no NUMA support."""
    name = ctypes.util.find_library("numa")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    if lib.numa_available() < 0:
        return None
    lib.numa_tonode_memory.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


@dataclass(frozen=True)
class NumaPlacement:
    """Where a replica lives: `node` None means no placement (one node, or unknown)."""

    node: int | None
    cpus: tuple[int, ...]

    def bind_memory(self, ptr: int, nbytes: int, libnuma) -> bool:
        """Bind a not-yet-touched region to the node, before it is first written or pinned."""
        if self.node is None or libnuma is None:
            return False
        libnuma.numa_tonode_memory(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), ctypes.c_int(self.node))
        return True

    def pin_threads(self, set_affinity=os.sched_setaffinity) -> bool:
        """Pin the calling process's threads to the node's CPUs."""
        if self.node is None or not self.cpus:
            return False
        set_affinity(0, set(self.cpus))
        return True


def placement_for_gpu(device_index: int, pci_bus_id: str | None = None, sysfs: Path = Path("/sys"),
                      use_nvml: bool = True) -> NumaPlacement:
    nodes = node_cpus(sysfs)
    if len(nodes) <= 1:
        if nodes:
            (only, cpus), = nodes.items()
            logger.info("NUMA: GPU %d, its host values and threads are on node %d, this host's only node "
                        "(%d CPUs); nothing to bind", device_index, only, len(cpus))
        else:
            logger.info("NUMA: no nodes listed under %s; host values and threads stay where the OS puts them",
                        sysfs / "devices/system/node")
        return NumaPlacement(None, tuple(next(iter(nodes.values()), ())))
    node = gpu_numa_node(device_index, pci_bus_id, sysfs, use_nvml)
    if node is None or node not in nodes:
        logger.info("NUMA: node of GPU %d unknown; no placement", device_index)
        return NumaPlacement(None, ())
    logger.info("NUMA: GPU %d is on node %d; host values and threads go to CPUs %s", device_index, node,
                nodes[node])
    return NumaPlacement(node, tuple(nodes[node]))


def placement_for_cuda_device(device) -> NumaPlacement:
    """Placement of a torch CUDA device (as this process numbers it)."""
    import torch

    index = torch.device(device).index or 0
    return placement_for_gpu(index, cuda_pci_bus_id(index))
