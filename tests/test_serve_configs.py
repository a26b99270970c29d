"""configs/*.yaml and the application builder, without starting Ray: the files are valid Serve configs, their args
build the application, prod autoscales on GPUs with the memory-demand policy, local serves the shipped small model
whatever the working directory, and no config serves random weights."""
import dataclasses
from pathlib import Path

import pytest
import yaml
from ray.serve._private.build_app import build_app as serve_build
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray.serve.schema import ServeDeploySchema

from serve_app import app as app_module
from serve_app.app import AppArgs, build_app, replica_options, resolve_model, weights_source
from serve_app.autoscaling import memory_demand_policy
from serve_app.router import MemoryAwareRouter
from shadowkv_core import memory_model as mm
from shadowkv_core.config import shadowkv_from

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL_MODEL = CONFIGS.parent / "models" / "shadowkv-small"


def _config(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def _args(name: str) -> dict:
    return _config(name)["applications"][0]["args"]


def _deployments(raw_args: dict) -> dict:
    built = serve_build(build_app(raw_args), name="shadowkv")
    return {d.name: d for d in built.deployments}


SHIPPED = sorted(path.name for path in CONFIGS.glob("*.yaml"))


def test_every_shipped_config_is_tested():
    assert SHIPPED == ["local.yaml", "prod-1m.yaml", "prod-70b.yaml", "prod.yaml"]


@pytest.mark.parametrize("name", SHIPPED)
def test_config_is_a_valid_serve_config_with_valid_args(name):
    schema = ServeDeploySchema.model_validate(_config(name))
    assert schema.applications[0].import_path == "serve_app.app:build_app"
    AppArgs(**_args(name))


def test_prod_builds_gpu_replicas_autoscaled_on_memory_demand():
    deployments = _deployments(_args("prod.yaml"))
    engine = deployments["EngineReplica"]
    assert engine.ray_actor_options["num_gpus"] == 1
    autoscaling = AutoscalingConfig(**replica_options(AppArgs(**_args("prod.yaml")))["autoscaling_config"])
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 8)
    policy = autoscaling.policy.get_policy()  # Serve pickles it by value: a copy
    assert policy.__name__ == "memory_demand_policy" and policy(_context({"a": 1.0}, 1))[0] == 2
    router = engine._deployment_config.request_router_config
    assert router.request_router_class.endswith("MemoryAwareRouter")
    assert set(deployments) == {"EngineReplica", "Ingress"}


def test_autoscaling_delays_are_app_args_and_the_policy_stays():
    args = {**_args("prod.yaml"), "max_replicas": 2, "autoscaling": {"upscale_delay_s": 5, "downscale_delay_s": 15}}
    autoscaling = AutoscalingConfig(**replica_options(AppArgs(**args))["autoscaling_config"])
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 2)
    assert (autoscaling.upscale_delay_s, autoscaling.downscale_delay_s) == (5, 15)
    assert autoscaling.policy.get_policy().__name__ == "memory_demand_policy"
    with pytest.raises(ValueError, match="max_replicas"):
        AppArgs(**{**args, "autoscaling": {"max_replicas": 4}})


def test_local_serves_the_shipped_small_model_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = AppArgs(**_args("local.yaml"))
    model = resolve_model(args)
    assert model == str(SMALL_MODEL.resolve())
    assert weights_source(args, model) == {"root": model, "random_weights": False}
    engine = _deployments(_args("local.yaml"))["EngineReplica"]
    assert engine.ray_actor_options["num_gpus"] == 0 and engine.num_replicas == 1


def test_prod_70b_asks_each_replica_for_its_tensor_parallel_gpus():
    args = AppArgs(**_args("prod-70b.yaml"))
    assert args.tensor_parallel_size in (4, 8)
    engine = _deployments(_args("prod-70b.yaml"))["EngineReplica"]
    assert engine.ray_actor_options["num_gpus"] == args.tensor_parallel_size * args.num_gpus
    assert engine.init_args[0]["tensor_parallel_size"] == args.tensor_parallel_size  # the engine's EngineConfig


def test_prod_1m_holds_a_million_token_request_on_one_h200():
    """By the memory model that sizes and admits a replica (the config's ShadowKV fields and max_model_len; an
    8B Llama's shapes), one GPU of 139 GiB at its gpu_memory_utilization and 100 GiB of host memory hold a request of
    max_model_len tokens, prompt and answer, where dense attention holds none (every value on the host: a device
    value share only adds room)."""
    args = AppArgs(**_args("prod-1m.yaml"))
    g = mm.PRESETS["llama-3.1-8b"]
    cfg = dataclasses.replace(shadowkv_from(args.shadowkv), device_value_share=0.0)
    gpu, host = int(139 * mm.GIB * args.engine["gpu_memory_utilization"]), 100 * mm.GIB
    prompt = [args.max_model_len - args.default_max_tokens]
    assert mm.capacity(g, cfg, gpu, host, prompt, args.default_max_tokens) >= 1
    assert mm.capacity(g, None, gpu, host, prompt, args.default_max_tokens) == 0


@pytest.mark.parametrize("name", SHIPPED)
def test_no_shipped_config_serves_random_weights(name):
    args = AppArgs(**_args(name))
    assert args.engine.get("load_format", "auto") != "dummy"
    with pytest.raises(ValueError, match="tiny_model_fallback"):  # the random-model fallback is gone
        AppArgs(**{**_args(name), "tiny_model_fallback": True})


def test_a_missing_model_stops_start_up_naming_its_path(tmp_path):
    args = {**_args("local.yaml"), "config_dir": str(tmp_path)}
    with pytest.raises(ValueError, match=str(tmp_path / "../models/shadowkv-small")):
        build_app(args)
    assert resolve_model(AppArgs(model="sub/ckpt", config_dir=str(tmp_path))) == "sub/ckpt"  # a hub id
    (tmp_path / "sub" / "ckpt").mkdir(parents=True)  # a folder beside the config wins over the hub id
    with pytest.raises(ValueError, match=str(tmp_path / "sub" / "ckpt")):
        resolve_model(AppArgs(model="sub/ckpt", config_dir=str(tmp_path)))


def test_unknown_arg_or_missing_model_without_fallback():
    with pytest.raises(ValueError):
        AppArgs(model="m", max_num_seq=4)
    assert resolve_model(AppArgs(model="org/hub-id")) == "org/hub-id"


def _context(demands: dict, current: int) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=None, deployment_name="EngineReplica", app_name="shadowkv", current_num_replicas=current,
        target_num_replicas=current, running_replicas=list(demands), total_num_requests=0.0,
        total_queued_requests=0.0, aggregated_metrics={"memory_demand": demands} if demands else {},
        raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=None)


def test_memory_demand_policy_scales_with_predicted_memory_not_requests():
    assert memory_demand_policy(_context({"a": 0.95, "b": 0.9}, 2))[0] == 3
    assert memory_demand_policy(_context({"a": 0.1, "b": 0.05}, 2))[0] == 1
    assert memory_demand_policy(_context({}, 4))[0] == 4


def test_router_is_a_request_router():
    from ray.serve.request_router import RequestRouter

    assert issubclass(MemoryAwareRouter, RequestRouter)


def test_prod_on_a_cluster_without_a_gpu_fails_naming_it_and_waits_only_a_bounded_time(monkeypatch):
    seen = iter([{"CPU": 2.0}, {"CPU": 2.0, "GPU": 1.0}])  # a GPU node joins while the build waits
    monkeypatch.setattr(app_module.ray, "cluster_resources", lambda: next(seen))
    app_module.require_gpus(AppArgs(**_args("prod.yaml")), wait_s=60, poll_s=0)
    monkeypatch.setattr(app_module.ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(RuntimeError, match="no GPU: each engine replica needs 1 .* this Ray cluster has 0"):
        app_module.require_gpus(AppArgs(**_args("prod.yaml")), wait_s=0)
    app_module.require_gpus(AppArgs(**_args("local.yaml")), wait_s=0)  # CPU replicas need none
    assert app_module.GPU_WAIT_S < 30
