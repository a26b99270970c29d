"""The workload benchmark's figures: one panel per scenario and driver, one line per method. Offline: the distribution
of TTFT; online: requests/min and goodput against the arrival rate."""
from __future__ import annotations

import sys
from pathlib import Path

from .runs import METHODS


def plot(rows: list[dict], path: Path) -> Path | None:
    """The figure of the rows, written to `path` (a row of panels per driver present); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return None
    drivers = [d for d in ("offline", "online") if any(r["driver"] == d for r in rows)]
    panels = [[(d, s) for s in dict.fromkeys(r["scenario"] for r in rows if r["driver"] == d)] for d in drivers]
    width = max(len(line) for line in panels)
    fig, axes = plt.subplots(len(panels), width, figsize=(4.2 * width, 3.4 * len(panels)), squeeze=False)
    for line, ax_line in zip(panels, axes):
        for ax in ax_line[len(line):]:
            ax.set_visible(False)
        for (driver, scenario), ax in zip(line, ax_line):
            ours = [r for r in rows if r["scenario"] == scenario and r["driver"] == driver]
            (_rates if driver == "online" else _ttft_cdf)(ax, ours)
            ax.set_title(f"{scenario}, {driver}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _ttft_cdf(ax, rows: list[dict]) -> None:
    """Over every request of a run: one cut short by its time limit never reaches 1."""
    for r in rows:
        ttft = sorted(q["ttft_s"] for q in r["request_records"] if q["error"] is None)
        if ttft and "defect" not in r:
            share = [(i + 1) / len(r["request_records"]) for i in range(len(ttft))]
            ax.step(ttft, share, where="post", label=r["method"], color=_colour(r["method"]))
    ax.set(xlabel="time to first token (s)", ylabel="share of requests")


def _rates(ax, rows: list[dict]) -> None:
    for method in dict.fromkeys(r["method"] for r in rows):
        runs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["rate"])
        rates = [60 * r["rate"] for r in runs]
        ax.plot(rates, [r["requests_per_min"] for r in runs], marker="o", color=_colour(method),
                label=f"{method} requests")
        ax.plot(rates, [r["goodput_per_min"] for r in runs], marker="x", linestyle="--", color=_colour(method),
                label=f"{method} goodput")
    ax.set(xlabel="conversations arriving per minute", ylabel="requests per minute")


def _colour(method: str) -> str:
    """A method's colour, alike in every panel."""
    return f"C{METHODS.index(method)}"
