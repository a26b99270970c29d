"""configs/*.yaml and the application builder, without starting Ray: the files are valid Serve configs, their args
build the application, prod autoscales on GPUs with the memory-demand policy, local falls back to the tiny model."""
import logging
from pathlib import Path

import pytest
import yaml
from ray.serve._private.build_app import build_app as serve_build
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray.serve.schema import ServeDeploySchema

from serve_app import app as app_module
from serve_app.app import AppArgs, build_app, replica_options, resolve_model
from serve_app.autoscaling import memory_demand_policy
from serve_app.router import MemoryAwareRouter

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _config(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def _args(name: str) -> dict:
    return _config(name)["applications"][0]["args"]


def _deployments(raw_args: dict) -> dict:
    built = serve_build(build_app(raw_args), name="shadowkv")
    return {d.name: d for d in built.deployments}


@pytest.mark.parametrize("name", ["local.yaml", "prod.yaml"])
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


def test_local_builds_cpu_replica_and_serves_the_tiny_model_when_the_small_one_is_missing(tmp_path, monkeypatch,
                                                                                          caplog):
    monkeypatch.setattr(app_module, "TINY_MODEL_DIR", tmp_path / "tiny")
    args = {**_args("local.yaml"), "model": str(tmp_path / "not-trained-yet")}
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        model = resolve_model(AppArgs(**args))
    assert model == str(tmp_path / "tiny") and (tmp_path / "tiny" / "config.json").exists()
    assert "TINY RANDOM-WEIGHT" in caplog.text
    engine = _deployments(args)["EngineReplica"]
    assert engine.ray_actor_options["num_gpus"] == 0 and engine.num_replicas == 1


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
