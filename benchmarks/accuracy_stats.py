"""95 % intervals for benchmarks/accuracy.py's scores, and its markdown tables with every cell shown.

A cell (task, context, method) holds n samples, each scored 0-100. Its interval is Wilson's score interval for a
proportion, on the mean score: exact in kind where every sample scores 0 or 100 (one needle, one item), and
conservative where samples score in between (several items), since a score in [0, 1] of mean p has a variance of at
most p(1 - p), the all-or-nothing case. An average over k cells (a task over its contexts, the task average) is a sum
of independent cells, so each side of its interval is the root of the sum of the cells' squared distances from their
mean to that side of their Wilson interval, over k: Wilson's own interval for one cell, and as asymmetric near 0 and
100 as the cells' are. Rows written before intervals (no per-sample scores) show their score and sample count
without one.
Two methods scored on the same samples (the same seeds, as every method of a run is) are compared by their paired
difference: a cell's is the mean of its per-sample differences, its variance that of the mean (the differences'
sample variance over n); an average over k cells sums independent cells; the interval is normal. Pairing takes out
what the samples share (a needle both find, a haystack both lose in), so it is narrower than the two methods'
intervals side by side.
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


def average_interval(cells: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(mean, low, high) of the average of cells given as (mean, low, high): each side the root of the sum of the
    cells' squared distances to that side, over the number of cells."""
    k = len(cells)
    mean = sum(c[0] for c in cells) / k
    below = math.sqrt(sum((c[0] - c[1]) ** 2 for c in cells)) / k
    above = math.sqrt(sum((c[2] - c[0]) ** 2 for c in cells)) / k
    return mean, max(0.0, mean - below), min(100.0, mean + above)


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


def paired_difference(pairs: list[tuple[list[float], list[float]]]) -> tuple[float, float, float]:
    """(mean, low, high) of method a's score minus method b's, averaged over cells; each pair is one cell's
    per-sample scores of a and of b, in the same sample order (two samples or more)."""
    means, variance = [], 0.0
    for a, b in pairs:
        if len(a) != len(b) or len(a) < 2:
            raise ValueError(f"a paired difference needs two or more samples scored by both, got {len(a)} and {len(b)}")
        d = [x - y for x, y in zip(a, b)]
        m = sum(d) / len(d)
        means.append(m)
        variance += sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)
    k = len(means)
    mean, half = sum(means) / k, Z95 * math.sqrt(variance) / k
    return mean, mean - half, mean + half


def fmt_difference(diff: tuple[float, float, float] | None) -> str:
    return "-" if diff is None else f"{diff[0]:+.1f} [{diff[1]:+.1f}, {diff[2]:+.1f}]"
