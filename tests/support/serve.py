"""What the tests that run a real local Ray Serve instance (serve_app/local.py) check of it."""
from __future__ import annotations

from serve_app.local import wait_drained


def assert_engine_drains(app: str, within_s: float) -> dict:
    """The engine (one replica) ends every request and frees every byte within `within_s`; returns its stats."""
    stats = wait_drained(app, within_s)
    assert stats["num_running"] == stats["num_waiting"] == stats["num_held"] == 0, stats
    assert stats["gpu_bytes_in_use"] == 0 and stats["host_bytes_in_use"] == 0, stats
    return stats
