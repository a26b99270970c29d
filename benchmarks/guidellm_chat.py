"""guidellm in chat mode against configs/local.yaml on loopback: vLLM's benchmark client sends its default chat
requests (synthetic prompts, streamed, `/v1/chat/completions`) at a fixed concurrency; records how many succeeded,
were refused or failed, and guidellm's TTFT, inter-token latency, end-to-end latency and output token rate.

guidellm is heavy (torch, datasets, pandas): it runs from its own environment, which `scripts/guidellm.sh` creates
and then calls this script with `--guidellm` pointing at it. The service's model folder is guidellm's tokenizer,
read offline.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PERCENTILES = ("p50", "p90", "p99")
LATENCIES = {"ttft_ms": "time_to_first_token_ms", "itl_ms": "inter_token_latency_ms", "e2e_s": "request_latency"}


def guidellm_command(guidellm: str, url: str, model: str, tokenizer: str, out: Path, streams: int, requests: int,
                     prompt_tokens: int, output_tokens: int) -> list[str]:
    return [guidellm, "run",
            "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/chat/completions",
            "--profile", f"kind=concurrent,streams={streams}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--output", f"kind=json,path={out}", "--disable-progress"]


def summarize(report: dict) -> dict:
    """The one benchmark of a guidellm JSON report: request counts, rates over its duration, the latencies' mean and
    percentiles over the successful requests, and the distinct errors."""
    (bench,) = report["benchmarks"]
    metrics, duration = bench["metrics"], bench["duration"]
    totals = metrics["request_totals"]
    row = {"successful": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
           "duration_s": round(duration, 1), "requests_per_s": round(totals["successful"] / duration, 3),
           "output_tok_s": round(metrics["output_token_count"]["successful"]["total_sum"] / duration, 1),
           "prompt_tokens_mean": metrics["prompt_token_count"]["successful"]["mean"],
           "output_tokens_mean": metrics["output_token_count"]["successful"]["mean"]}
    for name, key in LATENCIES.items():
        stats = metrics[key]["successful"]
        row[f"{name}_mean"] = round(stats["mean"], 3)
        row |= {f"{name}_{p}": round(stats["percentiles"][p], 3) for p in PERCENTILES}
    row["errors"] = sorted({r["info"]["error"] or "" for r in bench["requests"]["errored"]})
    return row


def run(config: Path, guidellm: str, streams: int, requests: int, prompt_tokens: int, output_tokens: int) -> tuple:
    """Serves `config`'s first application on loopback and runs guidellm against it: (summary row, served model
    name, model folder)."""
    from serve_app.app import AppArgs, resolve_model
    from serve_app.local import local_service

    app = yaml.safe_load(config.read_text())["applications"][0]
    args = {**app["args"], "config_dir": str(config.resolve().parent)}
    model = resolve_model(AppArgs(**args))
    served = args.get("served_model_name") or Path(model).name
    with tempfile.TemporaryDirectory() as tmp, local_service(args, app["name"]) as url:
        out = Path(tmp) / "guidellm.json"
        command = guidellm_command(guidellm, url, served, model, out, streams, requests, prompt_tokens, output_tokens)
        subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
        report = json.loads(out.read_text())
    return summarize(report), served, model


def main() -> None:
    from benchmarks.report import print_table, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.yaml")
    parser.add_argument("--guidellm", default=str(ROOT / ".venv-guidellm" / "bin" / "guidellm"))
    parser.add_argument("--streams", type=int, default=8,
                        help="concurrent requests (twice the local config's slots: half of them wait for room)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--out", default="guidellm_chat.json", help="relative paths land in benchmarks/results/")
    args = parser.parse_args()
    row, served, model = run(args.config, args.guidellm, args.streams, args.requests, args.prompt_tokens,
                             args.output_tokens)
    shown = guidellm_command("guidellm", "http://127.0.0.1:PORT", served, os.path.relpath(model, ROOT),
                             Path("OUT.json"), args.streams, args.requests, args.prompt_tokens, args.output_tokens)
    version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True, check=True).stdout
    path = write_json(args.out, [row], config=str(args.config.resolve().relative_to(ROOT)),
                      guidellm_command=" ".join(shown), guidellm_version=version.strip())
    print_table([row], ["successful", "errored", "incomplete", "ttft_ms_p50", "itl_ms_p50", "e2e_s_p50",
                        "output_tok_s"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
