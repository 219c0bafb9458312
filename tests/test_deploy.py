"""deploy/ against the code it deploys: every file parses; every `despina` command line in the Dockerfile,
the compose file and the Kubernetes manifests is one the CLI takes, and starts with valid settings; every
DESPINA_* variable is a setting; ports, probes and Services agree with each other and with the settings'
defaults; KEDA's streams are the streams Despina writes. Nothing here needs Docker or a cluster;
`kubectl kustomize` runs where kubectl is installed."""
from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from copy import deepcopy
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from despina.contract.keys import CONTROL_GROUP, GROUP, Keys
from despina.settings import SAGEMAKER_MODEL_DIR, Settings

from .deploy_support import (
    DEFAULTS,
    DEPLOY,
    KUBE,
    NOT_IN_KUSTOMIZATION,
    ROOT,
    SETTINGS,
    check_http_check,
    compose,
    compose_roles,
    control_routes,
    dockerignored,
    documents,
    image,
    interpolate,
    keda,
    kube_roles,
    kustomization,
    manifests,
    of_kind,
    published,
    role_paths,
    run_role,
    schema_errors,
    secrets,
    selects,
    service_link_variables,
    stages,
    workloads,
)

# KEDA's redis-streams scaler: its fields, from pkg/scalers/redis_streams_scaler.go and its documentation
KEDA_REDIS_STREAMS = {"address", "host", "port", "addressFromEnv", "hostFromEnv", "portFromEnv",
                      "usernameFromEnv", "passwordFromEnv", "stream", "consumerGroup", "pendingEntriesCount",
                      "streamLength", "lagCount", "activationLagCount", "databaseIndex", "enableTLS",
                      "unsafeSsl"}


# -- the image -------------------------------------------------------------------------------------

def test_the_image_runs_despina_as_a_non_root_user() -> None:
    first, *others = stages().values()
    assert first.base == "${PYTHON_IMAGE}" and first.args["PYTHON_IMAGE"] == "python:3.11-slim"
    for img in (first, *others):
        assert img.entrypoint == ["despina"]
        assert img.user.split(":")[0] not in ("root", "0")
    assert image().env == first.env, "the default target is the plain image"


def test_the_image_serves_the_models_volume_on_every_address() -> None:
    img = image()
    for argv in (img.cmd, ["serve"]):  # `docker run IMAGE serve` replaces CMD
        role, settings = run_role(argv, img.env, f"Dockerfile: CMD {argv}")
        assert role == "serve" and not settings.sagemaker
        assert settings.host == "0.0.0.0"
        assert settings.model_repository in img.volumes
        assert img.expose == {settings.http_port, settings.metrics_port} \
            == {DEFAULTS.http_port, DEFAULTS.metrics_port}
        health = re.search(r"'(http://[^']+)'", img.healthcheck)
        assert health and str(DEFAULTS.http_port) in img.healthcheck, img.healthcheck
        check_http_check(health.group(1) % settings.http_port, role, settings, "Dockerfile HEALTHCHECK")


def test_the_sagemaker_target_starts_as_sagemaker_starts_containers() -> None:
    img = image("sagemaker")
    role, settings = run_role(["serve"], img.env, "Dockerfile, sagemaker: `docker run IMAGE serve`")
    assert role == "serve" and settings.sagemaker
    assert settings.host == "0.0.0.0" and settings.model_repository == SAGEMAKER_MODEL_DIR
    assert settings.http_port in img.expose
    health = re.search(r"'(http://[^']+)'", img.healthcheck)
    assert health and f"'{settings.http_port}'" in img.healthcheck, img.healthcheck
    check_http_check(health.group(1) % settings.http_port, role, settings, "sagemaker HEALTHCHECK")


def test_the_sagemaker_target_carries_the_labels_sagemaker_asks_for() -> None:
    # CreateModel refuses an image without them ("does not contain required ... Docker label(s)"): the
    # multi-model label for Mode=MultiModel (SAGEMAKER_MULTI_MODEL), the port label for an inference
    # pipeline or a multi-container endpoint, which is also what makes SageMaker set SAGEMAKER_BIND_TO_PORT
    labels = image("sagemaker").labels
    assert labels.get("com.amazonaws.sagemaker.capabilities.multi-models") == "true"
    assert labels.get("com.amazonaws.sagemaker.capabilities.accept-bind-to-port") == "true"


def test_the_image_installs_extras_that_exist_and_no_torch_by_default() -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    default = set(image().args["EXTRAS"].split(","))
    assert "onnx" in default and default <= extras
    assert not default & {"torch", "tensorflow", "test", "bench"}
    assert not any(re.search(r"pip install\b[^&;]*\btorch\b", run) for run in image().runs)
    compose_extras = interpolate(compose()["x-despina"]["build"]["args"]["EXTRAS"])
    assert set(compose_extras.split(",")) <= extras


def test_the_image_copies_what_exists_and_its_dependencies_first() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = [src for copy in image().copies for src in copy[:-1]]
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
        assert not dockerignored(src, patterns), f"COPY {src}: .dockerignore leaves it out"
    assert sources.index("pyproject.toml") < sources.index("despina"), "dependencies before the code"
    for heavy in (".venv", ".git", "bench/out", "model_repository/mlp/1/model.onnx", "tests"):
        assert dockerignored(heavy, patterns), f".dockerignore sends {heavy}"


# -- compose ---------------------------------------------------------------------------------------

def test_compose_variables_all_have_defaults() -> None:
    text = (DEPLOY / "compose.yaml").read_text()
    bare = [m for m in re.findall(r"(?<!\$)\$\{([^}]*)\}", text) if ":-" not in m]
    assert not bare, f"set with no default: {bare} (`docker compose up` needs no .env)"


def test_compose_runs_each_role_against_the_shared_valkey() -> None:
    services = compose()["services"]
    roles = compose_roles()
    assert sorted(role for role, _, _ in roles.values()) == ["control", "gateway", "worker"]
    for name, (role, settings, service) in roles.items():
        assert settings.redis_url and urlparse(settings.redis_url).hostname in services, name
        if role in ("gateway", "worker"):  # SIGTERM drains; Docker kills past the grace period
            grace = re.fullmatch(r"(\d+)s", service.get("stop_grace_period", "10s"))
            assert grace and int(grace[1]) > settings.drain_timeout_s, f"{name}: stop_grace_period"


def test_compose_ports_and_health_checks_are_the_roles_own() -> None:
    for name, (role, settings, service) in compose_roles().items():
        ports = published(service)
        expected = {getattr(settings, port) for port in role_paths(role, settings)}
        assert ports <= expected, f"{name} publishes {ports}; `despina {role}` listens on {expected}"
        # a port the role opens by default is there; one off by default (the worker's health port) is set
        assert all(getattr(settings, p) == getattr(DEFAULTS, p) or not getattr(DEFAULTS, p)
                   for p in role_paths(role, settings)), name
        test = service.get("healthcheck", {}).get("test")
        if test and not service["healthcheck"].get("disable"):
            url = re.search(r"https?://[^'\" ]+", " ".join(test))
            assert url, f"{name}: a health check that is no HTTP check"
            check_http_check(url.group(0), role, settings, f"compose.yaml: {name} healthcheck")
    assert published(compose()["services"]["gateway"]) == {DEFAULTS.http_port}


def test_compose_start_order_waits_for_what_it_names() -> None:
    services = compose()["services"]
    ours = compose()["x-despina"]["image"]
    for name, service in services.items():
        for dep, spec in service.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on {dep}: no such service"
            condition = spec["condition"]
            target = services[dep]
            if condition == "service_healthy":
                check = target.get("healthcheck", {})
                has = check.get("test") or (target.get("image") == ours and image().healthcheck)
                assert has and not check.get("disable"), f"{name} waits for {dep} healthy: it has no check"
            elif condition == "service_completed_successfully":
                assert target.get("restart") == "no", f"{dep} is a one-shot: restart 'no'"
            else:
                assert condition == "service_started", condition


def test_compose_workers_scale_and_see_the_repository_where_control_does() -> None:
    roles = compose_roles()
    by_role = {role: (settings, service) for role, settings, service in roles.values()}
    worker = compose()["services"]["worker"]
    assert "container_name" not in worker and not worker.get("ports"), "--scale worker=N needs neither"
    repository = by_role["control"][0].model_repository

    def mounts(service: dict[str, Any]) -> dict[str, str]:
        return {v.split(":")[1]: v for v in service.get("volumes", [])}

    for role in ("control", "worker"):
        volume = mounts(by_role[role][1]).get(repository)
        assert volume and volume.endswith(":ro"), f"{role} must mount {repository} read-only"
        assert (DEPLOY / volume.split(":")[0]).resolve() == ROOT / "model_repository"
    examples = interpolate(compose()["services"]["examples"])
    assert repository in mounts(examples), "the examples are built where the roles read them"
    assert f"python -m despina.examples {repository}" in examples["command"][0]
    assert "examples" in interpolate(compose()["x-despina"]["build"]["args"]["EXTRAS"]).split(",")


# -- kubernetes ------------------------------------------------------------------------------------

def test_kustomization_lists_every_manifest() -> None:
    on_disk = {p.name for p in KUBE.glob("*.yaml")}
    assert set(kustomization()["resources"]) == on_disk - NOT_IN_KUSTOMIZATION
    assert all(d.get("apiVersion") and d.get("kind") and d["metadata"].get("name") for d in manifests())


def test_manifests_fit_the_kubernetes_api() -> None:
    # the kubernetes client's models are the API's types (client 36: Kubernetes 1.36); keda.yaml's CRDs are
    # checked against the streams below, not here
    docs = [*manifests(), *documents(KUBE / "secrets.example.yaml")]
    errors = [e for d in docs for e in schema_errors(d)]
    assert not errors, "\n".join(errors)


def test_the_api_check_finds_a_misspelled_field_and_a_wrong_type() -> None:
    deployment = deepcopy(of_kind("Deployment")["despina-worker"])
    pod = deployment["spec"]["template"]["spec"]
    pod["enableServiceLink"] = False
    pod["containers"][0]["ports"] = [{"containerPort": "8002"}]
    assert schema_errors(deployment) == [
        "Deployment.spec.template.spec.containers[0].ports[0].containerPort: a int, not '8002'",
        "Deployment.spec.template.spec: V1PodSpec has no field 'enableServiceLink'",
    ]
    assert schema_errors({"apiVersion": "apps/v1", "kind": "Deployments"}) == [
        "apps/v1 Deployments: not a kind of Kubernetes' API"]


def test_configmap_holds_only_valid_settings() -> None:
    for name, configmap in of_kind("ConfigMap").items():
        data = {k: str(v) for k, v in configmap["data"].items()}
        assert set(data) <= SETTINGS, f"ConfigMap {name}: not settings: {sorted(set(data) - SETTINGS)}"
        Settings.from_sources({}, environ=data)


def test_kubernetes_runs_each_role_with_its_ports_and_probes() -> None:
    roles = kube_roles()
    assert sorted(role for role, *_ in roles.values()) == ["control", "gateway", "worker"]
    for name, (role, settings, container, workload) in roles.items():
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        listening = {getattr(settings, port) for port in role_paths(role, settings)}
        assert set(ports.values()) == listening, \
            f"{name}: ports {ports}, `despina {role}` listens on {listening}"
        # a port the role opens by default is there; one off by default (the worker's health port) is set
        assert all(getattr(settings, p) == getattr(DEFAULTS, p) or not getattr(DEFAULTS, p)
                   for p in role_paths(role, settings)), name
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe := container.get(kind, {}).get("httpGet"):
                port = ports.get(probe["port"], probe["port"])
                check_http_check(f"http://pod:{port}{probe['path']}", role, settings, f"{name} {kind}")
        if role == "gateway":
            assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"  # not every model loaded
        if role == "worker":  # a rolling update waits for a new worker's loads (workers/health.py)
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
            assert workload["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            assert role == "control" and int(annotations["prometheus.io/port"]) == settings.metrics_port
            assert annotations["prometheus.io/path"] in control_routes()


def test_no_service_sets_a_setting_through_the_variables_kubernetes_adds() -> None:
    # Every pod of the namespace gets Docker-link variables for each Service: `despina-metrics` on port 8002
    # gives DESPINA_METRICS_PORT=tcp://<cluster IP>:8002, a setting's name. Only a value of the pod's own
    # (the ConfigMap's) hides it; without that every role would refuse to start ("expected a whole number").
    links = service_link_variables(of_kind("Service").values())
    for name, (_, _, _, workload) in kube_roles().items():
        if workload["spec"]["template"]["spec"].get("enableServiceLinks", True):
            assert not links & SETTINGS, f"{name}: Services set {sorted(links & SETTINGS)} in its pods"


def test_kubernetes_roles_reach_valkey_and_the_s3_registry() -> None:
    services = of_kind("Service")
    for name, (role, settings, container, _) in kube_roles().items():
        url = urlparse(settings.redis_url)
        assert url.hostname in services, f"{name}: REDIS_URL names no Service"
        assert url.port in {p["port"] for p in services[url.hostname]["spec"]["ports"]}
        if role in ("control", "worker"):
            assert settings.model_repository.startswith("s3://")
            env = {var["name"] for var in container.get("env", [])}
            assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= env, name


def test_kubernetes_pods_are_restricted_and_writable_where_despina_writes() -> None:
    roles = kube_roles()
    uid = int(image().user.split(":")[0])
    for name, workload in workloads().items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod.get("automountServiceAccountToken") is False, name
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
            assert context["readOnlyRootFilesystem"] is True, name
            assert "memory" in container["resources"]["limits"], name
        mounts = {m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        assert mounts <= {v["name"] for v in pod.get("volumes", [])} | claims, f"{name}: mounts no volume"
        if name in roles:
            role, settings, container, _ = roles[name]
            assert pod["securityContext"]["runAsUser"] == uid, f"{name}: the image's user is {uid}"
            mounted = {m["mountPath"] for m in container.get("volumeMounts", [])}
            needed = {"/tmp"} | ({settings.cache_dir} if role in ("control", "worker") else set())
            assert needed <= mounted, f"{name}: a read-only root needs volumes at {needed - mounted}"
            if role in ("gateway", "worker"):
                assert pod["terminationGracePeriodSeconds"] > settings.drain_timeout_s, name


def test_services_budgets_and_autoscalers_find_their_pods() -> None:
    loads = workloads()
    for name, service in of_kind("Service").items():
        chosen = [w for w in loads.values() if selects(service["spec"]["selector"], w)]
        assert chosen, f"Service {name} selects no pods"
        for w in chosen:
            ports = {p["name"]: p["containerPort"] for c in w["spec"]["template"]["spec"]["containers"]
                     for p in c.get("ports", [])}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in ports or port["targetPort"] in ports.values(), name
    gateway = loads["despina-gateway"]
    assert of_kind("Service")["despina"]["spec"]["ports"][0]["port"] == DEFAULTS.http_port
    for budget in of_kind("PodDisruptionBudget").values():
        assert selects(budget["spec"]["selector"]["matchLabels"], gateway)
    for hpa in of_kind("HorizontalPodAutoscaler").values():
        target = loads[hpa["spec"]["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"], "the autoscaler owns replicas: a re-apply would reset them"


# -- KEDA ------------------------------------------------------------------------------------------

def test_keda_scales_the_workers_on_the_streams_despina_writes() -> None:
    [scaled] = of_kind("ScaledObject", keda()).values()
    auths = of_kind("TriggerAuthentication", keda())
    namespace = kustomization()["namespace"]
    assert all(d["metadata"]["namespace"] == namespace for d in keda())
    role, settings, _, _ = kube_roles()[scaled["spec"]["scaleTargetRef"]["name"]]
    assert role == "worker"
    keys = Keys(settings.key_prefix)
    valkey = of_kind("Service")["valkey"]
    request = re.compile(re.escape(keys.prefix)
                         + r":req:(?P<model>[^:]+):(?P<version>\d+)(?::p(?P<level>\d+))?")
    streams = set()
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "redis-streams"
        meta = trigger["metadata"]
        assert set(meta) <= KEDA_REDIS_STREAMS, f"not KEDA fields: {set(meta) - KEDA_REDIS_STREAMS}"
        assert all(isinstance(v, str) for v in meta.values()), "KEDA's metadata values are strings"
        host, port = meta["address"].rsplit(":", 1)
        assert host.split(".")[:2] == ["valkey", namespace], f"{host}: the Valkey Service in {namespace}"
        assert int(port) == valkey["spec"]["ports"][0]["port"]
        stream = meta["stream"]
        if stream == keys.control_commands:
            assert meta.get("consumerGroup", CONTROL_GROUP) == CONTROL_GROUP
        else:
            m = request.fullmatch(stream)
            assert m, f"{stream} is not a request stream under the prefix {keys.prefix!r}"
            assert keys.request_stream(m["model"], int(m["version"]), int(m["level"] or 1)) == stream
            assert (ROOT / "model_repository" / m["model"] / "config.pbtxt").exists(), "an example model"
            assert meta.get("consumerGroup", GROUP) == GROUP
        streams.add(stream)
        ref = auths[trigger["authenticationRef"]["name"]]["spec"]["secretTargetRef"][0]
        assert ref["key"] in secrets()[ref["name"]]["stringData"]
    assert streams - {keys.control_commands}, "no request stream"
    assert settings.model_replicas == 0, "workers KEDA adds must load the models (DESPINA_MODEL_REPLICAS 0)"
    if scaled["spec"].get("minReplicaCount", 0) == 0:  # keda.yaml's conditions for removing the last worker
        assert 0 < settings.idle_timeout_s < scaled["spec"].get("cooldownPeriod", 300)
        assert keys.control_commands in streams


def test_kustomize_renders_the_manifests() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    done = subprocess.run([kubectl, "kustomize", str(KUBE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert len(rendered) == len(manifests())
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == kustomization()["namespace"], doc["metadata"]["name"]
    [tag] = kustomization()["images"]
    images = {c["image"] for d in rendered if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {f"{tag['newName']}:{tag['newTag']}"}


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = documents(path)
    assert docs and all(isinstance(d, dict) for d in docs)
