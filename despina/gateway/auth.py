"""Who may call what: API keys (bearer tokens) and Triton's restricted-API headers.

`Guard` is an ASGI middleware that runs before routing. It names the API group of the request's path
with Triton's names (health, metadata, inference, model-config, model-repository, statistics), checks
the model name and version the path carries, then the credentials that group needs:

- With API keys configured, model-repository, model-config, statistics, logging, shared-memory and trace
  need a key, and so does every path not listed here (deny by default); inference and metadata need one
  only with `auth_inference`. Health and the OpenAPI document stay open.
- A Triton restriction (`<apis>:<header>=<value>`) makes its APIs need that header (403 without it,
  as Triton answers); where keys are configured too, a valid key opens them as well (then 401).

Key entries: `KEY` (every model) or `KEY: model1, model2` (those models only; such a key cannot use
the server-wide repository index or statistics, nor load a model with new config or files). Keys are
kept only as SHA-256 digests and compared in constant time; no message or log line ever holds one.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..contract.errors import Code, ConfigError, DespinaError, InvalidArgument, NotFound
from ..contract.modelconfig import check_model_name
from ..registry.base import VERSION_DIGITS
from ..settings import Settings
from . import http
from .http import Receive, Scope, Send

log = logging.getLogger("despina.gateway")

TRITON_APIS = frozenset({"health", "metadata", "inference", "shared-memory", "model-config",
                         "model-repository", "statistics", "trace", "logging"})
KEY_APIS = frozenset({"model-repository", "model-config", "statistics", "logging", "shared-memory", "trace"})
INFERENCE_APIS = frozenset({"inference", "metadata"})
OPEN = "open"          # the OpenAPI document: never restricted
UNLISTED = "unlisted"  # a path no API group names: needs an unrestricted key when keys are configured
SERVER_WIDE_OK = frozenset({"metadata"})  # server-wide APIs a model-limited key may still call
KEY_MODELS = "despina.key_models"  # in the ASGI scope: the models the caller's key is limited to

_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")      # RFC 6750 b64token
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")  # RFC 9110 token
_VERSION = re.compile(rf"[0-9]{{1,{VERSION_DIGITS}}}")
_MODEL = r"(?P<model{i}>[^/]+)(?:/versions/(?P<version{i}>[^/]+))?"
ROUTES: tuple[tuple[str, str], ...] = (  # (path pattern, API group); the router's routes, most used first
    (rf"/v2/models/{_MODEL}/infer", "inference"),
    (rf"/fn/{_MODEL}", "inference"),
    (rf"/v2/models/{_MODEL}/generate(?:_stream)?", "inference"),
    (r"/v2/health/(?:live|ready)", "health"),
    (r"/readyz", "health"),
    (rf"/v2/models/{_MODEL}/ready", "health"),
    (r"/v2", "metadata"),
    (r"/openapi\.json", OPEN),
    (r"/v2/models/stats", "statistics"),
    (rf"/v2/models/{_MODEL}", "metadata"),
    (rf"/v2/models/{_MODEL}/config", "model-config"),
    (rf"/v2/models/{_MODEL}/stats", "statistics"),
    (r"/v2/repository/index", "model-repository"),
    (r"/v2/logging", "logging"),
    (rf"/v2(?:/models/{_MODEL})?/trace/setting", "trace"),
    (r"/v2/(?:system|cuda)sharedmemory(?:/region/[^/]+)?/(?:status|register|unregister)", "shared-memory"),
    (r"/v2/repository/models/(?P<model{i}>[^/]+)/(?:load|unload)", "model-repository"),
    # SageMaker's contract (gateway/sagemaker.py): /invocations runs the endpoint's model, named nowhere
    (r"/invocations", "inference"),
    (r"/ping", "health"),
    (r"/models/(?P<model{i}>[^/]+)/invoke", "inference"),
    (r"/models(?:/(?P<model{i}>[^/]+))?", "model-repository"),
)
# One regular expression for all: a request pays one match, not one per route.
_ROUTE = re.compile("|".join(f"(?P<r{i}>{p.replace('{i}', str(i))})" for i, (p, _) in enumerate(ROUTES)))
_GROUPS = {f"r{i}": (api, f"model{i}" if "model{i}" in p else "", f"version{i}" if "version{i}" in p else "")
           for i, (p, api) in enumerate(ROUTES)}


class Unauthenticated(DespinaError):
    code = Code.UNAUTHENTICATED


class PermissionDenied(DespinaError):
    code = Code.PERMISSION_DENIED


class Target(NamedTuple):
    """What a request path names: its API group, and the model and version in it."""

    api: str
    model: str | None = None
    version: str | None = None


def classify(path: str) -> Target:
    m = _ROUTE.fullmatch(path)
    if m is None:
        return Target(UNLISTED)
    api, model, version = _GROUPS[m.lastgroup]  # type: ignore[index]
    return Target(api, m.group(model) if model else None, m.group(version) if version else None)


def check_target(target: Target) -> None:
    """Model names and versions from a client never reach a key, a path or int() unchecked."""
    if target.model is not None:
        if len(target.model) > 128:
            raise InvalidArgument("invalid model name: longer than 128 characters")
        check_model_name(target.model)
    if target.version is not None and not _VERSION.fullmatch(target.version):
        # 404 on every route, as Triton's: its routes take a version of digits only, and answer any other
        # path "Not Found" (a longer number is no version of any model either)
        shown = target.version if len(target.version) <= 32 else target.version[:32] + "..."
        raise NotFound(f"no such model version {shown!r}: a version is a number of 1 to {VERSION_DIGITS} "
                       "digits")


@dataclass(frozen=True)
class ApiKey:
    digest: bytes                       # SHA-256 of the key; the key itself is not kept
    models: frozenset[str] | None       # None: every model


@dataclass(frozen=True)
class Restriction:
    """One of Triton's `--http-restricted-api` groups: these APIs need `header: value`."""

    apis: frozenset[str]
    header: bytes                       # lower case, as ASGI servers hand headers over
    digest: bytes                       # SHA-256 of the value


def _digest(secret: str | bytes) -> bytes:
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


def _entries(text: str, comments: bool = True) -> list[tuple[int, str]]:
    out = []
    for n, line in enumerate(re.split(r"[;\n]", text), 1):
        line = (line.split("#", 1)[0] if comments else line).strip()
        if line:
            out.append((n, line))
    return out


def parse_keys(text: str, source: str) -> list[ApiKey]:
    """Key entries (`KEY` or `KEY: model, ...`, separated by ';' or newlines) -> keys."""
    keys: list[ApiKey] = []
    seen: set[bytes] = set()
    for n, entry in _entries(text):
        secret, scoped, models = entry.partition(":")
        secret = secret.strip()
        where = f"{source}, entry {n}"
        if not _TOKEN.fullmatch(secret):  # the message never repeats the key
            raise ConfigError(f"{where}: an API key may hold only letters, digits and -._~+/ "
                              "(then '=' padding)")
        if len(secret) < 16:
            log.warning("%s: the API key is shorter than 16 characters; use a long random one "
                        "(openssl rand -hex 32)", where)
        names = None
        if scoped:
            listed = [m.strip() for m in models.split(",") if m.strip()]
            if not listed:
                raise ConfigError(f"{where}: no model names after ':'")
            try:
                names = frozenset(check_model_name(m) for m in listed)
            except InvalidArgument as exc:
                raise ConfigError(f"{where}: {exc}") from None
        digest = _digest(secret)
        if digest in seen:
            raise ConfigError(f"{where}: the same key appears twice")
        seen.add(digest)
        keys.append(ApiKey(digest, names))
    return keys


def parse_restricted_api(text: str) -> list[Restriction]:
    """Triton's `<api>,<api>...:<header>=<value>` groups, separated by ';' or newlines."""
    groups: list[Restriction] = []
    taken: set[str] = set()
    for n, entry in _entries(text, comments=False):  # a value may hold '#', as Triton's may
        apis_text, colon, pair = entry.partition(":")
        header, equals, value = pair.partition("=")
        where = f"DESPINA_HTTP_RESTRICTED_API, group {n}"
        if not (colon and equals and value.strip() and _HEADER_NAME.fullmatch(header.strip())):
            raise ConfigError(f"{where}: expected <api>[,<api>...]:<header>=<value>")
        apis = {a.strip() for a in apis_text.split(",") if a.strip()}
        unknown = sorted(apis - TRITON_APIS)
        if not apis or unknown:
            raise ConfigError(f"{where}: unknown API {', '.join(unknown) or '(none)'}; known: "
                              f"{', '.join(sorted(TRITON_APIS))}")
        if apis & taken:
            raise ConfigError(f"{where}: API {', '.join(sorted(apis & taken))} is already in a group")
        taken |= apis
        groups.append(Restriction(frozenset(apis), header.strip().lower().encode(),
                                  _digest(value.strip())))
    return groups


class AuthPolicy:
    """The credentials each API group needs, built once from the settings."""

    def __init__(self, keys: list[ApiKey], restrictions: list[Restriction], auth_inference: bool) -> None:
        self.keys = tuple(keys)
        self.key_apis = KEY_APIS | INFERENCE_APIS if auth_inference else KEY_APIS
        self.restricted = {api: r for r in restrictions for api in r.apis}
        self.active = bool(self.keys or self.restricted)

    @classmethod
    def from_settings(cls, settings: Settings) -> AuthPolicy:
        keys = parse_keys(settings.api_keys or "", "DESPINA_API_KEYS")
        if settings.api_keys_file:
            path = Path(settings.api_keys_file)
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"cannot read the API keys file {path}: {exc}") from None
            keys += parse_keys(text, str(path))
            if len({k.digest for k in keys}) != len(keys):
                raise ConfigError(f"{path} repeats a key of DESPINA_API_KEYS")
        policy = cls(keys, parse_restricted_api(settings.http_restricted_api or ""), settings.auth_inference)
        if policy.active:
            log.info("gateway: %d API key(s); key needed for %s; Triton restricted APIs: %s",
                     len(policy.keys), ", ".join(sorted(policy.key_apis)),
                     ", ".join(sorted(policy.restricted)) or "none")
        return policy

    def check(self, target: Target, headers: list[tuple[bytes, bytes]]) -> ApiKey | None:
        """Returns when the request may go on (with the key it came with, when one was needed and
        given); raises Unauthenticated or PermissionDenied."""
        if not self.active or target.api == OPEN:
            return None
        restriction = self.restricted.get(target.api)
        needs_key = bool(self.keys) and (target.api == UNLISTED or target.api in self.key_apis)
        if restriction is None and not needs_key:
            return None
        if restriction is not None:
            given = _header(headers, restriction.header)
            if given is not None and hmac.compare_digest(_digest(given), restriction.digest):
                return None
        token = _bearer(headers)
        if self.keys and token is not None:
            key = self._match(token)
            if key is None:
                raise Unauthenticated("the API key is not valid")
            self._check_scope(key, target)
            return key
        if restriction is not None:
            expecting = f"This API is restricted, expecting header '{restriction.header.decode()}'"
            if self.keys:  # a key opens it too: an authentication challenge
                raise Unauthenticated(f"{expecting} or 'Authorization: Bearer <key>'")
            raise PermissionDenied(expecting)  # Triton's answer: 403, no challenge
        raise Unauthenticated(f"the {target.api} API needs an API key: send 'Authorization: Bearer <key>'"
                              if target.api != UNLISTED else
                              "this path needs an API key: send 'Authorization: Bearer <key>'")

    def _match(self, token: bytes) -> ApiKey | None:
        digest = _digest(token)
        found = None
        for key in self.keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    @staticmethod
    def _check_scope(key: ApiKey, target: Target) -> None:
        if key.models is None:
            return
        if target.model is None:
            if target.api == "inference":
                return  # SageMaker's /invocations: the endpoint names its model, and checks the key's scope
            if target.api not in SERVER_WIDE_OK:
                raise PermissionDenied(f"this API key is limited to some models; the server-wide "
                                       f"{target.api} API needs a key for every model")
        elif target.model not in key.models:
            raise PermissionDenied(f"this API key may not use model '{target.model}'")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _bearer(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    value = _header(headers, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class Guard:
    """ASGI middleware: a request goes on only with a well-formed model path and the credentials
    its API group needs."""

    def __init__(self, app: object, policy: AuthPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            root = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root):]
            target = classify(path)
            try:
                if path.endswith("\n"):
                    # the router's patterns end in '$', which matches before a final newline too: it would
                    # serve '/v2/logging\n' as /v2/logging, where classify() names no API group for it
                    raise NotFound("no such path")
                key = self.policy.check(target, scope["headers"])
                check_target(target)
            except DespinaError as exc:
                await http.send_error(send, exc)
                return
            if key is not None and key.models is not None:
                scope[KEY_MODELS] = key.models  # for a route whose model the path does not name
        await self.app(scope, receive, send)  # type: ignore[operator]


def check_key_scope(scope: Scope, model: str) -> None:
    """For a route that names its model itself (SageMaker's /invocations): the caller's key may use it."""
    allowed = scope.get(KEY_MODELS)
    if allowed is not None and model not in allowed:
        raise PermissionDenied(f"this API key may not use model '{model}'")


def check_key_may_rewrite(scope: Scope, params: dict[str, object]) -> None:
    """The load API's `config` and `file:` parameters replace a model's config and files (never written into
    the repository), and a Python model's files are code the server runs, which may call any model: not
    for a key limited to some."""
    if scope.get(KEY_MODELS) is not None and any(k == "config" or k.startswith("file:") for k in params):
        raise PermissionDenied("a load with 'config' or 'file:' parameters needs a key for every model; "
                               "this one may load a model only as the repository holds it")
