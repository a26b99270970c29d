"""Accuracy smoke on CPU: the shipped model finds a needle in 3K tokens, with dense attention and with ShadowKV at a
1.56 % budget, on a handful of held-out samples (benchmarks/accuracy.py does the full grid)."""
from pathlib import Path

import pytest

from benchmarks.accuracy import run
from training.data import make_sample, score

MODEL = Path(__file__).resolve().parents[1] / "models" / "shadowkv-small"


@pytest.mark.parametrize("method, budget", [("dense", 1.0), ("shadowkv", 0.0156)])
def test_needle_found_at_3k(method, budget):
    samples = [make_sample("niah_single", 3072, seed, depth=depth) for seed, depth in enumerate((0.1, 0.5, 0.9))]
    texts, _ = run(str(MODEL), method, budget, samples, "cpu")
    assert [score(s, t) for s, t in zip(samples, texts)] == [100.0] * 3, list(zip([s.answer for s in samples], texts))
