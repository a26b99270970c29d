"""How much prefill an engine step runs beside its decodes (EngineConfig.prefill_step_tflop, prefill_step_ms)."""
from __future__ import annotations

import time
from collections.abc import Callable

from ..config import EngineConfig

GROWTH = 1.25  # the most a budget grows from one step to the next: an overshoot of the target lasts a few steps
SHRINK = 0.5  # the most it shrinks from one step to the next


class SlicePacer:
    """The FLOPs of prefill slices a step may run beside its decode: prefill_step_tflop times `scale`. Without
    prefill_step_ms the scale stays 1. With it, each step that held a decode and slices reports its seconds, and the
    scale moves by the target over them (within [SHRINK, GROWTH] a step, never below 1): while the decodes leave
    room, a step's slices grow until steps take about the target, so the prefill gets what the decodes' inter-token
    latency target leaves instead of a fixed share; prefill_step_tflop stays the least a step runs."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.scale = 1.0
        self._started = 0.0

    def budget(self, config: EngineConfig) -> float | None:
        """This step's prefill FLOPs beside a decode; None: no limit."""
        return None if config.prefill_step_tflop is None else config.prefill_step_tflop * 1e12 * self.scale

    def start_step(self) -> None:
        self._started = self.clock()

    def end_step(self, config: EngineConfig, paced: bool) -> None:
        """A step ends; paced: it held a decode and prefill slices on a finite budget."""
        if not paced or config.prefill_step_ms is None:
            return
        seconds = max(self.clock() - self._started, 1e-9)
        self.scale = max(1.0, self.scale * min(max(config.prefill_step_ms / 1e3 / seconds, SHRINK), GROWTH))
