"""The accuracy harness's intervals (benchmarks/accuracy_stats.py) against textbook values, and its tables and merge
with rows written before intervals (the shipped benchmarks/results/accuracy.json)."""
import json
import math
from pathlib import Path

import pytest

from benchmarks.accuracy import join_shards, kept_rows, markdown, shard_seeds
from benchmarks.accuracy_stats import Z95, average_interval, cell_interval, paired_difference, wilson

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "accuracy.json"


@pytest.mark.parametrize("successes, n, low, high", [
    (0, 10, 0.0, 27.75), (10, 10, 72.25, 100.0), (5, 10, 23.66, 76.34), (45, 50, 78.64, 95.65)])
def test_wilson_matches_textbook_values(successes, n, low, high):
    lo, hi = wilson(100 * successes / n, n)
    assert lo == pytest.approx(low, abs=0.01) and hi == pytest.approx(high, abs=0.01)


def test_wilson_narrows_with_samples_and_refuses_none():
    assert wilson(90, 50)[1] - wilson(90, 50)[0] < wilson(90, 10)[1] - wilson(90, 10)[0]
    with pytest.raises(ValueError, match="needs samples"):
        wilson(50, 0)


def test_partial_credit_cell_is_wilson_on_its_mean():
    mean, low, high = cell_interval([100, 50, 75, 100])
    assert mean == 81.25 and (low, high) == wilson(81.25, 4)


def test_average_of_cells_pools_each_side_of_their_intervals():
    a, b = cell_interval([100] * 9 + [0]), cell_interval([100] * 5 + [0] * 5)
    mean, low, high = average_interval([a, b])
    assert mean == 70.0
    assert low == pytest.approx(70 - math.hypot(a[0] - a[1], b[0] - b[1]) / 2)
    assert high == pytest.approx(70 + math.hypot(a[2] - a[0], b[2] - b[0]) / 2)
    assert average_interval([a]) == a  # one cell: its own Wilson interval
    full = cell_interval([100] * 50)
    assert average_interval([full] * 4) == (100.0, 100 - (100 - full[1]) / 2, 100.0)  # sqrt(4) / 4 of one side


def test_markdown_shows_every_cell_with_intervals_and_old_rows_without():
    new = [{"task": "niah_single", "context": c, "method": m, "budget": b, "templates": "heldout", "samples": 4,
            "score": 75.0, "scores": [100, 100, 100, 0]} for c in (4096, 8192)
           for m, b in (("dense", 1.0), ("snapkv", 0.0156))]
    old = [{"task": "niah_single", "context": 4096, "method": "dense", "budget": 1.0, "score": 90.0, "samples": 10}]
    table = markdown(new + old)
    lo, hi = wilson(75, 4)
    assert f"| niah_single | 4096 | 75.0 [{lo:.1f}, {hi:.1f}] | 75.0 [{lo:.1f}, {hi:.1f}] |" in table
    assert "| niah_single | 8192 |" in table
    assert "### templates: heldout" in table and "### templates: ruler" in table
    assert "| niah_single | 4096 | 90.0 (n=10, no interval) |" in table


def test_a_method_run_at_calibrated_layer_ranks_is_a_column_of_its_own():
    rows = [{"task": "niah_single", "context": 4096, "method": "shadowkv", "budget": 0.0156, "templates": "heldout",
             "samples": 2, "score": score, "scores": scores, **extra}
            for score, scores, extra in ((50.0, [100, 0], {}), (100.0, [100, 100], {"layer_ranks": "calibrated"}))]
    table = markdown(rows)
    assert "| task | shadowkv 1.56% | shadowkv 1.56%, calibrated ranks |" in table
    lo, hi = wilson(50, 2)
    lo2, hi2 = wilson(100, 2)
    assert f"| niah_single | 4096 | 50.0 [{lo:.1f}, {hi:.1f}] | 100.0 [{lo2:.1f}, {hi2:.1f}] |" in table


def test_keys_onto_landmarks_is_a_column_of_its_own_and_combines_with_calibrated_ranks():
    rows = [{"task": "niah_single", "context": 4096, "method": "shadowkv", "budget": 0.0156, "templates": "heldout",
             "samples": 2, "score": score, "scores": scores, **extra}
            for score, scores, extra in ((50.0, [100, 0], {"layer_ranks": "calibrated"}),
                                         (0.0, [0, 0], {"layer_ranks": "calibrated", "landmark_rebuild": True}))]
    table = markdown(rows)
    assert ("| task | shadowkv 1.56%, calibrated ranks | shadowkv 1.56%, calibrated ranks, keys onto landmarks |"
            in table)
    lo, hi = wilson(50, 2)
    lo2, hi2 = wilson(0, 2)
    assert f"| niah_single | 4096 | 50.0 [{lo:.1f}, {hi:.1f}] | 0.0 [{lo2:.1f}, {hi2:.1f}] |" in table


def test_the_shipped_rows_stay_readable_and_merge_by_templates(tmp_path):
    rows = json.loads(RESULTS.read_text())
    assert rows and all("scores" not in r for r in rows)  # written before intervals
    table = markdown(rows)
    assert "### templates: ruler" in table and "no interval" in table
    path = tmp_path / "accuracy.json"
    path.write_text(RESULTS.read_text())
    assert kept_rows(path, [("dense", 1.0, "heldout")]) == rows  # another templates' run keeps them all
    assert not any(r["method"] == "dense" for r in kept_rows(path, [("dense", 1.0, "ruler")]))


def _shard_rows(scores: list[float], k: int, **extra) -> list[dict]:
    """The rows k shards of one cell would write, scores given per seed."""
    rows = []
    for i in range(k):
        mine = [scores[seed] for seed in shard_seeds(len(scores), (i, k))]
        mean, low, high = cell_interval(mine)
        rows.append({"task": "niah_longgen", "context": 4096, "method": "shadowkv", "budget": 0.0156,
                     "templates": "heldout", "seconds": 10.0 + i, "hit_rate": 0.1 * (i + 1), "shard": [i, k],
                     "score": mean, "low": low, "high": high, "samples": len(mine), "scores": mine, **extra})
    return rows


def test_shards_partition_the_seeds():
    for k in (1, 3, 7):
        seeds = sorted(s for i in range(k) for s in shard_seeds(20, (i, k)))
        assert seeds == list(range(20))
    assert shard_seeds(20, None) == list(range(20))


def test_joined_shards_are_the_whole_cell():
    scores = [100.0, 0.0, 0.0, 100.0, 50.0, 100.0, 0.0, 0.0, 100.0, 100.0, 0.0]
    whole = {"task": "niah_single", "context": 4096, "method": "dense", "budget": 1.0, "templates": "heldout",
             "score": 50.0, "scores": [100, 0], "samples": 2}
    rows = _shard_rows(scores, 3)
    joined = join_shards(rows[::-1] + [whole])
    assert whole in joined and len(joined) == 2
    row = next(r for r in joined if r is not whole)
    mean, low, high = cell_interval(scores)
    assert row["scores"] == scores and row["samples"] == len(scores) and "shard" not in row
    assert (row["score"], row["low"], row["high"]) == (mean, round(low, 2), round(high, 2))
    assert row["seconds"] == 33.0
    weights = [len(shard_seeds(len(scores), (i, 3))) for i in range(3)]
    assert row["hit_rate"] == pytest.approx(sum(0.1 * (i + 1) * w for i, w in enumerate(weights)) / len(scores),
                                            abs=1e-4)


def test_shards_that_do_not_make_a_cell_are_refused():
    scores = [100.0, 0.0, 50.0, 100.0, 0.0, 100.0]
    with pytest.raises(ValueError, match="need each of 0..2 of 3"):
        join_shards(_shard_rows(scores, 3)[:2])
    differing = _shard_rows(scores, 2)
    differing[1]["landmark_rebuild"] = True
    with pytest.raises(ValueError, match="need each of 0..1 of 2"):
        join_shards(differing)
    short = _shard_rows(scores, 2)
    short[1]["scores"] = short[1]["scores"][:1]  # shard 1 run with fewer samples
    with pytest.raises(ValueError, match=r"leave seeds out .*\[3\]"):
        join_shards(short)


def test_paired_difference_matches_a_hand_computation():
    # differences 0, 0, 100, 0: mean 25, sample variance 2500, variance of the mean 625
    mean, low, high = paired_difference([([100, 0, 100, 100], [100, 0, 0, 100])])
    assert mean == 25 and (low, high) == pytest.approx((25 - Z95 * 25, 25 + Z95 * 25))
    # two cells: the average of their means, the variance of an average of independent cells
    mean, low, high = paired_difference([([100, 0, 100, 100], [100, 0, 0, 100]), ([50, 50], [0, 100])])
    assert mean == pytest.approx(12.5) and high - mean == pytest.approx(Z95 * math.sqrt(625 + 2500) / 2)
    with pytest.raises(ValueError, match="two or more samples scored by both"):
        paired_difference([([100, 0], [100])])


def test_pairing_takes_out_what_the_samples_share():
    """Two methods that differ on one sample of forty: the paired interval is far narrower than the unpaired
    intervals side by side, and holds the difference."""
    dense = [100.0 if i % 2 else 0.0 for i in range(40)]
    sparse = dense[:]
    sparse[1] = 0.0
    mean, low, high = paired_difference([(sparse, dense)])
    assert mean == -2.5 and low < -2.5 < high and high - low < 12
    _, d_low, d_high = cell_interval(dense)
    assert d_high - d_low > 25


def test_markdown_pairs_each_sparse_column_with_the_dense_method_of_its_cells():
    def row(method, task, context, scores, budget=0.0156):
        return {"task": task, "context": context, "method": method, "budget": budget, "templates": "heldout",
                "samples": len(scores), "score": sum(scores) / len(scores), "scores": scores}
    rows = [row("dense", "niah_single", 4096, [100, 0, 100, 100], 1.0),
            row("shadowkv", "niah_single", 4096, [100, 0, 0, 100]),
            row("dense_timed", "niah_longgen", 4096, [0, 100], 1.0),
            row("shadowkv", "niah_longgen", 4096, [100, 100])]
    table = markdown(rows)
    assert "Paired difference to dense" in table
    lo, hi = -25 - Z95 * 25, -25 + Z95 * 25
    assert f"| niah_single | -25.0 [{lo:+.1f}, {hi:+.1f}] |" in table
    lg = paired_difference([([100, 100], [0, 100])])
    assert f"| niah_longgen | +50.0 [{lg[1]:+.1f}, {lg[2]:+.1f}] |" in table  # against dense_timed
    assert "Paired difference" not in markdown([r for r in rows if r["method"] == "shadowkv"])
    one = [row("dense", "niah_single", 4096, [100], 1.0), row("shadowkv", "niah_single", 4096, [0])]
    assert "Paired difference" not in markdown(one)  # one sample a cell: no interval to pair, and no error
