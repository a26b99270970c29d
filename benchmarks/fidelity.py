"""How closely ShadowKV follows dense attention, whatever the task: the same held-out text, teacher-forced.

A prompt of `context` tokens of held-out text is prefilled in a dense engine and in a ShadowKV engine; then the
passage's next `steps` tokens are fed to both, one decode step at a time (teacher forcing: both see the same tokens,
so a wrong guess never compounds). Per step: the cosine similarity of each layer's attention output to dense's, the
top-1 agreement of the next-token logits, and ShadowKV's hit rate. Writes benchmarks/results/fidelity.json.

    python -m benchmarks.fidelity --model models/shadowkv-small --device cpu
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

from benchmarks.accuracy import device_name, shadowkv_config
from benchmarks.longctx_data import BOS, load_corpus
from shadowkv_core import LLM
from shadowkv_core.attention import AttentionMetadata


def held_out_tokens(seed: int, length: int) -> list[int]:
    text = load_corpus("eval")
    start = random.Random(f"fidelity:{seed}").randrange(len(text) - length)
    return [BOS] + list(text[start:start + length - 1].encode("ascii"))


@torch.inference_mode()
def teacher_forced(llm: LLM, prompt: list[int], forced: list[int]) -> dict[str, list]:
    """Per decode step: top-1 token, per-layer attention outputs (L, Hq*d) and the cache's hit rate."""
    engine, seq_id = llm.engine, 0
    model, cache, device = engine.runner.model, engine.cache, engine.runner.device
    outputs: dict[int, torch.Tensor] = {}
    attend = cache.attend

    def recording_attend(layer, q, *args):
        out = attend(layer, q, *args)  # (T, Hq, d)
        outputs[layer] = out[-1].flatten().float()
        return out

    cache.attend = recording_attend
    cache.allocate(seq_id, len(prompt), len(forced) + 1)
    P = len(prompt)
    meta = AttentionMetadata(True, [seq_id], [P], [0], torch.arange(P, device=device))
    model(torch.tensor(prompt, device=device), meta.positions, cache, meta)
    cache.finish_forward(meta)
    steps = {"top1": [], "attn": [], "hit_rate": []}
    for t, token in enumerate(forced):
        meta = AttentionMetadata(False, [seq_id], [1], [P + t], torch.tensor([P + t], device=device))
        hidden = model(torch.tensor([token], device=device), meta.positions, cache, meta)
        cache.finish_forward(meta)
        steps["top1"].append(int(model.compute_logits(hidden).argmax(-1)))
        steps["attn"].append(torch.stack([outputs[i] for i in range(len(outputs))]).cpu())  # (L, Hq*d)
        steps["hit_rate"].append(cache.stats().get("hit_rate", 1.0))
    cache.attend = attend
    cache.free(seq_id)
    return steps


def compare(dense: dict, sparse: dict) -> dict:
    attn_d, attn_s = torch.stack(dense["attn"]), torch.stack(sparse["attn"])  # (steps, L, Hq*d)
    cosine = torch.cosine_similarity(attn_d, attn_s, dim=-1)  # (steps, L)
    agree = [a == b for a, b in zip(dense["top1"], sparse["top1"])]
    return {"layer_cosine": [round(c, 4) for c in cosine.mean(0).tolist()],
            "layer_cosine_min": [round(c, 4) for c in cosine.amin(0).tolist()],
            "top1_agreement": 100.0 * sum(agree) / len(agree),
            "hit_rate": round(sum(sparse["hit_rate"][1:]) / max(1, len(sparse["hit_rate"]) - 1), 4),
            "hit_rate_per_step": [round(h, 3) for h in sparse["hit_rate"]]}


def engine(model: str, device: str, context: int, steps: int, budget: float | None) -> LLM:
    config = None if budget is None else shadowkv_config(model, context, budget)
    return LLM(model=model, device=device, shadowkv=config, max_model_len=context + steps + 1, max_num_seqs=1,
               gpu_cache_gib=1, host_cache_gib=1, use_kernels=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/shadowkv-small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.0156, 0.06])
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/fidelity.json")
    args = parser.parse_args()
    rows, start = [], time.time()
    for context in args.contexts:
        for seed in range(args.seeds):
            tokens = held_out_tokens(seed, context + args.steps)
            prompt, forced = tokens[:context], tokens[context:]
            dense = teacher_forced(engine(args.model, args.device, context, args.steps, None), prompt, forced)
            for budget in args.budgets:
                llm = engine(args.model, args.device, context, args.steps, budget)
                rows.append({"context": context, "seed": seed, "budget": budget, "steps": args.steps,
                             **compare(dense, teacher_forced(llm, prompt, forced))})
                r = rows[-1]
                print(f"{context:6d} seed {seed} budget {budget:.4f}: top-1 {r['top1_agreement']:5.1f} % "
                      f"hit {r['hit_rate']:.2f} cosine per layer {r['layer_cosine']}", flush=True)
    meta = {"command": "python -m benchmarks.fidelity " + " ".join(sys.argv[1:]), "device": device_name(args.device),
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "seconds": round(time.time() - start, 1)}
    Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
