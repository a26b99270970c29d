"""Train the small long-context model this project ships (models/shadowkv-small), then score it densely.

A Llama-architecture decoder (RoPE theta 500K, GQA 3 query heads per KV head, RMSNorm, SwiGLU) over the byte-level
vocabulary, trained on one GPU with a length curriculum up to 16K tokens. Each step holds the same number of tokens:
rows of plain text (language-model loss on every token) and of the synthetic tasks of training/data.py
(language-model loss on the haystack, weighted down, plus the loss on the answer tokens), in the words of
--templates (training/templates.py: arbitrary by default, most samples' forms made anew of any of the corpus's
words; composed, of word pools; varied, a few hand-written ones; ruler, the one form the first shipped model saw).
Optionally, the terms of training/objectives.py, all off for the shipped model's first run: a key low-rank regulariser
(--key-rank-weight), a landmark divergence (--landmark-weight), a rank attention divergence
(--rank-attention-weight) and a rank logit error (--rank-logit-weight); --key-proj-rank trains each k_proj as a
product of that rank (saved merged), so the pre-RoPE keys have that rank whatever the input. The log reports
every term at every log line either way; docs/accuracy.md says what they did. --init fine-tunes a saved model
instead of training from scratch (with --min-context, on the curriculum's longer stages only).
Deterministic given --seed and the corpus file. Data come from the training split and training seeds; the closing
evaluation (greedy, transformers, dense attention) from the held-out split and evaluation seeds.

    python -m training.data --write-corpus .cache/corpus.txt
    python -m training.train --corpus-file .cache/corpus.txt --out models/shadowkv-small
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shadowkv_core.tiny_model import save_byte_tokenizer
from training.data import EOS, TASKS, ContextTooShort, TRAIN_SEED_BASE, answer_ids, make_sample, text_stream
from training.templates import MULTITURN, TRAINING_TEMPLATES, Templates
from training.evaluate import dense_eval, model_card
from training.objectives import (ANSWER_SLOT, KEY_SUBSPACE_ITERS, KeyCapture, factorise_key_projections, key_rank,
                                 key_tail, landmark_divergence, merge_key_projections, rank_attention_divergence,
                                 rank_logit_error)

# (row length in tokens, steps); every step holds --tokens-per-step tokens
CURRICULUM = ((512, 2000), (1024, 1500), (2048, 1000), (4096, 800), (8192, 600), (16384, 600))
TEXT_SHARE = 0.25  # share of rows that are plain text
LM_WEIGHT = 0.3  # weight of the language-model loss against the answer loss
EVAL_CONTEXTS = (1024, 2048, 4096, 8192, 16384)
MULTITURN_MIN_LENGTH = 2048
TASK_DRAWS = 32  # arbitrary forms with long keys often leave a 512-token row no room
TASK_DRAW_STRIDE = 1_000_003  # another draw's seed, far from every row's own


def model_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 262,
        "hidden_size": 384, "intermediate_size": 768, "num_hidden_layers": 6, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 257, "attention_bias": False, "mlp_bias": False,
    }


def build_model(seed: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in model_config().items() if k not in ("architectures", "torch_dtype")})
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(device)


# ---------------------------------------------------------------- data

def task_row(rng: random.Random, length: int, seed: int, corpus_file: str | None, templates: Templates):
    """(ids, lm_mask, answer_mask) of one task row; the masks mark the tokens whose prediction is scored."""
    # a five-turn conversation's questions, answers and needles do not fit the curriculum's shortest rows
    tasks = [t for t in templates.tasks if t != MULTITURN or length >= MULTITURN_MIN_LENGTH]
    for draw in range(TASK_DRAWS):  # a long composed form may leave a short row no room, or outgrow the answer slot
        try:
            sample = make_sample(rng.choice(tasks), length - ANSWER_SLOT, seed + draw * TASK_DRAW_STRIDE,
                                 split="train", corpus_file=corpus_file, templates=templates)
        except ContextTooShort:
            continue
        if len(answer_ids(sample)) <= ANSWER_SLOT:
            break
    else:
        raise ContextTooShort(f"no {templates.name} task fits a row of {length} tokens in {TASK_DRAWS} draws")
    answer = answer_ids(sample)
    prompt, pad = len(sample.prompt_ids), length - len(sample.prompt_ids) - len(answer)
    ids = sample.prompt_ids + answer + [EOS] * pad
    lm_mask = [True] * (prompt - 1) + [False] * (length - prompt + 1)  # position t predicts ids[t + 1]
    answer_mask = [False] * (prompt - 1) + [True] * len(answer) + [False] * (pad + 1)
    return ids, lm_mask, answer_mask


class StepBatches(torch.utils.data.Dataset):
    """Item i is step i's rows, a function of (seed, i) alone, so loader workers build them in any order."""

    def __init__(self, stages: list[tuple[int, int]], args):
        self.lengths = [length for length, steps in stages for _ in range(steps)]
        self.seed, self.tokens_per_step, self.corpus_file = args.seed, args.tokens_per_step, args.corpus_file
        self.templates = TRAINING_TEMPLATES[args.templates]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, step: int):
        """(ids (B, L) int64, lm_mask (B, L) bool, answer_mask (B, L) bool)."""
        length = self.lengths[step]
        rng = random.Random(f"batch:{self.seed}:{step}")
        rows = []
        for r in range(max(1, self.tokens_per_step // length)):
            row_seed = TRAIN_SEED_BASE + self.seed * 10_000_000 + step * 1000 + r
            if rng.random() < TEXT_SHARE:
                ids = text_stream(row_seed, length, self.corpus_file)
                rows.append((ids, [True] * (length - 1) + [False], [False] * length))
            else:
                rows.append(task_row(rng, length, row_seed, self.corpus_file, self.templates))
        return tuple(torch.tensor(column) for column in zip(*rows))


def loss_fn(model, ids, lm_mask, answer_mask, capture: KeyCapture, rank: int, key_weight: float,
            key_iters: int | None = KEY_SUBSPACE_ITERS, measure: bool = True, landmark_weight: float = 0.0,
            rank_attention_weight: float = 0.0, rank_logit_weight: float = 0.0
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, terms): terms (detached) lm, answer, key tail (key_tail, averaged over layers and rows), landmark KL
    (landmark_divergence), rank attention KL (rank_attention_divergence) and rank logit error (rank_logit_error),
    the last three averaged over layers; each of the last four is computed when its weight is > 0 or `measure` (else
    0; the last three need a capture made with queries)."""
    capture.take()
    capture.take_queries()
    with torch.autocast("cuda" if ids.is_cuda else "cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits  # (B, L, V)
    keys, queries = capture.take(), capture.take_queries()
    zero = torch.zeros((), device=ids.device)
    terms = {"key tail": zero, "landmark KL": zero, "rank attention KL": zero, "rank logit error": zero}
    if key_weight > 0 or measure:
        with torch.set_grad_enabled(key_weight > 0 and torch.is_grad_enabled()):
            terms["key tail"] = key_tail(torch.cat(keys), rank, key_iters).mean()  # every layer's rows in one batch
    if queries:
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        cos, sin = (t[0] for t in model.model.rotary_emb(keys[0].float(), positions))
        heads = model.config.num_key_value_heads
        divergences = {
            "landmark KL": (landmark_weight, lambda q, k: landmark_divergence(q, k, answer_mask, cos, sin, heads)),
            "rank attention KL": (rank_attention_weight, lambda q, k: rank_attention_divergence(
                q, k, answer_mask, cos, sin, heads, rank, key_iters)),
            "rank logit error": (rank_logit_weight, lambda q, k: rank_logit_error(
                q, k, answer_mask, cos, sin, heads, rank, key_iters)),
        }
        for name, (weight, divergence) in divergences.items():
            if weight > 0 or measure:
                with torch.set_grad_enabled(weight > 0 and torch.is_grad_enabled()):
                    terms[name] = torch.stack([divergence(q, k) for q, k in zip(queries, keys)]).mean()
    targets = torch.roll(ids, -1, dims=1)
    token_loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")  # fp32 CE
    token_loss = token_loss.view_as(ids)
    # masked means, not boolean indexing: no host sync, so the CPU builds the next batch while the GPU works
    lm = (token_loss * lm_mask).sum() / lm_mask.sum().clamp(min=1)
    answer = (token_loss * answer_mask).sum() / answer_mask.sum().clamp(min=1)
    loss = (LM_WEIGHT * lm + answer + key_weight * terms["key tail"] + landmark_weight * terms["landmark KL"]
            + rank_attention_weight * terms["rank attention KL"] + rank_logit_weight * terms["rank logit error"])
    return loss, {"lm": lm.detach(), "answer": answer.detach(), **{k: v.detach() for k, v in terms.items()}}


# ---------------------------------------------------------------- training

def schedule(scale: float, max_context: int, min_context: int = 0) -> list[tuple[int, int]]:
    return [(length, max(1, round(steps * scale))) for length, steps in CURRICULUM
            if min_context <= length <= max_context]


def learning_rate(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, args, log) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=args.device == "cuda")
    batches = StepBatches(schedule(args.step_scale, args.max_context, args.min_context), args)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=args.workers,
                                         pin_memory=args.device == "cuda", prefetch_factor=4 if args.workers else None)
    capture, rank = KeyCapture(model, queries=True), key_rank(model.config)
    total, start = len(batches), time.time()
    for step, tensors in enumerate(loader):
        if time.time() - start > args.max_minutes * 60:
            log(f"time limit reached at step {step}/{total}: stopped early")
            capture.close()
            return {"steps": step, "planned_steps": total, "seconds": time.time() - start, "key_rank": rank}
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, total, args.lr)
        logged = step % args.log_every == 0 or step == total - 1
        loss, terms = loss_fn(model, *(t.to(args.device, non_blocking=True) for t in tensors), capture, rank,
                              args.key_rank_weight, None if args.key_subspace_iters < 0 else args.key_subspace_iters,
                              logged, args.landmark_weight, args.rank_attention_weight, args.rank_logit_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if logged:
            shown = " ".join(f"{name} {value.item():.3f}" for name, value in terms.items())
            log(f"step {step:5d}/{total} len {tensors[0].shape[1]:5d} {shown} (rank {rank}) "
                f"{time.time() - start:6.1f}s")
    capture.close()
    return {"steps": total, "planned_steps": total, "seconds": time.time() - start, "key_rank": rank}


# ---------------------------------------------------------------- saving

def save(model, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    save_byte_tokenizer(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/shadowkv-small")
    parser.add_argument("--results", default="benchmarks/results/train_small_model.json", help="dense scores (JSON)")
    parser.add_argument("--corpus-file", default=None, help="frozen haystack text (training.data --write-corpus)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--templates", default="arbitrary", choices=sorted(TRAINING_TEMPLATES),
                        help="the task rows' words (training/templates.py): arbitrary, most samples' needle forms, "
                             "phrasings and chain forms made anew of any of the corpus's words, and a multi-turn task; "
                             "composed, made anew from word pools; varied, a few hand-written ones; ruler, the one "
                             "form the first shipped model was trained on")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--tokens-per-step", type=int, default=65536)
    parser.add_argument("--max-context", type=int, default=CURRICULUM[-1][0], help="drop longer curriculum stages")
    parser.add_argument("--min-context", type=int, default=0, help="drop shorter curriculum stages")
    parser.add_argument("--init", default=None,
                        help="start from this saved model (fine-tuning) instead of from scratch")
    parser.add_argument("--step-scale", type=float, default=1.0, help="multiplies every stage's step count")
    parser.add_argument("--max-minutes", type=float, default=7.0, help="stop training (and say so) past this")
    parser.add_argument("--key-rank-weight", type=float, default=0.0,
                        help="weight of the key low-rank regulariser (0: none, as the shipped model)")
    parser.add_argument("--landmark-weight", type=float, default=0.0,
                        help="weight of the landmark divergence at answer positions (0: none)")
    parser.add_argument("--rank-attention-weight", type=float, default=0.0,
                        help="weight of the divergence of rank-r keys' attention from dense at answer positions")
    parser.add_argument("--rank-logit-weight", type=float, default=0.0,
                        help="weight of the attention-weighted logit error of rank-r keys at answer positions")
    parser.add_argument("--key-proj-rank", type=int, default=0,
                        help="train every k_proj as a product of this rank (0: full rank); saved merged")
    parser.add_argument("--key-subspace-iters", type=int, default=KEY_SUBSPACE_ITERS,
                        help="subspace iterations for the regulariser's basis (-1: exact eigh, slow on CUDA)")
    parser.add_argument("--log-every", type=int, default=100, help="steps between log lines")
    parser.add_argument("--workers", type=int, default=6, help="data loader processes")
    parser.add_argument("--eval-samples", type=int, default=20)
    parser.add_argument("--eval-contexts", type=int, nargs="+", default=list(EVAL_CONTEXTS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    command = "python -m training.train " + " ".join(sys.argv[1:])
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    if args.init:
        from transformers import AutoModelForCausalLM
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32).to(args.device)
    else:
        model = build_model(args.seed, args.device)
    if args.key_proj_rank:
        factorise_key_projections(model, args.key_proj_rank)
    info = train(model, args, log)
    merge_key_projections(model)
    info.update(init=args.init, templates=args.templates, key_proj_rank=args.key_proj_rank,
                key_rank_weight=args.key_rank_weight,
                landmark_weight=args.landmark_weight,
                rank_attention_weight=args.rank_attention_weight, rank_logit_weight=args.rank_logit_weight,
                device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                parameters=sum(p.numel() for p in model.parameters()))
    save(model.eval(), Path(args.out))  # before the evaluation, so a run cut short still leaves the weights
    rows = dense_eval(model, args.eval_contexts, args.eval_samples, args.device)
    (Path(args.out) / "README.md").write_text(model_card(command, info, rows))
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    result = {"command": command, **info, "versions": versions, "rows": rows}
    Path(args.results).write_text(json.dumps(result, indent=1))
    log(f"{'task':20s} " + " ".join(f"{c:>6d}" for c in args.eval_contexts))
    for task in TASKS:
        log(f"{task:20s} " + " ".join(f"{r['score']:6.1f}" for r in rows if r["task"] == task))


if __name__ == "__main__":
    main()
