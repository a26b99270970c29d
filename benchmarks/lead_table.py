"""docs/accuracy.md's lead table in one command: every method at one budget on one instrument, its cells split into
jobs of benchmarks.accuracy (one process each, one method, task and context), run N at a time on one machine, then
joined into one table (benchmarks.accuracy --combine).

    python -m benchmarks.lead_table --model .cache/plain-arbitrary-words --haystack-file .cache/heldout.txt \
        --calibrate-ranks .cache/corpus8k.txt --landmark-rebuild [--rescore 4] --out-dir DIR [--parallel 16]

The ShadowKV options (--calibrate-ranks, --landmark-rebuild, --rescore) go to every job: the harness applies them to
ShadowKV's methods only. Long generation runs `dense_timed` for dense (the engine's default path) and no reference-path
ShadowKV (its 2,048 decode steps per sample on the PyTorch path; the timed configuration runs it). The longest jobs
start first. A job whose directory already holds every row it scores is not run again, so a call cut short resumes.
DIR/jobs/<method>_<task>_<context>/ holds each job's results and log, DIR/combined/ the joined table, and
DIR/lead_table.json this command, the machine and each job's exit code and seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.accuracy import LONGGEN, device_name
from training.templates import MULTITURN, TASKS

METHODS = ("dense", "shadowkv", "shadowkv_timed", "quest", "streamingllm", "snapkv")
NOT_RUN = {("shadowkv", LONGGEN)}  # the reference path's long generation
RUNS_AS = {("dense", LONGGEN): "dense_timed"}  # long generation's dense row: the engine's default path
# the longest first, so that the last jobs to start are short
ORDER = (LONGGEN, MULTITURN, *TASKS)


@dataclasses.dataclass(frozen=True)
class Job:
    method: str  # the harness's method
    task: str
    context: int

    @property
    def name(self) -> str:
        return f"{self.method}_{self.task}_{self.context}"


def plan(methods: list[str], tasks: list[str], contexts: list[int]) -> list[Job]:
    """One job per (method, task, context) the table has, the longest tasks and contexts first."""
    order = sorted(tasks, key=ORDER.index)
    return [Job(RUNS_AS.get((m, t), m), t, c) for t in order for c in sorted(contexts, reverse=True) for m in methods
            if (m, t) not in NOT_RUN]


def command(job: Job, args, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.accuracy", "--device", args.device, "--model", args.model,
           "--samples", str(args.samples), "--niah-contexts", "--budgets", str(args.budget), "--methods", job.method,
           "--tasks", job.task, "--contexts", str(job.context), "--max-minutes", str(args.max_minutes),
           "--templates", args.templates, "--out-dir", str(out)]
    if args.haystack_file:
        cmd += ["--haystack-file", args.haystack_file]
    if args.calibrate_ranks:
        cmd += ["--calibrate-ranks", args.calibrate_ranks]
    if args.landmark_rebuild:
        cmd.append("--landmark-rebuild")
    if args.rescore:
        cmd += ["--rescore", str(args.rescore)]
    return cmd


def done(out: Path, samples: int) -> bool:
    """The job's one row is there with all its samples."""
    path = out / "accuracy.json"
    if not path.exists():
        return False
    rows = json.loads(path.read_text())
    return len(rows) == 1 and rows[0]["samples"] == samples


def run_job(job: Job, args, jobs_dir: Path) -> dict:
    out = jobs_dir / job.name
    if done(out, args.samples):
        return {"job": job.name, "skipped": "done before"}
    out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    with open(out / "run.log", "w") as log:
        rc = subprocess.call(command(job, args, out), stdout=log, stderr=subprocess.STDOUT)
    record = {"job": job.name, "rc": rc, "seconds": round(time.time() - began, 1), "complete": done(out, args.samples)}
    print(f"{job.name:48s} rc={rc} {record['seconds']:7.1f}s {'' if record['complete'] else 'INCOMPLETE'}",
          flush=True)
    return record


def combine(jobs_dir: Path, jobs: list[Job], out: Path) -> int:
    dirs = [str(jobs_dir / j.name) for j in jobs if (jobs_dir / j.name / "accuracy.json").exists()]
    if not dirs:
        return 0
    return subprocess.call([sys.executable, "-m", "benchmarks.accuracy", "--combine", *dirs, "--out-dir", str(out)])


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--templates", default="heldout", choices=("heldout", "fresh"),
                        help="fresh: the second held-out set, with its own --haystack-file")
    parser.add_argument("--haystack-file", default=None)
    parser.add_argument("--calibrate-ranks", metavar="TEXT_FILE", default=None)
    parser.add_argument("--landmark-rebuild", action="store_true")
    parser.add_argument("--rescore", type=int, default=0, metavar="C")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--tasks", nargs="+", default=list(ORDER), choices=ORDER)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--budget", type=float, default=0.0156)
    parser.add_argument("--parallel", type=int, default=os.cpu_count(), help="jobs at once")
    parser.add_argument("--max-minutes", type=float, default=60.0, help="each job's: it starts no run past this")
    parser.add_argument("--dry-run", action="store_true", help="print the jobs' commands, run nothing")
    return parser


def main() -> None:
    args = arg_parser().parse_args()
    out = Path(args.out_dir)
    jobs_dir = out / "jobs"
    jobs = plan(args.methods, args.tasks, args.contexts)
    if args.dry_run:
        for job in jobs:
            print(" ".join(command(job, args, jobs_dir / job.name)))
        return
    began = time.time()
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        records = list(pool.map(lambda job: run_job(job, args, jobs_dir), jobs))
    combined_rc = combine(jobs_dir, jobs, out / "combined")
    meta = {"command": "python -m benchmarks.lead_table " + " ".join(sys.argv[1:]), "device": device_name(args.device),
            "python": platform.python_version(), "seconds": round(time.time() - began, 1), "parallel": args.parallel,
            "combined_rc": combined_rc, "jobs": records}
    (out / "lead_table.json").write_text(json.dumps(meta, indent=1))
    missing = [r["job"] for r in records if not r.get("complete", True)]
    print(f"{len(jobs)} jobs, {len(missing)} incomplete, {meta['seconds']:.0f} s; table: {out / 'combined'}")
    if missing or combined_rc:
        sys.exit(1)


if __name__ == "__main__":
    main()
