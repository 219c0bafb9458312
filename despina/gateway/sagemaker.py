"""SageMaker's inference container contract, as Triton's SageMaker front end speaks it.

An endpoint built for Triton's SageMaker image works unchanged: the same routes, request bodies, content
types and model variables. Served when `sagemaker` is set (`despina serve --sagemaker`, which also takes
SageMaker's port 8080 and its artifacts' folder /opt/ml/model; settings.py):

- GET /ping: 200 once the server is ready (as /v2/health/ready), else 400 as Triton answers; on a
  single-model endpoint 400 too while /invocations has no model that can serve. With Triton's
  ping mode live (a multi-model endpoint's default, as Triton's image: settings.py), 200 while the
  gateway runs (as /v2/health/live).
- POST /invocations: a V2 inference request for the endpoint's model (`sagemaker_model`, Triton's
  SAGEMAKER_TRITON_DEFAULT_MODEL_NAME, else the repository's only model): JSON, or binary tensors with
  the content type `application/vnd.sagemaker-triton.binary+json;json-header-size=N` in place of the
  Inference-Header-Content-Length header (0: Triton's raw binary request, the body the one input's data).
  The answer comes back the same way. With Triton's
  SAGEMAKER_TRITON_INFERENCE_TYPE=generate it is a request of the generate extension instead (generate.py:
  JSON in, JSON out), with =generate_stream one of generate_stream (its answer server-sent events), as an
  LLM endpoint built for Triton's image sends them.
- Multi-model endpoints (SAGEMAKER_MULTI_MODEL=true): the /models routes, sagemaker_mme.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as HttpRoute

from ..contract.errors import DespinaError, InvalidArgument, NotFound
from . import http
from .asgi_endpoint import AsgiEndpoint
from .auth import KEY_MODELS, check_key_scope
from .generate import GenerateRoute, StreamEndpoint
from .http import Receive, Scope, Send
from .infer import Exchange, InferRoute, Route, fail
from .models import NotLoaded
from .readiness import server_ready

if TYPE_CHECKING:
    from .app import Gateway

BINARY = b"application/vnd.sagemaker-triton.binary+json;json-header-size="


class SageMakerInfer(InferRoute):
    """A V2 inference request in SageMaker's framing: the JSON header's length in the content type."""

    def header_length(self, ex: Exchange) -> int | None:
        raw = http.header(ex.headers, b"content-type")
        if raw is None:
            return None
        ctype = raw.replace(b" ", b"").lower()
        at = ctype.find(BINARY)
        if at < 0:
            return None
        if at > 0:
            raise InvalidArgument(f"the content type of binary data must start with "
                                  f"'{BINARY.decode()}', got '{raw.decode('latin-1')}'")
        size = ctype[len(BINARY):].split(b";", 1)[0]
        if not size.isdigit() or int(size) > len(ex.body):  # 0: Triton's raw request, the one input's data
            raise InvalidArgument(f"json-header-size must be a number from 0 (a raw binary request) to the "
                                  f"body's length ({len(ex.body)}), got '{size.decode('latin-1')}'")
        return int(size)

    @staticmethod
    def respond(ex: Exchange, out: bytes, json_length: int | None, echo: http.Headers) -> None:
        ex.respond(200, out, http.JSON if json_length is None else BINARY + b"%d" % json_length, echo)


class EndpointModel(Route):
    """A route for the endpoint's one model, which its path does not name (/invocations)."""

    streams_at = "/invocations under SAGEMAKER_TRITON_INFERENCE_TYPE=generate_stream"

    def __call__(self, ex: Exchange) -> None:
        try:
            ex.params = {"model": endpoint_model(self.gateway)}
        except DespinaError as exc:
            fail(ex, exc, http.header(ex.headers, b"x-request-id"))
            return
        super().__call__(ex)


class Invocations(EndpointModel, SageMakerInfer):
    """POST /invocations as a V2 inference request (SAGEMAKER_TRITON_INFERENCE_TYPE=infer: the default)."""


class GenerateInvocations(EndpointModel, GenerateRoute):
    """POST /invocations as Triton's generate extension (SAGEMAKER_TRITON_INFERENCE_TYPE=generate), or as
    its generate_stream (=generate_stream: server-sent events, under StreamInvocationsEndpoint)."""

    several = ("generate expects model to produce exactly 1 response: /invocations answers with all under "
               "SAGEMAKER_TRITON_INFERENCE_TYPE=generate_stream")


class InvocationsEndpoint(AsgiEndpoint):
    """/invocations under ASGI: its path names no model, so the key's scope is checked here (auth.Guard
    left it in the scope) against the model it runs."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if KEY_MODELS in scope:
            try:
                check_key_scope(scope, endpoint_model(self.route.gateway))
            except DespinaError as exc:
                await http.send_error(send, exc)
                return
        await super().__call__(scope, receive, send)


class StreamInvocationsEndpoint(InvocationsEndpoint, StreamEndpoint):
    """/invocations under SAGEMAKER_TRITON_INFERENCE_TYPE=generate_stream: the key's scope checked as
    above, the answer a stream of server-sent events as /generate_stream's."""


def invocations(gw: Gateway) -> AsgiEndpoint:
    """/invocations as SAGEMAKER_TRITON_INFERENCE_TYPE says, chosen once: no request asks again."""
    kind = gw.settings.sagemaker_inference_type
    if kind == "infer":
        return InvocationsEndpoint(Invocations(gw))
    if kind == "generate":
        return InvocationsEndpoint(GenerateInvocations(gw, stream=False))
    return StreamInvocationsEndpoint(GenerateInvocations(gw, stream=True))


def endpoint_model(gw: Gateway) -> str:
    """The model /invocations runs: the one configured, else the only one there is."""
    if gw.settings.sagemaker_model:
        return gw.settings.sagemaker_model
    models = gw.view.models
    if len(models) == 1:  # every request asks: no more work than that here
        return next(iter(models))
    names = sorted(models)
    if not names:
        raise NotFound("no model to run: the model repository has none (SageMaker puts a single-model "
                       "endpoint's models in /opt/ml/model)")
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    raise InvalidArgument(f"the repository has {len(names)} models ({shown}): name the one /invocations "
                          "runs with SAGEMAKER_TRITON_DEFAULT_MODEL_NAME or DESPINA_SAGEMAKER_MODEL")


def sagemaker_routes(gw: Gateway) -> list[HttpRoute]:
    """/ping and /invocations; a multi-model endpoint's /models routes are sagemaker_mme.py's."""

    async def ping(request: Request) -> Response:
        if gw.settings.sagemaker_ping_mode == "live":  # as /v2/health/live: a load under way is no sickness
            return Response(b"", 200)
        ready = server_ready(gw.view, gw.settings.strict_readiness) and _endpoint_serves(gw)
        return Response(b"", 200 if ready else 400)

    return [
        HttpRoute("/ping", ping, methods=["GET"]),
        HttpRoute("/invocations", invocations(gw), methods=["POST"]),
    ]


def _endpoint_serves(gw: Gateway) -> bool:
    """Whether a single-model endpoint's /invocations has a model that serves (or wakes on a request).
    Triton's image does not start without it, so SageMaker never takes the endpoint for healthy: a /ping
    of 200 would have it send every invocation to an error."""
    if gw.settings.model_control_mode == "explicit":
        return True  # a multi-model endpoint: its models come with its loads
    try:
        gw.view.resolve(endpoint_model(gw), None)
    except NotLoaded:
        return True  # scaled to zero: the first request loads it
    except DespinaError:
        return False
    return True


