"""What every benchmark records beside its numbers: the command, the device and the library versions."""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    import transformers

    env = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def write_json(path: str | Path, rows: list[dict], **extra) -> Path:
    """Rows plus the environment, to `path` (relative paths land in benchmarks/results/)."""
    path = Path(path)
    if not path.is_absolute():
        path = RESULTS / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": environment(), **extra, "rows": rows}, indent=2) + "\n")
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)
