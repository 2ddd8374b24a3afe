"""The deployment manifests under deploy/ are what the engines accept: Kubernetes kinds pass
kubernetes-validate --strict, KServe, KEDA and Kubeflow kinds pass check-jsonschema against their
CRD schemas vendored under deploy/schemas/ (strict: an unknown field fails), and every command line
they hold is accepted by the real argument parsers (optiserve's, and torchrun's)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

DEPLOY = ROOT / "deploy"
SCHEMAS = DEPLOY / "schemas"
# kind -> the vendored schema of the version the manifests use (None: a Kubernetes kind)
CUSTOM = {"ServingRuntime": "servingruntime_serving_v1alpha1.json",
          "InferenceService": "inferenceservice_serving_v1beta1.json",
          "ScaledObject": "scaledobject_keda_v1alpha1.json",
          "TrainJob": "trainjob_trainer_v1alpha1.json"}
BUILTIN = {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
# Helm values and a Ray Serve config file: not Kubernetes objects, checked below
NOT_MANIFESTS = {DEPLOY / "k8s" / "hpa" / "prometheus-adapter-values.yaml", DEPLOY / "ray" / "serve_config.yaml"}


def manifests() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path not in NOT_MANIFESTS:
            out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def _id(item) -> str:
    path, doc = item
    return f"{path.relative_to(DEPLOY)}:{doc.get('kind')}"


def test_every_manifest_is_a_kind_the_tests_check():
    kinds = {doc.get("kind") for _, doc in manifests()}
    assert kinds == set(CUSTOM) | BUILTIN, kinds


@pytest.mark.parametrize("item", [m for m in manifests() if m[1]["kind"] in BUILTIN], ids=_id)
def test_kubernetes_kinds_pass_strict_validation(item):
    import kubernetes_validate

    path, doc = item
    kubernetes_validate.validate(doc, "1.33.0", strict=True)  # raises on any error, unknown fields included


def check_jsonschema(schema: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--schemafile", str(SCHEMAS / schema), str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("item", [m for m in manifests() if m[1]["kind"] in CUSTOM], ids=_id)
def test_custom_kinds_pass_their_vendored_crd_schemas(item):
    path, doc = item
    result = check_jsonschema(CUSTOM[doc["kind"]], path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_misplaced_field_fails_the_crd_schema_check(tmp_path):
    # The cluster would prune an unknown field silently; the vendored schemas are strict so a typo fails here.
    runtime = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())
    runtime["spec"]["protocolVersion"] = runtime["spec"].pop("protocolVersions")
    bad = tmp_path / "runtime.yaml"
    bad.write_text(yaml.safe_dump(runtime))
    result = check_jsonschema(CUSTOM["ServingRuntime"], bad)
    assert result.returncode == 1 and "protocolVersion" in result.stdout + result.stderr


def test_vendored_schemas_say_where_they_came_from():
    sources = (SCHEMAS / "SOURCES.md").read_text()
    for name in CUSTOM.values():
        assert name in sources
        assert '"$comment":"from ' in (SCHEMAS / name).read_text()


def _containers(doc: dict) -> list[dict]:
    spec = doc["spec"]
    if doc["kind"] == "ServingRuntime":
        return spec["containers"]
    return spec["template"]["spec"]["containers"]


@pytest.mark.parametrize("path", [DEPLOY / "kserve" / "servingruntime.yaml", DEPLOY / "k8s" / "deployment.yaml"],
                         ids=lambda p: p.name)
def test_container_args_are_accepted_by_the_real_parser_and_fit_the_probes(path):
    from optiserve.cli import build_parser

    doc = yaml.safe_load(path.read_text())
    (container,) = _containers(doc)
    args = [a.replace("{{.Name}}", "resnet18") for a in container["args"]]
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve" and parsed.host == "0.0.0.0"
    port = container["ports"][0]["containerPort"]
    assert parsed.port == port
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    # the start-up probe covers loading: /live answers before the models are loaded, /ready after
    assert container["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    if doc["kind"] == "ServingRuntime":
        assert container["name"] == "kserve-container" and port == 8080 and args[1] == "/mnt/models"
        assert doc["spec"]["protocolVersions"] == ["v2", "grpc-v2"]
        assert {"name": "optiserve", "version": "1", "autoSelect": True} in doc["spec"]["supportedModelFormats"]
        assert doc["spec"]["annotations"] == {"prometheus.kserve.io/port": str(port),
                                              "prometheus.kserve.io/path": "/metrics"}
        grace = yaml.safe_load((DEPLOY / "kserve" / "inferenceservice.yaml").read_text())["spec"]["predictor"][
            "terminationGracePeriodSeconds"]
    else:
        pod = doc["spec"]["template"]["spec"]
        grace = pod["terminationGracePeriodSeconds"] - container["lifecycle"]["preStop"]["sleep"]["seconds"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == parsed.grpc_port != parsed.port  # gRPC on a port of its own, named for the Service
        service = {p["name"]: p["targetPort"] for p in yaml.safe_load((DEPLOY / "k8s" / "service.yaml").read_text())[
            "spec"]["ports"]}
        assert service == {"http": "http", "grpc": "grpc"}
    # the pod is killed only after the drain and the queued requests' time are over
    assert grace > parsed.drain_seconds + parsed.shutdown_timeout_s


def test_the_grpc_inference_service_opens_the_port_it_routes_to_beside_the_probed_http_port():
    from optiserve.cli import build_parser

    isvc = yaml.safe_load((DEPLOY / "kserve" / "inferenceservice-grpc.yaml").read_text())
    runtime = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] and model["protocolVersion"] == "grpc-v2"
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    (container,) = runtime["spec"]["containers"]
    # KServe appends the InferenceService's args to the runtime's
    args = [a.replace("{{.Name}}", "resnet18-grpc") for a in container["args"] + model["args"]]
    parsed = build_parser().parse_args(args)
    (port,) = model["ports"]
    assert port["name"] == "h2c" and port["containerPort"] == parsed.grpc_port  # cleartext HTTP/2, routed by KServe
    assert parsed.port == container["readinessProbe"]["httpGet"]["port"] != parsed.grpc_port
    assert isvc["spec"]["predictor"]["terminationGracePeriodSeconds"] > parsed.drain_seconds + parsed.shutdown_timeout_s


def test_the_inference_service_uses_the_runtime_and_scales_on_queue_depth_through_keda():
    isvc = yaml.safe_load((DEPLOY / "kserve" / "inferenceservice.yaml").read_text())
    runtime = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())
    predictor = isvc["spec"]["predictor"]
    assert predictor["model"]["runtime"] == runtime["metadata"]["name"]
    assert predictor["model"]["modelFormat"]["name"] == runtime["spec"]["supportedModelFormats"][0]["name"]
    assert predictor["model"]["protocolVersion"] == "v2" and predictor["model"]["storageUri"]
    assert isvc["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "keda"
    (metric,) = predictor["autoScaling"]["metrics"]
    assert metric["external"]["metric"]["backend"] == "prometheus"
    assert "optiserve_queue_depth" in metric["external"]["metric"]["query"]


def test_queue_depth_autoscalers_name_the_metric_the_server_exports(small_artifact):
    from optiserve.serve.app import ServeConfig, create_app
    from fastapi.testclient import TestClient

    with TestClient(create_app(ServeConfig(str(small_artifact), variants=["onnx-int8"]))) as client:
        exported = client.get("/metrics").text
    assert "# TYPE optiserve_queue_depth gauge" in exported
    hpa = yaml.safe_load((DEPLOY / "k8s" / "hpa" / "hpa.yaml").read_text())
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "optiserve_queue_depth"
    adapter = yaml.safe_load((DEPLOY / "k8s" / "hpa" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["seriesQuery"].startswith("optiserve_queue_depth{") and rule["name"]["as"] == "optiserve_queue_depth"
    keda = yaml.safe_load((DEPLOY / "k8s" / "keda" / "scaledobject.yaml").read_text())
    assert "optiserve_queue_depth" in keda["spec"]["triggers"][0]["metadata"]["query"]


def test_the_trainjob_command_is_accepted_by_torchrun_and_by_optiserve_train():
    from torch.distributed.run import get_args_parser

    from optiserve.cli import build_parser

    job = yaml.safe_load((DEPLOY / "kubeflow" / "trainjob.yaml").read_text())
    command = job["spec"]["trainer"]["command"]
    assert command[0] == "torchrun"
    torchrun = get_args_parser().parse_args(command[1:])
    assert torchrun.module and torchrun.training_script == "optiserve" and torchrun.max_restarts >= 1
    train = build_parser().parse_args(torchrun.training_script_args)
    assert train.command == "train" and train.out.startswith("/checkpoints/")
    assert shlex.join(command)  # one line a user can paste


def test_the_images_run_as_a_user_not_root():
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        lines = [line.strip() for line in (ROOT / dockerfile).read_text().splitlines()]
        assert "USER 1000" in lines, dockerfile


def test_the_ray_serve_config_passes_rays_own_schema_and_its_args_the_real_parser():
    pytest.importorskip("ray.serve", reason="ray[serve] is in the [dev] extra")
    from ray.serve.schema import ServeDeploySchema

    from optiserve.serve.command import config_from_args
    from optiserve.serve.ray_deployment import _serve_args, deployment_options

    config = yaml.safe_load((DEPLOY / "ray" / "serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(config)  # raises on a field Ray does not know
    (app,) = config["applications"]
    assert app["import_path"] == "optiserve.serve.ray_deployment:build"
    cfg = config_from_args(_serve_args(app["args"]["serve"]))
    options = deployment_options(app["args"], cfg.max_batch_size)
    assert options["max_ongoing_requests"] >= cfg.max_batch_size
    assert options["autoscaling_config"]["min_replicas"] <= options["autoscaling_config"]["max_replicas"]


def test_ray_deployment_options_refuse_a_queue_smaller_than_a_batch():
    from optiserve.errors import UserError
    from optiserve.serve.ray_deployment import deployment_options

    with pytest.raises(UserError, match="max_ongoing_requests 8 is below --max-batch-size 16"):
        deployment_options({"serve": "x", "max_ongoing_requests": 8}, 16)
    with pytest.raises(UserError, match="unknown Ray deployment args max_replica"):
        deployment_options({"serve": "x", "max_replica": 2}, 16)
    with pytest.raises(UserError, match="the Ray deployment arg max_replicas must be an integer, got 'two'"):
        deployment_options({"serve": "x", "max_replicas": "two"}, 16)


@pytest.mark.parametrize("path", [DEPLOY / "kserve" / "servingruntime.yaml", DEPLOY / "k8s" / "deployment.yaml"],
                         ids=lambda p: p.name)
def test_a_pod_of_the_size_optimize_ran_on_reuses_its_recorded_choice_instead_of_timing_again(path, small_artifact):
    """The shipped container's --threads is its CPU limit: the threads `optimize` times with on a
    machine of that size, so every replica takes the recorded choice at start instead of re-timing."""
    from optiserve.artifacts import read_manifest
    from optiserve.cli import build_parser
    from optiserve.runtime.recorded import recorded_choice

    (container,) = _containers(yaml.safe_load(path.read_text()))
    parsed = build_parser().parse_args([a.replace("{{.Name}}", "resnet18") for a in container["args"]])
    limit = int(container["resources"]["limits"]["cpu"])
    if parsed.threads is not None:
        assert parsed.threads == limit
    manifest = read_manifest(small_artifact)
    manifest["threads"] = limit  # as optimize records it on a machine with the pod's cores
    accepted = {v["name"]: v for v in manifest["variants"] if v["status"] == "accepted"}
    recorded = recorded_choice(manifest, accepted, {"cpu"}, 1, parsed.threads)
    assert recorded.choice is not None, recorded.reason
    assert recorded.choice["variant"] == manifest["recommended"]["latency"]
    assert "--threads" in recorded_choice(manifest, accepted, {"cpu"}, 1, limit + 1).reason
