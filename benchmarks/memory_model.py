"""Memory model against measurement on the GPU: Llama-3.1-8B geometry (random weights), ShadowKV, contexts and
batches up to the predicted maximum. For each, the engine is sized by the memory model for exactly that batch; the
batch runs (prefill + a few decode steps), one more request is refused before any allocation, and peak GPU bytes
(allocator peak + what the CUDA context holds outside it) and pinned host bytes are compared with the prediction.

python -m benchmarks.memory_model --contexts 8192 32768 122880 --out memory_model.json

The NUMA placement the engine logged is recorded with the rows (`numa_log`).
"""
from __future__ import annotations

import argparse
import gc
import logging
import time

import torch

from benchmarks.report import print_table, write_json
from shadowkv_core import EngineConfig, LLMEngine, SamplingParams, ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.models.geometry import LLAMA_31_8B, TINY, TINY_SHADOWKV, model_spec, write_config


def non_torch_gpu_bytes() -> int:
    """Device memory this process holds outside torch's allocator (CUDA context, cuBLAS workspaces, ...)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) - torch.cuda.memory_reserved()


def run_batch(model: str, cfg: ShadowKVConfig, context: int, batch: int, max_new: int, device: str) -> dict:
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = mm.Geometry.from_spec(model_spec(model), dtype)
    gpu_budget, host_budget = mm.pool_budget_for(g, cfg, batch, context, max_new)
    engine = LLMEngine(EngineConfig(model=model, device=device, dtype=str(dtype).removeprefix("torch."),
                                    load_format="dummy", shadowkv=cfg, max_num_seqs=batch,
                                    max_model_len=context + max_new, max_prefill_tokens=context, max_waiting=batch + 1,
                                    gpu_cache_gib=gpu_budget / mm.GIB, host_cache_gib=host_budget / mm.GIB,
                                    prefill_step_tflop=None))  # whole prefills: the batch is resident before any ends
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(context + batch)
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    for i in range(batch + 1):
        engine.add_request(f"r{i}", torch.randint(0, g.vocab_size, (context,), generator=gen).tolist(), params)
    start, peak_host, refusals, concurrent = time.perf_counter(), 0, [], 0
    while any(f"r{i}" in engine.requests for i in range(batch)):
        engine.step()
        peak_host = max(peak_host, engine.stats()["host_bytes_in_use"])
        concurrent = max(concurrent, engine.stats()["num_running"])
        holding = [engine.requests.get(f"r{i}") for i in range(batch)]
        if all(seq is not None and seq.status.value != "waiting" for seq in holding):  # the whole batch admitted
            extra = engine.requests[f"r{batch}"]
            refusals.append(extra.status.value == "waiting" and not engine.cache.manager.can_allocate(context, max_new))
    refused = bool(refusals) and all(refusals)
    predicted_gpu = mm.fixed_gpu_bytes(g, cfg, context, engine.config.prefill_chunk_tokens, batch) + gpu_budget
    row = {"device": torch.cuda.get_device_name() if cuda else "cpu", "context": context, "batch": batch,
           "predicted_gpu_bytes": predicted_gpu, "predicted_host_bytes": host_budget, "measured_host_bytes": peak_host,
           "weights_bytes": g.weight_bytes, "pools_gpu_bytes": gpu_budget, "extra_request_refused": refused,
           "max_concurrent": concurrent, "max_new_tokens": max_new,
           "seconds": round(time.perf_counter() - start, 1), "host_ratio": peak_host / host_budget}
    if cuda:
        torch.cuda.synchronize()
        row.update(measured_gpu_bytes=torch.cuda.max_memory_allocated() + non_torch_gpu_bytes(),
                   allocator_peak_bytes=torch.cuda.max_memory_allocated(), non_torch_bytes=non_torch_gpu_bytes())
        row["gpu_ratio"] = row["measured_gpu_bytes"] / predicted_gpu
        row["within_5pct"] = all(0.95 <= ratio <= 1.0 for ratio in (row["gpu_ratio"], row["host_ratio"]))
    engine.close()
    del engine
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def capture_log(name: str) -> list[str]:
    """The messages `name`'s logger emits from now on (also printed), to record them with the results."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    logger.addHandler(logging.StreamHandler())
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 122880])
    parser.add_argument("--batches", default="1,max", help="comma list of batch sizes; 'max' = predicted maximum")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="more than the batch, so the whole batch is resident at once (one prefill per step)")
    parser.add_argument("--host-gib", type=float, default=None, help="host budget (default 80%% of MemAvailable)")
    parser.add_argument("--out", default="memory_model.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny geometry (a dry run of this script on CPU)")
    args = parser.parse_args()
    model = write_config(TINY if args.tiny else LLAMA_31_8B)
    cuda = args.device == "cuda"
    g = mm.Geometry.from_spec(model_spec(model), torch.bfloat16 if cuda else torch.float32)
    cfg = TINY_SHADOWKV if args.tiny else ShadowKVConfig(device_value_share=0.0)
    total = torch.cuda.mem_get_info()[1] if cuda else 4 * mm.GIB
    host = int(args.host_gib * mm.GIB) if args.host_gib else int(mm.mem_available_bytes() * 0.8)
    numa_log = capture_log("shadowkv_core.numa")
    rows = []
    for context in args.contexts:
        best = mm.capacity(g, cfg, int(total * 0.9), host, [context], args.max_new_tokens)
        for b in args.batches.split(","):
            batch = best if b == "max" else min(int(b), best)
            row = run_batch(model, cfg, context, batch, args.max_new_tokens, args.device)
            row["predicted_max_batch"] = best
            rows.append(row)
            print_table([row], ["context", "batch", "gpu_ratio", "host_ratio", "extra_request_refused", "seconds"])
            path = write_json(args.out, rows, gpu_total_bytes=total, host_budget_bytes=host,
                              numa_log=numa_log)  # after every row
    print(f"wrote {path}")
    print_table(rows, ["context", "batch", "predicted_max_batch", "predicted_gpu_bytes", "measured_gpu_bytes",
                       "gpu_ratio", "predicted_host_bytes", "measured_host_bytes", "host_ratio",
                       "extra_request_refused"])


if __name__ == "__main__":
    main()
