"""The small model's closing evaluation: greedy answers of held-out samples with transformers and dense attention, and
the model card that reports them."""
from __future__ import annotations

import torch

from training.data import EOS, TASKS, make_sample, score
from training.objectives import ANSWER_SLOT


@torch.no_grad()
def dense_eval(model, contexts, samples: int, device: str) -> list[dict]:
    """Greedy answers of the held-out samples (evaluation seeds 0..samples-1), one row per task and context."""
    rows = []
    for context in contexts:
        for task in TASKS:
            batch_samples = [make_sample(task, context, seed) for seed in range(samples)]
            texts = []
            per_batch = max(1, 65536 // context)
            for i in range(0, samples, per_batch):
                texts += greedy(model, [s.prompt_ids for s in batch_samples[i:i + per_batch]], device)
            value = sum(score(s, t) for s, t in zip(batch_samples, texts)) / len(texts)
            rows.append({"task": task, "context": context, "method": "dense", "budget": 1.0, "score": value,
                         "samples": len(texts)})
    return rows


def greedy(model, prompts: list[list[int]], device: str) -> list[str]:
    """Greedy completions of equal-length prompts (no padding, so SDPA stays causal without a mask)."""
    ids = torch.tensor(prompts, device=device)
    with torch.autocast("cuda" if ids.is_cuda else "cpu", dtype=torch.bfloat16):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER_SLOT,
                             do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
    return [bytes(t for t in row.tolist() if t < 256).decode("ascii", "replace") for row in out[:, ids.shape[1]:]]


def model_card(command: str, info: dict, rows: list[dict]) -> str:
    table = "\n".join(f"| {r['task']} | {r['context']} | {r['score']:.1f} | {r['samples']} |" for r in rows)
    trained = f"Fine-tuned from the model then in `{info['init']}`" if info["init"] else "Trained"
    return f"""# shadowkv-small

A {info['parameters'] / 1e6:.1f}M-parameter Llama-architecture decoder over bytes (vocab 262), trained from scratch by
this project for retrieval over long contexts (up to 16K tokens) on licences, Debian copyright files and Python stdlib
sources plus the synthetic tasks of `training/data.py`. It knows nothing else: use it to measure what a
sparse KV cache keeps, not as an assistant. Weights in bfloat16.

{trained} with `{command}`
({info['steps']} of {info['planned_steps']} steps, {info['seconds']:.0f} s on {info['device']}).

Dense greedy scores (0-100) on held-out text and evaluation seeds, transformers, bfloat16:

| task | context | score | samples |
|---|---|---|---|
{table}
"""
