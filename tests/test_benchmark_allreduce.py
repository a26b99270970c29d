"""benchmarks/allreduce.py through torchrun's launcher on the CPU (gloo, eager only): a row per size, from rank 0."""
import json

from support.cli import run_module


def test_two_ranks_time_each_size(tmp_path):
    out = tmp_path / "allreduce.json"
    run_module("torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "benchmarks.allreduce",
               "--kib", "16", "96", "--out", str(out), timeout_s=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["ranks"], r["kib"]) for r in rows] == [(2, 16), (2, 96)]
    assert all(r["eager_us"] > 0 and r["graph_us"] is None for r in rows)  # no CUDA: no graph to replay
