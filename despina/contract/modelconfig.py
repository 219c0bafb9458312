"""Model configuration: Triton's config.pbtxt, parsed with Triton's own ModelConfig schema.

The control plane turns a config.pbtxt into its JSON form (Triton's, as `GET .../config` answers)
and publishes that; gateways and workers rebuild a `ModelSpec` from it (modelspec.py).
"""
from __future__ import annotations

import re
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor

from ._schema import model_config_pb2 as pb
from .batchio import validate_batch_io
from .datatypes import CONFIG_TO_V2
from .errors import ConfigError, InvalidArgument
from .sequence import DEFAULT_IDLE_US
from .sequence import validate as validate_sequence
from .unsupported import refuse as refuse_unsupported

ModelConfig = pb.ModelConfig

PLATFORM_TO_BACKEND = {
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "tensorflow_savedmodel": "tensorflow",
    "ensemble": "ensemble",
}
# what to do instead, for a Triton platform Despina does not serve
PLATFORM_HINTS = {"tensorflow_graphdef": "; export the model as a SavedModel (platform "
                                         "\"tensorflow_savedmodel\", its folder 1/model.savedmodel)"}
BACKEND_TO_PLATFORM = {
    "onnxruntime": "onnxruntime_onnx",
    "pytorch": "pytorch_libtorch",
    "tensorflow": "tensorflow_savedmodel",
}
# Triton's default_model_filename, by platform else backend; a pytorch model's stays empty, as Despina
# then takes its model.pt, else a torch.export model.pt2
DEFAULT_FILENAMES = {
    "onnxruntime_onnx": "model.onnx",
    "tensorflow_savedmodel": "model.savedmodel",
    "python": "model.py",
}

# each level is a Redis stream that every worker reads and every metrics scrape counts: Triton's limit
# (2**64 - 1) would never finish being read
MAX_PRIORITY_LEVELS = 64

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")  # fullmatch: "$" lets a trailing newline through


def check_model_name(name: str) -> str:
    """Model names become key and path components: nothing may reach outside the repository."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidArgument(
            f"invalid model name {name!r}: use letters, digits, '_', '-' and '.', at most 128 characters")
    return name


def parse_text(model: str, text: str | bytes) -> Any:
    """config.pbtxt text (or its bytes, UTF-8) -> ModelConfig; a syntax error names the model, line, column
    and field."""
    raw = text if isinstance(text, bytes) else None
    source = text if isinstance(text, str) else ""
    if raw is not None:
        try:
            source = raw.decode("utf-8")
        except UnicodeDecodeError:  # a Latin-1 comment: Triton's parser skips a comment's bytes, as this does
            source = raw.decode("utf-8", errors="surrogateescape")
    try:
        return text_format.Parse(source, ModelConfig())
    except text_format.ParseError as exc:
        # a byte that is not UTF-8 in a value (which would be no text), or a UTF-16 file from a Windows editor
        if raw is not None and (bad := _first_bad_byte(raw, exc.GetLine())) is not None:
            line = raw.count(b"\n", 0, bad) + 1
            raise ConfigError(f"model '{model}': config.pbtxt is not UTF-8 text (line {line}, byte {bad})"
                              ) from None
        if source.startswith("\ufeff"):  # a mark no editor shows: the parser's words would show nothing
            raise ConfigError(f"model '{model}': invalid config.pbtxt: it begins with a byte order mark "
                              "(U+FEFF), which Triton's parser refuses too: save it as UTF-8 without one"
                              ) from None
        said = str(exc).encode("utf-8", errors="backslashreplace").decode()  # (no lone surrogate goes out)
        raise ConfigError(f"model '{model}': invalid config.pbtxt: {said}") from None


def _first_bad_byte(raw: bytes, line: int | None) -> int | None:
    """Where the first byte that is not UTF-8 is on `line` (where the parser stopped; with none, in all of
    `raw`); None where there is none."""
    lines = raw.split(b"\n")
    start, text = 0, raw
    if line and line <= len(lines):
        start, text = sum(len(x) + 1 for x in lines[:line - 1]), _code(lines[line - 1])
    try:
        text.decode("utf-8")
    except UnicodeDecodeError as exc:
        return start + exc.start
    return None


def _code(line: bytes) -> bytes:
    """A line without its comment (a `#` outside quotes): a comment's bytes are not the parser's trouble."""
    quote = 0
    for i, byte in enumerate(line):
        if quote:
            if byte == quote and line[i - 1:i] != b"\\":
                quote = 0
        elif byte in b"\"'":
            quote = byte
        elif byte == ord("#"):
            return line[:i]
    return line


def parse_json(model: str, config: dict[str, Any]) -> Any:
    """Triton's JSON form (as the load API's `config` parameter carries it) -> ModelConfig."""
    try:
        return json_format.ParseDict(config, ModelConfig())
    except json_format.ParseError as exc:
        raise ConfigError(f"model '{model}': invalid config: {exc}") from None


def to_dict(config: Any) -> dict[str, Any]:
    """ModelConfig -> Triton's JSON form: field names as in the .proto, 64-bit integers as numbers."""
    raw = json_format.MessageToDict(config, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True)
    scheduling = raw.get("ensemble_scheduling")
    if scheduling is not None and not scheduling.get("max_inflight_requests"):
        # newer than Triton 2.51, whose ModelConfig (so its /config) has no such field: shown only when set
        scheduling.pop("max_inflight_requests", None)
    return _fix_int64(config.DESCRIPTOR, raw)


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _fix_int64(descriptor: Any, value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    for key, item in value.items():
        fd = descriptor.fields_by_name.get(key)
        if fd is None:
            continue
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            vfd = fd.message_type.fields_by_name["value"]
            value[key] = {k: _convert(vfd, v) for k, v in item.items()}
        elif isinstance(item, list):
            value[key] = [_convert(fd, v) for v in item]
        else:
            value[key] = _convert(fd, item)
    return value


def _convert(fd: Any, item: Any) -> Any:
    if fd.message_type is not None:
        return _fix_int64(fd.message_type, item)
    if fd.type in _INT64 and isinstance(item, str):
        return int(item)
    return item


def string_parameters(config: dict[str, Any]) -> dict[str, str]:
    """The config's `parameters { key: ... value: { string_value: ... } }` entries, by key."""
    return {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()
            if isinstance(v, dict)}


def parameter_bool(model: str, key: str, value: str) -> bool:
    """A config parameter's true or false, as Triton's backends spell them; else the load error."""
    lowered = value.strip().lower()
    if lowered in ("true", "1", "on", "yes"):
        return True
    if lowered in ("false", "0", "off", "no"):
        return False
    raise ConfigError(f"model '{model}': parameter {key} must be true or false, got {value!r}")


def parameter_int(model: str, key: str, value: str, minimum: int = 0) -> int:
    """A config parameter's integer, at least `minimum`; else the load error."""
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"model '{model}': parameter {key} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"model '{model}': parameter {key} must be >= {minimum}, got {number}")
    return number


def normalize(model: str, config: Any) -> Any:
    """Fill what Triton fills before auto-complete: name, the platform/backend pair, version policy."""
    if not config.name:
        config.name = model
    elif config.name != model:
        raise ConfigError(f"model '{model}': field 'name' is '{config.name}', the folder is '{model}'")
    if config.platform and config.platform not in PLATFORM_TO_BACKEND:
        raise ConfigError(f"model '{model}': field 'platform': '{config.platform}' is not supported by "
                          f"Despina (it serves {', '.join(PLATFORM_TO_BACKEND)})"
                          f"{PLATFORM_HINTS.get(config.platform, '')}")
    if config.platform and not config.backend:
        config.backend = PLATFORM_TO_BACKEND[config.platform]
    elif config.platform and config.backend != PLATFORM_TO_BACKEND[config.platform]:
        raise ConfigError(f"model '{model}': field 'platform' '{config.platform}' and field 'backend' "
                          f"'{config.backend}' do not go together (that platform's backend is "
                          f"'{PLATFORM_TO_BACKEND[config.platform]}')")
    elif config.backend and not config.platform and config.backend in BACKEND_TO_PLATFORM:
        config.platform = BACKEND_TO_PLATFORM[config.backend]
    if not config.backend and not config.platform:
        raise ConfigError(f"model '{model}': neither field 'platform' nor field 'backend' is set")
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    return config


def complete(config: Any) -> Any:
    """Fill what Triton fills after auto-complete, as GET .../config and a Python model's initialize
    show it: default_model_filename, a preferred batch size of max_batch_size, the sequence idle time,
    pinned memory, and each instance group's name and count (the count Despina runs: 1 when unset).
    An instance group's kind stays as the config has it: each worker resolves KIND_AUTO for itself."""
    if not config.default_model_filename:
        config.default_model_filename = DEFAULT_FILENAMES.get(config.platform or config.backend, "")
    batched = [config.max_batch_size] if config.max_batch_size > 0 else []
    if config.HasField("dynamic_batching") and not config.dynamic_batching.preferred_batch_size:
        config.dynamic_batching.preferred_batch_size.extend(batched)
    if config.HasField("sequence_batching"):
        sb = config.sequence_batching
        sb.max_sequence_idle_microseconds = sb.max_sequence_idle_microseconds or DEFAULT_IDLE_US
        if sb.HasField("oldest") and not sb.oldest.preferred_batch_size:
            sb.oldest.preferred_batch_size.extend(batched)
    if config.platform == "ensemble":
        # as Triton shows an ensemble: no backend (Despina's marker "ensemble" stops here), and decoupled
        # when a step is, which the control plane marks once it sees the steps (control/ensembles.py)
        config.backend = ""
        config.model_transaction_policy.decoupled = False
        config.model_transaction_policy.SetInParent()
        return config
    for pinned in ("input_pinned_memory", "output_pinned_memory"):
        if not config.optimization.HasField(pinned):
            getattr(config.optimization, pinned).enable = True
    if not config.instance_group:
        config.instance_group.add(name=config.name)
    for index, group in enumerate(config.instance_group):
        group.name = group.name or f"{config.name}_{index}"
        group.count = max(group.count, 1)  # as Triton's: a count below 1 (0, unset, or negative) is 1
    return config


def validate(config: Any) -> None:
    """Semantic checks Triton makes at load; each error names the model and the field."""
    model = config.name
    if config.max_batch_size < 0:
        raise ConfigError(f"model '{model}': field 'max_batch_size' must be >= 0")
    if config.model_transaction_policy.decoupled and config.backend != "python":
        raise ConfigError(f"model '{model}': model_transaction_policy.decoupled needs backend \"python\" "
                          "(a model that answers through a response sender)")
    scheduling = config.WhichOneof("scheduling_choice")
    if config.model_transaction_policy.decoupled and config.response_cache.enable:
        raise ConfigError(f"model '{model}': the response cache does not support a decoupled model (one "
                          "request, several responses): remove response_cache or its enable: true")
    if config.model_transaction_policy.decoupled and scheduling == "sequence_batching":
        raise ConfigError(f"model '{model}': a decoupled model with sequence_batching is not supported by "
                          "Despina yet")
    if scheduling not in (None, "dynamic_batching"):
        if scheduling == "sequence_batching":
            validate_sequence(config)
        if scheduling == "ensemble_scheduling" and config.platform != "ensemble":
            raise ConfigError(f"model '{model}': field 'ensemble_scheduling' needs platform \"ensemble\"")
    seen: set[tuple[str, str]] = set()
    for kind, tensors in (("input", config.input), ("output", config.output)):
        for t in tensors:
            where = f"model '{model}': {kind} '{t.name}'"
            if not t.name:
                raise ConfigError(f"model '{model}': an {kind} has no field 'name'")
            if (kind, t.name) in seen:
                whom = "a request" if kind == "input" else "a response"
                raise ConfigError(f"model '{model}': two {kind}s are named '{t.name}' ({whom} could not tell "
                                  "them apart)")
            seen.add((kind, t.name))
            dtype = pb.DataType.Name(t.data_type)
            if dtype not in CONFIG_TO_V2:
                raise ConfigError(f"{where}: field 'data_type' {dtype} is not supported")
            if not t.dims:  # Triton's words (ValidateIOShape); a reshape alone does not stand for them
                raise ConfigError(f"model '{model}': {kind} '{t.name}' must specify 'dims' (a scalar per "
                                  "row: dims [ 1 ] with reshape { shape: [ ] })")
            if any(d < -1 or d == 0 for d in t.dims):
                raise ConfigError(f"{where}: field 'dims' must hold positive sizes or -1, got {list(t.dims)}")
            if t.HasField("reshape"):
                shape = list(t.reshape.shape)
                if not shape and config.max_batch_size == 0:  # Triton's words (ValidateIOShape)
                    raise ConfigError(f"model '{model}': {kind} '{t.name}' cannot have empty reshape for "
                                      "non-batching model as scalar tensors are not supported")
                if any(d < -1 or d == 0 for d in shape):
                    raise ConfigError(f"{where}: field 'reshape' must hold positive sizes or -1, got {shape}")
                if shape.count(-1) != list(t.dims).count(-1):
                    raise ConfigError(f"{where}: field 'reshape' {shape} must leave as many sizes open (-1) "
                                      f"as 'dims' {list(t.dims)}")
                if _chunks(t.dims) != _chunks(shape):
                    raise ConfigError(f"{where}: has different size for dims {list(t.dims)} and reshape "
                                      f"{shape} (field 'reshape': the sizes between open ones, -1, must hold "
                                      "as many elements in both)")
    if scheduling == "dynamic_batching":
        # (with max_batch_size 0 too, as in Triton: its queue policies apply, and each request runs alone)
        db = config.dynamic_batching
        for size in db.preferred_batch_size:  # in Triton's words (model_config_utils.cc)
            said = f"model '{model}': dynamic batching preferred size must be"
            where = f"field 'dynamic_batching.preferred_batch_size' has {size}"
            if size <= 0:
                raise ConfigError(f"{said} positive ({where})")
            if size > config.max_batch_size:
                raise ConfigError(f"{said} <= max batch size ({where}, max_batch_size is "
                                  f"{config.max_batch_size})")
        if db.priority_levels > MAX_PRIORITY_LEVELS:
            raise ConfigError(f"model '{model}': field 'dynamic_batching.priority_levels' is "
                              f"{db.priority_levels}; Despina serves at most {MAX_PRIORITY_LEVELS} (each "
                              "level is a request stream of its own)")
        if db.priority_levels:  # else the gateways and workers could not build the model's BatchPolicy
            if not 1 <= db.default_priority_level <= db.priority_levels:
                raise ConfigError(f"model '{model}': default priority level must be in range [1, "
                                  f"{db.priority_levels}] (field 'dynamic_batching.default_priority_level' "
                                  f"is {db.default_priority_level})")
            for level in db.priority_queue_policy:
                if not 1 <= level <= db.priority_levels:
                    raise ConfigError(f"model '{model}': priority queue policy must have priority level in "
                                      f"range [1, {db.priority_levels}] (field "
                                      f"'dynamic_batching.priority_queue_policy' has {level})")
        if db.preserve_ordering:  # Triton's rules: one queue, and nothing moved behind the others
            if config.model_transaction_policy.decoupled:
                raise ConfigError(f"model '{model}': 'preserve_ordering' for a decoupled model is not "
                                  "supported by Despina yet")
            if db.priority_levels > 1:
                raise ConfigError(f"model '{model}': only one priority level is allowed when "
                                  "'preserve_ordering' is true")
            policies = [db.default_queue_policy, *db.priority_queue_policy.values()]
            if any(p.default_timeout_microseconds and p.timeout_action == pb.ModelQueuePolicy.DELAY
                   for p in policies):
                raise ConfigError(f"model '{model}': a queue policy cannot have DELAY as its timeout "
                                  "action when 'preserve_ordering' is true")
    for group in config.instance_group:
        if group.kind == pb.ModelInstanceGroup.KIND_CPU and group.gpus:
            raise ConfigError(f"model '{model}': instance group {group.name} has kind KIND_CPU but "
                              "specifies one or more GPUs")
    validate_batch_io(config, scheduling)
    refuse_unsupported(config)


def _chunks(dims: Any) -> list[int]:
    """The element counts between open sizes (-1), as Triton compares a reshape with its dims: [2, 4, -1, 6]
    and [8, -1, 1, 6] both give [8, 6]."""
    counts = [1]
    for d in dims:
        if d == -1:
            counts.append(1)
        else:
            counts[-1] *= d
    return counts
