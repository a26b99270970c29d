"""infra/: every file parses and validates against the schema its consumer applies (Ray Serve's ServeDeploySchema, the
KubeRay RayService CRD, Ray's cluster-launcher schema), the RayService serves configs/prod.yaml unchanged, and the
image, the RayService and the launcher files agree with each other, with pyproject.toml and with the memory model."""
import copy
import dataclasses
import functools
import gzip
import json
import re
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from packaging.requirements import Requirement
from ray.serve.schema import ServeDeploySchema

from shadowkv_core import memory_model as mm
from shadowkv_core.config import PRESETS

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
LAUNCHERS = ["aws/cluster.yaml", "gcp/cluster.yaml"]
# The KubeRay v1.7.0 RayService CRD's openAPIV3Schema (ray-operator/config/crd/bases/ray.io_rayservices.yaml, v1).
CRD_SCHEMA = INFRA / "k8s" / "schema" / "ray.io_rayservices.v1.json.gz"
QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _prod() -> dict:
    return _yaml(ROOT / "configs" / "prod.yaml")


def _rayservice() -> dict:
    return _yaml(INFRA / "k8s" / "rayservice.yaml")


def _cluster() -> dict:
    return _rayservice()["spec"]["rayClusterConfig"]


def _gpu_group() -> dict:
    (group,) = _cluster()["workerGroupSpecs"]
    return group


def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (INFRA / "docker" / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [tuple(line.split(None, 1)) for line in lines]


def _docker_args() -> dict[str, str]:
    return dict(arg.split("=", 1) for op, arg in _dockerfile() if op == "ARG")


def _strict(schema):
    """A CRD's structural schema as `kubeconform -strict` reads it: an object that declares its properties takes no
    others (the API server would silently drop them, which hides typos)."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


@functools.cache
def _crd_validator() -> jsonschema.Validator:
    schema = _strict(json.loads(gzip.open(CRD_SCHEMA).read()))
    return jsonschema.validators.validator_for(schema)(schema)


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()
    return int(number) * QUANTITY.get(unit, 1)


@pytest.mark.parametrize("path", sorted(INFRA.rglob("*.yaml")), ids=lambda p: str(p.relative_to(INFRA)))
def test_every_infra_yaml_parses_to_a_mapping(path):
    assert isinstance(_yaml(path), dict)


@pytest.mark.parametrize("source", ["configs/prod.yaml", "rayservice serveConfigV2"])
def test_serve_config_validates_against_serve_deploy_schema(source):
    config = _prod() if source == "configs/prod.yaml" else yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(config)
    assert [app.import_path for app in schema.applications] == ["serve_app.app:build_app"]


def test_rayservice_serves_prod_yaml_unchanged():
    assert yaml.safe_load(_rayservice()["spec"]["serveConfigV2"]) == _prod(), \
        "infra/k8s/rayservice.yaml serveConfigV2 drifted from configs/prod.yaml: copy prod.yaml into it"


def test_rayservice_validates_against_the_kuberay_crd_schema_strictly():
    manifest = _rayservice()
    assert (manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"]) == ("ray.io/v1", "RayService",
                                                                                        "shadowkv")
    _crd_validator().validate(manifest)


def test_the_crd_schema_rejects_a_misspelt_field():
    manifest = _rayservice()
    bad = copy.deepcopy(manifest)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 8
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        _crd_validator().validate(bad)


def test_head_has_no_gpu_and_runs_no_replica():
    head = _cluster()["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    (container,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_gpu_workers_autoscale_between_prod_yaml_replica_bounds():
    args = _prod()["applications"][0]["args"]
    group = _gpu_group()
    assert _cluster()["enableInTreeAutoscaling"] is True
    assert (group["minReplicas"], group["maxReplicas"]) == (args["min_replicas"], args["max_replicas"])
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(args["num_gpus"])
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in group["template"]["spec"][
        "tolerations"]


def test_gpu_worker_memory_holds_a_full_value_shard_and_the_object_store_in_shm():
    args = _prod()["applications"][0]["args"]
    group = _gpu_group()
    spec = group["template"]["spec"]
    (container,) = spec["containers"]
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    object_store = int(group["rayStartParams"]["object-store-memory"])
    assert object_store <= _bytes(shm["emptyDir"]["sizeLimit"])
    geometry = mm.load_geometry("llama-3.1-8b")
    prompt = args["max_model_len"] - args["default_max_tokens"]
    all_on_host = dataclasses.replace(PRESETS[args["shadowkv"]], device_value_share=0.0)  # the largest shard
    shard = args["max_num_seqs"] * mm.seq_bytes(geometry, all_on_host, prompt, args["default_max_tokens"]).host
    memory = _bytes(container["resources"]["limits"]["memory"])
    assert shard + object_store < memory == _bytes(container["resources"]["requests"]["memory"])


def test_gpu_worker_readiness_is_serves_health_on_prod_port():
    (container,) = _gpu_group()["template"]["spec"]["containers"]
    probe = container["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/-/healthz", _prod()["http_options"]["port"])


@pytest.mark.parametrize("name", LAUNCHERS)
def test_cluster_launcher_validates_against_rays_schema(name):
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(_yaml(INFRA / name), schema)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_cluster_launcher_has_a_cpu_head_and_gpu_workers_within_prod_bounds(name):
    config, args = _yaml(INFRA / name), _prod()["applications"][0]["args"]
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"] == {"CPU": 0}
    workers = [t for key, t in types.items() if key != config["head_node_type"]]
    assert [(t["resources"]["GPU"], t["min_workers"], t["max_workers"]) for t in workers] == [
        (args["num_gpus"], args["min_replicas"], args["max_replicas"])]
    assert config["max_workers"] == args["max_replicas"] and config["idle_timeout_minutes"] > 0


@pytest.mark.parametrize("name", LAUNCHERS)
def test_cluster_launcher_installs_the_mounted_project_with_the_images_torch(name):
    config = _yaml(INFRA / name)
    assert config["file_mounts"] == {"~/shadowkv": "."}
    install = f'pip install -q --python ~/shadowkv-env "torch=={_docker_args()["TORCH_VERSION"]}" ~/shadowkv'
    assert any(cmd.endswith(install) for cmd in config["setup_commands"])


def test_dockerfile_copies_what_the_install_needs_and_dockerignore_lets_through():
    copied = {src.rstrip("/") for op, arg in _dockerfile() if op == "COPY"
              for src in arg.split()[:-1] if not src.startswith("--")}
    assert all((ROOT / src).exists() for src in copied)
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    assert copied <= allowed
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {name.rstrip("*") for name in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", project["project"]["readme"], "configs"} <= copied


def test_dockerfile_installs_torch_and_ray_versions_the_project_accepts():
    args = _docker_args()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requirements = {Requirement(dep).name: Requirement(dep) for dep in project["project"]["dependencies"]}
    assert args["TORCH_VERSION"] in requirements["torch"].specifier
    assert args["RAY_VERSION"] in requirements["ray"].specifier
    assert f"SHADOWKV_TORCH_SPEC=torch=={args['TORCH_VERSION']}" in (ROOT / "README.md").read_text()
    assert _cluster()["rayVersion"] == args["RAY_VERSION"]
    run = next(arg for op, arg in _dockerfile() if op == "RUN")
    assert 'pip install --no-cache-dir "torch==${TORCH_VERSION}"' in run and "pip install --no-cache-dir . " in run


def test_dockerfile_runs_prod_as_non_root_and_checks_the_ingress_health_route():
    ops = dict(_dockerfile())
    assert not ops["USER"].startswith(("0", "root"))
    assert json.loads(ops["ENTRYPOINT"]) == ["serve", "run", "configs/prod.yaml"]
    port = _prod()["http_options"]["port"]
    assert f"http://127.0.0.1:{port}/health" in ops["HEALTHCHECK"]
    assert re.search(r'@api\.(get|api_route)\("/health"', (ROOT / "serve_app" / "ingress.py").read_text())


def test_grafana_dashboard_plots_only_series_the_service_exposes():
    from prometheus_client.parser import text_string_to_metric_families

    from serve_app.metrics import ServiceMetrics

    metrics = ServiceMetrics()
    metrics.model_name = "m"
    metrics.record_tokens(1, 0.1, first=True)
    metrics.record_tokens(1, 0.1, first=False)
    metrics.record_end("stop", 1, 0.2)
    metrics.errors.labels("400").inc()
    metrics.rejected.labels("rate_limit_exceeded").inc()
    text = metrics.render([{"gpu_bytes_in_use": 1, "hit_rate": 0.5}], 0, 0).decode()
    exposed = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    dashboard = json.loads((INFRA / "grafana" / "shadowkv-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    plotted = {name for expr in exprs for name in re.findall(r"\b(vllm:\w+|shadowkv_\w+)", expr)}
    assert plotted and plotted <= exposed, plotted - exposed
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:request_success_total"} <= plotted


def test_sigterm_stops_the_server_without_a_crash_dump_wherever_it_is_started():
    """Ray's failure-signal handler prints a stack dump on SIGTERM; off, Ray's own SIGTERM handler exits cleanly."""
    assert ("ENV", "RAY_DISABLE_FAILURE_SIGNAL_HANDLER=1") in _dockerfile()
    assert "RAY_DISABLE_FAILURE_SIGNAL_HANDLER:-1" in (ROOT / "scripts" / "serve.sh").read_text()
