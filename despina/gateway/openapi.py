"""The OpenAPI document of the HTTP API, served at `GET /openapi.json`.

Built from plain dicts so that it ships with the code; `tests/test_openapi_fuzz.py` validates it and
fuzzes a live server with it.
"""
from __future__ import annotations

from typing import Any

from ..contract.datatypes import V2_TO_NUMPY

MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$"
VERSION = r"^[0-9]{1,18}$"
Doc = dict[str, Any]


def _ref(name: str) -> Doc:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: Doc) -> Doc:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: int) -> Doc:
    words = {400: "Bad request", 401: "No valid API key (see `WWW-Authenticate`)",
             403: "The API key may not use this model or API, or a restricted API's header is missing",
             404: "Unknown model or version",
             409: "A model of that name is loaded, or being loaded",
             413: "Body over the size limit (as sent, or inflated)",
             415: "Content-Encoding other than gzip, deflate or identity (with `Accept-Encoding`)",
             501: "Not supported (as Triton's: a trace or log file named by the API)",
             503: "Not ready, or the queue is unavailable (with `Retry-After`)",
             504: "No answer before the request's deadline",
             507: "No memory for the model (SageMaker's cue to unload others and retry)"}
    return {str(s): {"description": words[s], "content": _json(_ref("Error"))} for s in statuses}


def _param(name: str, pattern: str, text: str) -> Doc:
    return {"name": name, "in": "path", "required": True, "description": text,
            "schema": {"type": "string", "pattern": pattern}}


MODEL = _param("model", MODEL_NAME, "Model name (letters, digits, `_`, `-`, `.`; no `..`)")
VERSION_PARAM = _param("version", VERSION, "Model version; without it, the highest ready version")
READ_ERRORS = (400, 401, 403, 404, 503)
INFER_ERRORS = (400, 401, 403, 404, 413, 415, 503, 504)

BINARY_BODY = """Triton's binary tensor extension: the JSON infer request (its length in the
`Inference-Header-Content-Length` header), then the raw tensors in the order of the inputs that carry
`"parameters": {"binary_data_size": N}`: little-endian, row-major, BOOL one byte per element, each
BYTES element a 4-byte little-endian length followed by its bytes."""


INFER_EXAMPLE = {"inputs": [{"name": n, "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
                            for n in ("a", "b")],
                 "outputs": [{"name": "sum", "parameters": {"binary_data": False}}]}


def _schemas() -> Doc:
    datatype = {"type": "string", "enum": list(V2_TO_NUMPY)}
    shape = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    params = {"type": "object", "additionalProperties": True,
              "description": "Free-form parameters (values: string, number or boolean)"}
    tensor_meta = {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
        "name": {"type": "string"}, "datatype": datatype,
        "shape": {"type": "array", "items": {"type": "integer", "minimum": -1},
                  "description": "-1: variable; the batch dimension is included when batching"}}}
    duration = {"type": "object", "properties": {"count": {"type": "integer"}, "ns": {"type": "integer"}}}
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
        "Datatype": datatype,
        "ServerMetadata": {"type": "object", "required": ["name", "version", "extensions"], "properties": {
            "name": {"type": "string"}, "version": {"type": "string"},
            "extensions": {"type": "array", "items": {"type": "string"}}}},
        "TensorMetadata": tensor_meta,
        "ModelMetadata": {"type": "object", "required": ["name", "versions", "platform", "inputs", "outputs"],
                          "properties": {"name": {"type": "string"},
                                         "versions": {"type": "array", "items": {"type": "string"}},
                                         "platform": {"type": "string"},
                                         "inputs": {"type": "array", "items": _ref("TensorMetadata")},
                                         "outputs": {"type": "array", "items": _ref("TensorMetadata")}}},
        "ModelConfig": {"type": "object", "additionalProperties": True,
                        "description": "Triton's ModelConfig in its protobuf JSON form"},
        "InferInput": {"type": "object", "required": ["name", "shape", "datatype"], "properties": {
            "name": {"type": "string"}, "shape": shape, "datatype": _ref("Datatype"),
            "parameters": {"type": "object", "additionalProperties": True, "properties": {
                "binary_data_size": {"type": "integer", "minimum": 0,
                                     "description": "Bytes of this tensor in the binary tail"}}},
            "data": {"description": "Row-major elements, flat or nested (absent with binary_data_size)"}}},
        "InferRequestOutput": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"},
            "parameters": {"type": "object", "additionalProperties": True, "properties": {
                "binary_data": {"type": "boolean"},
                "classification": {"type": "integer", "minimum": 0, "description": "Triton's classification "
                                   "extension: the output's k highest values as \"value:index[:label]\" "
                                   "(0: the tensor itself)"}}}}},
        "InferRequest": {"type": "object", "required": ["inputs"], "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object", "additionalProperties": True,
                           "description": "The others (string, number or boolean) reach a Python model as "
                                          "request.parameters()", "properties": {
                "binary_data_output": {"type": "boolean"},
                "priority": {"type": "integer", "minimum": 0, "description": "1 = highest; 0 = default"},
                "timeout": {"type": "integer", "minimum": 0, "description": "queue timeout, µs"}}},
            "inputs": {"type": "array", "minItems": 1, "items": _ref("InferInput")},
            "outputs": {"type": "array", "items": _ref("InferRequestOutput")}}},
        "InferOutput": {"type": "object", "required": ["name", "shape", "datatype"], "properties": {
            "name": {"type": "string"}, "shape": shape, "datatype": _ref("Datatype"), "parameters": params,
            "data": {"type": "array", "items": {}}}},
        "InferResponse": {"type": "object", "required": ["model_name", "model_version", "outputs"],
                          "properties": {"model_name": {"type": "string"},
                                         "model_version": {"type": "string"},
                                         "id": {"type": "string"}, "parameters": params,
                                         "outputs": {"type": "array", "items": _ref("InferOutput")}}},
        "ModelStatistics": {"type": "object", "properties": {
            "name": {"type": "string"}, "version": {"type": "string"},
            "last_inference": {"type": "integer"}, "inference_count": {"type": "integer"},
            "execution_count": {"type": "integer"},
            "inference_stats": {"type": "object", "additionalProperties": duration},
            "batch_stats": {"type": "array", "items": {"type": "object"}},
            "memory_usage": {"type": "array", "items": {"type": "object"}}}},
        "Statistics": {"type": "object", "required": ["model_stats"], "properties": {
            "model_stats": {"type": "array", "items": _ref("ModelStatistics")}}},
        "RepositoryIndexRequest": {"type": "object", "properties": {"ready": {"type": "boolean"}}},
        "LogSettings": {"type": "object", "properties": {
            "log_file": {"type": "string", "description": "Only \"\": every process logs to standard error"},
            "log_info": {"type": "boolean"}, "log_warning": {"type": "boolean"},
            "log_error": {"type": "boolean"},
            "log_verbose_level": {"type": "integer", "minimum": 0,
                                  "description": "1: Despina's debug lines; 2 and more: every library's"},
            "log_format": {"type": "string", "enum": ["default", "ISO8601"]}},
            "additionalProperties": False},
        "TraceSettings": {"type": "object", "description": "Values are strings (trace_level a list of them)",
                          "properties": {
            "trace_file": {"type": "string", "description": "The server's trace file (--trace-file, "
                           "DESPINA_TRACE_FILE; \"\": none), set at start: a POST naming one gets 501"},
            "trace_level": {"type": "array", "items": {
                "type": "string", "enum": ["OFF", "TIMESTAMPS", "TENSORS"]}},
            "trace_rate": {"type": "string"}, "trace_count": {"type": "string"},
            "log_frequency": {"type": "string"}, "trace_mode": {"type": "string", "enum": ["triton"]}}},
        "ShmRegion": {"type": "object", "required": ["key", "byte_size"], "properties": {
            "key": {"type": "string", "description": "The POSIX shared memory object's key (shm_open's)"},
            "offset": {"type": "integer", "minimum": 0, "description": "Where the region starts in it"},
            "byte_size": {"type": "integer", "minimum": 0}}},
        "ShmStatus": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "key": {"type": "string"}, "offset": {"type": "integer"},
            "byte_size": {"type": "integer"}}}},
        "RepositoryIndex": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "version": {"type": "string"}, "state": {"type": "string"},
            "reason": {"type": "string"}}}},
        "LoadRequest": {"type": "object", "properties": {"parameters": {
            "type": "object", "additionalProperties": {"type": "string"}, "properties": {
                "config": {"type": "string", "description": "Model config JSON, overriding config.pbtxt"},
                "fail_without_room": {"type": "boolean", "description": "Despina's: answer 503 at once when "
                                      "memory alone keeps the model off every worker, not wait for room"}},
            "description": "`file:<version>/<name>` entries carry base64 file contents (need `config`): "
                           "the model is these files alone; the repository is not written"}}},
        "UnloadRequest": {"type": "object", "properties": {"parameters": {
            "type": "object", "additionalProperties": True,
            "properties": {"unload_dependents": {"type": "boolean"}}}}},
        "FunctionRequest": {"oneOf": [
            {"type": "object", "minProperties": 1, "additionalProperties": {},
             "description": "Input name -> nested list (or scalar)"},
            {"type": "array", "description": "The only input of a single-input model"}]},
        "FunctionResponse": {"type": "object", "additionalProperties": {},
                             "description": "Output name -> nested list"},
        "GenerateRequest": {"type": "object", "additionalProperties": {}, "properties": {
            "text_input": {"type": "string", "description": "The input text_input, of a model that has one"},
            "parameters": {"type": "object", "additionalProperties": {}}},
            "description": "Triton's generate extension: input name -> value (a scalar or a list); "
                           "'parameters' and any other key are request parameters"},
        "GenerateResponse": {"type": "object", "required": ["model_name", "model_version"],
                             "additionalProperties": {}, "properties": {
                                 "model_name": {"type": "string"}, "model_version": {"type": "string"}},
                             "description": "Output or response parameter name -> value (one element as a "
                                            "scalar, more as a flat list)"},
        "SageMakerLoad": {"type": "object", "required": ["model_name", "url"], "properties": {
            "model_name": {"type": "string", "pattern": MODEL_NAME},
            "url": {"type": "string", "description": "Where SageMaker unpacked the model's archive"}}},
        "SageMakerModel": {"type": "object", "required": ["modelName", "modelUrl"], "properties": {
            "modelName": {"type": "string"}, "modelUrl": {"type": "string"}}},
        "SageMakerModels": {"type": "object", "required": ["models"], "properties": {
            "models": {"type": "array", "items": _ref("SageMakerModel")},
            "nextPageToken": {"type": "string", "description": "next_page_token of the next page"}}},
    }


def _op(op_id: str, summary: str, tag: str, ok: Doc, errors: tuple[int, ...], **extra: Any) -> Doc:
    return {"operationId": op_id, "summary": summary, "tags": [tag],
            "responses": {"200": ok, **_errors(*errors)}, **extra}


def _ok(description: str, schema: Doc | None = None) -> Doc:
    return {"description": description, **({"content": _json(schema)} if schema else {})}


def _ready_op(op_id: str, summary: str, error_body: bool = False) -> Doc:
    """`error_body`: the 400 carries Triton's `{"error": "Model version not ready"}` (a model's does;
    the server's is empty)."""
    not_ready = {"description": "Not ready (as Triton answers)",
                 **({"content": _json(_ref("Error"))} if error_body else {})}
    return {"operationId": op_id, "summary": summary, "tags": ["health"],
            "responses": {"200": {"description": "Ready"}, "400": not_ready}}


def _infer_op(op_id: str) -> Doc:
    request = {"required": True, "content": {
        "application/json": {"schema": _ref("InferRequest"), "example": INFER_EXAMPLE},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"},
                                     "x-description": BINARY_BODY}},
        "description": "A V2 infer request as JSON; or, with the binary tensor extension, " + BINARY_BODY +
                       " Either may be sent compressed (`Content-Encoding: gzip` or `deflate`, "
                       "tritonclient's request_compression_algorithm): lengths count the body before "
                       "compression."}
    ok = {"description": "The outputs; binary ones after the JSON header when asked for",
          "headers": {"Inference-Header-Content-Length": {
              "description": "Length of the JSON header when binary outputs follow (before compression)",
              "schema": {"type": "integer"}},
              "Content-Encoding": {"description": "gzip or deflate when the request's Accept-Encoding "
                                                  "chose it: the whole answer is compressed",
                                   "schema": {"type": "string", "enum": ["gzip", "deflate"]}}},
          "content": {"application/json": {"schema": _ref("InferResponse")},
                      "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
    header = {"name": "Inference-Header-Content-Length", "in": "header", "required": False,
              "description": "Length of the JSON part of a binary body", "schema": {"type": "integer",
                                                                                   "minimum": 0}}
    accept = {"name": "Accept-Encoding", "in": "header", "required": False,
              "description": "gzip or deflate (tritonclient's response_compression_algorithm) to have the "
                             "answer compressed; chosen as Triton chooses (highest q, the first of equals); "
                             "any other coding: the answer as it is", "schema": {"type": "string"}}
    return _op(op_id, "Run inference (KServe V2, Triton's binary tensor extension)", "inference", ok,
               INFER_ERRORS, parameters=[header, accept], requestBody=request)


def _per_model(paths: Doc, suffix: str, method: str, make: Any) -> None:
    """The same operation at /v2/models/{model}... and /v2/models/{model}/versions/{version}..."""
    paths[f"/v2/models/{{model}}{suffix}"] = {method: make(""), "parameters": [MODEL]}
    paths[f"/v2/models/{{model}}/versions/{{version}}{suffix}"] = {
        method: make("_version"), "parameters": [MODEL, VERSION_PARAM]}


def _paths() -> Doc:
    paths: Doc = {
        "/v2/health/live": {"get": _ready_op("server_live", "Server liveness (always open)")},
        "/v2/health/ready": {"get": _ready_op("server_ready", "Server readiness (always open)")},
        "/readyz": {"get": {
            "operationId": "gateway_ready", "tags": ["health"],
            "summary": "This gateway can take requests (always open): a load balancer's probe",
            "responses": {"200": {"description": "Redis answers and the catalog is published"},
                          "503": {"description": "Not yet, or Redis is unreachable"}}}},
        "/v2": {"get": _op("server_metadata", "Server metadata and extensions", "metadata",
                           _ok("Server metadata", _ref("ServerMetadata")), (401, 403))},
        "/openapi.json": {"get": {"operationId": "openapi", "summary": "This document", "tags": ["metadata"],
                                  "security": [], "responses": {"200": _ok("OpenAPI document",
                                                                           {"type": "object"})}}},
        "/v2/models/stats": {"get": _op("statistics", "Statistics of every model version", "statistics",
                                        _ok("Statistics", _ref("Statistics")), (401, 403, 503))},
    }
    _per_model(paths, "", "get", lambda s: _op(f"model_metadata{s}", "Model metadata", "metadata",
                                               _ok("Model metadata", _ref("ModelMetadata")), READ_ERRORS))
    _per_model(paths, "/ready", "get", lambda s: _ready_op(f"model_ready{s}", "Model readiness", True))
    _per_model(paths, "/config", "get", lambda s: _op(
        f"model_config{s}", "Triton's model configuration", "model-config",
        _ok("Model config", _ref("ModelConfig")), READ_ERRORS))
    _per_model(paths, "/stats", "get", lambda s: _op(f"model_statistics{s}", "Statistics of a model",
                                                     "statistics", _ok("Statistics", _ref("Statistics")),
                                                     READ_ERRORS))
    _per_model(paths, "/infer", "post", lambda s: _infer_op(f"infer{s}"))
    for path, parameters, suffix in (("/fn/{model}", [MODEL], ""),
                                     ("/fn/{model}/versions/{version}", [MODEL, VERSION_PARAM], "_version")):
        paths[path] = {"parameters": parameters, "post": _op(
            f"function{suffix}", "Function URL: JSON keyed by input name in, JSON keyed by output name out",
            "inference", _ok("The outputs", _ref("FunctionResponse")), INFER_ERRORS,
            requestBody={"required": True, "content": {"application/json": {
                "schema": _ref("FunctionRequest"), "example": {"a": [1, 2, 3, 4], "b": [1, 1, 1, 1]}}}})}
    for name, text, content in (
            ("generate", "Triton's generate extension: a flat JSON object in and out",
             _json(_ref("GenerateResponse"))),
            ("generate_stream", "Triton's generate extension: the answer as server-sent events",
             {"text/event-stream": {"schema": {"type": "string"}}})):
        _per_model(paths, f"/{name}", "post", lambda s, name=name, text=text, content=content: _op(
            f"{name}{s}", text, "inference", {"description": "The outputs", "content": content},
            INFER_ERRORS, requestBody={"required": True, "content": {"application/json": {
                "schema": _ref("GenerateRequest"), "example": {"text_input": "hello"}}}}))
    paths["/v2/repository/index"] = {"post": _op(
        "repository_index", "Models in the repository and their states", "model-repository",
        _ok("Index", _ref("RepositoryIndex")), (400, 401, 403, 503),
        requestBody={"required": False, "content": _json(_ref("RepositoryIndexRequest"))})}
    paths["/v2/logging"] = {
        "get": _op("log_settings", "The log settings every process follows", "logging",
                   _ok("Log settings", _ref("LogSettings")), (401, 403)),
        "post": _op("update_log_settings", "Change the log settings it names, in every process", "logging",
                    _ok("Log settings, all of them", _ref("LogSettings")), (400, 401, 403, 501),
                    requestBody={"required": True, "content": _json(_ref("LogSettings"))})}
    for where, params, one in (("/v2", [], ""), ("/v2/models/{model}", [MODEL], "model_")):
        paths[f"{where}/trace/setting"] = {"parameters": params, "get": _op(
            f"{one}trace_settings", "The trace settings that apply" + (" to the model" if one else ""),
            "trace", _ok("Trace settings", _ref("TraceSettings")), (400, 401, 403)), "post": _op(
            f"update_{one}trace_settings", "Change the trace settings it names" +
            (" for the model (null: back to the global one)" if one else ""), "trace",
            _ok("Trace settings, all of them", _ref("TraceSettings")), (400, 401, 403, 501),
            requestBody={"required": True, "content": _json(_ref("TraceSettings"))})}
    region = {"name": "region", "in": "path", "required": True, "schema": {"type": "string"},
              "description": "The region's name"}
    for kind, what in (("system", "System"), ("cuda", "CUDA")):
        base = f"/v2/{kind}sharedmemory"
        for one, where in (("", ""), ("_region", "/region/{region}")):
            paths[f"{base}{where}/status"] = {"parameters": [region] if one else [], "get": _op(
                f"{kind}_shm{one}_status", f"{what} shared memory region{'' if one else 's'} registered "
                "(--allow-client-shm)", "shared-memory", _ok("Regions", _ref("ShmStatus")),
                (400, 401, 403, 404))}
            paths[f"{base}{where}/unregister"] = {"parameters": [region] if one else [], "post": _op(
                f"{kind}_shm{one}_unregister", f"Unregister {'the' if one else 'every'} {what} shared memory "
                "region", "shared-memory", _ok("Done (also when none was registered)"), (400, 401, 403))}
        paths[f"{base}/region/{{region}}/register"] = {"parameters": [region], "post": _op(
            f"{kind}_shm_register", f"Register a {what} shared memory region" +
            (" (refused: not supported)" if kind == "cuda" else ""), "shared-memory", _ok("Registered"),
            (400, 401, 403), requestBody={"required": True, "content": _json(
                _ref("ShmRegion") if kind == "system" else {"type": "object"})})}
    for action, schema, text in (("load", "LoadRequest", "Load or reload a model"),
                                 ("unload", "UnloadRequest", "Unload a model")):
        paths[f"/v2/repository/models/{{model}}/{action}"] = {"parameters": [MODEL], "post": _op(
            f"repository_{action}", text, "model-repository", _ok("Done"), READ_ERRORS,
            requestBody={"required": False, "content": _json(_ref(schema))})}
    return paths


SAGEMAKER_BINARY = """SageMaker's framing of Triton's binary tensor extension: the JSON header's length in
the content type, `application/vnd.sagemaker-triton.binary+json;json-header-size=N`, not in a header; N=0
is a raw binary request, the body the data of the model's one input."""


def _sagemaker_infer_op(op_id: str, summary: str, errors: tuple[int, ...] = ()) -> Doc:
    op = _infer_op(op_id)
    op["summary"], op["parameters"], op["responses"] = summary, [], {**op["responses"], **_errors(*errors)}
    op["description"] = SAGEMAKER_BINARY
    binary = {"schema": {"type": "string", "format": "binary"}}
    op["requestBody"]["content"] = {"application/json": op["requestBody"]["content"]["application/json"],
                                    "application/vnd.sagemaker-triton.binary+json": binary}
    ok = op["responses"]["200"]
    ok.pop("headers")
    ok["content"] = {"application/json": ok["content"]["application/json"],
                     "application/vnd.sagemaker-triton.binary+json": binary}
    return op


def _sagemaker_paths() -> Doc:
    """SageMaker's container contract (`--sagemaker`; gateway/sagemaker.py)."""
    name = {**MODEL, "description": "The model's name on the multi-model endpoint"}
    page = [{"name": "max_results", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1}},
            {"name": "next_page_token", "in": "query", "required": False, "schema": {"type": "string"}}]
    return {
        "/ping": {"get": _ready_op("sagemaker_ping", "SageMaker's health check: server readiness")},
        "/invocations": {"post": _sagemaker_infer_op(
            "sagemaker_invocations", "SageMaker: run the endpoint's model (a V2 infer request; with "
            "SAGEMAKER_TRITON_INFERENCE_TYPE=generate or generate_stream, a generate extension request)")},
        "/models": {
            "get": _op("sagemaker_list", "SageMaker: the multi-model endpoint's loaded models",
                       "model-repository", _ok("Models", _ref("SageMakerModels")), (400, 401, 403),
                       parameters=page),
            "post": _op("sagemaker_load", "SageMaker: load a model from the folder SageMaker unpacked",
                        "model-repository", _ok("Loaded"), (400, 401, 403, 409, 503, 507),
                        requestBody={"required": True, "content": _json(_ref("SageMakerLoad"))})},
        "/models/{model}": {
            "parameters": [name],
            "get": _op("sagemaker_describe", "SageMaker: one loaded model", "model-repository",
                       _ok("The model", _ref("SageMakerModel")), (401, 403, 404)),
            "delete": _op("sagemaker_unload", "SageMaker: unload a model", "model-repository",
                          _ok("Unloaded"), (401, 403, 404, 503))},
        "/models/{model}/invoke": {"parameters": [name], "post": _sagemaker_infer_op(
            "sagemaker_invoke", "SageMaker: run one model of a multi-model endpoint", (404, 507))},
    }


DESCRIPTION = """Despina serves the models of a Triton model repository over the KServe V2 / Open
Inference Protocol with Triton's extensions (binary tensors, statistics, model repository), plus
function URLs (`POST /fn/{model}`). Errors are `{"error": "..."}`.

Keys: when API keys are configured, the model-repository, model-config and statistics APIs need
`Authorization: Bearer <key>` (inference and metadata too with `DESPINA_AUTH_INFERENCE=true`); health
and this document stay open. Triton's restricted-API headers (`DESPINA_HTTP_RESTRICTED_API`) work too."""


def document(version: str, sagemaker: bool = False) -> Doc:
    """The OpenAPI 3.0 document of the gateway's HTTP API (with SageMaker's routes when it serves them)."""
    return {
        "openapi": "3.0.3",
        "info": {"title": "Despina", "version": version, "description": DESCRIPTION,
                 "license": {"name": "Apache-2.0"}},
        "tags": [{"name": t} for t in ("health", "metadata", "inference", "model-config", "statistics",
                                       "model-repository", "logging", "shared-memory", "trace")],
        "security": [{}, {"bearer": []}],
        "paths": {**_paths(), **(_sagemaker_paths() if sagemaker else {})},
        "components": {"schemas": _schemas(),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "An API key"}}},
    }
