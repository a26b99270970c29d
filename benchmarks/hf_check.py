"""Is the Hugging Face baseline's shortcut honest on this device? benchmarks/hf_baseline.py prefills one prompt,
replicates its cache to the batch and decodes from its dynamic cache (throughput's `hf`) or from its static cache
(`hf_static`); both must generate the same greedy tokens, step after step. Random weights of a geometry. Writes every
token to --out; exits 1 when the two caches disagree.

    PYTHONPATH=. python -m benchmarks.hf_check --model tiny --device cpu --out hf_check.json
    PYTHONPATH=. python -m benchmarks.hf_check --model llama-3.1-8b --context 8192 --device cuda
"""
from __future__ import annotations

import argparse

import torch

from benchmarks import hf_baseline
from benchmarks import throughput as tp
from benchmarks.report import write_json
from shadowkv_core import memory_model as mm
from shadowkv_core.models.geometry import write_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=[*mm.PRESETS, "tiny"], help="geometry")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens")
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="greedy decode steps compared")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="hf_check.json", help="relative paths land in benchmarks/results/")
    args = parser.parse_args(argv)
    config_dir = write_config(tp.geometry_config(args.model, args.context + args.steps + 1))
    model = hf_baseline.load(config_dir, tp.dtype_for(args.device), args.device)
    prompt = torch.randint(0, model.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    _, token, prefix = hf_baseline.prefill(model, prompt.tolist(), args.device)
    tokens = {name: hf_baseline.decode(model, prefix, token, args.batch, args.steps, 1, args.device,
                                       static=static)[1].tolist()
              for name, static in (("dynamic", False), ("static", True))}
    honest = tokens["static"] == tokens["dynamic"]
    path = write_json(args.out, [], **tokens, honest=honest)
    print(f"wrote {path}: the static cache {'agrees' if honest else 'DISAGREES'} with the dynamic one")
    if not honest:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
