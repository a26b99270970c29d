"""Copies between host and device that never wait for the device's queued work.

A decode step is launched while the step before it still runs on the device (EngineConfig.async_decode), so its
host-side bookkeeping must not wait for that step. A blocking host-to-device copy waits for everything queued on the
stream before it starts, and reading a device tensor's values (`.tolist()`, `.item()`) waits for everything queued
after the tensor was written, the next step included. These two helpers do neither.
"""
from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list (or host tensor) on `device`, queued without waiting for the stream's earlier work: a pageable
    source is staged by the driver before this returns, so the caller may drop or change it at once."""
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    return host.to(device, dtype=dtype, non_blocking=True)


class Readback:
    """A device tensor's values, copied to pinned host memory behind the work queued so far and read later: `wait`
    waits for that work only, not for what is queued after this copy. On the CPU, the tensor itself."""

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.device.type != "cuda":
            self.host = tensor
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        """Whether the copy has completed (never waits)."""
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host

    def tolist(self) -> list:
        return self.wait().tolist()
