"""Bounded load on the local service (loopback only): a mix of short, medium and long prompts, streamed and not, from
`--concurrency` clients until `--duration-s` has passed or `--max-requests` were sent, whichever comes first.

Every request ends as ok, refused (a 429: the service said so at once) or error (any other clean error); one that
breaks off or outlives `--request-timeout-s` is lost, and the run fails if any is. Records p50/p99 time to first token
and inter-token latency. Without --url it serves --config (configs/local.yaml) itself, then also records the engine's
GPU/host bytes in use and process RSS before, after the load, and after it drained:
    python -m benchmarks.load --duration-s 180 --concurrency 8
Writes benchmarks/results/load.json (--out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPT_WORDS = "the quick brown fox jumps over a lazy dog while long context serving keeps its cache in shadows".split()
# (share, words from, words to): short, medium, long; with the shipped model ~4 tokens a word, so up to ~3K tokens
MIX = ((0.6, 4, 32), (0.3, 100, 300), (0.1, 400, 750))


@dataclass
class LoadConfig:
    url: str
    model: str
    duration_s: float = 60.0
    max_requests: int = 1000
    concurrency: int = 4
    stream_share: float = 0.7
    max_tokens: tuple[int, int] = (8, 64)
    request_timeout_s: float = 120.0
    api_key: str | None = None
    seed: int = 0
    mix: tuple[tuple[float, int, int], ...] = MIX


@dataclass
class Outcome:
    kind: str  # ok, refused, error, lost
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    detail: str = ""


def require_loopback(url: str) -> None:
    if urlparse(url).hostname != "127.0.0.1":
        raise ValueError(f"the load generator only drives 127.0.0.1, not {url!r}")


def request_body(cfg: LoadConfig, rng: random.Random) -> dict:
    share = rng.random()
    for weight, low, high in cfg.mix:
        share -= weight
        if share <= 0:
            break
    words = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(low, high)))
    return {"model": cfg.model, "prompt": words, "max_tokens": rng.randint(*cfg.max_tokens), "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.8]), "stream": rng.random() < cfg.stream_share}


async def _streamed(http: httpx.AsyncClient, body: dict, sent: float) -> Outcome:
    outcome, last = Outcome("ok"), None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Outcome("refused" if r.status_code == 429 else "error", detail=r.text[:200])
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return outcome
            if not line.startswith("data: "):
                continue
            if "error" in json.loads(line[6:]):
                outcome = Outcome("error", detail=line[:200])
                continue
            now = time.monotonic()
            if last is None:
                outcome.ttft_s = now - sent
            else:
                outcome.itl_s.append(now - last)
            last = now
    return Outcome("lost", detail="the stream ended without [DONE]")


async def one_request(http: httpx.AsyncClient, body: dict, timeout_s: float) -> Outcome:
    """One request, bounded by `timeout_s` in all (httpx's own timeout bounds each read only)."""
    sent = time.monotonic()
    try:
        if body["stream"]:
            return await asyncio.wait_for(_streamed(http, body, sent), timeout_s)
        r = await asyncio.wait_for(http.post("/v1/completions", json=body), timeout_s)
    except (httpx.TransportError, httpx.StreamError, TimeoutError) as exc:
        return Outcome("lost", detail=f"{type(exc).__name__}: {exc}")
    if r.status_code == 200:
        return Outcome("ok", ttft_s=time.monotonic() - sent)  # the whole body: TTFT only for streams counts
    return Outcome("refused" if r.status_code == 429 else "error", detail=r.text[:200])


async def run_load(cfg: LoadConfig) -> dict:
    """The load, then its summary; bounded by duration, request count and each request's timeout."""
    require_loopback(cfg.url)
    rng, outcomes = random.Random(cfg.seed), []
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=cfg.concurrency)
    start = time.monotonic()
    stop_at, sent = start + cfg.duration_s, 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal sent
        while time.monotonic() < stop_at and sent < cfg.max_requests:
            sent += 1
            outcome = await one_request(http, request_body(cfg, rng), cfg.request_timeout_s)
            outcomes.append(outcome)
            if outcome.kind == "refused":
                await asyncio.sleep(0.25)  # full: the service said so; come back shortly

    async with httpx.AsyncClient(base_url=cfg.url, headers=headers, timeout=timeout, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(cfg.concurrency)))
    return summarize(outcomes, time.monotonic() - start)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)


def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    by_kind = {kind: sum(o.kind == kind for o in outcomes) for kind in ("ok", "refused", "error", "lost")}
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None and o.itl_s]
    itl = [gap for o in outcomes for gap in o.itl_s]
    return {"requests": len(outcomes), **by_kind, "wall_s": round(wall_s, 1),
            "ttft_ms_p50": percentile(ttft, 0.5), "ttft_ms_p99": percentile(ttft, 0.99),
            "itl_ms_p50": percentile(itl, 0.5), "itl_ms_p99": percentile(itl, 0.99),
            "failures": [o.detail for o in outcomes if o.kind in ("error", "lost")][:10]}


def engine_snapshot(app: str) -> dict:
    from benchmarks.local_service import engine_stats

    stats = engine_stats(app)
    return {k: stats[k] for k in ("num_running", "num_held", "gpu_bytes_in_use", "host_bytes_in_use", "rss_bytes")}


def serve_and_load(config: Path, cfg_args: dict, warmup_requests: int) -> dict:
    """Serve `config`'s first application on loopback, drive it, and record the engine before, after and drained."""
    import yaml

    from benchmarks.local_service import local_service, wait_drained

    app = yaml.safe_load(config.read_text())["applications"][0]
    args = {**app["args"], "model": str(ROOT / app["args"]["model"])}
    with local_service(args, app["name"]) as url:
        cfg = LoadConfig(url=url, model=args.get("served_model_name") or Path(args["model"]).name, **cfg_args)
        asyncio.run(run_load(replace(cfg, duration_s=60, max_requests=warmup_requests)))  # RSS settles first
        before = engine_snapshot(app["name"])
        summary = asyncio.run(run_load(cfg))
        loaded = engine_snapshot(app["name"])
        wait_drained(app["name"], within_s=30)
        return {"config": asdict(cfg), **summary, "engine_before": before, "engine_after_load": loaded,
                "engine_drained": engine_snapshot(app["name"])}


def main() -> None:
    from benchmarks.report import write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.yaml")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--max-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--stream-share", type=float, default=0.7)
    parser.add_argument("--warmup-requests", type=int, default=20, help="sent (and not counted) before the baseline")
    parser.add_argument("--out", default="load.json", help="under benchmarks/results/")
    args = parser.parse_args()
    load = {"duration_s": args.duration_s, "max_requests": args.max_requests, "concurrency": args.concurrency,
            "stream_share": args.stream_share}
    result = serve_and_load(args.config, load, args.warmup_requests)
    path = write_json(args.out, [], **result)
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1), f"\nwritten to {path}")
    if result["lost"]:
        raise SystemExit(f"{result['lost']} requests lost")


if __name__ == "__main__":
    main()
