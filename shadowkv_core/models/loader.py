"""Load a Hugging Face checkpoint (config.json + safetensors) into the decoder, shard by shard, tensor by tensor,
straight onto the target device and dtype. Separate q/k/v and gate/up projections are copied into their rows of the
fused modules; checkpoints that already fuse them (Phi-3, GLM) load as they are. Never runs remote code."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..parallel import TensorParallel
from .decoder import Decoder
from .spec import ModelSpec

_HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
              "tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt", "*.tiktoken", "chat_template*"]
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved


LOAD_FORMATS = ("auto", "dummy")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_model(model: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
               prefill_chunk_tokens: int = 8192, load_format: str = "auto",
               tp: TensorParallel | None = None) -> tuple[Decoder, ModelSpec]:
    """model: a local directory or a hub id. dtype None: the checkpoint's torch_dtype (float32 if it names none).
    load_format "dummy": random weights of the real architecture (speed runs; only config.json is read).
    tp: this rank's shard of a tensor-parallel replica (parallel.py); the spec returned is the whole model's."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = resolve_model_path(model)
    spec = ModelSpec.from_hf_config(read_config(path))
    if spec.sliding_window is not None and spec.sliding_window < spec.max_position_embeddings:
        raise ValueError(f"{path}: sliding_window={spec.sliding_window} (< max_position_embeddings="
                         f"{spec.max_position_embeddings}) is not supported: this engine attends to the whole context")
    decoder = Decoder(spec, dtype or spec.torch_dtype or torch.float32, device, prefill_chunk_tokens, tp)
    if load_format == "dummy":
        init_random_weights(decoder)
    else:
        load_weights(decoder, weight_files(path))
    return decoder.eval(), spec


def init_random_weights(decoder: Decoder, seed: int = 0) -> None:
    """Norm weights 1, biases 0, everything else N(0, 0.02): activations stay in range through many layers. Each
    parameter draws from its own seed, so the replicated ones are equal on every tensor-parallel rank."""
    device = next(decoder.parameters()).device
    for index, (name, param) in enumerate(decoder.named_parameters()):
        if "norm" in name:
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=torch.Generator(device=device).manual_seed(seed + index))


def load_tokenizer(model: str):
    """The checkpoint's tokenizer, or None for a local directory that ships none (token ids only)."""
    path = resolve_model_path(model)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # transformers only at this edge
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


def resolve_model_path(model: str) -> Path:
    """A local directory as is (never the network); otherwise a hub id, downloaded (config, weights, tokenizer)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model {model!r} is not a directory with config.json and *.safetensors")
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(repo_id=model, allow_patterns=_HUB_FILES))


def read_config(path: Path) -> dict:
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    return json.loads(config.read_text())


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: weight files listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files (only safetensors checkpoints are loaded)")
    return files


def load_weights(decoder: Decoder, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its parameter (or its rows of a fused one); every row must be filled. A
    tensor-parallel rank reads only its own slices of the split projections (safetensors' get_slice)."""
    params = dict(decoder.named_parameters())
    rows_loaded = dict.fromkeys(params, 0)
    device = str(next(iter(params.values())).device)
    rank, size = (0, 1) if decoder.tp is None else (decoder.tp.rank, decoder.tp.size)
    for file in files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                target = _target(decoder.spec, name)
                if target is None:
                    continue
                param_name, start, num_rows = target
                if param_name not in params:
                    raise ValueError(f"{file.name}: tensor {name!r} has no place in a {decoder.spec.architecture}")
                param = params[param_name]
                tensor = f.get_slice(name)
                shape, expected = tuple(tensor.get_shape()), _full_shape(decoder.spec, param_name, param, num_rows,
                                                                         size)
                if shape != expected:
                    raise ValueError(f"{file.name}: tensor {name!r} has shape {shape}, expected {expected}")
                for src, dst in _pieces(decoder.spec, param_name, start, shape, rank, size):
                    rows = param[dst] if dst is not None else param
                    rows.copy_(tensor[src])
                    rows_loaded[param_name] += rows.shape[0]
    missing = [name for name, rows in rows_loaded.items() if rows != params[name].shape[0]]
    if missing:
        raise ValueError(f"checkpoint lacks weights for {len(missing)} parameters, e.g. {', '.join(missing[:4])}")


def _pieces(spec: ModelSpec, param_name: str, start: int, shape: tuple[int, ...], rank: int,
            size: int) -> list[tuple[tuple[slice, ...], slice | None]]:
    """(slice of the checkpoint tensor, rows of the rank's parameter or None for all of it) for each part of one
    checkpoint tensor that rank `rank` of `size` holds. The tensor covers the full parameter's rows [start, start +
    shape[0]). Column-parallel parameters (fused qkv, gate/up) hold the rank's share of every section's rows;
    row-parallel ones (o_proj, down_proj weights) the rank's share of the input columns; the rest is replicated."""
    sections = _column_sections(spec, param_name)
    if sections is None:
        if _row_parallel(param_name) and size > 1:
            part = shape[1] // size
            return [((slice(None), slice(rank * part, (rank + 1) * part)), None)]
        return [((slice(None),), None)]
    pieces, full, local = [], 0, 0
    for section in sections:
        part = section // size
        first = full + rank * part
        if start <= first and first + part <= start + shape[0]:
            pieces.append(((slice(first - start, first - start + part),), slice(local, local + part)))
        full, local = full + section, local + part
    return pieces


def _column_sections(spec: ModelSpec, param_name: str) -> list[int] | None:
    """Rows of each section of a fused column-parallel parameter in the full model; None for other parameters."""
    if param_name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        kv = spec.num_kv_heads * spec.head_dim
        return [spec.num_heads * spec.head_dim, kv, kv]
    if param_name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
        return [spec.intermediate_size] * 2
    return None


def _row_parallel(param_name: str) -> bool:
    return param_name.endswith(("o_proj.weight", "down_proj.weight"))


def _full_shape(spec: ModelSpec, param_name: str, param: torch.Tensor, num_rows: int | None,
                size: int) -> tuple[int, ...]:
    """The shape a checkpoint tensor loaded into `param` (a rank's shard, or its rows `num_rows` of a fused
    parameter in the full model) has in the full model."""
    sections = _column_sections(spec, param_name)
    rows = num_rows or (sum(sections) if sections else param.shape[0])
    if _row_parallel(param_name):
        return rows, param.shape[1] * size
    return (rows, *param.shape[1:])


def _target(spec: ModelSpec, name: str) -> tuple[str, int, int | None] | None:
    """Checkpoint tensor name -> (decoder parameter, first row, rows or None for all), None for tensors the decoder
    does not use."""
    if name.endswith(_IGNORED_SUFFIXES) or (spec.tie_word_embeddings and name == "lm_head.weight"):
        return None
    name = name.removeprefix("model.")
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    inter = spec.intermediate_size
    fused = {"q_proj": ("qkv_proj", 0, q_size), "k_proj": ("qkv_proj", q_size, kv_size),
             "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
             "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter)}
    parts = name.split(".")  # e.g. layers.3.self_attn.q_proj.weight
    if len(parts) >= 2 and parts[-2] in fused:
        module, start, num_rows = fused[parts[-2]]
        return ".".join(parts[:-2] + [module, parts[-1]]), start, num_rows
    return name, 0, None
