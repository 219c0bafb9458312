"""Triton's ragged batching in a model config: inputs with `allow_ragged_batch`, the `batch_input`s a
backend makes for each batch from one source input, and the `batch_output`s it cuts by the requests'
input shapes. Checked here as Triton checks them at load (and refused where Despina cannot make them);
made and cut per batch by workers/ragged.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._schema import model_config_pb2 as pb
from .datatypes import CONFIG_TO_V2
from .errors import ConfigError


@dataclass(frozen=True, slots=True)
class BatchInputSpec:
    """A tensor the backend makes for each batch from one of its inputs (Triton's `batch_input`)."""

    kind: str                    # Triton's BatchInput.Kind name, BATCH_ELEMENT_COUNT ...
    targets: tuple[str, ...]     # the model's inputs that get it
    datatype: str                # V2 name: INT32 or FP32
    source: str                  # the request input it describes


@dataclass(frozen=True, slots=True)
class BatchOutputSpec:
    """Outputs cut into the requests' parts by the shapes of one input (BATCH_SCATTER_WITH_INPUT_SHAPE)."""

    targets: tuple[str, ...]
    source: str


def batch_inputs(config: dict[str, Any]) -> tuple[BatchInputSpec, ...]:
    """The batch inputs of a config in Triton's JSON form (validate_batch_io checked them)."""
    return tuple(BatchInputSpec(b.get("kind", "BATCH_ELEMENT_COUNT"), tuple(b.get("target_name", [])),
                                CONFIG_TO_V2.get(b.get("data_type", ""), "INT32"),
                                (b.get("source_input") or [""])[0])
                 for b in config.get("batch_input", []))


def batch_outputs(config: dict[str, Any]) -> tuple[BatchOutputSpec, ...]:
    return tuple(BatchOutputSpec(tuple(b.get("target_name", [])), (b.get("source_input") or [""])[0])
                 for b in config.get("batch_output", []))


def validate_batch_io(config: Any, scheduling: str | None) -> None:
    """Ragged inputs, batch inputs and batch outputs (Triton's ragged batching), checked as Triton
    checks them, and refused where Despina cannot make them: each error names the field."""
    model = config.name
    inputs = {t.name: t for t in config.input}
    outputs = {t.name: t for t in config.output}
    ragged = [t.name for t in config.input if t.allow_ragged_batch]
    if not ragged and not config.batch_input and not config.batch_output:
        return
    where = f"model '{model}'"
    if config.backend not in ("onnxruntime", "pytorch", "tensorflow"):
        # the Python backend hands each request's own tensors to the model: nothing is concatenated
        if config.batch_input or config.batch_output:
            raise ConfigError(f"{where}: field 'batch_input'/'batch_output' needs a backend that batches "
                              "tensors (onnxruntime, pytorch or tensorflow); a Python model gets each "
                              "request's own tensors")
    if scheduling == "sequence_batching":
        raise ConfigError(f"{where}: ragged batching (allow_ragged_batch, batch_input, batch_output) with "
                          "sequence_batching is not supported by Despina yet")
    for name in ragged:
        if inputs[name].HasField("reshape"):
            raise ConfigError(f"{where}: input '{name}': allow_ragged_batch with a reshape is not "
                              "supported by Despina yet")
    targets: set[str] = set()
    for b in config.batch_input:
        kind = pb.BatchInput.Kind.Name(b.kind)
        field_ = f"{where}: batch_input {kind}"
        if len(b.source_input) != 1:
            raise ConfigError(f"{field_}: expects 1 source input, got {len(b.source_input)}")
        if b.source_input[0] not in inputs:
            raise ConfigError(f"{field_}: unknown source input name '{b.source_input[0]}'")
        if b.data_type not in (pb.TYPE_INT32, pb.TYPE_FP32):
            raise ConfigError(f"{field_}: field 'data_type' must be TYPE_INT32 or TYPE_FP32, got "
                              f"{pb.DataType.Name(b.data_type)}")
        if not b.target_name:
            raise ConfigError(f"{field_}: field 'target_name' is empty")
        for target in b.target_name:
            if target in inputs:
                raise ConfigError(f"{field_}: target name '{target}' is one of the config's inputs, which "
                                  "requests give")
            if target in targets:
                raise ConfigError(f"{field_}: target name '{target}' is given by two batch inputs")
            targets.add(target)
    scattered: set[str] = set()
    for b in config.batch_output:
        field_ = f"{where}: batch_output {pb.BatchOutput.Kind.Name(b.kind)}"
        if len(b.source_input) != 1:
            raise ConfigError(f"{field_}: expects 1 source input, got {len(b.source_input)}")
        if b.source_input[0] not in inputs:
            raise ConfigError(f"{field_}: unknown source input name '{b.source_input[0]}'")
        for target in b.target_name:
            if target not in outputs:
                raise ConfigError(f"{field_}: unknown target output name '{target}'")
            if target in scattered:
                raise ConfigError(f"{field_}: target output name '{target}' can only be specified once")
            if outputs[target].HasField("reshape"):
                raise ConfigError(f"{field_}: output '{target}' has a reshape, which Despina does not "
                                  "support for a batch output yet")
            scattered.add(target)
