"""The application builder Serve configs point at: `import_path: serve_app.app:build_app`, with `args` from the YAML.

    applications:
      - name: shadowkv
        import_path: serve_app.app:build_app
        args: {model: models/shadowkv-small, device: cpu, max_num_seqs: 4, num_gpus: 0}
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray.serve import Application

from serve_app.engine_replica import EngineReplica
from serve_app.ingress import Ingress
from serve_app.limits import RequestLimits
from shadowkv_core.config import engine_fields

SHIPPED_CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
POLICY = "serve_app.autoscaling:memory_demand_policy"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]$")
GPU_WAIT_ENV = "SHADOWKV_GPU_WAIT_S"  # clusters whose GPU nodes start on demand set it longer
GPU_WAIT_S = 20.0


class AppArgs(BaseModel):
    """Everything the YAML's `args` may set; unknown keys are an error, so a typo fails at start-up."""

    model_config = ConfigDict(extra="forbid")

    model: str
    served_model_name: str | None = None
    config_dir: str = str(SHIPPED_CONFIGS_DIR)  # relative paths resolve here: the shipped configs' folder unless set
    device: str = "cpu"
    dtype: str = "auto"
    max_num_seqs: int = Field(default=8, ge=1)
    max_model_len: int | None = None
    shadowkv: str | dict[str, Any] | None = None  # a preset name ("paper", "small") or ShadowKVConfig fields
    engine: dict[str, Any] = Field(default_factory=dict)  # any other EngineConfig fields
    num_gpus: float = Field(default=0, ge=0)  # per tensor-parallel rank
    tensor_parallel_size: int = Field(default=1, ge=1)  # ranks (GPUs of one host) per engine replica
    num_cpus: float = Field(default=1, ge=0)
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=1, ge=1)
    autoscaling: dict[str, Any] = Field(default_factory=dict)  # other AutoscalingConfig fields: upscale_delay_s, ...
    max_waiting: int = Field(default=64, ge=0)  # requests queued for room in the ingress, beyond that 429
    max_wait_s: float = Field(default=300.0, ge=0)  # bound on a queued request's predicted and actual wait for room
    default_max_tokens: int = Field(default=256, ge=1)
    max_prompt_tokens: int | None = Field(default=None, ge=1)  # beyond the context length's own bound
    max_tokens_limit: int | None = Field(default=None, ge=1)  # the largest max_tokens a request may ask for
    request_timeout_s: float = Field(default=600.0, gt=0)  # then the request is aborted: 408
    max_body_bytes: int = Field(default=8 << 20, ge=1024)  # larger request bodies: 413
    metrics_need_api_key: bool = False  # with API keys set, /metrics stays open to scrapers unless this is on

    @field_validator("autoscaling")
    @classmethod
    def _bounds_and_policy_are_own_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(value) & {"min_replicas", "max_replicas", "policy"})
        if taken:
            raise ValueError(f"set {taken} through min_replicas / max_replicas; the policy is fixed")
        return value


def resolve_model(args: AppArgs) -> str:
    """A local model directory as an absolute path (replicas may run elsewhere in the tree), a relative one taken
    from the config's folder, not the working directory; or a hub id."""
    path = Path(args.model).expanduser()
    if path.is_absolute() or HUB_ID.fullmatch(args.model) and not (Path(args.config_dir) / path).exists():
        return validated_model(path, args)
    path = Path(args.config_dir) / path
    if not path.exists():  # only an absolute path may name a folder mounted where the replicas run
        raise ValueError(f"model: {args.model!r} resolves to {path}, which does not exist")
    return validated_model(path, args)


def weights_source(args: AppArgs, model: str) -> dict[str, Any]:
    """Where the served weights come from, as /v1/models reports it: the checkpoint path or hub id, and whether
    they are random (load_format "dummy")."""
    return {"root": model, "random_weights": args.engine.get("load_format") == "dummy"}


def validated_model(path: Path, args: AppArgs) -> str:
    """At build time: an existing directory must be a checkpoint (config.json, and weights unless load_format is
    "dummy"); a missing one must be absolute (mounted where the replicas run; the loader checks it again there) and
    free of "..", or else a well-formed hub id. Anything else fails before a replica starts."""
    if path.is_dir():
        weights = args.engine.get("load_format") == "dummy" or any(path.glob("*.safetensors"))
        if not (path / "config.json").is_file() or not weights:
            raise ValueError(f"model: {path} is not a checkpoint directory (config.json and *.safetensors)")
        return str(path.resolve())
    if ".." in path.parts or path.exists() or not (path.is_absolute() or HUB_ID.fullmatch(args.model)):
        raise ValueError(f"model: {args.model!r} ({path}) is neither a checkpoint directory nor a hub id (org/name)")
    return args.model


def require_gpus(args: AppArgs, wait_s: float, poll_s: float = 1.0) -> None:
    """A replica that asks for GPUs on a Ray cluster without them would wait forever to be placed: fail the start-up
    instead, once `wait_s` has passed without the cluster showing the GPUs one replica needs."""
    deadline = time.monotonic() + wait_s
    need = replica_gpus(args)
    while (have := ray.cluster_resources().get("GPU", 0)) < need:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"no GPU: each engine replica needs {need:g} (num_gpus x tensor_parallel_size, device "
                               f"{args.device!r}) "
                               f"but this Ray cluster has {have:g} after {wait_s:g} s; serve configs/local.yaml on a "
                               f"machine without a GPU, or set {GPU_WAIT_ENV} where GPU nodes start on demand")
        time.sleep(poll_s)


def engine_config(args: AppArgs, model: str) -> dict[str, Any]:
    return engine_fields(args.model_dump(), model)


def replica_gpus(args: AppArgs) -> float:
    """GPUs one replica asks Ray for: one actor holds all its ranks' GPUs, so they are GPUs of one host; the
    replica's N-1 worker processes inherit its CUDA_VISIBLE_DEVICES (engine/tensor_parallel.py)."""
    return args.num_gpus * args.tensor_parallel_size


def replica_options(args: AppArgs) -> dict[str, Any]:
    options: dict[str, Any] = {"ray_actor_options": {"num_gpus": replica_gpus(args), "num_cpus": args.num_cpus},
                               "max_ongoing_requests": 2 * args.max_num_seqs,
                               "max_queued_requests": 4 * args.max_num_seqs}  # at the ingress's handle
    if args.max_replicas > args.min_replicas:
        options["autoscaling_config"] = {**args.autoscaling, "min_replicas": args.min_replicas,
                                         "max_replicas": args.max_replicas, "policy": {"policy_function": POLICY}}
    else:
        options["num_replicas"] = args.min_replicas
    return options


def build_app(raw_args: dict[str, Any]) -> Application:
    args = AppArgs(**raw_args)
    model = resolve_model(args)
    if ray.is_initialized():  # building inside a cluster (not a config check)
        require_gpus(args, float(os.environ.get(GPU_WAIT_ENV, GPU_WAIT_S)))
    served_name = args.served_model_name or Path(args.model).name
    engine = EngineReplica.options(**replica_options(args)).bind(engine_config(args, model), served_name)
    limits = RequestLimits(args.max_prompt_tokens, args.max_tokens_limit, args.request_timeout_s)
    return Ingress.bind(engine, weights=weights_source(args, model), max_waiting=args.max_waiting,
                        max_wait_s=args.max_wait_s, default_max_tokens=args.default_max_tokens, limits=limits,
                        max_body_bytes=args.max_body_bytes, metrics_need_api_key=args.metrics_need_api_key)

