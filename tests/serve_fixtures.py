"""What the tests that run a real local Ray Serve instance share (the service itself: benchmarks/local_service.py)."""
from __future__ import annotations

from benchmarks.local_service import engine_stats, local_service, wait_drained, wait_healthy

__all__ = ["assert_engine_drains", "engine_stats", "local_service", "wait_healthy"]


def assert_engine_drains(app: str, within_s: float) -> dict:
    """The engine (one replica) ends every request and frees every byte within `within_s`; returns its stats."""
    stats = wait_drained(app, within_s)
    assert stats["num_running"] == stats["num_waiting"] == stats["num_held"] == 0, stats
    assert stats["gpu_bytes_in_use"] == 0 and stats["host_bytes_in_use"] == 0, stats
    return stats
