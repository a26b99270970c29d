"""What a refusal at capacity costs the service per request, with the HTTP proxy's edge shedding (serve_app/edge.py)
and without it: a local Ray Serve instance of the tiny model (2 slots, no waiting line), both slots held by long
streams, then `--probes` completion requests of ~150 KB of JSON one after another, each answered 429. In a burst the
excess waits for this per-request work of the requests ahead of it (docs/benchmarks.md, "Overload").

`--burst`: the overload burst of benchmarks/serve_gpu.py on CPU (edge shedding on): 2 slots + a waiting line of
`--waiting` (2 s bounded wait) + `--excess` requests, each ~232 KB of JSON (a 300-token prompt padded with the ignored
`user` field) and 64 new tokens, all at once; per request its status, latency and whether the proxy answered it
(x-shadowkv-shed: edge). Sent two ways: through one shared httpx AsyncClient (its pool issues the requests one after
another, slower the more are pending: the shed ones, sent last, wait for the client) and through one client (one
connection) per request, opened beforehand; and per request with small bodies.

    PYTHONPATH=. python -m benchmarks.edge_shedding [--probes 30] [--out edge_shedding.json]
    PYTHONPATH=. python -m benchmarks.edge_shedding --burst [--reps 3] [--out edge_shedding_burst.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import httpx

from benchmarks.load import percentile
from benchmarks.report import print_table, write_json
from serve_app.edge import EDGE_ENV
from serve_app.local import local_service, send_at_once, wait_drained
from shadowkv_core.tiny_model import build_tiny_model

SLOTS = 2
HOLD_TOKENS = 3000  # the holding streams outlast the probes
PROBE_PROMPT_TOKENS = 30000  # ~150 KB of JSON
BURST_PAD = 232_000  # bytes of the ignored `user` field: a body of ~232 KB, as a 32K-token prompt on the GPU
BURST_MAX_WAIT_S = 2.0  # prod's bounded wait


def app_args(model: str, max_waiting: int = 0, max_wait_s: float = 0.5, max_model_len: int = 4096) -> dict:
    return {"model": model, "served_model_name": "tiny", "max_num_seqs": SLOTS, "max_model_len": max_model_len,
            "max_waiting": max_waiting, "max_wait_s": max_wait_s,
            "engine": {"gpu_cache_gib": 0.05, "host_cache_gib": 0.05},
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


# ---- a burst (also benchmarks/serve_gpu.py's) -------------------------------------------------------------------
def burst_summary(replies: list[dict], max_wait_s: float, max_tokens: int) -> dict:
    """Admitted and completed; 429s from the edge (their ms p50 / p99 / max), from the ingress at once and after its
    bounded wait; Retry-After on every 429; how long the client took to send them all."""
    refused = [r for r in replies if r["status"] == 429]
    edge = [r["s"] for r in refused if r["edge"]]
    ingress = [r["s"] for r in refused if not r["edge"]]
    at_once = [r["s"] for r in refused if r["s"] < max_wait_s]
    after_wait = [dt for dt in ingress if dt >= max_wait_s]
    admitted = [r for r in replies if r["status"] == 200]
    ms = lambda values: {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99),  # noqa: E731
                         "max": percentile(values, 1.0)}
    return {"requests": len(replies), "admitted": len(admitted),
            "admitted_completed": sum(r["completion_tokens"] == max_tokens for r in admitted),
            "refused_by_edge": len(edge), "edge_429_ms": ms(edge),
            "refused_by_ingress_at_once": sum(dt < max_wait_s for dt in ingress),
            "refused_at_once": len(at_once), "refused_after_bounded_wait": len(after_wait),
            "other_statuses": sorted(r["status"] for r in replies if r["status"] not in (200, 429)),
            "retry_after_on_every_429": all(r["retry_after"] for r in refused),
            "refused_at_once_ms": ms(at_once), "refused_after_wait_ms_p50": percentile(after_wait, 0.5),
            "send_spread_ms": percentile([r["sent_s"] for r in replies], 1.0),
            "admitted_s": [round(min(r["s"] for r in admitted), 1), round(max(r["s"] for r in admitted), 1)]
            if admitted else None}


def burst_body(pad: int, max_tokens: int) -> bytes:
    return json.dumps({"model": "tiny", "prompt": [3 + i % 250 for i in range(300)], "max_tokens": max_tokens,
                       "ignore_eos": True, "user": "x" * pad}).encode()


def bursts(url: str, n: int, reps: int, max_tokens: int = 64) -> list[dict]:
    rows = []
    variants = (("one shared httpx client", BURST_PAD, True), ("a client per request", BURST_PAD, False),
                ("a client per request, small bodies", 0, False))
    for rep in range(reps):
        for name, pad, shared in variants:
            content = burst_body(pad, max_tokens)
            replies = asyncio.run(send_at_once(url, content, n, timeout_s=120, shared_client=shared))
            summary = burst_summary(replies, BURST_MAX_WAIT_S, max_tokens)
            drained = wait_drained("shadowkv", within_s=30)
            rows.append({"variant": name, "rep": rep, "body_kb": round(len(content) / 1e3), **summary,
                         "drained": not (drained["num_running"] or drained["num_held"]
                                         or drained["gpu_bytes_in_use"]),
                         "replies": [{**r, "s": round(r["s"], 4), "sent_s": round(r["sent_s"], 4)}
                                     for r in replies]})
            time.sleep(1)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=int, default=30)
    parser.add_argument("--burst", action="store_true", help="the overload burst instead of sequential probes")
    parser.add_argument("--waiting", type=int, default=62, help="--burst: the ingress's waiting line")
    parser.add_argument("--excess", type=int, default=24, help="--burst: requests beyond slots + waiting line")
    parser.add_argument("--reps", type=int, default=3, help="--burst: bursts per variant")
    parser.add_argument("--out", default=None, help="relative paths land in benchmarks/results/ (default: "
                                                    "edge_shedding.json, --burst: edge_shedding_burst.json)")
    args = parser.parse_args(argv)
    model = str(build_tiny_model(tempfile.mkdtemp() + "/tiny"))
    if args.burst:
        n = SLOTS + args.waiting + args.excess
        with local_service(app_args(model, args.waiting, BURST_MAX_WAIT_S, max_model_len=2048), "shadowkv") as url:
            rows = bursts(url, n, args.reps)
        columns = ["variant", "rep", "body_kb", "admitted", "admitted_completed", "refused_by_edge", "edge_429_ms",
                   "refused_after_bounded_wait", "retry_after_on_every_429", "send_spread_ms", "drained"]
        print_table(rows, columns)
        print(write_json(args.out or "edge_shedding_burst.json", rows, slots=SLOTS, waiting=args.waiting,
                         excess=args.excess, max_wait_s=BURST_MAX_WAIT_S))
        return rows
    rows = []
    no_shedding = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": ""}
    for name, env in (("edge shedding", EDGE_ENV), ("no edge shedding", no_shedding)):
        with local_service(app_args(model), "shadowkv", env=env) as url:
            results = asyncio.run(probe(url, args.probes))
        refused = [ms for status, ms, _ in results if status == 429]
        rows.append({"variant": name, "probes": len(results), "refused_429": len(refused),
                     "answered_by_proxy": sum(edge for status, _, edge in results if status == 429),
                     "p50_ms": statistics.median(refused), "max_ms": max(refused)})
    rows[0]["ingress_over_edge_p50"] = rows[1]["p50_ms"] / rows[0]["p50_ms"]
    print_table(rows, list(rows[0]))
    print(write_json(args.out or "edge_shedding.json", rows))
    return rows


if __name__ == "__main__":
    main()
