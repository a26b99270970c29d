"""The Hugging Face transformers baseline: AutoModelForCausalLM from the same config with random weights, SDPA, its
default dynamic cache or its static cache (preallocated to the prompt and the steps: no concatenation per step); one
prompt prefilled at batch 1, its cache replicated to the batch (a shortcut: each batch would otherwise need its own
prefill), then greedy decode. Batches grow in powers of two up to a cap; on an
out-of-memory error the batch steps down until one fits."""
from __future__ import annotations

import gc
import time

import torch


def load(config_dir: str, dtype: torch.dtype, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def prefill(model, prompt: list[int], device: str) -> tuple[float, torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    """(seconds to the first token, that token (1,), each layer's (K, V) moved to the host to free the GPU)."""
    ids = torch.tensor([prompt], device=device)
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1)
    _sync(device)
    seconds = time.perf_counter() - start
    prefix = [(layer.keys.cpu(), layer.values.cpu()) for layer in out.past_key_values.layers]  # (1, Hkv, S, d)
    return seconds, token, prefix


@torch.inference_mode()
def decode(model, prefix, token: torch.Tensor, batch: int, steps: int, warmup: int, device: str,
           static: bool = False) -> tuple[list[float], torch.Tensor]:
    """(step times (s), the tokens of every step (B, steps)) of greedy decode at `batch`: the prefix cache expanded
    to the batch (the dynamic cache's first step's concatenation materialises it; the static cache is written once),
    every step appending to the cache."""
    from transformers import DynamicCache, StaticCache

    length = prefix[0][0].shape[2]
    if static:
        cache = StaticCache(config=model.config, max_cache_len=length + warmup + steps)
        where = {"cache_position": torch.arange(length, device=device)}
        for layer, (k, v) in enumerate(prefix):
            cache.update(k.to(device).expand(batch, -1, -1, -1), v.to(device).expand(batch, -1, -1, -1), layer, where)
    else:
        cache = DynamicCache([(k.to(device).expand(batch, -1, -1, -1), v.to(device).expand(batch, -1, -1, -1))
                              for k, v in prefix])
    tokens = token.to(device).expand(batch)[:, None]  # (B, 1)
    times, generated = [], []
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        out = model(input_ids=tokens, past_key_values=cache, use_cache=True,
                    cache_position=torch.tensor([length + i], device=device))
        tokens = out.logits[:, -1:].argmax(-1)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            generated.append(tokens)
    return times, torch.cat(generated, 1)


def sweep(model, prefix, token, max_batch: int, steps: int, warmup: int, device: str, static: bool = False):
    """[(batch, step times, peak GPU bytes)] for batches 1, 2, 4, ... up to max_batch; past the first batch that runs
    out of memory, the largest batch below it that fits (bisection)."""
    results = []
    batches = [b for b in (2 ** i for i in range(max_batch.bit_length())) if b < max_batch] + [max_batch]
    for batch in batches:
        result = _try(model, prefix, token, batch, steps, warmup, device, static)
        if result is None:
            fits, fails = (results[-1][0] if results else 0), batch
            while fails - fits > 1:
                mid = (fits + fails) // 2
                result = _try(model, prefix, token, mid, steps, warmup, device, static)
                fits, fails = (mid, fails) if result is not None else (fits, mid)
                results += [result] if result is not None else []
            break
        results.append(result)
    return results


def _try(model, prefix, token, batch, steps, warmup, device, static):
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        times = decode(model, prefix, token, batch, steps, warmup, device, static)[0]
    except torch.OutOfMemoryError:
        times = None  # the failed step's tensors are released with the exception, before the collection below
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    if times is None:
        print(f"hf: batch {batch} out of memory", flush=True)
        return None
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return batch, times, peak


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
