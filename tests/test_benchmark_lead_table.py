"""benchmarks/lead_table.py: the lead table's jobs, their commands as the accuracy harness reads them, and a run that
resumes (jobs done before are not run again) and joins what the jobs wrote."""
import json
import subprocess
import sys
from pathlib import Path

from benchmarks import lead_table
from benchmarks.accuracy import arg_parser

CONTEXTS = [4096, 8192, 16384]


def test_every_cell_of_the_table_is_one_job():
    jobs = lead_table.plan(list(lead_table.METHODS), list(lead_table.ORDER), CONTEXTS)
    cells = [(j.method, j.task, j.context) for j in jobs]
    assert len(cells) == len(set(cells))
    tasks = lead_table.ORDER
    want = {(m, t, c) for m in lead_table.METHODS for t in tasks for c in CONTEXTS if m != "dense"} - {
        ("shadowkv", "niah_longgen", c) for c in CONTEXTS}
    want |= {("dense", t, c) for t in tasks if t != "niah_longgen" for c in CONTEXTS}
    want |= {("dense_timed", "niah_longgen", c) for c in CONTEXTS}
    assert set(cells) == want
    assert [j.task for j in jobs[:3 * 5]] == ["niah_longgen"] * 15  # the longest start first
    assert jobs[0].context == 16384


def test_each_command_is_one_cell_of_the_harness_with_the_shadowkv_options(tmp_path):
    args = lead_table.arg_parser().parse_args(
        ["--model", "M", "--out-dir", str(tmp_path), "--haystack-file", "H", "--calibrate-ranks", "T",
         "--landmark-rebuild", "--rescore", "4", "--samples", "7", "--templates", "fresh"])
    for job in lead_table.plan(args.methods, args.tasks, args.contexts):
        cmd = lead_table.command(job, args, tmp_path / job.name)
        assert cmd[1:3] == ["-m", "benchmarks.accuracy"]
        got = arg_parser().parse_args(cmd[3:])
        assert (got.methods, got.tasks, got.contexts) == ([job.method], [job.task], [job.context])
        assert (got.model, got.haystack_file, got.samples, got.budgets) == ("M", "H", 7, [0.0156])
        assert (got.calibrate_ranks, got.landmark_rebuild, got.rescore, got.niah_contexts) == ("T", True, 4, [])
        assert (got.out_dir, got.templates) == (str(tmp_path / job.name), "fresh")


def _row(method, task, context, samples, score):
    return {"task": task, "context": context, "method": method, "budget": 1.0 if method == "dense" else 0.0156,
            "templates": "heldout", "score": score, "low": 0.0, "high": 100.0, "samples": samples,
            "scores": [score] * samples}


def test_a_run_skips_the_jobs_done_before_and_joins_them(tmp_path):
    jobs = tmp_path / "jobs"
    for method, score in (("dense", 100.0), ("quest", 0.0)):
        job = jobs / f"{method}_niah_single_4096"
        job.mkdir(parents=True)
        (job / "accuracy.json").write_text(json.dumps([_row(method, "niah_single", 4096, 3, score)]))
        (job / "accuracy.meta.json").write_text(json.dumps({"command": f"python -m benchmarks.accuracy {method}",
                                                            "device": "cpu"}))
    subprocess.run([sys.executable, "-m", "benchmarks.lead_table", "--model", "unused", "--device", "cpu",
                    "--out-dir", str(tmp_path), "--methods", "dense", "quest", "--tasks", "niah_single",
                    "--contexts", "4096", "--samples", "3"], check=True, cwd=Path(__file__).parents[1])
    meta = json.loads((tmp_path / "lead_table.json").read_text())
    assert [r["skipped"] for r in meta["jobs"]] == ["done before"] * 2
    joined = json.loads((tmp_path / "combined" / "accuracy.json").read_text())
    assert sorted((r["method"], r["score"]) for r in joined) == [("dense", 100.0), ("quest", 0.0)]
    assert not lead_table.done(jobs / "quest_niah_single_4096", samples=4)  # a cell short of its samples runs again
