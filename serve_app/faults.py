"""Test-only fault injection into an engine replica, off unless SHADOWKV_TEST_FAULTS=1 is in the replica's
environment (tests set it before Ray starts; no config file or request can): the reliability tests use it to fail
one forward or slow the steps down (a replica's death they cause with ray.kill)."""
from __future__ import annotations

import os
import time

ENV = "SHADOWKV_TEST_FAULTS"
FORWARDS = ("decode", "advance_prefill")


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def inject(engine, kind: str, value: float | str | None = None) -> None:
    """kind "fail_forward" (value: one of FORWARDS): its next call raises; "step_delay" (value: seconds, 0 to stop):
    every step sleeps first."""
    if not enabled():
        raise PermissionError(f"fault injection is off (set {ENV}=1 in the replica's environment, in tests only)")
    if kind == "fail_forward" and value in FORWARDS:
        _fail_once(engine.runner, value)
    elif kind == "step_delay":
        _delay_steps(engine, float(value))
    else:
        raise ValueError(f"unknown fault {kind!r} ({value!r})")


def _fail_once(runner, name: str) -> None:
    def failing(*args, **kwargs):
        del runner.__dict__[name]  # the method again from the next call on
        raise RuntimeError(f"injected fault in {name}")

    runner.__dict__[name] = failing


def _delay_steps(engine, delay_s: float) -> None:
    engine.__dict__.pop("step", None)
    if delay_s > 0:
        step = engine.step

        def slow_step():
            time.sleep(delay_s)
            return step()

        engine.__dict__["step"] = slow_step
