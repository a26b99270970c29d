"""Autoscaling timeline: a bounded load on loopback drives the engine deployment up, then stops so it scales back down;
engine replicas, the admission queue, tokens/s and per-replica request counts are sampled all along.

Against a running service, e.g. prod.yaml with max_replicas 2 on a host with two GPUs:
    ray start --head --num-gpus 2
    serve run configs/prod.yaml &
    python -m benchmarks.autoscale_timeline --load-s 300 --tail-s 900
Serve waits downscale_delay_s (600 s unless the app arg `autoscaling` sets it) before it removes a replica, so
--tail-s must exceed it; the tail ends early once the replicas are back to --min-replicas and every client is done.
benchmarks/serve_gpu.py runs this on two GPUs with shorter delays. Per-replica request counts are the ingress's
`shadowkv_replica_requests` (what each replica has taken since it started, labelled with its GPU). Writes
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Awaitable, Callable

import httpx

from benchmarks.load import require_loopback

RESULTS = Path(__file__).resolve().parent / "results"
INGRESS_GAUGES = {"queue": "shadowkv_admission_queue_depth", "tokens_per_s": "shadowkv_tokens_per_second",
                  "replicas": "shadowkv_replicas_ready", "running": "shadowkv_num_running",
                  "gpu_bytes_in_use": "shadowkv_gpu_bytes_in_use", "host_bytes_in_use": "shadowkv_host_bytes_in_use"}
REPLICA_REQUESTS = re.compile(r"^shadowkv_replica_requests\{([^}]*)\}\s+(\S+)", re.M)


@dataclass
class TimelineConfig:
    url: str = "http://127.0.0.1:8000"
    model: str = "llama-3.1-8b-instruct"
    users: int = 24  # concurrent clients: more than one replica's 16 slots
    vocab_size: int = 128256  # prompt token ids are drawn below it
    context: int = 65536  # prompt tokens per request
    max_tokens: int = 256
    load_s: float = 300.0
    tail_s: float = 900.0
    interval_s: float = 5.0
    request_timeout_s: float = 600.0
    min_replicas: int = 1  # the tail ends once the replicas are back to this


def gauge(text: str, name: str) -> float:
    found = re.search(rf"^{name}\s+(\S+)", text, re.M)
    return float(found.group(1)) if found else float("nan")


def requests_per_replica(metrics: str) -> dict[str, float]:
    """Requests each engine replica has taken, keyed "<replica id> <device>"."""
    counts = {}
    for labels, value in REPLICA_REQUESTS.findall(metrics):
        tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        counts[f"{tags['replica']} {tags['device']}"] = float(value)
    return counts


async def sample(client: httpx.AsyncClient, url: str, start: float) -> dict:
    """One point of the timeline: the ingress's gauges and per-replica request counts."""
    text = (await client.get(f"{url}/metrics")).text
    return {"t_s": round(time.monotonic() - start, 1), **{k: gauge(text, n) for k, n in INGRESS_GAUGES.items()},
            "requests_per_replica": requests_per_replica(text)}


async def sample_until(client: httpx.AsyncClient, cfg: TimelineConfig, start: float, timeline: list,
                       stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            timeline.append(await sample(client, cfg.url, start))
            print(json.dumps(timeline[-1]), flush=True)
        except httpx.HTTPError as exc:  # a missed point, not a failed run
            timeline.append({"t_s": round(time.monotonic() - start, 1), "error": repr(exc)})
        try:
            await asyncio.wait_for(stop.wait(), cfg.interval_s)
        except TimeoutError:
            pass


async def user(client: httpx.AsyncClient, cfg: TimelineConfig, stop_at: float, outcomes: dict,
               failures: list) -> None:
    """One client sending requests back to back until the load stops; prompts are token ids (random weights)."""
    while time.monotonic() < stop_at:
        prompt = [random.randrange(cfg.vocab_size) for _ in range(cfg.context)]
        try:
            reply = await client.post(f"{cfg.url}/v1/completions", json={
                "model": cfg.model, "prompt": prompt, "max_tokens": cfg.max_tokens, "ignore_eos": True})
            status = reply.status_code
        except httpx.HTTPError as exc:
            status, reply = type(exc).__name__, None
        outcomes[status] = outcomes.get(status, 0) + 1
        if status == 429:  # full everywhere: what makes the policy scale up; back off a little
            await asyncio.sleep(1.0)
        elif status != 200:
            failures.append(reply.text[:300] if reply is not None else status)
            await asyncio.sleep(1.0)


def settled(timeline: list[dict], users: list[asyncio.Task], min_replicas: int) -> bool:
    last = next((p for p in reversed(timeline) if "replicas" in p), None)
    return all(u.done() for u in users) and last is not None and last["replicas"] <= min_replicas


async def run(cfg: TimelineConfig, prelude: Callable[[], Awaitable[dict]] | None = None) -> dict:
    """The timeline; `prelude` (e.g. an overload burst) runs first, while the timeline is already being sampled, and
    its result is kept. Bounded: prelude, then load_s of load, then at most tail_s until settled."""
    require_loopback(cfg.url)
    timeline, outcomes, failures, events = [], {}, [], {}
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=cfg.users + 4)) as client:
        start = time.monotonic()
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_until(client, cfg, start, timeline, stop))
        prelude_result = await prelude() if prelude is not None else None
        events["load_start_s"] = round(time.monotonic() - start, 1)
        stop_load = time.monotonic() + cfg.load_s
        users = [asyncio.create_task(user(client, cfg, stop_load, outcomes, failures)) for _ in range(cfg.users)]
        await asyncio.sleep(cfg.load_s)
        events["load_stop_s"] = round(time.monotonic() - start, 1)
        give_up = time.monotonic() + cfg.tail_s
        while not settled(timeline, users, cfg.min_replicas) and time.monotonic() < give_up:
            await asyncio.sleep(cfg.interval_s)
        cancelled = sum(u.cancel() for u in users)  # only those still waiting on a reply at the bound
        await asyncio.gather(*users, return_exceptions=True)
        stop.set()
        await sampler
    return {"command": " ".join(sys.argv), "config": asdict(cfg), "events": events, "prelude": prelude_result,
            "responses_by_status": outcomes, "failures": failures[:10], "users_cancelled_at_tail_end": cancelled,
            "timeline": timeline}


def summary(result: dict) -> dict:
    """Replicas at most and at the end, and the most requests each replica reported (it may be gone by the end)."""
    points = [p for p in result["timeline"] if "replicas" in p]
    per_replica: dict[str, float] = {}
    for p in points:
        for name, count in p["requests_per_replica"].items():
            per_replica[name] = max(per_replica.get(name, 0.0), count)
    return {"max_replicas": max((p["replicas"] for p in points), default=None),
            "final_replicas": points[-1]["replicas"] if points else None, "requests_per_replica": per_replica,
            "responses_by_status": result["responses_by_status"]}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in result["timeline"] if "replicas" in p]
    t = [p["t_s"] for p in points]
    fig, axes = plt.subplots(4, 1, sharex=True, figsize=(9, 9))
    for ax, key, label in zip(axes, ("replicas", "queue", "tokens_per_s"),
                              ("engine replicas", "admission queue", "tokens/s")):
        ax.plot(t, [p[key] for p in points])
        ax.set_ylabel(label)
    for name in sorted({n for p in points for n in p["requests_per_replica"]}):
        axes[3].plot(t, [p["requests_per_replica"].get(name, float("nan")) for p in points], label=name)
    axes[3].set_ylabel("requests per replica")
    axes[3].legend(fontsize=7)
    for ax in axes:
        for at in result["events"].values():
            ax.axvline(at, color="grey", linestyle="--")
    axes[-1].set_xlabel("seconds (dashed: load starts, load stops; a prelude, if any, from 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in asdict(TimelineConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = vars(parser.parse_args())
    out = args.pop("out")
    result = asyncio.run(run(TimelineConfig(**args)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "autoscale_timeline.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, out / "autoscale_timeline.png")
    print(json.dumps(summary(result)))


if __name__ == "__main__":
    main()
