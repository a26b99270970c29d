"""Running a module's command line (a benchmark's, the trainer's) as its users do: a fresh interpreter at the
repository root, which is on its path."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str, timeout_s: float, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m module args...` from the repository root; with `check`, fails the test unless it exits 0."""
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=timeout_s)
    assert not check or done.returncode == 0, f"{module} exited {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                               f"{done.stderr[-3000:]}"
    return done
