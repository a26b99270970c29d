"""The online driver: the service each workload is sent to (online.py sends it), and what is read of its engines.

The service: for each method, a local Serve app of the --config file's first application (serve_app.local: Ray once
for all methods, Serve on a free loopback port per method), serving --model with the method applied (runs.method_args;
a geometry preset or `tiny` gets a word-level tokenizer, so that its random answers stream as text and read back as
their token ids). Or, with --url, the service already running there (loopback only), named as one method; --model
must then be the model it serves (its tokenizer and vocabulary). Before its runs, a warm-up request.

The engines' figures come from the service's /metrics, read more often than the replicas report (every
ROUTING_STATS_PERIOD_S; the figures are sums over replicas): the peak GPU and host bytes in use (each report holds the
most its replica held after any step since its report before, so that none is missed; with several replicas the sum of
their peaks bounds the service's from above), the hit rate of the ShadowKV chunk selections made over the run, and
every unlabelled series at its end.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import time
from typing import Iterator

import httpx

from benchmarks.load import require_loopback
from serve_app.edge import EDGE_ENV
from serve_app.engine_replica import ROUTING_STATS_PERIOD_S
from serve_app.local import ray_session, serve_on_loopback
from shadowkv_core.engine.warm_up import warm_up_prompt
from shadowkv_core.models import load_tokenizer
from shadowkv_core.models.geometry import model_spec

from .online import OnlineRun
from .runs import failure, method_args, model_dir, progress, run_row
from .scenarios import make_workload

APP = "workloads"
SERIES = re.compile(r"^(shadowkv_\w+) (\S+)$", re.M)  # the unlabelled series of /metrics
SAMPLE_S = ROUTING_STATS_PERIOD_S / 2
SETTLE_S = 3 * ROUTING_STATS_PERIOD_S  # after a run: the replicas' reports of its last steps have arrived


def online_runs(args: argparse.Namespace, app_args: dict) -> Iterator[tuple[str, dict]]:
    """("row", its row) or ("failure", what failed) for each method, scenario and rate, one after another."""
    model, dummy = model_dir(args.model, app_args["max_model_len"], tokenizer=True)
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise SystemExit(f"{model} ships no tokenizer: the online driver reads each answer back through it")
    vocab_size = model_spec(model).vocab_size
    with contextlib.ExitStack() as stack:
        if args.url is None:
            stack.enter_context(ray_session(EDGE_ENV, num_cpus=os.cpu_count()))
        for method in args.methods:
            try:
                with service(args.url, method_args(app_args, model, dummy, method)) as url:
                    served = warm_up(url, vocab_size)
                    for scenario in args.scenarios:
                        for rate in args.rates:
                            yield one_run(args, url, served, tokenizer, vocab_size, scenario, method, rate)
            except Exception as exc:  # the service did not start: this method's runs fail, the others still run
                yield failure(exc, method=method)


@contextlib.contextmanager
def service(url: str | None, app_args: dict) -> Iterator[str]:
    """The base URL of the service: `url` (loopback only), or a local Serve app of `app_args` (inside a Ray
    session)."""
    if url is not None:
        require_loopback(url)
        yield url.rstrip("/")
        return
    with serve_on_loopback(app_args, APP) as base:
        yield base


def warm_up(url: str, vocab_size: int) -> str:
    """The served model's name, after a warm-up request (the engines' warm-up prompt) and the reports of its steps."""
    card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    body = {"model": card["id"], "prompt": warm_up_prompt(card["max_model_len"], vocab_size), "max_tokens": 4,
            "ignore_eos": True}
    httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
    time.sleep(SETTLE_S)
    return card["id"]


def one_run(args: argparse.Namespace, url: str, served: str, tokenizer, vocab_size: int, scenario: str, method: str,
            rate: float) -> tuple[str, dict]:
    """One scenario at one rate -> ("row", its row) or ("failure", what failed)."""
    workload = make_workload(scenario, args.seed, vocab_size, args.scale, args.count_scale, rate)
    bar = progress(f"{scenario} {method} {rate:g}/s", workload)
    run = OnlineRun(url, served, workload, tokenizer, args.max_in_flight, args.request_timeout_s, bar)
    try:
        records, wall, engine = asyncio.run(measured(run))
    except Exception as exc:
        return failure(exc, scenario=scenario, method=method, rate=rate)
    return "row", run_row(scenario, method, "online", records, wall, args.events, rate=rate,
                          max_in_flight=args.max_in_flight, **engine)


async def measured(run: OnlineRun) -> tuple[list, float, dict]:
    """The run's records and wall time, and its engines' figures read around it from /metrics."""
    peaks = {"gpu": 0.0, "host": 0.0}
    async with httpx.AsyncClient(base_url=run.url, timeout=30) as http:
        before = await metrics(http)
        sampler = asyncio.create_task(sample_peaks(http, peaks))
        try:
            records, wall = await run.run()
            await asyncio.sleep(SETTLE_S)
        finally:
            sampler.cancel()
        after = await metrics(http)
    return records, wall, engine_figures(before, after, peaks)


async def metrics(http: httpx.AsyncClient) -> dict[str, float]:
    response = await http.get("/metrics")
    response.raise_for_status()
    return {name: float(value) for name, value in SERIES.findall(response.text)}


async def sample_peaks(http: httpx.AsyncClient, peaks: dict[str, float]) -> None:
    while True:
        now = await metrics(http)
        for kind in peaks:
            peaks[kind] = max(peaks[kind], now.get(f"shadowkv_{kind}_bytes_peak", 0.0))
        await asyncio.sleep(SAMPLE_S)


def engine_figures(before: dict[str, float], after: dict[str, float], peaks: dict[str, float]) -> dict:
    """Peak bytes in use (GiB), the hit rate over the run (None: no ShadowKV selection), and the service's series at
    the end."""
    selected, hits = (after.get(name, 0.0) - before.get(name, 0.0)
                      for name in ("shadowkv_chunks_selected_total", "shadowkv_chunk_hits_total"))
    return {"peak_gpu_in_use_gib": peaks["gpu"] / 2**30, "peak_host_gib": peaks["host"] / 2**30,
            "hit_rate": hits / selected if selected else None, "service_metrics": after}
