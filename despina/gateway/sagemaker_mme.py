"""SageMaker's multi-model endpoint (SAGEMAKER_MULTI_MODEL=true: explicit model control), as Triton's
SageMaker front end serves it (the single-model routes: sagemaker.py).

POST /models {"model_name", "url"} copies the model folder SageMaker unpacked at `url` into the model
repository as `model_name` and loads it (409 when that name is loaded, 400 on an endpoint without
explicit model control; its errors name the TargetModel SageMaker sends along, as an invoke's do; an
archive of an ensemble and the models it calls loads them under their own names, and DELETE unloads
them with it); GET /models (paged: max_results, next_page_token), GET
/models/{name}, DELETE /models/{name} (404 when not loaded), and POST /models/{name}/invoke (V2
inference whatever the inference type, as Triton's; 404 when not loaded; the answer and its errors
name the X-Amzn-SageMaker-Target-Model SageMaker sends, as Triton's do). The endpoint's models are kept in one
Redis hash, so that every gateway of the endpoint answers for them alike.
"""
from __future__ import annotations

import asyncio
import errno
import io
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as HttpRoute

from ..contract.commands import LOAD, UNLOAD
from ..contract.ensemble import PLATFORM
from ..contract.errors import Code, DespinaError, FailedPrecondition, InvalidArgument, NotFound
from ..contract.modelconfig import check_model_name, parse_text
from ..registry import LocalRegistry, open_registry
from ..registry.base import is_version
from ..registry.transfer import push
from . import http
from .asgi_endpoint import AsgiEndpoint, AsgiExchange
from .http import Scope
from .infer import Exchange, fail
from .responses import error_response, json_body, json_response
from .sagemaker import SageMakerInfer

if TYPE_CHECKING:
    from ..contract.modelspec import ModelSpec
    from ..settings import Settings
    from .app import Gateway

log = logging.getLogger("despina.gateway")

TARGET_MODEL = b"x-amzn-sagemaker-target-model"  # InvokeEndpoint's TargetModel: "[path/]archive.tar.gz"
FORBIDDEN_ROOTS = ("/dev/", "/proc/", "/sys/")  # as Triton: a load never reads from these
PAGE_MAX = 1000  # models in one GET /models answer at most
# a model's failure for lack of memory, in the frameworks' words that Triton's SageMaker front end looks for
OUT_OF_MEMORY = ("out of memory", "Out of memory", "Out Of Memory", "CUDA_OUT_OF_MEMORY", "MemoryError",
                 "OutOfMemory", "OOM", "Dst tensor is not initialized", "Src tensor is not initialized",
                 "CNMEM_STATUS_OUT_OF_MEMORY", "CUDNN_STATUS_NOT_INITIALIZED", "CUBLAS_STATUS_ALLOC_FAILED",
                 "CUBLAS_STATUS_NOT_INITIALIZED", "failed to allocate memory", "Failed to allocate memory",
                 "No space left on device")


class AlreadyLoaded(DespinaError):
    code = Code.FAILED_PRECONDITION  # 409 on SageMaker's routes


class ModelInvoke(SageMakerInfer):
    """POST /models/{name}/invoke: 404 for a model not loaded, as SageMaker's multi-model contract asks (an
    unloaded one would otherwise answer 400, one whose load failed 503)."""

    def __call__(self, ex: Exchange) -> None:
        name = ex.params["model"]
        if not _loaded(self.gateway, name):
            fail(ex, NotFound(f"model '{name}' is not loaded"), http.header(ex.headers, b"x-request-id"))
            return
        super().__call__(ex)

    def answered_as(self, ex: Exchange, spec: ModelSpec) -> str:
        """InvokeEndpoint's TargetModel, which SageMaker sends along: Triton's image loads the model under
        that name, so its answers name what the client asked for, not SageMaker's opaque model_name."""
        return target_model(ex.headers) or spec.name


class TargetExchange(AsgiExchange):
    """An invoke's exchange: its errors name the TargetModel as its answers do (Triton's name the model it
    loaded under the TargetModel), where they named SageMaker's model_name, which the client never saw;
    a model's failure for lack of memory is a 507, as Triton's image answers it."""

    def respond(self, status: int, body: bytes, content_type: bytes, extra: http.Headers) -> None:
        if status >= 400:  # errors only: an answer goes as it is
            target = target_model(self.headers)
            try:
                message = orjson.loads(body)["error"]
                if target:
                    body = orjson.dumps({"error": named_as_sent(message, self.params["model"], target)})
                if status >= 500 and out_of_memory(message):
                    status = 507
            except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                pass  # not an error of ours (there is none such): as it is
        super().respond(status, body, content_type, extra)


class InvokeEndpoint(AsgiEndpoint):
    """POST /models/{name}/invoke under ASGI, its exchange a TargetExchange."""

    def exchange(self, scope: Scope, body: bytes) -> AsgiExchange:
        return TargetExchange(scope, body)


def target_model(headers: http.Headers) -> str | None:
    """X-Amzn-SageMaker-Target-Model: InvokeEndpoint's TargetModel, which SageMaker sends with an invoke
    (not in a test on one's own machine)."""
    target = http.header(headers, TARGET_MODEL)
    return target.decode("utf-8", "replace") if target else None


def out_of_memory(message: object) -> bool:
    """Whether a model's failure says it ran out of memory, in the words Triton's SageMaker front end
    looks for (the frameworks'): SageMaker reads the 507 it answers as "unload others and retry". A
    model's failures only (5xx): Triton's check also turns a refused request naming, say, an input
    "BLOOM" into a 507."""
    return isinstance(message, str) and any(words in message for words in OUT_OF_MEMORY)


def named_as_sent(message: str, name: str, target: str | None) -> str:
    """An error's message naming the TargetModel where it named SageMaker's model_name (as it is without
    a TargetModel)."""
    return message.replace(f"'{name}'", f"'{target}'") if target and name else message


def multi_model_routes(gw: Gateway) -> list[HttpRoute]:
    key = gw.keys.sagemaker_models

    async def load(request: Request) -> Response:
        target = request.headers.get(TARGET_MODEL.decode())  # errors name it, as Triton's (it loads as that)
        name: object = None
        try:
            if gw.settings.model_control_mode != "explicit":  # before staging: its folder would stay behind
                raise FailedPrecondition("this endpoint loads no models: POST /models needs a multi-model "
                                         "endpoint (SAGEMAKER_MULTI_MODEL=true) or "
                                         "--model-control-mode explicit")
            doc = await json_body(request, gw.settings.max_body_bytes)
            name, url = doc.get("model_name"), doc.get("url")
            if not isinstance(name, str) or not isinstance(url, str) or not name or not url:
                raise InvalidArgument("the body must be {\"model_name\": \"...\", \"url\": \"...\"} "
                                      "with both strings")
            check_model_name(name)
            if await gw.redis.hexists(key, name) or _loaded(gw, name):  # by /models or by the V2 API
                raise AlreadyLoaded(f"model '{name}' is already loaded")
            # one load of a name at a time, over every gateway (two staged into one folder, and both
            # answered 200); the claim expires should its gateway die in the load
            claim = gw.keys.sagemaker_loading(name)
            if not await gw.redis.set(claim, url, nx=True, px=int(1000 * (gw.settings.load_timeout_s + 60))):
                raise AlreadyLoaded(f"model '{name}' is being loaded")
        except DespinaError as exc:
            return _load_error(exc, name if isinstance(name, str) else "", target)
        try:
            return await staged_and_loaded(name, url, target)
        finally:
            await gw.redis.delete(claim)

    async def staged_and_loaded(name: str, url: str, target: str | None) -> Response:
        try:
            folder, steps = model_folders(url)
            for step in steps:  # as Triton: an archive's other models keep their names, once
                if step.name == name or _loaded(gw, step.name):
                    raise AlreadyLoaded(f"model '{step.name}' of the archive at '{url}' is already loaded")
        except DespinaError as exc:
            return _load_error(exc, name, target)
        staged: list[str] = []  # the folders this load made in the repository (filled by stage)
        try:
            await asyncio.to_thread(stage, folder, name, gw.settings, steps, staged)
        except (DespinaError, OSError) as exc:
            await _unstage(gw, staged)  # what it copied before it stopped
            return _load_error(exc if isinstance(exc, DespinaError) else _copy_error(exc, url), name, target)
        try:
            # no room on any worker: 507 at once, SageMaker's cue to unload others and retry
            await gw.view.control.call(LOAD, name, {"fail_without_room": True}, gw.settings.load_timeout_s)
        except DespinaError as exc:
            await _give_up(gw, name)
            await _unstage(gw, staged)
            return _load_error(exc, name, target, loading=True)
        await gw.redis.hset(key, name, orjson.dumps({"url": url, "staged": staged}))
        await gw.view.refresh()
        log.info("SageMaker model %s (TargetModel %s) loaded from %s", name, target or name, url)
        return Response(b"", 200)

    async def listing(request: Request) -> Response:
        try:
            size = _int_param(request, "max_results", PAGE_MAX)
            start = _int_param(request, "next_page_token", 0)
        except DespinaError as exc:
            return error_response(exc)
        models = await _models(gw, key)
        page = models[start:start + min(max(size, 1), PAGE_MAX)]
        doc: dict[str, Any] = {"models": page}
        if start + len(page) < len(models):
            doc["nextPageToken"] = str(start + len(page))
        return json_response(doc)

    async def describe(request: Request) -> Response:
        name = request.path_params["model"]
        raw = await gw.redis.hget(key, name)
        if raw is None:
            return error_response(NotFound(f"model '{name}' is not loaded"))
        return json_response({"modelName": name, "modelUrl": orjson.loads(raw)["url"]})

    async def unload(request: Request) -> Response:
        name = request.path_params["model"]
        try:
            raw = await gw.redis.hget(key, name)
            if raw is None:
                raise NotFound(f"model '{name}' is not loaded")
            await gw.view.control.call(UNLOAD, name, {"unload_dependents": True},  # an ensemble's steps too
                                       gw.settings.load_timeout_s)
            await gw.redis.hdel(key, name)
            await gw.view.refresh()
        except DespinaError as exc:
            return error_response(exc)
        await _unstage(gw, orjson.loads(raw).get("staged", [name]))
        log.info("SageMaker model %s unloaded", name)
        return Response(b"", 200)

    return [
        HttpRoute("/models", load, methods=["POST"]),
        HttpRoute("/models", listing, methods=["GET"]),
        HttpRoute("/models/{model}", describe, methods=["GET"]),
        HttpRoute("/models/{model}", unload, methods=["DELETE"]),
        HttpRoute("/models/{model}/invoke", InvokeEndpoint(ModelInvoke(gw)), methods=["POST"]),
    ]


def _loaded(gw: Gateway, name: str) -> bool:
    """Whether a model of that name is loaded, however it was (serving, loading, or idle: scaled to zero):
    staging an archive under its name would overwrite the files it loads from. One whose load failed is
    not: SageMaker may load it again, as Triton lets it."""
    model = gw.view.models.get(name)
    return model is not None and model.entry.loaded


async def _models(gw: Gateway, key: str) -> list[dict[str, str]]:
    """The endpoint's models that serve now, by name."""
    rows = cast(dict[bytes, bytes], await gw.redis.hgetall(key))
    out = []
    for raw_name, raw in sorted(rows.items()):
        name = raw_name.decode()
        if gw.view.is_ready(name, None):
            out.append({"modelName": name, "modelUrl": orjson.loads(raw)["url"]})
    return out


async def _give_up(gw: Gateway, name: str) -> None:
    """After a failed load, unload what it left: a model still waiting for a worker with room would keep
    the server not ready, and SageMaker would take /ping's answer for a sick container."""
    try:
        await gw.view.control.call(UNLOAD, name, {"unload_dependents": True}, gw.settings.load_timeout_s)
        await gw.view.refresh()
    except DespinaError as exc:
        log.warning("SageMaker model %s: unloading after its failed load failed too: %s", name, exc.message)


async def _unstage(gw: Gateway, names: Sequence[str]) -> None:
    """Remove the copies a load staged, as Triton's image unregisters the repository of a model it unloads
    or failed to load: SageMaker loads and unloads model after model, and each copy would stay on the
    disk for good. A name loaded all the same (by the V2 API: an ensemble's step it also loaded) keeps
    its files."""
    gone = [n for n in names if not _loaded(gw, n)]
    try:
        await asyncio.to_thread(unstage, gone, gw.settings)
    except (DespinaError, OSError) as exc:
        log.warning("SageMaker models %s: removing their staged copies failed: %s", ", ".join(gone), exc)


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if not (raw.isascii() and raw.isdigit()):  # str.isdigit() takes '²', which int() refuses
        raise InvalidArgument(f"'{name}' must be a whole number, got '{raw[:32]}'")
    return int(raw)


def _copy_error(exc: OSError, url: str) -> DespinaError:
    """A copy of the archive's files that failed: a full disk is a 507, as Triton's image answers "No space
    left on device" (SageMaker unloads others, which frees theirs, and retries); anything else is the
    archive's (a file that cannot be read or copied), a 400."""
    message = f"the model's files at '{url}' could not be copied: {exc}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DespinaError(message, Code.RESOURCE_EXHAUSTED)
    return InvalidArgument(message)


def _load_error(exc: DespinaError, name: str, target: str | None, loading: bool = False) -> Response:
    """SageMaker reads 409 as "loaded already" and 507 as "no room: unload another and retry" (no worker
    has room, or, `loading`, the model failed for memory as it loaded). The message names the
    TargetModel where it named the model_name `name`."""
    response = error_response(DespinaError(named_as_sent(exc.message, name, target), exc.code))
    if isinstance(exc, AlreadyLoaded):
        response.status_code = 409
    elif exc.code == Code.RESOURCE_EXHAUSTED or (loading and out_of_memory(exc.message)):
        response.status_code = 507
    return response


def model_folders(url: str) -> tuple[Path, list[Path]]:
    """The model folder in what SageMaker unpacked at `url`, and the archive's other models: the folder
    itself when it is a model's (it has a config.pbtxt or a version folder), else its only model
    sub-folder, else, as Triton's SageMaker front end reads an archive of several, its one ensemble
    (loaded as the endpoint's model) with the models it calls beside it (loaded under their own names).
    Nothing that is not a model's folder is copied."""
    path = Path(os.path.normpath(os.path.abspath(url)))
    if any(str(path).startswith(root) or str(path) + "/" == root for root in FORBIDDEN_ROOTS):
        raise InvalidArgument(f"'url' cannot be under /dev, /proc or /sys, got '{url}'")
    if not path.is_dir():
        raise InvalidArgument(f"'url' must be a folder on the endpoint's machine, got '{url}'")
    if _is_model(path):
        return path, []
    models = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".") and _is_model(p))
    if len(models) == 1:
        return models[0], []
    ensembles = [p for p in models if _is_ensemble(p)]
    if len(ensembles) == 1:
        return ensembles[0], [p for p in models if p != ensembles[0]]
    if not models:
        raise InvalidArgument(f"'{url}' is not a model folder (config.pbtxt and version folders) and holds "
                              "none")
    raise InvalidArgument(f"'{url}' holds {len(models)} model folders and {len(ensembles) or 'no'} "
                          f"ensemble{'' if len(ensembles) == 1 else 's'}: an archive of several models "
                          "needs exactly one ensemble, the model the endpoint loads")


def _is_ensemble(folder: Path) -> bool:
    config = folder / "config.pbtxt"
    if not config.is_file():
        return False
    try:
        parsed = parse_text(folder.name, config.read_bytes())
    except (DespinaError, OSError):
        return False  # not this one: its own load says what is wrong with it
    return PLATFORM in (parsed.platform, parsed.backend)


def _is_model(folder: Path) -> bool:
    return (folder / "config.pbtxt").is_file() or any(
        p.is_dir() and is_version(p.name) for p in folder.iterdir())


def unstage(names: Sequence[str], settings: Settings) -> None:
    """Remove each model folder of `names` from the model repository: a local one whole (what a model
    wrote there too, a __pycache__), a store's file by file, its config first (what is left of one is no
    model a poll would load)."""
    registry = open_registry(settings.model_repository, settings)
    for name in names:
        if isinstance(registry, LocalRegistry):
            shutil.rmtree(registry.root / name, ignore_errors=True)
            continue
        model = registry.scan_one(name)
        if model is None:
            continue
        for path in sorted((f.path for f in model.files), key=lambda p: p != "config.pbtxt"):
            registry.delete(name, path)


def stage(folder: Path, name: str, settings: Settings, steps: Sequence[Path] = (),
          made: list[str] | None = None) -> None:
    """Push a model folder into the model repository as model `name` (its config renamed: the folder
    SageMaker unpacked is named after the archive, the config after the model), as `despina push` does;
    an ensemble's `steps` first, each under its own folder's name. `made` gets each name whose folder was
    not in the repository before, as its push starts: only those are the load's to remove (unstage)."""
    registry = open_registry(settings.model_repository, settings) if made is not None else None
    for source, target in [*((step, step.name) for step in steps), (folder, name)]:
        if registry is not None and made is not None and registry.scan_one(target) is None:
            made.append(target)
        out = io.StringIO()
        push(source, settings.model_repository, settings, name=target, out=out, rename=source is folder)
        log.info("SageMaker model %s: %s", name, out.getvalue().strip().splitlines()[-1])  # "pushed ..."
