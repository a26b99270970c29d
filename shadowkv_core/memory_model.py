"""Memory model: the bytes a sequence holds on the GPU and on the host, the fixed cost of a replica, and from them
the batch a replica can hold. Pure functions of the model geometry and the configs: no GPU needed.

The same formulas size the engine's pools (engine/cache_factory.py), so what the router admits is what the engine
allocates. Per sequence, ShadowKV holds a slot (sparse buffer, outliers, local + generated window, its key basis)
and pages of U rows + landmarks on the GPU, and pages of values on the host; a dense sequence holds K/V blocks.

CLI: python -m shadowkv_core.memory_model --model <config.json or preset> --context 122880 --gpu-gib 80 --host-gib 512
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import AUTO, KV_CACHE_DTYPES, LANDMARK_KINDS, VALUE_FORMATS, ShadowKVConfig, default_block_size

INDEX_BYTES = 8  # int64 chunk ids in a slot
FP8_SCALE_BYTES = 4  # fp32 scale of one chunk (dense cache: one token) of one KV head's fp8 values
OUTLIER_FLAG_BYTES = 1  # uint8 per chunk and KV head on the GPU pages: 1 for an outlier
GIB = 1 << 30


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    kv_cache_dtype: str = "auto"  # the dense cache's (EngineConfig.kv_cache_dtype)

    @classmethod
    def from_spec(cls, spec, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> Geometry:
        return cls(spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size,
                   spec.intermediate_size, spec.vocab_size, dtype.itemsize, spec.tie_word_embeddings,
                   spec.qkv_bias, spec.o_bias, spec.mlp_bias, spec.qk_norm, spec.post_norms, kv_cache_dtype)

    def rank_share(self, size: int) -> Geometry:
        """One tensor-parallel rank's geometry (parallel.rank_spec): 1/size of the heads and of the intermediate;
        embeddings and norms replicated, as Geometry.from_spec(rank_spec) counts them."""
        if self.num_kv_heads % size or self.num_q_heads % size or self.intermediate_size % size:
            raise ValueError(f"tensor-parallel size {size} does not divide the model's heads and intermediate")
        return dataclasses.replace(self, num_q_heads=self.num_q_heads // size, num_kv_heads=self.num_kv_heads // size,
                                   intermediate_size=self.intermediate_size // size)

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def weight_bytes(self) -> int:
        """Every parameter of the decoder: projections, the biases and norms its family has, embeddings."""
        h, q, kv, inter = self.hidden_size, self.num_q_heads * self.head_dim, self.kv_width, self.intermediate_size
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
        per_layer += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + (2 * inter + h) * self.mlp_bias
        per_layer += 2 * self.head_dim * self.qk_norm + 2 * h * self.post_norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (self.num_layers * per_layer + embeddings + h) * self.dtype_bytes


PRESETS = {
    "llama-3.1-8b": Geometry(32, 32, 8, 128, 4096, 14336, 128256),
    "llama-3-8b-1m": Geometry(32, 32, 8, 128, 4096, 14336, 128256),
    "yi-9b-200k": Geometry(48, 32, 4, 128, 4096, 11008, 64000),
    "glm-4-9b-1m": Geometry(40, 32, 4, 128, 4096, 13696, 151552),
    "llama-3.1-70b": Geometry(80, 64, 8, 128, 8192, 28672, 128256),
}


def load_geometry(model: str, dtype_bytes: int = 2) -> Geometry:
    """A preset name, or a Hugging Face config.json (or the directory holding it)."""
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--model: {model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
    cfg = json.loads(path.read_text())
    heads = cfg["num_attention_heads"]
    return Geometry(cfg["num_hidden_layers"], heads, cfg.get("num_key_value_heads", heads),
                    cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg["hidden_size"],
                    cfg["intermediate_size"], cfg["vocab_size"], dtype_bytes,
                    cfg.get("tie_word_embeddings", False))


# ---- dense ---------------------------------------------------------------------------------------------------
def dense_block_bytes(g: Geometry, block_size: int | None = None) -> int:
    """K and V of block_size tokens (None: the engine's default for the cache's dtype), every layer: in the model's
    dtype, or fp8 plus an fp32 scale per token and KV head."""
    block_size = block_size or default_block_size(g.kv_cache_dtype)
    if g.kv_cache_dtype == "fp8":
        return 2 * g.num_layers * block_size * (g.kv_width + g.num_kv_heads * FP8_SCALE_BYTES)
    return 2 * g.num_layers * block_size * g.kv_width * g.dtype_bytes


def dense_seq_bytes(g: Geometry, tokens: int, block_size: int | None = None) -> int:
    block_size = block_size or default_block_size(g.kv_cache_dtype)
    return math.ceil(tokens / block_size) * dense_block_bytes(g, block_size)


# ---- ShadowKV ------------------------------------------------------------------------------------------------
def page_tokens(cfg: ShadowKVConfig) -> int:
    return cfg.page_chunks * cfg.chunk_size


def gpu_page_bytes(g: Geometry, cfg: ShadowKVConfig) -> int:
    """U rows (page_tokens, rank), landmarks (page_chunks, Hkv, d; bounds: 2d) and outlier flags (page_chunks, Hkv)
    of every layer; fp8 landmarks with an fp32 scale per chunk and KV head."""
    u = page_tokens(cfg) * cfg.rank * g.dtype_bytes
    flags = cfg.page_chunks * g.num_kv_heads * OUTLIER_FLAG_BYTES
    width = g.kv_width * cfg.landmark_width
    if cfg.landmark_format == "fp8":
        return g.num_layers * (u + flags + cfg.page_chunks * (width + g.num_kv_heads * FP8_SCALE_BYTES))
    return g.num_layers * (u + flags + cfg.page_chunks * width * g.dtype_bytes)


def host_page_bytes(g: Geometry, cfg: ShadowKVConfig) -> int:
    """Values (page_tokens, Hkv, d) of every layer: in the model's dtype, or fp8 plus an fp32 scale per chunk and
    KV head."""
    if cfg.value_format == "fp8":
        return g.num_layers * (page_tokens(cfg) * g.kv_width + cfg.page_chunks * g.num_kv_heads * FP8_SCALE_BYTES)
    return g.num_layers * page_tokens(cfg) * g.kv_width * g.dtype_bytes


def window_tokens(cfg: ShadowKVConfig) -> int:
    return cfg.local_chunks * cfg.chunk_size + cfg.decode_window


@dataclass(frozen=True)
class SeqBytes:
    gpu: int
    host: int


def slot_bytes(g: Geometry, cfg: ShadowKVConfig) -> int:
    """One sequence's fixed GPU working set, every layer: key basis SV (Hkv, r, d); resident chunk ids; sparse,
    outlier and window keys and values."""
    C, K, O = cfg.chunk_size, cfg.budget_chunks, cfg.outlier_chunks
    exact_tokens = K * C + O * C + window_tokens(cfg)
    per_layer = (cfg.rank * g.kv_width + 2 * exact_tokens * g.kv_width) * g.dtype_bytes
    per_layer += K * g.num_kv_heads * INDEX_BYTES
    return g.num_layers * per_layer


def shadow_pages(cfg: ShadowKVConfig, tokens: int) -> int:
    return math.ceil(tokens / page_tokens(cfg))


def device_value_pages(cfg: ShadowKVConfig, pages: int) -> int:
    """Of a sequence's value pages, those kept in device memory (ShadowKVConfig.device_value_share)."""
    if cfg.device_value_share == AUTO:
        raise ValueError("device_value_share 'auto' is chosen when a replica's pools are planned: replace it with a "
                         "share first (best_device_value_share)")
    return math.floor(cfg.device_value_share * pages)


def shadow_seq_bytes(g: Geometry, cfg: ShadowKVConfig, tokens: int) -> SeqBytes:
    """The pages of one sequence of `tokens` tokens: U rows, landmarks and the device share of its values on the
    GPU, the rest of its values on the host."""
    pages = shadow_pages(cfg, tokens)
    on_device = device_value_pages(cfg, pages)
    value = host_page_bytes(g, cfg)
    return SeqBytes(pages * gpu_page_bytes(g, cfg) + on_device * value, (pages - on_device) * value)


def seq_bytes(g: Geometry, cfg: ShadowKVConfig | None, context: int, max_new_tokens: int,
              block_size: int | None = None) -> SeqBytes:
    """What one sequence of `context` prompt tokens and up to `max_new_tokens` generated ones holds."""
    tokens = context + max_new_tokens
    if cfg is None or cfg.stays_dense(context, max_new_tokens):
        return SeqBytes(dense_seq_bytes(g, tokens, block_size), 0)
    pages = shadow_seq_bytes(g, cfg, tokens)
    return SeqBytes(slot_bytes(g, cfg) + pages.gpu, pages.host)


# ---- the engine's pools -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pools:
    """What an engine allocates once at start: slots, dense blocks for short sequences, shadow pages, and value pages
    on the host and (device_value_share) on the device."""

    num_slots: int
    num_dense_blocks: int
    num_gpu_pages: int
    num_host_pages: int
    num_device_value_pages: int = 0

    def gpu_bytes(self, g: Geometry, cfg: ShadowKVConfig | None, block_size: int | None = None) -> int:
        if cfg is None:
            return self.num_dense_blocks * dense_block_bytes(g, block_size)
        shadow = (self.num_slots * slot_bytes(g, cfg) + self.num_gpu_pages * gpu_page_bytes(g, cfg)
                  + self.num_device_value_pages * host_page_bytes(g, cfg))
        return shadow + self.num_dense_blocks * dense_block_bytes(g, block_size)

    def host_bytes(self, g: Geometry, cfg: ShadowKVConfig | None) -> int:
        return 0 if cfg is None else self.num_host_pages * host_page_bytes(g, cfg)

    def num_sequences(self, cfg: ShadowKVConfig, tokens: int) -> int:
        """How many ShadowKV sequences of `tokens` tokens (prompt and generation) these pools hold at once."""
        pages = shadow_pages(cfg, tokens)
        on_device = device_value_pages(cfg, pages)
        held = [self.num_slots, self.num_gpu_pages // pages]
        held += [self.num_device_value_pages // on_device] if on_device else []
        held += [self.num_host_pages // (pages - on_device)] if pages > on_device else []
        return min(held)


def plan_pools(g: Geometry, cfg: ShadowKVConfig | None, gpu_bytes: int, host_bytes: int, max_num_seqs: int,
               block_size: int | None = None) -> Pools:
    """Split a cache budget: a dense engine takes it all in blocks. A ShadowKV engine takes max_num_seqs slots,
    dense blocks for max_num_seqs sequences of min_context tokens (those stay dense), and with the rest GPU shadow
    pages and, for device_value_share, as many device value pages as sequences holding all those shadow pages
    need; host pages as many as its host budget holds."""
    block_size = block_size or default_block_size(g.kv_cache_dtype)
    block = dense_block_bytes(g, block_size)
    if cfg is None:
        return Pools(0, gpu_bytes // block, 0, 0)
    dense_blocks = max_num_seqs * math.ceil(cfg.min_context / block_size)
    rest = gpu_bytes - max_num_seqs * slot_bytes(g, cfg) - dense_blocks * block
    gpu_page, value_page = gpu_page_bytes(g, cfg), host_page_bytes(g, cfg)
    pages = max(int(rest // (gpu_page + cfg.device_value_share * value_page)), 0)
    while (pages + 1) * gpu_page + device_value_pages(cfg, pages + 1) * value_page <= rest:  # the share rounds down
        pages += 1
    return Pools(max_num_seqs, dense_blocks, pages, host_bytes // value_page, device_value_pages(cfg, pages))


def pool_budget_for(g: Geometry, cfg: ShadowKVConfig, batch: int, context: int, max_new_tokens: int,
                    block_size: int | None = None) -> tuple[int, int]:
    """(GPU, host) cache budgets whose pools hold exactly `batch` ShadowKV sequences of this shape (the pool's
    device value pages are its share of all its pages, rounded down once: see capacity)."""
    need = engine_seq_bytes(g, cfg, context, max_new_tokens, block_size)
    if cfg.stays_dense(context, max_new_tokens):
        return batch * need.gpu, 0
    pool_pages = batch * shadow_pages(cfg, context + max_new_tokens)
    gpu = (batch * reserved_seq_bytes(g, cfg, block_size) + pool_pages * gpu_page_bytes(g, cfg)
           + device_value_pages(cfg, pool_pages) * host_page_bytes(g, cfg))
    return gpu, batch * need.host


def mem_available_bytes(proc: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Host memory a replica's value store may draw on: MemAvailable, capped by the container's cgroup (v2) limit
    less its usage, since inside a container /proc/meminfo shows the whole node (never MemTotal)."""
    available = None
    for line in proc.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        raise RuntimeError(f"{proc} has no MemAvailable line")
    limit, usage = cgroup / "memory.max", cgroup / "memory.current"
    if limit.is_file() and usage.is_file() and limit.read_text().strip() != "max":
        available = min(available, int(limit.read_text()) - int(usage.read_text()))
    return available


# ---- fixed cost and capacity ----------------------------------------------------------------------------------
# Fitted to measured peaks of what torch's caching allocator reserves (docs/benchmarks.md, "The prefill's
# workspace"): a layer-wise prefill peaks either in its attention, holding hidden-sized vectors per prompt token (the
# layer's input, its norm, q, the attention output and their temporaries), or in its MLP, holding fewer of them plus
# one token chunk's intermediate-sized vectors (gate and up, the activation and its product). Beside either: an fp8
# pool's keys and values quantised through fp32 temporaries (FP8_WRITE_ROWS fp32 rows of the KV width a token), and
# ShadowKV's keys being factorised (two fp32 rows and one in the model's dtype), twice over: the build stream's
# allocator pool keeps its blocks apart from the main stream's. WORKSPACE_MARGIN covers the allocator's rounding and
# fragmentation. The CUDA context holds memory outside torch's allocator.
ATTENTION_HIDDEN_VECTORS = 5
MLP_HIDDEN_VECTORS = 4
MLP_CHUNK_VECTORS = 4
FP8_WRITE_ROWS = 4
WORKSPACE_MARGIN = 1.1
CONTEXT_BYTES = int(0.9 * GIB)


def prefill_workspace_bytes(g: Geometry, cfg: ShadowKVConfig | None, prompt_tokens: int, chunk_tokens: int,
                            context_tokens: int = 0) -> int:
    """Peak temporaries of prefilling `prompt_tokens` tokens layer by layer, after `context_tokens` cached ones (a
    dense prefix: one layer's keys and values read from its blocks, through fp32 from an fp8 pool, and the prompt's
    own beside them; a shadow prefix: the same, its keys rebuilt in fp32 on the reference path)."""
    hidden = g.hidden_size * g.dtype_bytes
    attention = prompt_tokens * ATTENTION_HIDDEN_VECTORS * hidden
    mlp = (prompt_tokens * MLP_HIDDEN_VECTORS * hidden
           + min(chunk_tokens, prompt_tokens) * MLP_CHUNK_VECTORS * g.intermediate_size * g.dtype_bytes)
    held = 0
    if g.kv_cache_dtype == "fp8":
        held += prompt_tokens * FP8_WRITE_ROWS * g.kv_width * 4
    if cfg is not None:
        held += 2 * prompt_tokens * g.kv_width * (2 * 4 + g.dtype_bytes)
    context = 0
    if context_tokens:
        context = 2 * (context_tokens + prompt_tokens) * g.kv_width * g.dtype_bytes
        if g.kv_cache_dtype == "fp8" or cfg is not None:
            context += 2 * context_tokens * g.kv_width * 4
    return int(WORKSPACE_MARGIN * (max(attention, mlp) + held)) + context


def largest_prefill_workspace_bytes(g: Geometry, cfg: ShadowKVConfig | None, max_prefill_tokens: int,
                                    max_model_len: int, chunk_tokens: int, prefix_caching: bool) -> int:
    """The workspace of the largest prefill an engine admits: a job of up to max_prefill_tokens prompt tokens, or
    one longer prompt alone (up to max_model_len); with prefix caching also a job's new tokens after a cached prefix
    of up to max_model_len - 1 tokens (a bound: a sequence's prefix and its own new tokens stay within
    max_model_len)."""
    worst = prefill_workspace_bytes(g, cfg, max(max_prefill_tokens, max_model_len), chunk_tokens)
    if prefix_caching:
        worst = max(worst, prefill_workspace_bytes(g, cfg, max_prefill_tokens, chunk_tokens, max_model_len - 1))
    return worst


def decode_workspace_bytes(g: Geometry, num_seqs: int) -> int:
    """A decode step's logits for `num_seqs` sequences: the lm_head's output and its fp32 copy, twice (a decode
    replayed from a CUDA graph writes them in the graph's memory pool, and the step returns a copy)."""
    return 2 * num_seqs * g.vocab_size * (g.dtype_bytes + 4)


def fixed_gpu_bytes(g: Geometry, cfg: ShadowKVConfig | None, max_prompt_tokens: int, chunk_tokens: int,
                    max_num_seqs: int = 1, context_bytes: int = CONTEXT_BYTES) -> int:
    """Weights, the largest prefill's workspace, the full batch's decode logits, and what the CUDA context holds
    outside torch's allocator."""
    return (g.weight_bytes + prefill_workspace_bytes(g, cfg, max_prompt_tokens, chunk_tokens)
            + decode_workspace_bytes(g, max_num_seqs) + context_bytes)


def reserved_seq_bytes(g: Geometry, cfg: ShadowKVConfig, block_size: int | None = None) -> int:
    """What every sequence of a ShadowKV engine holds on the GPU, long or short: a slot and a dense reservation for
    min_context tokens (plan_pools)."""
    block_size = block_size or default_block_size(g.kv_cache_dtype)
    return slot_bytes(g, cfg) + math.ceil(cfg.min_context / block_size) * dense_block_bytes(g, block_size)


def engine_seq_bytes(g: Geometry, cfg: ShadowKVConfig | None, context: int, max_new_tokens: int,
                     block_size: int | None = None) -> SeqBytes:
    """What one more sequence costs an engine sized for it: in a ShadowKV engine each of max_num_seqs holds a slot
    and a dense reservation for a short sequence (plan_pools), plus pages when it is long."""
    if cfg is None:
        return seq_bytes(g, None, context, max_new_tokens, block_size)
    reserved = reserved_seq_bytes(g, cfg, block_size)
    if cfg.stays_dense(context, max_new_tokens):
        return SeqBytes(reserved, 0)
    pages = shadow_seq_bytes(g, cfg, context + max_new_tokens)
    return SeqBytes(reserved + pages.gpu, pages.host)


def capacity(g: Geometry, cfg: ShadowKVConfig | None, gpu_bytes: int, host_bytes: int, contexts: list[int],
             max_new_tokens: int, chunk_tokens: int = 8192, block_size: int | None = None) -> int:
    """How many sequences of the given context mix (repeated in turn) a replica holds in its GPU and host bytes,
    after the fixed cost of weights and the largest prefill."""
    free_gpu = gpu_bytes - fixed_gpu_bytes(g, cfg, max(contexts), chunk_tokens, max_num_seqs=0)
    free_host = host_bytes
    batch = pool_pages = 0
    while True:
        context = contexts[batch % len(contexts)]
        need = engine_seq_bytes(g, cfg, context, max_new_tokens, block_size)
        gpu = need.gpu + decode_workspace_bytes(g, 1)
        if cfg is not None and cfg.device_value_share and not cfg.stays_dense(context, max_new_tokens):
            # the pool's device value pages are its share of all its pages (plan_pools), rounded down once: a
            # little more than the sum of every sequence's share, each rounded down
            pages = shadow_pages(cfg, context + max_new_tokens)
            extra = device_value_pages(cfg, pool_pages + pages) - device_value_pages(cfg, pool_pages)
            gpu += (extra - device_value_pages(cfg, pages)) * host_page_bytes(g, cfg)
            pool_pages += pages
        if gpu > free_gpu or need.host > free_host:
            return batch
        free_gpu -= gpu
        free_host, batch = free_host - need.host, batch + 1


def best_device_value_share(cfg: ShadowKVConfig, held: Callable[[ShadowKVConfig], int], steps: int = 64) -> float:
    """The device_value_share (a multiple of 1/steps, below 1: a replica keeps a host shard) under which `held(cfg)`,
    the sequences a replica holds, is largest; of those shares, the largest: the device memory that batch leaves over
    then holds values (fewer PCIe bytes) instead of lying idle. held: e.g. capacity at one context (whole replica
    bytes), or Pools.num_sequences of the pools planned for a share (an engine's cache budget)."""
    counts = [held(dataclasses.replace(cfg, device_value_share=i / steps)) for i in range(steps)]
    return max(i for i, n in enumerate(counts) if n == max(counts)) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Dense vs ShadowKV batch capacity of one replica")
    parser.add_argument("--model", default="llama-3.1-8b", help=f"config.json, its folder, or {list(PRESETS)}")
    parser.add_argument("--context", type=int, nargs="+", default=[122880])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    parser.add_argument("--host-gib", type=float, default=512.0)
    parser.add_argument("--rank", type=int, default=160)
    parser.add_argument("--sparse-budget", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--outlier-chunks", type=int, default=48)
    parser.add_argument("--value-format", choices=VALUE_FORMATS, default="model",
                        help="host values: model dtype or fp8")
    parser.add_argument("--landmark-format", choices=VALUE_FORMATS, default="model",
                        help="landmarks: model dtype or fp8")
    parser.add_argument("--landmark-kind", choices=LANDMARK_KINDS, default=ShadowKVConfig.landmark_kind,
                        help="bounds (2·d numbers a chunk and KV head) or the paper's mean (d)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="dense cache: model dtype or fp8")
    parser.add_argument("--device-value-share", default="0",
                        help="share of values in device memory, or 'auto': the best for each context")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="ranks per replica: one rank's GPU and host bytes (--rank stays the replica's, over all "
                             "KV heads; each rank factorises its own at rank/N)")
    args = parser.parse_args(argv)
    tp = args.tensor_parallel
    g = dataclasses.replace(load_geometry(args.model), kv_cache_dtype=args.kv_cache_dtype).rank_share(tp)
    share = args.device_value_share if args.device_value_share == AUTO else float(args.device_value_share)
    if args.rank % tp:
        raise ValueError(f"--rank {args.rank} must be a multiple of --tensor-parallel {tp}")
    cfg = ShadowKVConfig(rank=args.rank // tp, sparse_budget=args.sparse_budget, chunk_size=args.chunk_size,
                         outlier_chunks=args.outlier_chunks, value_format=args.value_format, device_value_share=share,
                         landmark_format=args.landmark_format, landmark_kind=args.landmark_kind)
    cfg.check_model(g.num_kv_heads, g.head_dim, g.num_layers)
    gpu, host = int(args.gpu_gib * GIB), int(args.host_gib * GIB)
    print(f"model {args.model}: weights {g.weight_bytes / GIB:.1f} GiB; GPU {args.gpu_gib} GiB, "
          f"host {args.host_gib} GiB" + (f" (one of {tp} tensor-parallel ranks)" if tp > 1 else ""))
    print(f"{'context':>9} {'dense':>6} {'shadowkv':>9} {'ratio':>6} {'share':>6} {'GPU/seq GiB':>12} "
          f"{'host/seq GiB':>13}")
    for context in args.context:
        def held(c: ShadowKVConfig, context=context) -> int:
            return capacity(g, c, gpu, host, [context], args.max_new_tokens)

        at = cfg if share != AUTO else dataclasses.replace(cfg, device_value_share=best_device_value_share(cfg, held))
        dense, shadow = capacity(g, None, gpu, host, [context], args.max_new_tokens), held(at)
        per = seq_bytes(g, at, context, args.max_new_tokens)
        ratio = f"{shadow / dense:.1f}x" if dense else "inf"
        print(f"{context:>9} {dense:>6} {shadow:>9} {ratio:>6} {at.device_value_share:>6.3f} {per.gpu / GIB:>12.2f} "
              f"{per.host / GIB:>13.2f}")


if __name__ == "__main__":
    main()
