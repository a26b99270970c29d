"""How closely ShadowKV follows dense attention, whatever the task: the same held-out text, teacher-forced.

A prompt of `context` tokens of held-out text is prefilled in a dense engine and in a ShadowKV engine; then the
passage's next `steps` tokens are fed to both, one decode step at a time (teacher forcing: both see the same tokens,
so a wrong guess never compounds). Per step: the cosine similarity of each layer's attention output to dense's, the
top-1 agreement of the next-token logits, and ShadowKV's hit rate. Also, per layer, the key tail energy: the share of
the pre-RoPE key energy (all KV heads concatenated) outside the top-r eigen-directions of KᵀK, r being ShadowKV's
rank, over task prompts — what the rank-r factorisation throws away. Writes benchmarks/results/fidelity.json.

    python -m benchmarks.fidelity --model models/shadowkv-small --device cpu
    python -m benchmarks.fidelity --key-tail-only --contexts 4096   # the key tail energy alone, printed
    python -m benchmarks.fidelity --needle-probe --contexts 4096    # which layers' chunk scores find a needle
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

from benchmarks.accuracy import device_name
from benchmarks.accuracy_runs import shadowkv_config
from shadowkv_core import LLM
from shadowkv_core.cache.base import AttentionMetadata
from training.corpus import load_corpus
from training.data import BOS, TASKS, make_sample
from training.objectives import RANK_SHARE, KeyCapture, key_tail


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
    begin, end, begun = cache.attend_begin, cache.attend_end, []  # the layers call begin, then end (KVCache)

    def recording_begin(layer, *args):
        begun.append(layer)
        return begin(layer, *args)

    def recording_end(handle):
        out = end(handle)  # (T, Hq, d)
        outputs[begun.pop(0)] = out[-1].flatten().float()
        return out

    cache.attend_begin, cache.attend_end = recording_begin, recording_end
    cache.manager.allocate(seq_id, len(prompt), len(forced) + 1)
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
    del cache.attend_begin, cache.attend_end  # the class's methods again
    cache.manager.free(seq_id)
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


def rank_split_tail(keys: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """key_tail when each of `ranks` tensor-parallel ranks factorises its own KV heads (its slice of the W columns)
    at rank/ranks: the share of the whole key energy outside the ranks' subspaces. keys (B, L, W) -> (B,)."""
    parts = keys.float().chunk(ranks, dim=-1)
    energy = torch.stack([p.square().sum((1, 2)) for p in parts])  # (ranks, B)
    tails = torch.stack([key_tail(p, rank // ranks) for p in parts])
    return (tails * energy).sum(0) / energy.sum(0).clamp(min=1e-12)


@torch.inference_mode()
def key_tail_energy(model: str, context: int, samples: int, device: str, rank_share: float = RANK_SHARE,
                    ranks: int = 1) -> dict:
    """Per layer, the mean over `samples` task prompts (evaluation seeds, tasks in turn) of the share of pre-RoPE key
    energy outside the top-r eigen-directions, r = rank_share * kv_heads*head_dim (ShadowKV's rank); with ranks > 1,
    also that share when each tensor-parallel rank factorises its own heads at r/ranks (rank_split_tail)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    cfg = hf.config
    width = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    rank = max(1, round(rank_share * width))
    capture, tails, split = KeyCapture(hf), [], []
    for seed in range(samples):
        prompt = make_sample(TASKS[seed % len(TASKS)], context, seed).prompt_ids
        hf.model(input_ids=torch.tensor([prompt], device=device))  # the decoder alone: keys, no logits
        keys = capture.take()
        tails.append(torch.cat([key_tail(k, rank) for k in keys]).tolist())  # (layers,)
        if ranks > 1:
            split.append(torch.cat([rank_split_tail(k, rank, ranks) for k in keys]).tolist())
    capture.close()
    out = {"context": context, "samples": samples, "rank": rank, "width": width, **_layer_means("", tails)}
    if ranks > 1:
        out |= {"ranks": ranks, **_layer_means("per_rank_", split)}
    return out


def _layer_means(prefix: str, tails: list[list[float]]) -> dict:
    layer_tail = [round(sum(t[i] for t in tails) / len(tails), 4) for i in range(len(tails[0]))]
    return {f"{prefix}layer_tail": layer_tail, f"{prefix}mean_tail": round(sum(layer_tail) / len(layer_tail), 4)}


@torch.inference_mode()
def needle_probe(model: str, context: int, samples: int, device: str, budget: float = 0.0156,
                 chunk: int = 8, local_chunks: int = 4) -> dict:
    """Per layer, the share of niah_single prompts (evaluation seeds) where a chunk holding the needle's value is among
    the budget's best chunks of either KV head, at the last prompt token's query, by three chunk scores: ShadowKV's
    landmarks (softmax of q·chunk-mean over the chunks, max over the GQA group), Quest's min/max bound, and the exact
    max q·k in the chunk. Exact keys, no outlier chunks, local chunks left out: a probe of the scores alone."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").to(device)
    cfg = hf.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    captured: dict[str, torch.Tensor] = {}
    handles = [getattr(layer.self_attn, f"{n}_proj").register_forward_hook(
        lambda m, i, o, key=f"{n}{idx}": captured.__setitem__(key, o))
        for idx, layer in enumerate(hf.model.layers) for n in "qk"]
    top = max(1, round(budget * context / chunk))
    hits = [[0, 0, 0] for _ in hf.model.layers]
    for seed in range(samples):
        sample = make_sample("niah_single", context, seed)
        ids = sample.prompt_ids
        at = bytes(t if t < 256 else 0 for t in ids).find(sample.answer.strip().encode())  # BOS as a 0 byte
        needle = {(at + j) // chunk for j in range(len(sample.answer.strip()))}
        hf.model(input_ids=torch.tensor([ids], device=device))
        n = (len(ids) - local_chunks * chunk) // chunk
        cos, sin = hf.model.rotary_emb(captured["k0"], torch.arange(len(ids), device=device)[None])
        for layer in range(len(hits)):
            q = captured[f"q{layer}"].view(1, -1, hq, d).transpose(1, 2)
            k = captured[f"k{layer}"].view(1, -1, hkv, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            q = q[0, :, -1].view(hkv, hq // hkv, d)  # (Hkv, group, d)
            k = k[0, :, :n * chunk].reshape(hkv, n, chunk, d)
            landmark = torch.softmax(torch.einsum("hgd,hnd->hgn", q, k.mean(2)) / d ** 0.5, -1).amax(1)
            bound = torch.maximum(q[:, :, None] * k.amax(2)[:, None], q[:, :, None] * k.amin(2)[:, None])
            exact = torch.einsum("hgd,hncd->hgnc", q, k).amax(-1).amax(1)
            for i, score in enumerate((landmark, bound.sum(-1).amax(1), exact)):
                hits[layer][i] += bool(needle & set(score.topk(min(top, n), -1).indices.flatten().tolist()))
    for handle in handles:
        handle.remove()
    names = ("landmark", "quest", "exact_max")
    return {"context": context, "samples": samples, "budget": budget,
            "layers": [{name: h[i] / samples for i, name in enumerate(names)} for h in hits]}


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
    parser.add_argument("--key-tail-samples", type=int, default=5, help="task prompts per context for the key tail")
    parser.add_argument("--key-tail-only", action="store_true", help="print the key tail energy, write nothing")
    parser.add_argument("--needle-probe", action="store_true",
                        help="print, per layer, how often each chunk score finds a needle (needle_probe), and stop")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="key tail also when each of this many ranks factorises its own KV heads at rank/N")
    parser.add_argument("--key-tail-out", help="with --key-tail-only: also write the key tails to this JSON file")
    parser.add_argument("--out", default="benchmarks/results/fidelity.json")
    args = parser.parse_args()
    if args.needle_probe:
        for context in args.contexts:
            probe = needle_probe(args.model, context, args.key_tail_samples * 2, args.device)
            for layer, shares in enumerate(probe["layers"]):
                print(f"{context:6d} layer {layer}: needle chunk among the best {probe['budget']:.2%}: "
                      + " ".join(f"{name} {share:.1f}" for name, share in shares.items()), flush=True)
        return
    rows, start = [], time.time()
    key_tails = [key_tail_energy(args.model, c, args.key_tail_samples, args.device, ranks=args.tensor_parallel)
                 for c in args.contexts]
    for t in key_tails:
        print(f"{t['context']:6d} key tail energy outside rank {t['rank']} of {t['width']}, per layer "
              f"{t['layer_tail']} (mean {t['mean_tail']})", flush=True)
        if "ranks" in t:
            print(f"{t['context']:6d} ... each of {t['ranks']} ranks at rank {t['rank'] // t['ranks']} of its heads: "
                  f"per layer {t['per_rank_layer_tail']} (mean {t['per_rank_mean_tail']})", flush=True)
    if args.key_tail_only:
        if args.key_tail_out:
            Path(args.key_tail_out).write_text(json.dumps({**_meta(args, start), "key_tail": key_tails}, indent=1))
        return
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
    Path(args.out).write_text(json.dumps({**_meta(args, start), "key_tail": key_tails, "rows": rows}, indent=1))


def _meta(args: argparse.Namespace, start: float) -> dict:
    return {"command": "python -m benchmarks.fidelity " + " ".join(sys.argv[1:]), "device": device_name(args.device),
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "seconds": round(time.time() - start, 1)}


if __name__ == "__main__":
    main()
