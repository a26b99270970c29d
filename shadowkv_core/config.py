"""Configuration: small frozen dataclasses validated on construction, plus named presets."""
from __future__ import annotations

from dataclasses import dataclass

import torch

VALUE_FORMATS = ("model", "fp8")
LANDMARK_KINDS = ("bounds", "mean")  # ShadowKVConfig.landmark_kind
PREFILL_ATTENTIONS = ("sdpa", "sdpa_split", "cudnn", "triton")  # attention.chunk_attention's implementations
KV_CACHE_DTYPES = ("auto", "fp8")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
AUTO = "auto"  # an option left to what the device and the memory model make best; a value overrides it


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _require_auto_or(name: str, value, kinds: tuple[type, ...], what: str, check=lambda v: True) -> None:
    typed = isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))
    _require(value == AUTO or (typed and check(value)), f"{name} must be 'auto' or {what}, got {value!r}")


def default_block_size(kv_cache_dtype: str) -> int:
    """Tokens per dense cache block when EngineConfig.block_size is auto: 64 for an fp8 cache (its decode kernel
    reads a block's values of one dimension as a whole 64-byte run: docs/benchmarks.md), 16 otherwise."""
    return 64 if kv_cache_dtype == "fp8" else 16


def choose(value, default):
    """An option's value: `default` (what this device does best) where it reads "auto", else the value given."""
    return default if value == AUTO else value


@dataclass(frozen=True)
class ShadowKVConfig:
    """How a long sequence's KV cache is kept "in shadows" (glossary in DESIGN.md).

    rank: kept rank of the pre-RoPE key factorisation over all KV heads of a layer concatenated.
    layer_ranks: each layer's own rank instead (one per layer, their mean `rank`, so the memory is rank's): a layer
        whose keys need more rank takes it from one whose keys need less (shadowkv.ranks calibrates them from the
        model's keys on a text). None: every layer at `rank`.
    chunk_size: tokens per chunk. sparse_budget: tokens selected per KV head per decode step.
    outlier_chunks / local_chunks: chunks kept exact on the GPU. min_context: a sequence whose prompt and generation
    fit in this many tokens stays dense (see stays_dense).
    decode_window: generated tokens kept exact; when full, its older half is folded into the shadow.
    page_chunks: chunks per page of U rows, landmarks and host values (the unit of allocation).
    value_format: how values are kept on the host: "model" (the model's dtype) or "fp8" (e4m3 with one fp32 scale
        per chunk and KV head: about half the host memory and PCIe bytes, dequantised as they are fetched).
    landmark_format: how landmarks are kept on the GPU: "model" (the model's dtype) or "fp8" (e4m3 with one fp32
        scale per chunk and KV head): half the bytes the per-step scoring reads, and half their GPU memory; the
        selection then ranks chunks by the quantised landmarks.
    landmark_kind: what a chunk's landmark keeps of its post-RoPE keys: "bounds" (their per-dimension centre and
        half-range, 2·d numbers per KV head; a chunk scores q·centre + |q|·half-range, the largest logit any key
        inside the bounds could reach, never below its best key's, so a key that stands out in a few dimensions is
        not averaged away) or "mean" (the paper's: their mean, d numbers, half the landmark bytes and scoring reads;
        a chunk scores q·mean). Outliers are the chunks worst approximated by their mean either way.
    landmark_rebuild: rebuilt keys also meet their chunk's landmark, which holds the exact keys' summary: for bounds,
        each rebuilt key is clamped into its chunk's bounds (never farther from the exact key, which lies inside
        them); for mean landmarks, each rebuilt chunk is shifted so that its mean is the landmark's. Part of the
        low-rank error is taken out at no extra memory, for a slightly slower decode step (docs/accuracy.md, "Keys
        onto their landmarks").
    rescore: 0 lets the landmarks choose each step's chunks; c >= 2 takes their c·k best chunks per KV head as
        candidates, rebuilds the candidates' keys and keeps the k whose largest logit is highest (softmaxed per query
        head over the candidates, the max over the GQA group, as landmarks are): a landmark bounds a chunk's logits
        loosely, its rebuilt keys give them. Nothing kept (the candidates' keys are transient); each step rebuilds
        c·k chunks a head (docs/accuracy.md, "Rescoring the landmarks' candidates").
    device_value_share: share of each sequence's value pages kept in device memory instead of the host store (its
        first pages, rounded down to whole pages): a hit there costs no PCIe. "auto": the share under which the
        replica's pools hold the most sequences of max_model_len tokens (memory_model.best_device_value_share), on
        CUDA; 0 elsewhere. 0 keeps every value on the host, as the paper. Results are the same wherever a value lies.
    """

    rank: int = 160
    chunk_size: int = 8
    sparse_budget: int = 2048
    outlier_chunks: int = 48
    local_chunks: int = 4
    min_context: int = 4096
    decode_window: int = 512
    page_chunks: int = 16
    value_format: str = "model"
    landmark_format: str = "model"
    landmark_kind: str = "bounds"
    device_value_share: float | str = AUTO
    layer_ranks: tuple[int, ...] | None = None
    landmark_rebuild: bool = False
    rescore: int = 0

    def __post_init__(self):
        _require(self.rank >= 1, f"rank must be >= 1, got {self.rank}")
        _require(isinstance(self.rescore, int) and not isinstance(self.rescore, bool)
                 and (self.rescore == 0 or self.rescore >= 2),
                 f"rescore must be 0 (the landmarks choose) or a candidate factor >= 2, got {self.rescore!r}")
        if self.layer_ranks is not None:
            _require(isinstance(self.layer_ranks, (list, tuple)) and len(self.layer_ranks) > 0
                     and all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in self.layer_ranks),
                     f"layer_ranks must be a list of ranks >= 1, one per layer, got {self.layer_ranks!r}")
            object.__setattr__(self, "layer_ranks", tuple(self.layer_ranks))
            _require(sum(self.layer_ranks) == len(self.layer_ranks) * self.rank,
                     f"layer_ranks {list(self.layer_ranks)} must average to rank ({self.rank}): they share its "
                     f"memory, {len(self.layer_ranks) * self.rank} in all, not {sum(self.layer_ranks)}")
        _require(self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")
        _require(self.sparse_budget >= self.chunk_size,
                 f"sparse_budget ({self.sparse_budget}) must be at least one chunk ({self.chunk_size} tokens)")
        _require(self.sparse_budget % self.chunk_size == 0,
                 f"sparse_budget ({self.sparse_budget}) must be a multiple of chunk_size ({self.chunk_size})")
        _require(self.outlier_chunks >= 0, f"outlier_chunks must be >= 0, got {self.outlier_chunks}")
        _require(self.local_chunks >= 1, f"local_chunks must be >= 1, got {self.local_chunks}")
        _require(self.page_chunks >= 1, f"page_chunks must be >= 1, got {self.page_chunks}")
        _require(self.min_context >= 0, f"min_context must be >= 0, got {self.min_context}")
        _require_auto_or("device_value_share", self.device_value_share, (int, float), "a number in [0, 1]",
                         lambda v: 0.0 <= v <= 1.0)
        _require(self.landmark_format in VALUE_FORMATS,
                 f"landmark_format must be one of {VALUE_FORMATS}, got {self.landmark_format!r}")
        _require(self.landmark_kind in LANDMARK_KINDS,
                 f"landmark_kind must be one of {LANDMARK_KINDS}, got {self.landmark_kind!r}")
        _require(self.value_format in VALUE_FORMATS,
                 f"value_format must be one of {VALUE_FORMATS}, got {self.value_format!r}")
        _require(self.decode_window >= 2 * self.chunk_size and self.decode_window % (2 * self.chunk_size) == 0,
                 f"decode_window ({self.decode_window}) must be a positive multiple of 2*chunk_size "
                 f"({2 * self.chunk_size}): its older half is folded into the shadow chunk by chunk")

    def stays_dense(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Short sequences keep a dense cache: ShadowKV pays off on long contexts only. Decided on the whole length,
        so a short prompt with a long generation is kept in shadows from the start (its window folds as it grows)."""
        return prompt_len + max_new_tokens <= self.min_context

    @property
    def budget_chunks(self) -> int:
        return self.sparse_budget // self.chunk_size

    @property
    def landmark_width(self) -> int:
        """Numbers a landmark keeps per KV head, in head dims: 1 (mean) or 2 (bounds)."""
        return 2 if self.landmark_kind == "bounds" else 1

    def layer_rank(self, layer: int) -> int:
        """The rank a layer's keys are kept at."""
        return self.rank if self.layer_ranks is None else self.layer_ranks[layer]

    def check_model(self, num_kv_heads: int, head_dim: int, num_layers: int) -> None:
        """Raise if this config cannot apply to a model of this geometry."""
        width = num_kv_heads * head_dim
        if self.layer_ranks is not None:
            _require(len(self.layer_ranks) == num_layers,
                     f"layer_ranks has {len(self.layer_ranks)} ranks; this model has {num_layers} layers")
        top = max(self.layer_ranks or (self.rank,))
        _require(top <= width,
                 f"{'a layer rank' if self.layer_ranks else 'rank'} ({top}) is larger than kv_heads*head_dim "
                 f"({num_kv_heads}*{head_dim}={width}) of this model: the pre-RoPE keys have no more than that many "
                 "dimensions")


@dataclass(frozen=True)
class EngineConfig:
    """What one engine (one replica, one device) serves and how much memory it may use.

    model: local directory with config.json + safetensors, or a hub id (needs a network).
    dtype: "auto" (the checkpoint's torch_dtype; float32 on CPU), "float32", "float16" or "bfloat16".
    max_model_len: longest prompt + generation; None takes the model's max_position_embeddings.
    gpu_cache_gib / host_cache_gib: memory for the KV caches on the device and for pinned host values;
        None derives them (device free memory x gpu_memory_utilization; 1 GiB each on CPU).
    prefill_chunk_tokens: tokens computed at once inside a layer during prefill (bounds activation memory).
    max_prefill_tokens: prompt tokens admitted into one prefill job (one longer prompt still runs alone).
    prefill_step_tflop: the prefill work an engine step may run beside its decode step, in TFLOP estimated from the
        geometry (models/prefill_cost.py: 2 per weight per token, attention per query-key pair; in a tensor-parallel
        group each rank's, on its share of the geometry): a long prompt's
        prefill advances by slices of a layer (projection rows, attention query chunks, MLP rows) sized to it, so
        that the running decodes' inter-token latency stays near a step's; None: no limit (a whole prefill per
        step). With nothing decoding a prefill always runs whole. The default is about 20 ms at a few hundred
        TFLOP/s.
    prefill_step_ms: None keeps each step's prefill at prefill_step_tflop. A number (milliseconds) raises the budget
        above it while steps that hold a decode and prefill slices take less than this (engine/pacing.py): the
        decodes' inter-token latency settles near it, and a long prefill beside short decode steps advances at
        close to its speed alone instead of by a fixed share; prefill_step_tflop stays the least a step runs.
    prefill_attention: how a prefill chunk attends to the keys up to its end (attention.chunk_attention): "auto"
        (the default: "triton" for a chunk after a prefix on CUDA in half precision, else "sdpa"), "sdpa" (SDPA: a
        whole prompt by its flash kernel, a chunk after a prefix with a causal_lower_right bias), "sdpa_split" (the
        keys before the chunk and its causal diagonal, merged by log-sum-exp, by SDPA's flash kernel), "cudnn" (the
        same split by its cuDNN kernel; CUDA only) or "triton" (kernels/prefill_attention.py, head dims 64 and 128).
        Equal up to rounding.
    max_waiting: requests queued beyond the running batch; more are refused (no unbounded queue).
    shadowkv: None keeps every sequence dense (full attention).
    load_format: "auto" reads the checkpoint's weights; "dummy" draws random ones (speed runs at full size).
    kv_cache_dtype: how the dense cache keeps keys and values: "auto" (the model's dtype) or "fp8" (e4m3 with one fp32
        scale per token and KV head: about half the bytes of a block, so about twice the dense sequences).
    block_size: tokens per dense cache block (and per prefix-cache entry); auto: 64 with an fp8 cache, 16 otherwise
        (default_block_size).
    tensor_parallel_size: ranks (GPUs of one host) a replica's model is split over (parallel.py); each rank holds its
        share of the heads and its own cache of them, so the memory model counts one rank's bytes.
    enable_prefix_caching: keep the full KV blocks of finished prefills and ended sequences, indexed by their tokens,
        so that a prompt starting with them prefills only the rest (dense sequences; cache/prefix.py). Cached blocks no
        sequence holds count as free: an allocation evicts them, least recently used first.
    The options below change speed, never results; each reads "auto" (what the device does best) unless a test or
    a benchmark overrides it.
    use_kernels: decode on the Triton kernels (dense paged and ShadowKV); auto: on CUDA, for heads the kernels take
        (elsewhere the PyTorch reference).
    pipeline_decode: decode a batch of `pipeline_min_batch` or more in halves pipelined layer by layer
        (Decoder.forward_halves), so that one half's host value fetch runs under the other half's compute; ShadowKV
        only. It reads the weights twice per step, so it pays once the fetch is long enough to hide. auto: on CUDA
        with tensor_parallel_size 1 (elsewhere there are no side streams for a half's fetch to run on; a rank of a
        group fetches for its share of the KV heads only, too short to hide a second read of its weights).
    pipeline_min_batch: auto takes the measured break-even batch (docs/benchmarks.md): 8, or 16 with fp8 values.
    cuda_graphs: replay decode steps from CUDA graphs captured once per batch shape (engine/cuda_graphs.py): the same
        tokens as eager, without the per-kernel launch cost. auto: on CUDA.
    async_decode: launch each decode step before reading the one before it back (LLMEngine.step), so that the host's
        work of a step (bookkeeping, graph launch, read back) runs while the device computes the step before it; the
        same tokens (sampling runs on the device: engine/sampler.py), each reported one step later. auto: on CUDA
        (elsewhere the host computes the step itself).
    overlap_prefill: run prefill slices on a low-priority stream of their own, beside the step's decode on a
        high-priority one (engine/streams.py): the slices may run while the decode waits on its value fetch,
        and the decode's blocks go first where both are ready; the same tokens. auto: on CUDA with
        tensor_parallel_size 1 (a rank's two streams would issue their collectives side by side).
    warm_up: when a replica's engine starts (start_engine), run synthetic requests through every path its first
        requests would otherwise compile and capture on arrival (engine/warm_up.py), then clear the prefix cache and
        reset the counters. auto: on CUDA (on the CPU nothing compiles).
    """

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    max_num_seqs: int = 8
    max_model_len: int | None = None
    shadowkv: ShadowKVConfig | None = None
    gpu_cache_gib: float | None = None
    host_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    prefill_chunk_tokens: int = 8192
    max_prefill_tokens: int = 16384
    prefill_step_tflop: float | None = 6.0
    prefill_step_ms: float | None = None
    prefill_attention: str = AUTO
    max_waiting: int = 256
    block_size: int | str = AUTO
    seed: int = 0
    load_format: str = "auto"
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    use_kernels: bool | str = AUTO
    pipeline_decode: bool | str = AUTO
    pipeline_min_batch: int | str = AUTO
    cuda_graphs: bool | str = AUTO
    async_decode: bool | str = AUTO
    overlap_prefill: bool | str = AUTO
    warm_up: bool | str = AUTO

    def __post_init__(self):
        _require(bool(self.model), "model must name a local directory or a hub id")
        _require(self.dtype == "auto" or self.dtype in _DTYPES,
                 f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_model_len is None or self.max_model_len >= 2,
                 f"max_model_len must be >= 2, got {self.max_model_len}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.prefill_chunk_tokens >= 1, f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        _require(self.max_prefill_tokens >= 1, f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        _require(self.prefill_step_tflop is None or (isinstance(self.prefill_step_tflop, (int, float)) and not
                                                     isinstance(self.prefill_step_tflop, bool)
                                                     and self.prefill_step_tflop > 0),
                 f"prefill_step_tflop must be > 0 or None (no limit), got {self.prefill_step_tflop!r}")
        _require(self.prefill_step_ms is None or (isinstance(self.prefill_step_ms, (int, float))
                                                  and not isinstance(self.prefill_step_ms, bool)
                                                  and self.prefill_step_ms > 0),
                 f"prefill_step_ms must be > 0 or None (a fixed budget), got {self.prefill_step_ms!r}")
        _require(self.prefill_step_ms is None or self.prefill_step_tflop is not None,
                 "prefill_step_ms paces a step's prefill budget: it needs prefill_step_tflop (the least a step runs), "
                 "got None (no limit)")
        _require(self.prefill_attention in (AUTO, *PREFILL_ATTENTIONS),
                 f"prefill_attention must be 'auto' or one of {PREFILL_ATTENTIONS}, got {self.prefill_attention!r}")
        _require(self.max_waiting >= 0, f"max_waiting must be >= 0, got {self.max_waiting}")
        _require(self.load_format in ("auto", "dummy"),
                 f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require_auto_or("block_size", self.block_size, (int,), "an integer >= 1", lambda v: v >= 1)
        if self.block_size == AUTO:
            object.__setattr__(self, "block_size", default_block_size(self.kv_cache_dtype))
        _require(self.kv_cache_dtype != "fp8" or self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a power of two with kv_cache_dtype fp8 (its decode kernel steps over whole "
                 f"blocks, a power of two of keys at a time), got {self.block_size}")
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        _require(isinstance(self.enable_prefix_caching, bool),
                 f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        _require_auto_or("pipeline_min_batch", self.pipeline_min_batch, (int,), "an integer >= 2 (two halves)",
                         lambda v: v >= 2)
        for name in ("use_kernels", "pipeline_decode", "cuda_graphs", "async_decode", "overlap_prefill", "warm_up"):
            _require_auto_or(name, getattr(self, name), (bool,), "true or false")
        for name in ("gpu_cache_gib", "host_cache_gib"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"{name} must be > 0, got {value}")
        device = torch.device(self.device)  # raises a RuntimeError naming a malformed device string
        _require(self.prefill_attention != "cudnn" or device.type == "cuda",
                 f"prefill_attention 'cudnn' needs a CUDA device, got {self.device!r}")
        _require(self.overlap_prefill is not True or (device.type == "cuda" and self.tensor_parallel_size == 1),
                 f"overlap_prefill needs a CUDA device and tensor_parallel_size 1, got {self.device!r} and "
                 f"{self.tensor_parallel_size}")

    def requested_dtype(self) -> torch.dtype | None:
        """The weights' dtype; None means the checkpoint's own (float32 on CPU, where half precision is slow)."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        return torch.float32 if torch.device(self.device).type == "cpu" else None


PRESETS = {
    "paper": ShadowKVConfig(),  # Llama-3.1-8B at 1.56 % of 128K, the paper's sizes (its landmarks: landmark_kind)
    "small": ShadowKVConfig(rank=40, chunk_size=8, sparse_budget=256, outlier_chunks=8, local_chunks=4,
                            min_context=1024, decode_window=128),
}


def shadowkv_from(spec: str | dict | None) -> ShadowKVConfig | None:
    """A Serve config's `shadowkv`: a preset name (PRESETS), ShadowKVConfig fields, or None (dense attention)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"shadowkv: unknown preset {spec!r}; presets are {sorted(PRESETS)}")
        return PRESETS[spec]
    return ShadowKVConfig(**spec)


def engine_fields(app_args: dict, model: str) -> dict:
    """The EngineConfig fields an engine replica gets from a Serve application's args (configs/*.yaml): device, dtype,
    max_num_seqs, max_model_len, tensor_parallel_size, shadowkv, and the `engine` mapping's own fields; `model` as
    resolved."""
    fields = {key: app_args[key] for key in ("device", "dtype", "max_num_seqs", "max_model_len", "tensor_parallel_size")
              if key in app_args}
    return {"model": model, **fields, "shadowkv": shadowkv_from(app_args.get("shadowkv")), **app_args.get("engine", {})}
