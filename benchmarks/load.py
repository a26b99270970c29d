"""Bounded load on the local service (loopback only): a mix of short, medium and long prompts, streamed and not, from
`--concurrency` clients until `--duration-s` has passed or `--max-requests` were sent, whichever comes first.

Every request ends as ok, refused (a 429: the service said so at once) or error (any other clean error); one that
breaks off or outlives `--request-timeout-s` is lost, and the run fails if any is. Records p50/p99 time to first token
and inter-token latency. It serves --config (configs/local.yaml) itself and also records the engine's GPU/host bytes in
use and process RSS, drained: after the warm-up (the baseline) and after every `--rss-every` requests (the RSS series,
with its slope over the second half of the run):
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
# (share, words from, words to): short, medium and long prompts for the shipped model (byte-level: a word is a few
# tokens), the longest within configs/local.yaml's max_model_len
MIX = ((0.6, 4, 32), (0.3, 100, 300), (0.1, 400, 750))
PEAK_TOKEN_ID = 42  # the peak burst's prompts are token ids (so their length is exact); every model here has this one


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


async def drive(cfg: LoadConfig) -> list[Outcome]:
    """The load: every request's outcome; bounded by duration, request count and each request's timeout."""
    require_loopback(cfg.url)
    rng, outcomes = random.Random(cfg.seed), []
    stop_at, sent = time.monotonic() + cfg.duration_s, 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal sent
        while time.monotonic() < stop_at and sent < cfg.max_requests:
            sent += 1
            outcome = await one_request(http, request_body(cfg, rng), cfg.request_timeout_s)
            outcomes.append(outcome)
            if outcome.kind == "refused":
                await asyncio.sleep(0.25)  # full: the service said so; come back shortly

    async with _client(cfg) as http:
        await asyncio.gather(*(client(http) for _ in range(cfg.concurrency)))
    return outcomes


async def peak_burst(cfg: LoadConfig) -> list[Outcome]:
    """`concurrency` requests at once, each as long as the model takes (prompt token ids + max_tokens =
    max_model_len): what the mix can hold at most, held together once. The engine's host value store is touched
    page by page on first use and reuses the last freed page first, so its resident bytes grow until this
    high-water is reached, and not after: sent before the baseline, it keeps that growth out of the leak check."""
    require_loopback(cfg.url)
    async with _client(cfg) as http:
        model = (await http.get("/v1/models")).json()["data"][0]
        max_tokens = cfg.max_tokens[1]
        body = {"model": cfg.model, "prompt": [PEAK_TOKEN_ID] * (model["max_model_len"] - max_tokens),
                "max_tokens": max_tokens, "ignore_eos": True, "stream": False}
        return await asyncio.gather(*(one_request(http, body, cfg.request_timeout_s) for _ in range(cfg.concurrency)))


async def warm_up(cfg: LoadConfig, num_requests: int) -> dict:
    """The peak burst, then `num_requests` of the mix: the engine's caches, pools and allocator settle. A burst
    request may be refused (more clients than slots), never fail; returns the burst's outcomes by kind."""
    burst = await peak_burst(cfg)
    failed = [o.detail for o in burst if o.kind in ("error", "lost")]
    if failed:
        raise RuntimeError(f"the peak burst failed: {failed}")
    await drive(replace(cfg, duration_s=max(60.0, num_requests), max_requests=num_requests, seed=cfg.seed - 1))
    return {kind: sum(o.kind == kind for o in burst) for kind in ("ok", "refused")}


def _client(cfg: LoadConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    return httpx.AsyncClient(base_url=cfg.url, headers=headers, timeout=timeout,
                             limits=httpx.Limits(max_connections=cfg.concurrency))


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


def drained_snapshot(app: str) -> dict:
    """The engine's bytes and requests in use and its process RSS, once it has drained."""
    from serve_app.local import wait_drained

    stats = wait_drained(app, within_s=30)
    return {k: stats[k] for k in ("num_running", "num_held", "gpu_bytes_in_use", "host_bytes_in_use", "rss_bytes")}


def load_in_rounds(cfg: LoadConfig, app: str, round_requests: int) -> tuple[dict, list[dict]]:
    """The load in rounds of `round_requests` requests, the engine drained after each; its summary and the RSS
    series (requests sent so far, engine RSS drained: comparable points, free of what requests in flight hold)."""
    start, outcomes, series = time.monotonic(), [], []
    stop_at = start + cfg.duration_s
    while len(outcomes) < cfg.max_requests and time.monotonic() < stop_at:
        rnd = replace(cfg, duration_s=stop_at - time.monotonic(), seed=cfg.seed + len(series),
                      max_requests=min(round_requests, cfg.max_requests - len(outcomes)))
        outcomes += asyncio.run(drive(rnd))
        series.append({"requests": len(outcomes), **drained_snapshot(app)})
    return summarize(outcomes, time.monotonic() - start), series


def slope_mib_per_1k(series: list[dict]) -> float | None:
    """Least-squares slope of drained RSS over requests, MiB per 1,000 requests, over the second half of the
    series (the first half shows how RSS settles; a leak shows in both)."""
    half = series[len(series) // 2:]
    if len(half) < 2:
        return None
    xs, ys = [p["requests"] for p in half], [p["rss_bytes"] / 2**20 for p in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return round(1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 3)


def serve_and_load(config: Path, cfg_args: dict, warmup_requests: int, rss_every: int) -> dict:
    """Serve `config`'s first application on loopback, warm it up, drive it in rounds, and record the engine drained
    after the warm-up (the baseline) and after every round."""
    import yaml

    from serve_app.local import local_service

    app = yaml.safe_load(config.read_text())["applications"][0]
    args = {**app["args"], "config_dir": str(config.resolve().parent)}  # its relative paths, as serve run reads them
    with local_service(args, app["name"]) as url:
        cfg = LoadConfig(url=url, model=args.get("served_model_name") or Path(args["model"]).name, **cfg_args)
        burst = asyncio.run(warm_up(cfg, warmup_requests))
        before = drained_snapshot(app["name"])
        summary, series = load_in_rounds(cfg, app["name"], rss_every)
    after, mib = series[-1], 2**20
    return {"config": asdict(cfg), **summary, "peak_burst": burst, "engine_before": before,
            "engine_drained": {k: v for k, v in after.items() if k != "requests"},
            "rss_baseline_mib": round(before["rss_bytes"] / mib, 1),
            "rss_drained_minus_baseline_mib": round((after["rss_bytes"] - before["rss_bytes"]) / mib, 1),
            "rss_slope_second_half_mib_per_1k_requests": slope_mib_per_1k(series),
            "rss_series": [{"requests": p["requests"], "rss_mib": round(p["rss_bytes"] / mib, 1)} for p in series]}


def mix_part(text: str) -> tuple[float, int, int]:
    """"SHARE:FROM:TO" -> (share, words from, words to), one part of LoadConfig.mix."""
    share, low, high = text.split(":")
    return float(share), int(low), int(high)


def main() -> None:
    from benchmarks.report import write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.yaml")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--max-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--stream-share", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, nargs=2, default=list(LoadConfig.max_tokens), metavar=("LOW", "HIGH"),
                        help="each request's max_tokens is drawn from LOW..HIGH")
    parser.add_argument("--mix", type=mix_part, nargs="+", default=list(MIX), metavar="SHARE:FROM:TO",
                        help="prompt lengths in words, each part of the mix drawn from FROM..TO (for a smaller model)")
    parser.add_argument("--request-timeout-s", type=float, default=LoadConfig.request_timeout_s)
    parser.add_argument("--warmup-requests", type=int, default=20, help="sent (and not counted) before the baseline")
    parser.add_argument("--rss-every", type=int, default=100, help="requests a round; RSS sampled drained after each")
    parser.add_argument("--out", default="load.json", help="under benchmarks/results/")
    args = parser.parse_args()
    load = {"duration_s": args.duration_s, "max_requests": args.max_requests, "concurrency": args.concurrency,
            "stream_share": args.stream_share, "max_tokens": tuple(args.max_tokens), "mix": tuple(args.mix),
            "request_timeout_s": args.request_timeout_s}
    result = serve_and_load(args.config, load, args.warmup_requests, args.rss_every)
    path = write_json(args.out, [], **result)
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1), f"\nwritten to {path}")
    if result["lost"]:
        raise SystemExit(f"{result['lost']} requests lost")


if __name__ == "__main__":
    main()
