"""Readers for tests/test_deploy.py: deploy/Dockerfile's final image, the compose file and the Kubernetes
manifests as Kubernetes would see them, and a `despina` command line turned into the settings it starts
with, as cli.main builds them."""
from __future__ import annotations

import contextlib
import fnmatch
import functools
import io
import json
import re
import shlex
from collections.abc import Iterable, Iterator
from copy import deepcopy
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes.client as k8s
import pytest
import redis.asyncio as aioredis
import yaml

from despina import cli
from despina.control.http import create_app as control_app
from despina.gateway.app import create_app as gateway_app
from despina.settings import BadSetting, Settings
from despina.workers.health import create_app as worker_health_app

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
SETTINGS = frozenset(f"DESPINA_{f.name.upper()}" for f in fields(Settings))
DEFAULTS = Settings()
NEEDS_REDIS = {"gateway", "worker", "control"}  # cli.main refuses to start these without a Redis URL
NOT_IN_KUSTOMIZATION = {"kustomization.yaml", "keda.yaml", "secrets.example.yaml"}


# -- reading the files ---------------------------------------------------------------------------------

def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@dataclass
class Image:
    """What one stage of deploy/Dockerfile carries, with what it took from the stage it starts from."""

    args: dict[str, str] = field(default_factory=dict)
    base: str = ""
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    copies: list[list[str]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    expose: set[int] = field(default_factory=set)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    user: str = "root"
    healthcheck: str = ""


def instructions(text: str) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, its arguments), continuation lines joined, comment lines dropped."""
    parts: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            parts.append(line[:-1].strip())
            continue
        keyword, _, rest = " ".join([*parts, line]).partition(" ")
        parts = []
        yield keyword.upper(), rest.strip()


@functools.cache
def stages() -> dict[str, Image]:
    """The Dockerfile's stages by name, in order: the last is what `docker build` makes."""
    built: dict[str, Image] = {}
    args: dict[str, str] = {}  # those before the first FROM, seen by every stage's FROM line
    img = Image(args=args)
    for keyword, rest in instructions((DEPLOY / "Dockerfile").read_text()):
        if keyword == "FROM":
            words = rest.split()  # IMAGE [AS NAME]
            source, name = words[0], words[2] if len(words) == 3 else str(len(built))
            img = deepcopy(built[source]) if source in built else Image(args=args, base=source)
            built[name] = img
        elif keyword == "ARG":
            arg, _, default = rest.partition("=")
            img.args.setdefault(arg, default)
        elif keyword == "ENV":
            for token in shlex.split(rest):
                var, eq, value = token.partition("=")
                assert eq, f"ENV {rest}: write NAME=value"
                img.env[var] = value
        elif keyword == "LABEL":
            for token in shlex.split(rest):
                key, eq, value = token.partition("=")
                assert eq, f"LABEL {rest}: write key=value"
                img.labels[key] = value
        elif keyword == "COPY":
            img.copies.append([t for t in shlex.split(rest) if not t.startswith("--")])
        elif keyword == "RUN":
            img.runs.append(rest)
        elif keyword == "VOLUME":
            img.volumes += json.loads(rest)
        elif keyword == "EXPOSE":
            img.expose |= {int(port.split("/")[0]) for port in rest.split()}
        elif keyword in ("ENTRYPOINT", "CMD"):
            value = json.loads(rest)  # the exec form: the shell form would run `sh -c`, not despina
            assert isinstance(value, list), f"{keyword} {rest}: use the exec (JSON) form"
            setattr(img, keyword.lower(), value)
        elif keyword == "USER":
            img.user = rest
        elif keyword == "HEALTHCHECK":
            img.healthcheck = rest
    return built


def image(stage: str | None = None) -> Image:
    """A stage of the Dockerfile: by default the one `docker build` makes without --target."""
    built = stages()
    return built[stage] if stage else list(built.values())[-1]


@functools.cache
def options_of(command: str) -> frozenset[str]:
    """Every long option `despina COMMAND` takes, as its --help spells them (no abbreviations)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.parser().parse_args([command, "--help"])
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))


def run_role(argv: list[str], env: dict[str, str], where: str) -> tuple[str, Settings]:
    """The command and settings `despina ARGV` starts with under ENV, built as cli.main builds them; the
    test fails on an option the CLI does not take or a setting it would refuse to start with."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = cli.parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `despina {shlex.join(argv)}`: {err.getvalue().strip()}")
    for token in argv:
        option = token.split("=", 1)[0]
        assert not option.startswith("--") or option in options_of(args.command), \
            f"{where}: `despina {args.command}` has no option {option} (argparse took it as an abbreviation)"
    unknown = sorted(name for name in env if name.startswith("DESPINA_") and name not in SETTINGS)
    assert not unknown, f"{where}: not settings: {unknown}"
    try:
        settings = cli.settings_of(args, env)
    except BadSetting as exc:
        pytest.fail(f"{where}: `despina {shlex.join(argv)}` would not start: {exc}")
    if args.command in NEEDS_REDIS:
        assert settings.redis_url, f"{where}: `despina {args.command}` needs REDIS_URL or --redis-url"
    return args.command, settings


@functools.cache
def control_routes() -> frozenset[str]:
    app = control_app(DEFAULTS, aioredis.Redis())  # never connects: only the routes are read
    return frozenset(route.path for route in app.routes)


@functools.cache
def gateway_routes(sagemaker: bool) -> frozenset[str]:
    # nothing connects before start-up: only the routes are read
    app = gateway_app(Settings(redis_url="redis://127.0.0.1:1", sagemaker=sagemaker))
    return frozenset(route.path for route in app.routes)


def worker_routes() -> frozenset[str]:
    return frozenset(route.path for route in worker_health_app(dict).routes)


def role_paths(role: str, settings: Settings) -> dict[str, frozenset[str]]:
    """The HTTP paths a role serves, by the setting that names their port (a port of 0 is none)."""
    gateway = gateway_routes(settings.sagemaker)
    if role == "gateway":
        return {"http_port": gateway}
    if role == "control":
        return {"metrics_port": control_routes()}
    if role == "worker":
        return {"worker_health_port": worker_routes()} if settings.worker_health_port else {}
    if role == "serve":
        return {"http_port": gateway, "metrics_port": control_routes()}
    return {}


def check_http_check(url: str, role: str, settings: Settings, where: str) -> None:
    """A health check's URL is on a port this role listens on, and names a path it serves there."""
    parsed = urlparse(url)
    listening = {getattr(settings, name): paths for name, paths in role_paths(role, settings).items()}
    assert parsed.port in listening, f"{where}: {url}: `despina {role}` listens on {sorted(listening)}"
    assert parsed.path in listening[parsed.port], f"{where}: {url}: no such route"


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the build context: the last pattern matching it or a folder
    above it decides."""
    parents = [str(Path(*Path(path).parts[:i])) for i in range(1, len(Path(path).parts) + 1)]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        glob = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase(p, glob) or fnmatch.fnmatchcase(p, glob.removeprefix("**/"))
               for p in parents):
            ignored = not keep
    return ignored


# -- compose -------------------------------------------------------------------------------------

@functools.cache
def compose() -> dict[str, Any]:
    [doc] = documents(DEPLOY / "compose.yaml")
    return doc


def interpolate(value: Any) -> Any:
    """Compose's ${VAR:-default} with nothing set (every variable has a default), and $$ for a $."""
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, str):
        return re.sub(r"(?<!\$)\$\{\w+:-([^}]*)\}", r"\1", value).replace("$$", "$")
    return value


def compose_roles() -> dict[str, tuple[str, Settings, dict[str, Any]]]:
    """Each compose service that runs a `despina` role: (role, settings, the service)."""
    ours = interpolate(compose()["x-despina"]["image"])
    roles = {}
    for name, raw in compose()["services"].items():
        service = interpolate(raw)
        if service.get("image") != ours or "entrypoint" in service:
            continue
        command = service.get("command", image().cmd)
        argv = shlex.split(command) if isinstance(command, str) else command
        env = {**image().env, **{k: str(v) for k, v in service.get("environment", {}).items()}}
        roles[name] = (*run_role(argv, env, f"compose.yaml: {name}"), service)
    return roles


def published(service: dict[str, Any]) -> set[int]:
    return {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in service.get("ports", [])}


# -- kubernetes ----------------------------------------------------------------------------------

@functools.cache
def kustomization() -> dict[str, Any]:
    [doc] = documents(KUBE / "kustomization.yaml")
    return doc


@functools.cache
def manifests() -> tuple[dict[str, Any], ...]:
    return tuple(d for name in kustomization()["resources"] for d in documents(KUBE / name))


def of_kind(kind: str, docs: tuple[dict[str, Any], ...] | None = None) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in (manifests() if docs is None else docs) if d["kind"] == kind}


def workloads() -> dict[str, dict[str, Any]]:
    return {**of_kind("Deployment"), **of_kind("StatefulSet")}


def secrets() -> dict[str, dict[str, Any]]:
    return of_kind("Secret", tuple(documents(KUBE / "secrets.example.yaml")))


def selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def service_link_variables(services: Iterable[dict[str, Any]]) -> set[str]:
    """The variables Kubernetes gives every pod of a namespace for each of its Services, unless the pod says
    enableServiceLinks: false (Kubernetes' "Services": FOO_SERVICE_HOST, FOO_PORT=tcp://IP:PORT, ...)."""
    names: set[str] = set()
    for service in services:
        base = service["metadata"]["name"].upper().replace("-", "_")
        names |= {f"{base}_SERVICE_HOST", f"{base}_SERVICE_PORT", f"{base}_PORT"}
        for port in service["spec"]["ports"]:
            if "name" in port:
                names.add(f"{base}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}")
            tcp = f"{base}_PORT_{port['port']}_{port.get('protocol', 'TCP')}"
            names |= {tcp, f"{tcp}_PROTO", f"{tcp}_PORT", f"{tcp}_ADDR"}
    return names


def container_env(container: dict[str, Any], where: str) -> dict[str, str]:
    """The environment Kubernetes gives a container: ConfigMaps, then env (with $(VAR) expanded)."""
    configmaps = of_kind("ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"{where}: no ConfigMap {name}"
        env.update(configmaps[name]["data"])
    for var in container.get("env", []):
        if "value" in var:
            for ref in re.findall(r"\$\((\w+)\)", var["value"]):
                assert ref in env, f"{where}: {var['name']} uses $({ref}) before it is defined"
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["key"] in secrets().get(ref["name"], {}).get("stringData", {}), \
                f"{where}: {var['name']}: Secret {ref['name']} has no {ref['key']} in secrets.example.yaml"
            env[var["name"]] = "from-a-secret"
    return env


def kube_roles() -> dict[str, tuple[str, Settings, dict[str, Any], dict[str, Any]]]:
    """Each container running a `despina` role: (role, settings, container, workload), by workload."""
    roles = {}
    for name, workload in workloads().items():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if container["image"].split(":")[0] != "despina":
                continue
            where = f"{name}/{container['name']}"
            assert container.get("command", ["despina"]) == ["despina"], f"{where}: keep the entrypoint"
            env = {**image().env, **container_env(container, where)}
            roles[name] = (*run_role(container.get("args", image().cmd), env, where), container, workload)
    return roles


# -- KEDA ----------------------------------------------------------------------------------------

def keda() -> tuple[dict[str, Any], ...]:
    return tuple(documents(KUBE / "keda.yaml"))


# -- Kubernetes' API types, as the kubernetes client package describes them ------------------------------

SCALARS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,),
                                         "datetime": (str,), "date": (str,)}


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """Every field of `doc` that its kind does not have, or whose value is of the wrong type."""
    version = doc.get("apiVersion", "").rsplit("/", 1)[-1]
    model = f"{version[:1].upper()}{version[1:]}{doc.get('kind', '')}"
    if not hasattr(k8s, model):
        return [f"{doc.get('apiVersion')} {doc.get('kind')}: not a kind of Kubernetes' API"]
    errors: list[str] = []
    _walk(doc, model, doc["kind"], errors)
    return errors


def _walk(value: Any, type_name: str, path: str, errors: list[str]) -> None:
    if type_name.lower().startswith("list["):
        if not isinstance(value, list):
            errors.append(f"{path}: a list, not {value!r}")
            return
        for i, item in enumerate(value):
            _walk(item, type_name[5:-1], f"{path}[{i}]", errors)
    elif type_name.lower().startswith("dict["):
        if not isinstance(value, dict):
            errors.append(f"{path}: a mapping, not {value!r}")
            return
        for key, item in value.items():
            _walk(item, type_name[5:-1].split(", ", 1)[1], f"{path}.{key}", errors)
    elif type_name == "object":  # int-or-string and free-form fields
        return
    elif type_name in SCALARS:
        if not isinstance(value, SCALARS[type_name]) or (type_name != "bool" and isinstance(value, bool)):
            errors.append(f"{path}: a {type_name}, not {value!r}")
    else:
        _fields(value, getattr(k8s, type_name), path, errors)


def _fields(value: Any, model: Any, path: str, errors: list[str]) -> None:
    if not isinstance(value, dict):
        errors.append(f"{path}: a {model.__name__} mapping, not {value!r}")
        return
    names = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        if key not in names:
            errors.append(f"{path}: {model.__name__} has no field {key!r}")
        else:
            _walk(item, model.openapi_types[names[key]], f"{path}.{key}", errors)
