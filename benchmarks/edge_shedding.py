"""What a refusal at capacity costs the service per request, with the HTTP proxy's edge shedding (serve_app/edge.py)
and without it: a local Ray Serve instance of the tiny model (2 slots, no waiting line), both slots held by long
streams, then `--probes` completion requests of ~150 KB of JSON one after another, each answered 429. In a burst the
excess waits for this per-request work of the requests ahead of it (docs/benchmarks.md, "Overload").

    PYTHONPATH=. python -m benchmarks.edge_shedding [--probes 30] [--out edge_shedding.json]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import httpx

from benchmarks.local_service import local_service
from benchmarks.report import print_table, write_json
from serve_app.edge import EDGE_ENV
from shadowkv_core.tiny_model import build_tiny_model

SLOTS = 2
HOLD_TOKENS = 3000  # the holding streams outlast the probes
PROBE_PROMPT_TOKENS = 30000  # ~150 KB of JSON


def app_args(model: str) -> dict:
    return {"model": model, "served_model_name": "tiny", "max_num_seqs": SLOTS, "max_model_len": 4096,
            "max_waiting": 0, "engine": {"gpu_cache_gib": 0.05, "host_cache_gib": 0.05},
            "shadowkv": {"rank": 16, "sparse_budget": 64, "outlier_chunks": 2, "min_context": 256,
                         "decode_window": 64}}


async def probe(url: str, probes: int) -> list[tuple[int, float, bool]]:
    """(status, ms, answered by the proxy) of each probe, with every slot held."""
    hold = {"model": "tiny", "prompt": [3 + i % 250 for i in range(300)], "max_tokens": HOLD_TOKENS,
            "ignore_eos": True, "stream": True}
    body = {"model": "tiny", "prompt": [3 + i % 250 for i in range(PROBE_PROMPT_TOKENS)], "max_tokens": 16}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await http.get("/health")  # the proxy learns the capacity from this answer
        streams = [asyncio.create_task(http.post("/v1/completions", json=hold)) for _ in range(SLOTS)]
        await asyncio.sleep(3)
        out = []
        for _ in range(probes):
            start = time.monotonic()
            r = await http.post("/v1/completions", json=body)
            out.append((r.status_code, 1e3 * (time.monotonic() - start), "x-shadowkv-capacity" not in r.headers))
        for stream in streams:
            stream.cancel()
        return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=int, default=30)
    parser.add_argument("--out", default="edge_shedding.json", help="relative paths land in benchmarks/results/")
    args = parser.parse_args(argv)
    model = str(build_tiny_model(tempfile.mkdtemp() + "/tiny"))
    rows = []
    for name, env in (("edge shedding", EDGE_ENV), ("no edge shedding", {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": ""})):
        with local_service(app_args(model), "shadowkv", env=env) as url:
            results = asyncio.run(probe(url, args.probes))
        refused = [ms for status, ms, _ in results if status == 429]
        rows.append({"variant": name, "probes": len(results), "refused_429": len(refused),
                     "answered_by_proxy": sum(edge for status, _, edge in results if status == 429),
                     "p50_ms": statistics.median(refused), "max_ms": max(refused)})
    rows[0]["ingress_over_edge_p50"] = rows[1]["p50_ms"] / rows[0]["p50_ms"]
    print_table(rows, list(rows[0]))
    print(write_json(args.out, rows))
    return rows


if __name__ == "__main__":
    main()
