"""The two CUDA streams of an engine's steps (EngineConfig.overlap_prefill).

A decode step at long context spends much of its time waiting on its value fetch over PCIe, while a prefill slice
is matrix work. On one stream they take turns. Here the step's decode (and all the engine's other work) runs on a
high-priority main stream and the step's prefill slices on a low-priority one, so the slices run in what the decode
leaves of the device, and where both have blocks ready the decode's go first. Priority does not take SMs back: a
slice's blocks, once resident, hold their SMs until they end.

The two streams meet at every step: the step's work on the main stream waits for the last step's slices, and its
slices wait for what the main stream queued before the step's decode. Within a step the decode and the slices touch
different sequences (a prompt is not decoded before its prefill has ended), and a sequence whose prefill is dropped
midway is freed only behind the slices queued for it, so that no page is reused while a slice still writes it.
"""
from __future__ import annotations

import contextlib

import torch


class StepStreams:
    def __init__(self, device: torch.device):
        low, high = torch.cuda.Stream.priority_range()
        self.main = torch.cuda.Stream(device, priority=high)
        self.prefill = torch.cuda.Stream(device, priority=low)
        current = torch.cuda.current_stream(device)  # the model and the caches were made there
        self.main.wait_stream(current)
        self.prefill.wait_stream(current)

    def engine(self) -> contextlib.AbstractContextManager:
        """The engine's own work (decode, sampling, admission, release) goes to the main stream."""
        return torch.cuda.stream(self.main)

    def slices(self) -> contextlib.AbstractContextManager:
        """Prefill work goes to the prefill stream (inside engine())."""
        return torch.cuda.stream(self.prefill)

    def before_decode(self) -> None:
        """The slices queued from now on wait for what the main stream holds now (call it before the step queues
        its decode)."""
        self.prefill.wait_stream(self.main)

    def after_slices(self, event: torch.cuda.Event | None = None) -> None:
        """The main stream's work from now on waits for the slices: those up to `event`, else all queued."""
        if event is None:
            self.main.wait_stream(self.prefill)
        else:
            self.main.wait_event(event)

    def mark(self) -> torch.cuda.Event:
        """An event after the slices queued so far."""
        event = torch.cuda.Event()
        event.record(self.prefill)
        return event
