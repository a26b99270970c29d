"""Autoscaling timeline: a bounded load on loopback drives the engine deployment up, then stops so it scales back down;
engine replicas, the admission queue, tokens/s and per-replica request counts are sampled all along.

NOT RUN ON GPUS YET: it is issue 9's acceptance, which needs a machine with two GPUs (only its sampling was tried, on
CPU against configs/local.yaml's single replica). There, with the checkpoint (or a
random-weight 8B geometry) at prod.yaml's `model`, and prod.yaml's max_replicas lowered to 2:
    ray start --head --num-gpus 2 --metrics-export-port 8080
    serve run configs/prod.yaml &
    python benchmarks/autoscale_timeline.py --load-s 300 --tail-s 900
Serve waits downscale_delay_s (600 s) before it removes a replica, so --tail-s must exceed it.
Request counts per replica are Ray's counters, cumulative since the application started. Writes
autoscale_timeline.json and .png to --out (benchmarks/results/).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).resolve().parent / "results"
INGRESS_GAUGES = {"queue": "shadowkv_admission_queue_depth", "tokens_per_s": "shadowkv_tokens_per_second",
                  "replicas": "shadowkv_replicas_ready"}
REQUESTS = re.compile(r"^ray_serve_deployment_request_counter_total\{([^}]*)\}\s+(\S+)", re.M)


def gauge(text: str, name: str) -> float:
    found = re.search(rf"^{name}\s+(\S+)", text, re.M)
    return float(found.group(1)) if found else float("nan")


def requests_per_replica(ray_metrics: str) -> dict[str, float]:
    """Completions each engine replica has taken (Ray's counter has one series per replica and route)."""
    counts: dict[str, float] = {}
    for labels, value in REQUESTS.findall(ray_metrics):
        tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if tags.get("deployment") == "EngineReplica" and tags.get("route", "").endswith("completions"):
            counts[tags["replica"]] = counts.get(tags["replica"], 0.0) + float(value)
    return counts


async def sample(client: httpx.AsyncClient, args, start: float) -> dict:
    """One point of the timeline: the ingress's gauges and Ray's per-replica request counters."""
    ingress = (await client.get(f"{args.url}/metrics")).text
    ray_metrics = (await client.get(args.ray_metrics_url)).text
    return {"t_s": round(time.monotonic() - start, 1), **{k: gauge(ingress, n) for k, n in INGRESS_GAUGES.items()},
            "requests_per_replica": requests_per_replica(ray_metrics)}


async def user(client: httpx.AsyncClient, args, stop_at: float, outcomes: dict) -> None:
    """One client sending requests back to back until the load stops; prompts are token ids (random weights)."""
    while time.monotonic() < stop_at:
        prompt = [random.randrange(args.vocab_size) for _ in range(args.context)]
        reply = await client.post(f"{args.url}/v1/completions", json={
            "model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True})
        outcomes[reply.status_code] = outcomes.get(reply.status_code, 0) + 1
        if reply.status_code == 429:  # full everywhere: what makes the policy scale up; back off a little
            await asyncio.sleep(1.0)
        elif reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {reply.text}")


async def run(args) -> dict:
    timeline, outcomes = [], {}
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=args.users + 4)) as client:
        start = time.monotonic()
        stop_load, stop_all = start + args.load_s, start + args.load_s + args.tail_s
        users = [asyncio.create_task(user(client, args, stop_load, outcomes)) for _ in range(args.users)]
        while time.monotonic() < stop_all:
            timeline.append(await sample(client, args, start))
            print(json.dumps(timeline[-1]), flush=True)
            await asyncio.sleep(args.interval_s)
        await asyncio.gather(*users)
    return {"command": " ".join(sys.argv), "args": vars(args), "load_stopped_at_s": args.load_s,
            "responses_by_status": outcomes, "timeline": timeline}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p["t_s"] for p in result["timeline"]]
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(9, 7))
    for ax, key, label in zip(axes, ("replicas", "queue", "tokens_per_s"),
                              ("engine replicas", "admission queue", "tokens/s")):
        ax.plot(t, [p[key] for p in result["timeline"]])
        ax.axvline(result["load_stopped_at_s"], color="grey", linestyle="--")
        ax.set_ylabel(label)
    axes[-1].set_xlabel("seconds (dashed: load stops)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--ray-metrics-url", default="http://127.0.0.1:8080/metrics")
    parser.add_argument("--model", default="llama-3.1-8b-instruct")
    parser.add_argument("--users", type=int, default=24, help="concurrent clients: more than one replica's 16 slots")
    parser.add_argument("--vocab-size", type=int, default=128256, help="prompt token ids are drawn below it")
    parser.add_argument("--context", type=int, default=65536, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--load-s", type=float, default=300)
    parser.add_argument("--tail-s", type=float, default=900)
    parser.add_argument("--interval-s", type=float, default=5)
    parser.add_argument("--request-timeout-s", type=float, default=600)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        parser.error("--url must be loopback")
    result = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "autoscale_timeline.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, args.out / "autoscale_timeline.png")
    counts = result["timeline"][-1]["requests_per_replica"]
    print(f"max replicas {max(p['replicas'] for p in result['timeline']):.0f}, final "
          f"{result['timeline'][-1]['replicas']:.0f}; responses {result['responses_by_status']}; "
          f"requests per replica {counts}")


if __name__ == "__main__":
    main()
