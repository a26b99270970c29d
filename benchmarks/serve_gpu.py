"""The service on a host with two GPUs, in one command: the service built from configs/prod.yaml against the engine
alone, an overload burst, and an autoscaling timeline from one replica to two and back.

The model is Llama-3.1-8B's geometry with random weights (shadowkv_core.models.geometry.LLAMA_31_8B, load_format dummy),
written to a temporary directory with a word-level tokenizer over its whole vocabulary ("t0" ... "t128255"), so that
every generated token streams as one word of text; prompts are token ids. prod.yaml's application args are used with
the profile's overrides (GPU: load_format dummy, a 36 GiB host value store, 1..2 replicas, upscale / downscale after
5 / 15 s instead of Serve's 30 / 600 s, demand averaged over 15 s instead of 30 s). Phases, each bounded and failing
alone (its traceback recorded):
  engine_alone  a Ray task on one GPU runs the replica's engine (same EngineConfig) with a plain step loop: a warm-up
                batch, then `batch` prompts of `context` tokens at once; TTFT and the decode rate while all decode.
                It runs while Serve starts the first replica on the other GPU.
  service       the same prompts, streamed through HTTP, the ingress and the replica, after a warm-up batch.
  timeline      sampled from the start of: an overload burst (slots + waiting line + `burst_extra` long requests at
                once, each over its own connection: per request its status, latency, Retry-After and whether the
                proxy's edge shedding answered it; every admitted one completed, the engines drained to zero),
                then a bounded load of `load.users` clients, then the tail until the replicas are back to one.
    PYTHONPATH=$PWD python -m benchmarks.serve_gpu --out DIR          # two GPUs, within the profile's budget
    PYTHONPATH=$PWD python -m benchmarks.serve_gpu --cpu --out DIR    # the same on CPU with the tiny geometry
Writes serve_gpu.json, autoscale_gpu.json, autoscale_gpu.png and ray_logs.tar.gz under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
import ray
import yaml

from benchmarks.autoscale_timeline import TimelineConfig, plot, sample, summary
from benchmarks.autoscale_timeline import run as run_timeline
from benchmarks.edge_shedding import burst_summary
from benchmarks.report import print_table
from serve_app.app import AppArgs, engine_config, resolve_model
from serve_app.edge import EDGE_ENV, SHED_HEADER
from serve_app.local import ray_session, send_at_once, serve_on_loopback
from shadowkv_core.models.geometry import LLAMA_31_8B, TINY, TINY_SHADOWKV, write_geometry

ROOT = Path(__file__).resolve().parents[1]
APP = "shadowkv"
WARMUP_TOKENS = 8
PROBES = 5


@dataclass(frozen=True)
class Profile:
    geometry: dict  # config.json
    overrides: dict  # on prod.yaml's application args ("engine" merged key by key)
    num_gpus: int | None  # Ray's; None: what Ray finds
    context: int  # prompt + generated tokens of each request of the engine / service comparison
    batch: int
    max_tokens: int
    burst_context: int
    burst_extra: int  # burst requests beyond one replica's slots and the ingress's waiting line
    burst_max_tokens: int
    load: TimelineConfig
    budget_s: float


AUTOSCALING = {"max_replicas": 2,
               "autoscaling": {"upscale_delay_s": 5.0, "downscale_delay_s": 15.0, "look_back_period_s": 15.0}}
# The host value store holds 16 slots x 2.06 GiB at 32K (the engine would size it from MemAvailable otherwise).
GPU = Profile(LLAMA_31_8B, {**AUTOSCALING, "engine": {"load_format": "dummy", "host_cache_gib": 36}},
              num_gpus=None, context=32768, batch=4, max_tokens=256, burst_context=32768, burst_extra=24,
              burst_max_tokens=16, load=TimelineConfig(users=24, context=16384, max_tokens=64, load_s=90, tail_s=120,
                                                       interval_s=2, request_timeout_s=300), budget_s=400)
CPU = Profile(TINY, {**AUTOSCALING, "device": "cpu", "dtype": "float32", "num_gpus": 0, "num_cpus": 0,
                     "max_num_seqs": 2, "max_model_len": 2048, "shadowkv": asdict(TINY_SHADOWKV), "max_waiting": 2,
                     "max_wait_s": 0.5,
                     "engine": {"load_format": "dummy", "gpu_cache_gib": 0.25, "host_cache_gib": 0.25}},
              num_gpus=0, context=600, batch=2, max_tokens=32, burst_context=600, burst_extra=4, burst_max_tokens=8,
              load=TimelineConfig(users=6, context=400, max_tokens=48, load_s=45, tail_s=90, interval_s=1,
                                  request_timeout_s=60), budget_s=400)


def app_args(profile: Profile, model: str) -> dict:
    prod = yaml.safe_load((ROOT / "configs" / "prod.yaml").read_text())["applications"][0]["args"]
    engine = {**prod["engine"], **profile.overrides.get("engine", {})}
    return {**prod, **profile.overrides, "engine": engine, "model": model}


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(n)]


# ---- the engine alone (in a Ray worker) -----------------------------------------------------------------------
def step_loop(engine, prompts: list[list[int]], max_tokens: int, prefix: str) -> list[dict]:
    """All prompts added at once, then engine.step() until done; per request (time, tokens so far) at every step."""
    from shadowkv_core import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sent = time.monotonic()
    streams = {f"{prefix}{i}": {"sent": sent, "points": []} for i in range(len(prompts))}
    for request_id, prompt in zip(streams, prompts):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            if out.finish_reason == "error":
                raise RuntimeError(f"{out.request_id}: {out.error}")
            if out.new_token_ids:
                streams[out.request_id]["points"].append((now, len(out.token_ids)))
    return list(streams.values())


def engine_alone(config: dict, prompts: list[list[int]], max_tokens: int, go: str) -> dict:
    """Load and warm up (kernels compile, the allocator warms) while Serve starts its replica, then wait for the file
    `go` (the service is up, its start no longer competes for host CPUs and memory) and measure."""
    from benchmarks.report import environment
    from shadowkv_core import EngineConfig, LLMEngine

    start = time.monotonic()
    engine = LLMEngine(EngineConfig(**config))
    load_s = time.monotonic() - start
    step_loop(engine, prompts[:2], WARMUP_TOKENS, "warmup")
    while not Path(go).exists() and time.monotonic() - start < 600:
        time.sleep(0.1)
    streams = step_loop(engine, prompts, max_tokens, "r")
    engine.close()
    return {"streams": streams, "load_s": round(load_s, 1), "pid": os.getpid(), "environment": environment()}


# ---- the service --------------------------------------------------------------------------------------------
def completion_body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    return {**body, "stream_options": {"include_usage": True}} if stream else body


async def stream_one(http: httpx.AsyncClient, body: dict) -> dict:
    """One streamed completion: (time, tokens so far) at every chunk, a token being one word of the text."""
    sent, points, usage = time.monotonic(), [], None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
            words = sum(len(choice["text"].split()) for choice in chunk["choices"])
            if words:
                points.append((time.monotonic(), (points[-1][1] if points else 0) + words))
    return {"sent": sent, "points": points, "completion_tokens": usage}


async def service_batches(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10)) as http:
        await asyncio.gather(*(stream_one(http, completion_body(model, p, WARMUP_TOKENS, True)) for p in prompts[:2]))
        return await asyncio.gather(*(stream_one(http, completion_body(model, p, max_tokens, True)) for p in prompts))


def tokens_at(points: list[tuple[float, int]], t: float) -> int:
    return max((n for at, n in points if at <= t), default=0)


def summarize_streams(streams: list[dict]) -> dict:
    """TTFT of each request, and the decode rate while every request decodes: all tokens produced from the last
    first token to the first last token, over that window."""
    firsts, lasts = [s["points"][0][0] for s in streams], [s["points"][-1][0] for s in streams]
    start, end = max(firsts), min(lasts)
    in_window = sum(tokens_at(s["points"], end) - tokens_at(s["points"], start) for s in streams)
    total, sent = sum(s["points"][-1][1] for s in streams), min(s["sent"] for s in streams)
    return {"ttft_s": [round(f - s["sent"], 3) for f, s in zip(firsts, streams)],
            "ttft_s_mean": round(sum(f - s["sent"] for f, s in zip(firsts, streams)) / len(streams), 3),
            "decode_window_s": round(end - start, 3),
            "decode_tokens_per_s": round(in_window / (end - start), 1) if end > start else None,
            "output_tokens": total, "output_tokens_per_s": round(total / (max(lasts) - sent), 1)}


# ---- overload -----------------------------------------------------------------------------------------------
async def overload_burst(url: str, body: dict, n: int, excess: int, max_wait_s: float, timeout_s: float) -> dict:
    """`n` requests at once, each over its own connection opened beforehand (benchmarks.edge_shedding.send_at_once:
    through one shared httpx client the last ones sent would wait seconds for the client's pool); per request what
    it got back, how fast and whether the proxy's edge shedding answered it. Once `excess` of them were refused (the
    waiting line is full, the slots taken), PROBES more, one after another: how fast a request beyond capacity is
    refused when no burst is queued in front of it."""
    content = json.dumps(body).encode()
    refused = asyncio.Event()
    count = [0]

    def on_reply(reply: dict) -> None:
        count[0] += reply["status"] == 429
        if count[0] >= excess:
            refused.set()

    async def probes() -> list[dict]:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(refused.wait(), max_wait_s)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10)) as http:
            await http.get("/health")
            out = []
            for _ in range(PROBES):
                sent = time.monotonic()
                r = await http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
                out.append({"status": r.status_code, "ms": round(1000 * (time.monotonic() - sent), 1),
                            "retry_after": r.headers.get("Retry-After"), "edge": r.headers.get(SHED_HEADER) == "edge"})
            return out

    probed, replies = await asyncio.gather(probes(), send_at_once(url, content, n, timeout_s, on_reply=on_reply))
    return {**burst_summary(replies, max_wait_s, body["max_tokens"]), "probes": probed,
            "replies": [{**r, "s": round(r["s"], 4), "sent_s": round(r["sent_s"], 4)} for r in replies]}


async def wait_drained(url: str, within_s: float) -> dict:
    """The engines' reported requests and bytes in use once all are zero, or at `within_s`."""
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            point = await sample(client, url, start)
            keys = ("running", "gpu_bytes_in_use", "host_bytes_in_use")
            if not any(point[k] for k in keys) or point["t_s"] > within_s:
                return {**{k: point[k] for k in keys}, "after_s": point["t_s"]}
            await asyncio.sleep(0.5)


# ---- the run ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def phase(record: dict, name: str, out: Path):
    """Fills record["phases"][name]; an exception is recorded there, not raised. Writes the record after each phase."""
    start, entry = time.monotonic(), record["phases"].setdefault(name, {})
    try:
        yield entry
    except Exception:
        entry["error"] = traceback.format_exc(limit=-6)
        print(f"phase {name} failed:\n{entry['error']}", flush=True)
    finally:
        entry["phase_s"] = round(time.monotonic() - start, 1)
        write(record, out / "serve_gpu.json")


def write(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def arm_watchdog(at: float, record: dict, out: Path) -> None:
    """Past the budget: record what there is and end the process, so the command ends in time."""
    def fire():
        time.sleep(max(0.0, at - time.monotonic()))
        record["watchdog"] = "the budget ran out: the process was ended here"
        write(record, out / "serve_gpu.json")
        os._exit(3)
    threading.Thread(target=fire, daemon=True).start()


def wait_gone(pid: int, within_s: float) -> None:
    """Until the engine_alone worker has exited (its GPU memory free for the next replica)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def run_phases(profile: Profile, record: dict, out: Path, deadline: float, phases: set[str]) -> None:
    """`phases`: "compare" (engine alone, then service), "timeline" (overload burst, load, scale down)."""
    model = write_geometry(profile.geometry)
    args = app_args(profile, model)
    parsed = AppArgs(**args)
    record["app_args"] = {**args, "model": "<random-weight geometry: profile.geometry>"}
    prompts = random_prompts(profile.batch, profile.context - profile.max_tokens, profile.geometry["vocab_size"])
    go = str(Path(model) / "go")
    with ray_session(EDGE_ENV, num_cpus=os.cpu_count(), num_gpus=profile.num_gpus, object_store_memory=2 << 30), \
            contextlib.ExitStack() as stack:
        record["ray_resources"] = ray.cluster_resources()
        task = None
        if "compare" in phases:
            task = ray.remote(max_calls=1)(engine_alone).options(
                num_gpus=0 if parsed.num_gpus == 0 else 1, num_cpus=parsed.num_cpus).remote(
                engine_config(parsed, resolve_model(parsed)), prompts, profile.max_tokens, go)
        url = None
        with phase(record, "service_start", out):
            url = stack.enter_context(serve_on_loopback(args, APP))
        Path(go).touch()
        if task is not None:
            engine_vs_service(task, record, out, deadline, url, parsed.served_model_name, prompts, profile.max_tokens)
        if url is not None and "timeline" in phases:
            with phase(record, "timeline", out) as entry:
                entry.update(timeline(profile, parsed, url, out, deadline))


def engine_vs_service(task, record: dict, out: Path, deadline: float, url: str | None, model: str,
                      prompts: list[list[int]], max_tokens: int) -> None:
    with phase(record, "engine_alone", out) as entry:
        try:
            alone = ray.get(task, timeout=max(10.0, deadline - time.monotonic() - 300))
        except Exception:
            ray.cancel(task, force=True)  # its GPU back to Ray, for the second replica
            raise
        record["environment"] = {**alone.pop("environment"), "command": record["command"]}  # not the worker's
        entry.update({**alone, **summarize_streams(alone["streams"])})
        wait_gone(alone["pid"], within_s=30)
    if url is not None:
        with phase(record, "service", out) as entry:
            streams = asyncio.run(asyncio.wait_for(service_batches(url, model, prompts, max_tokens), 240))
            entry.update({"streams": streams, **summarize_streams(streams)})


def timeline(profile: Profile, parsed: AppArgs, url: str, out: Path, deadline: float) -> dict:
    vocab = profile.geometry["vocab_size"]
    burst_prompt = random_prompts(1, profile.burst_context - profile.burst_max_tokens, vocab, seed=1)[0]
    body = completion_body(parsed.served_model_name, burst_prompt, profile.burst_max_tokens, False)
    n = parsed.max_num_seqs + parsed.max_waiting + profile.burst_extra

    async def burst() -> dict:
        result = await overload_burst(url, body, n, profile.burst_extra, parsed.max_wait_s, timeout_s=180)
        return {**result, "drained": await wait_drained(url, within_s=30)}

    rest = deadline - time.monotonic() - 60 - profile.load.tail_s  # the burst, then the tail
    cfg = replace(profile.load, url=url, model=parsed.served_model_name, vocab_size=vocab,
                  load_s=max(20.0, min(profile.load.load_s, rest)), min_replicas=parsed.min_replicas)
    result = asyncio.run(run_timeline(cfg, prelude=burst))
    write(result, out / "autoscale_gpu.json")
    with contextlib.suppress(ImportError):
        plot(result, out / "autoscale_gpu.png")
    return {"overload": result["prelude"], **summary(result), "events": result["events"]}


def table(record: dict) -> list[dict]:
    phases = record["phases"]
    alone, served, tl = phases.get("engine_alone", {}), phases.get("service", {}), phases.get("timeline", {})
    burst = tl.get("overload") or {}
    cost = (1 - served["decode_tokens_per_s"] / alone["decode_tokens_per_s"]
            if served.get("decode_tokens_per_s") and alone.get("decode_tokens_per_s") else None)
    rows = [
        {"what": "TTFT mean (s)", "engine": alone.get("ttft_s_mean"), "service": served.get("ttft_s_mean")},
        {"what": "decode tok/s, whole batch", "engine": alone.get("decode_tokens_per_s"),
         "service": served.get("decode_tokens_per_s")},
        {"what": "service cost, decode", "service": None if cost is None else f"{100 * cost:.1f} %",
         "target": "< 10 %"},
        {"what": "429 by the edge p50/p99/max (ms)",
         "service": f"{burst.get('refused_by_edge')}: {burst.get('edge_429_ms')}", "target": "< 100"},
        {"what": "429 at once p50/max (ms)", "service": f"{burst.get('refused_at_once_ms')}", "target": "< 100"},
        {"what": "429 after bounded wait", "service": burst.get("refused_after_bounded_wait")},
        {"what": "429 probes, line full (ms)", "service": [p["ms"] for p in burst.get("probes", [])],
         "target": "< 100"},
        {"what": "admitted / completed", "service": f"{burst.get('admitted')} / {burst.get('admitted_completed')}"},
        {"what": "drained after burst", "service": f"{burst.get('drained')}"},
        {"what": "replicas max / final", "service": f"{tl.get('max_replicas')} / {tl.get('final_replicas')}",
         "target": "2 / 1"},
        {"what": "requests per replica", "service": f"{tl.get('requests_per_replica')}"},
        {"what": "failed phases", "service": [name for name, p in phases.items() if "error" in p] or "none"},
    ]
    return [{"engine": "", "service": "", "target": "", **row} for row in rows]


def save_ray_logs(out: Path) -> None:
    logs = Path("/tmp/ray/session_latest/logs")
    if logs.is_dir():
        staging = Path(shutil.copytree(logs / "serve", out / "ray_logs", dirs_exist_ok=True))
        for err in logs.glob("worker-*.err"):
            if 0 < err.stat().st_size < 4 << 20:
                shutil.copy(err, staging)
        shutil.make_archive(str(out / "ray_logs"), "gztar", staging)
        shutil.rmtree(staging)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny geometry on CPU (a rehearsal)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=None, help="default: the profile's")
    parser.add_argument("--phases", nargs="+", choices=["compare", "timeline"], default=["compare", "timeline"])
    parser.add_argument("--tail-s", type=float, default=None,
                        help="how long the timeline watches after its load (scale-down); default: the profile's")
    args = parser.parse_args()
    profile = CPU if args.cpu else GPU
    if args.tail_s is not None:
        profile = replace(profile, load=replace(profile.load, tail_s=args.tail_s))
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (args.budget_s or profile.budget_s)
    record = {"command": "python -m benchmarks.serve_gpu " + " ".join(sys.argv[1:]),
              "profile": {k: v for k, v in asdict(profile).items() if k != "geometry"}, "phases": {}}
    arm_watchdog(deadline + 20, record, args.out)
    try:
        run_phases(profile, record, args.out, deadline, set(args.phases))
    finally:
        write(record, args.out / "serve_gpu.json")
        with contextlib.suppress(OSError):
            save_ray_logs(args.out)
    print_table(table(record), ["what", "engine", "service", "target"])


if __name__ == "__main__":
    main()
