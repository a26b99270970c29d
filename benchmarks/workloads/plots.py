"""The workload benchmark's figures: one panel per scenario, one line per method. Offline: the distribution of TTFT;
online: requests/min and goodput against the arrival rate."""
from __future__ import annotations

import sys
from pathlib import Path

from .runs import METHODS


def plot(rows: list[dict], path: Path) -> Path | None:
    """The figure of the rows' driver, written to `path`; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return None
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        ours = [r for r in rows if r["scenario"] == scenario]
        (_rates if rows[0]["driver"] == "online" else _ttft_cdf)(ax, ours)
        ax.set_title(scenario)
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
