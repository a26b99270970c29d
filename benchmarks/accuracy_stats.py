"""95 % intervals for benchmarks/accuracy.py's scores, and its markdown tables with every cell shown.

A cell (task, context, method) holds n samples, each scored 0-100. Its interval is Wilson's score interval for a
proportion, on the mean score: exact in kind where every sample scores 0 or 100 (one needle, one item), and
conservative where samples score in between (several items), since a score in [0, 1] of mean p has a variance of at
most p(1 - p), the all-or-nothing case. An average over cells (a task over its contexts, the task average) gets a
normal interval: each cell's standard error taken from its Wilson interval (its width / 2z), the cells independent,
so the average's error is the root of their squares' sum over the number of cells. Rows written before intervals
(no per-sample scores) show their score and sample count without one.
"""
from __future__ import annotations

import math

Z95 = 1.959964  # the normal quantile of a two-sided 95 % interval


def wilson(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's interval for a proportion: mean and bounds in 0-100, n samples."""
    if n < 1:
        raise ValueError(f"an interval needs samples, got n={n}")
    p = mean / 100
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * max(0.0, centre - half), 100 * min(1.0, centre + half)


def cell_interval(scores: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of one cell's per-sample scores (0-100)."""
    mean = sum(scores) / len(scores)
    return (mean, *wilson(mean, len(scores)))


def average_interval(cells: list[tuple[float, float, float]], z: float = Z95) -> tuple[float, float, float]:
    """(mean, low, high) of the average of cells given as (mean, low, high): normal, each cell's standard error its
    interval's width / 2z."""
    mean = sum(c[0] for c in cells) / len(cells)
    error = math.sqrt(sum(((c[2] - c[1]) / (2 * z)) ** 2 for c in cells)) / len(cells)
    return mean, max(0.0, mean - z * error), min(100.0, mean + z * error)


def row_interval(row: dict) -> tuple[float, float, float] | None:
    """A result row's (mean, low, high), or None for a row without per-sample scores (written before intervals)."""
    return cell_interval(row["scores"]) if row.get("scores") else None


def fmt(cell: tuple[float, float, float] | None, fallback: dict | None = None) -> str:
    if cell is not None:
        return f"{cell[0]:.1f} [{cell[1]:.1f}, {cell[2]:.1f}]"
    if fallback is not None:
        return f"{fallback['score']:.1f} (n={fallback['samples']}, no interval)"
    return "-"


def combined(rows: list[dict]) -> str:
    """The average of rows' cells with its interval; rows without per-sample scores make it a plain mean."""
    if not rows:
        return "-"
    cells = [row_interval(r) for r in rows]
    if all(c is not None for c in cells):
        return fmt(average_interval(cells))
    return f"{sum(r['score'] for r in rows) / len(rows):.1f} (no interval)"
