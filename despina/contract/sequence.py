"""Triton's sequence batcher (stateful models): its settings, and a request's place in its sequence.

A model with `sequence_batching` gets the requests of one sequence (one correlation ID, the request
parameter `sequence_id`) in order, each on the model instance that got the sequence's first, at most
one of them per batch; `sequence_start` must mark the first and `sequence_end` marks the last. The
control inputs the config names tell the model which rows start, end, or carry a request at all, and
each row's correlation ID. A sequence with nothing queued for `max_sequence_idle_microseconds` is
released. Implicit state (`state`): what the model gives as a state output with one request of a
sequence is its state input with the next; the first takes the initial state (`initial_state`: zeros,
or a file under <model>/initial_state/; else zeros, an open size taken as 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._schema import model_config_pb2 as pb
from .datatypes import CONFIG_TO_V2
from .errors import ConfigError, InvalidArgument

START, END = 1, 2  # request flags, as Triton's TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END
DEFAULT_IDLE_US = 1_000_000  # Triton's default max_sequence_idle_microseconds
KINDS = {"CONTROL_SEQUENCE_START": "START", "CONTROL_SEQUENCE_END": "END",
         "CONTROL_SEQUENCE_READY": "READY", "CONTROL_SEQUENCE_CORRID": "CORRID"}
CORRID_TYPES = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")
Correlation = int | str


@dataclass(frozen=True)
class Control:
    """A control input: the model input `name` gets `kind` (START, END, READY, CORRID) for each row."""

    name: str
    kind: str
    datatype: str                      # V2 name
    false_true: tuple[Any, Any] = (0, 1)  # START, END, READY: the values of false and true


@dataclass(frozen=True)
class State:
    """An implicit state: the model's output `output` with one request is its input `input` with the next."""

    input: str
    output: str
    datatype: str                      # V2 name
    dims: tuple[int, ...]              # without the batch dimension; -1 where the size is open
    initial_dims: tuple[int, ...] = ()  # the initial state's, when the config gives one
    initial_file: str = ""             # under <model>/initial_state/; empty: zeros


@dataclass(frozen=True)
class SequencePolicy:
    idle_us: int = DEFAULT_IDLE_US
    controls: tuple[Control, ...] = ()
    states: tuple[State, ...] = ()
    oldest: bool = False               # Triton's Oldest strategy, else Direct
    max_queue_delay_us: int = 0        # how long a batch may wait for more sequences' requests
    preferred: tuple[int, ...] = ()    # Oldest's preferred sizes; Direct's from minimum_slot_utilization
    slots: int = 1                     # sequences an instance runs at once; others wait


def sequence_policy(config: dict[str, Any]) -> SequencePolicy | None:
    """The config's sequence_batching (Triton's JSON form, already validated), or None."""
    raw = config.get("sequence_batching")
    if raw is None:
        return None
    controls = []
    for entry in raw.get("control_input") or ():
        for c in entry.get("control") or ():
            kind = KINDS[c["kind"]]
            if kind == "CORRID":
                controls.append(Control(entry["name"], kind, CONFIG_TO_V2[c["data_type"]], (0, 0)))
            else:
                for key, datatype in (("int32_false_true", "INT32"), ("fp32_false_true", "FP32"),
                                      ("bool_false_true", "BOOL")):
                    values = c.get(key) or []
                    if values:
                        controls.append(Control(entry["name"], kind, datatype, (values[0], values[1])))
    states = []
    for st in raw.get("state") or ():
        initial = (st.get("initial_state") or [{}])[0]
        states.append(State(st["input_name"], st["output_name"], CONFIG_TO_V2[st["data_type"]],
                            tuple(int(d) for d in st.get("dims") or ()),
                            tuple(int(d) for d in initial.get("dims") or ()), initial.get("data_file") or ""))
    oldest = raw.get("oldest")
    strategy = oldest if oldest is not None else raw.get("direct") or {}
    # a slot per row of a batch, as Triton's; Oldest's max_candidate_sequences, when set, instead
    slots = max(int(config.get("max_batch_size") or 0), 1)
    if oldest is not None and int(oldest.get("max_candidate_sequences") or 0) > 0:
        slots = int(oldest["max_candidate_sequences"])
    delay = int(strategy.get("max_queue_delay_microseconds") or 0)
    preferred = tuple(int(p) for p in (oldest or {}).get("preferred_batch_size") or ())
    if oldest is None:
        preferred = _utilized_sizes(config, float(strategy.get("minimum_slot_utilization") or 0))
        if not preferred:
            delay = 0  # Direct waits only to fill its minimum_slot_utilization; without one a ready slot runs
    return SequencePolicy(int(raw.get("max_sequence_idle_microseconds") or DEFAULT_IDLE_US), tuple(controls),
                          tuple(states), oldest is not None, delay, preferred, slots)


def _utilized_sizes(config: dict[str, Any], utilization: float) -> tuple[int, ...]:
    """Direct's minimum_slot_utilization as the batch sizes that go at once (the batcher's preferred sizes,
    each of the ready requests there are, up to max_batch_size): Triton's DirectSequenceBatch sends the
    ready slots once ready / max_batch_size reaches it (in float32), else once its oldest request waited
    max_queue_delay_microseconds. Empty without one (0): then nothing waits."""
    size = int(config.get("max_batch_size") or 0)
    if utilization <= 0 or size <= 0:
        return ()
    least = next(n for n in range(1, size + 1)
                 if np.float32(n) / np.float32(size) >= np.float32(utilization) or n == size)
    return tuple(range(least, size + 1))


def validate(config: Any) -> None:
    """Triton's load-time checks of sequence_batching (a ModelConfig message)."""
    model = config.name
    sb = config.sequence_batching
    where = f"model '{model}': field 'sequence_batching"
    _validate_states(config, where)
    if sb.iterative_sequence:
        raise ConfigError(f"{where}.iterative_sequence' is not supported by Despina yet")
    names: set[str] = set()
    inputs = {t.name for t in config.input}
    for entry in sb.control_input:
        if not entry.name:
            raise ConfigError(f"{where}.control_input': an entry has no field 'name'")
        if entry.name in names or entry.name in inputs:
            raise ConfigError(f"{where}.control_input': '{entry.name}' is named twice")
        names.add(entry.name)
        if len(entry.control) != 1:
            raise ConfigError(f"{where}.control_input' '{entry.name}': needs exactly one 'control'")
        control = entry.control[0]
        kind = pb.ModelSequenceBatching.Control.Kind.Name(control.kind)
        if kind == "CONTROL_SEQUENCE_CORRID":
            datatype = pb.DataType.Name(control.data_type)
            if datatype not in CORRID_TYPES:
                raise ConfigError(f"{where}.control_input' '{entry.name}': a CORRID control needs a "
                                  f"data_type of {', '.join(CORRID_TYPES)}, got {datatype}")
            continue
        given = [values for values in (control.int32_false_true, control.fp32_false_true,
                                       control.bool_false_true) if len(values)]
        if len(given) != 1 or len(given[0]) != 2:
            raise ConfigError(f"{where}.control_input' '{entry.name}': {kind} needs exactly one of "
                              "int32_false_true, fp32_false_true, bool_false_true, with two values")
    if sb.WhichOneof("strategy_choice") == "oldest":
        for size in sb.oldest.preferred_batch_size:
            if size <= 0 or size > max(config.max_batch_size, 1):
                raise ConfigError(f"{where}.oldest.preferred_batch_size' {size} is outside "
                                  f"1..max_batch_size ({config.max_batch_size})")


def _validate_states(config: Any, where: str) -> None:
    inputs = {t.name for t in config.input}
    seen: set[str] = set()
    for st in config.sequence_batching.state:
        name = f"{where}.state' '{st.input_name or '?'}'"
        if not st.input_name or not st.output_name:
            raise ConfigError(f"{name}: needs both 'input_name' and 'output_name'")
        if st.input_name in inputs or st.input_name in seen:
            raise ConfigError(f"{name}: '{st.input_name}' is named twice")
        seen.add(st.input_name)
        datatype = pb.DataType.Name(st.data_type)
        if datatype not in CONFIG_TO_V2 or datatype == "TYPE_STRING":
            raise ConfigError(f"{name}: field 'data_type' {datatype} cannot be a state")
        if any(d < -1 or d == 0 for d in st.dims):
            raise ConfigError(f"{name}: field 'dims' must hold positive sizes or -1, got {list(st.dims)}")
        if len(st.initial_state) > 1:
            raise ConfigError(f"{name}: at most one 'initial_state'")
        for initial in st.initial_state:
            if initial.data_type != st.data_type:
                raise ConfigError(f"{name}: its initial_state's data_type must be the state's, {datatype}")
            if any(d <= 0 for d in initial.dims):
                raise ConfigError(f"{name}: its initial_state's dims must be positive sizes")
            if initial.WhichOneof("state_data") is None:
                raise ConfigError(f"{name}: its initial_state needs 'zero_data' or 'data_file'")
            if initial.data_file and ("/" in initial.data_file or initial.data_file.startswith(".")):
                raise ConfigError(f"{name}: its initial_state's data_file must name a file in the "
                                  "model's initial_state/ folder")
            _validate_initial_shape(name, st, initial)


def _validate_initial_shape(where: str, state: Any, initial: Any) -> None:
    """Triton's load-time checks of an initial_state against its state (its messages after the colon):
    the state's first START would otherwise feed the model a state of another shape."""
    if not initial.name:
        raise ConfigError(f"{where}: Field 'name' must be set when using initial_state for state input "
                          f"'{state.input_name}'.")
    if len(initial.dims) != len(state.dims):
        raise ConfigError(f"{where}: Number of dimensions in 'initial_state' doesn't match the size of "
                          f"'state' dimensions for state input '{state.input_name}'. "
                          f"{len(initial.dims)} != {len(state.dims)}")
    for got, want in zip(initial.dims, state.dims):
        if want != -1 and got != want:
            raise ConfigError(f"{where}: 'initial_state' dim for input name '{state.input_name}' doesn't "
                              f"match 'state' dim description. {got} != {want}")


def check_correlation(policy: SequencePolicy, model: str, correlation: Correlation) -> None:
    """Triton's check of a correlation ID against the model's CORRID control: a string ID needs a
    TYPE_STRING control, a number one of the integer types (Triton does not turn one into the other)."""
    for control in policy.controls:
        if control.kind != "CORRID":
            continue
        given = "BYTES" if isinstance(correlation, str) else "UINT64"
        if (given == "BYTES") != (control.datatype == "BYTES"):
            raise InvalidArgument(f"sequence batching control 'CORRID' data-type is '{given}', but model "
                                  f"'{model}' expects '{control.datatype}'")


def optional_sequence(parameters: dict[str, Any], model: str) -> tuple[Correlation, int] | None:
    """An ensemble request's sequence, when it names one: its steps carry it to the stateful models
    they call, as Triton's ensemble scheduler passes the correlation ID and flags on."""
    if not parameters or "sequence_id" not in parameters:
        return None
    return request_sequence(parameters, model)


def request_sequence(parameters: dict[str, Any], model: str) -> tuple[Correlation, int]:
    """A request's (correlation ID, flags) from its V2 parameters, for a model with sequence batching:
    Triton's errors for a missing or malformed ID."""
    raw = parameters.get("sequence_id")
    if raw is None or raw == 0 or raw == "":
        raise InvalidArgument(f"inference request to model '{model}' must specify a non-zero or non-empty "
                              "correlation ID (the parameter 'sequence_id')")
    return _in_range(_id(raw)), _flags(parameters)


def _id(raw: Any) -> Correlation:
    if isinstance(raw, float) and raw.is_integer() and abs(raw) >= 2**63:
        raw = int(raw)  # (the JSON parser gives a number past 64 bits as a float)
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise InvalidArgument(f"parameter 'sequence_id' must be an unsigned integer or a string, got {raw}")
    return raw


def passed_sequence(parameters: dict[str, Any]) -> tuple[Correlation, int] | None:
    """A request's (correlation ID, flags) for a model without sequence batching, when it names either:
    Triton hands them to every model as they are (a Python model reads request.correlation_id() and
    .flags()), an ID of 0 or "" and flags without an ID included."""
    if not parameters or ("sequence_id" not in parameters and "sequence_start" not in parameters
                          and "sequence_end" not in parameters):
        return None
    return _in_range(_id(parameters.get("sequence_id", 0))), _flags(parameters)


def _in_range(raw: Correlation) -> Correlation:
    if isinstance(raw, int) and not 0 <= raw < 2**64:
        raise InvalidArgument(f"parameter 'sequence_id' {raw} is outside the range of a uint64")
    return raw


def _flags(parameters: dict[str, Any]) -> int:
    flags = 0
    for name, flag in (("sequence_start", START), ("sequence_end", END)):
        value = parameters.get(name, False)
        if not isinstance(value, bool):
            raise InvalidArgument(f"parameter '{name}' must be true or false")
        if value:
            flags |= flag
    return flags
