"""Triton's model_warmup: samples run on every instance at load, before the model is READY."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..contract.datatypes import CONFIG_TO_V2, V2_TO_NUMPY, deserialize_bytes, element_count
from ..contract.errors import ConfigError, DespinaError, InvalidArgument
from ..contract.modelspec import ModelSpec, check_datatype, check_shape
from .backends.base import Backend
from .ragged import BatchIO
from .reshape import Reshapes


@dataclass(frozen=True)
class Sample:
    name: str
    batch_size: int                   # requests of one row each (1 for a model without batching)
    count: int                        # times the sample runs
    inputs: dict[str, np.ndarray]     # one request's inputs, batch dimension included when batched


def samples(spec: ModelSpec, model_dir: Path) -> list[Sample]:
    """The model's warmup samples, built from zero_data, random_data or a file under <model>/warmup/."""
    rng = np.random.default_rng(0)
    found = []
    for i, raw in enumerate(spec.config.get("model_warmup") or ()):
        name = raw.get("name") or f"sample {i}"
        batch_size = max(1, int(raw.get("batch_size") or 1))
        if not spec.batched and batch_size != 1:
            raise ConfigError(f"model '{spec.name}': model_warmup '{name}': field 'batch_size' must be "
                              "1 for a model without batching")
        if batch_size > spec.max_batch_size > 0:
            raise ConfigError(f"model '{spec.name}': model_warmup '{name}': batch size {batch_size} is "
                              f"over max_batch_size {spec.max_batch_size}")
        inputs = {}
        for input_name, data in (raw.get("inputs") or {}).items():
            try:
                array = _data(data, model_dir, rng)
            except (OSError, ValueError, DespinaError) as exc:
                raise ConfigError(f"model '{spec.name}': model_warmup '{name}' input '{input_name}': "
                                  f"{exc}") from None
            try:
                _check(spec, input_name, data, array)
            except DespinaError as exc:
                raise ConfigError(f"model '{spec.name}': model_warmup '{name}': {exc.message}") from None
            inputs[input_name] = array[np.newaxis] if spec.batched else array
        missing = [t.name for t in spec.inputs if not t.optional and t.name not in inputs]
        if missing:
            raise ConfigError(f"model '{spec.name}': model_warmup '{name}' lacks input(s) "
                              f"{', '.join(missing)}")
        found.append(Sample(name, batch_size, max(1, int(raw.get("count") or 1)), inputs))
    return found


def _check(spec: ModelSpec, name: str, data: dict[str, Any], array: np.ndarray) -> None:
    """A sample's input holds what a request may send, as Triton checks its warmup requests; a name the
    model lacks goes through (Triton passes it on, a sequence's control input)."""
    expected = spec.input(name)
    if expected is None:
        return
    check_datatype(expected, CONFIG_TO_V2[data["data_type"]])
    check_shape(spec, expected, ([1] if spec.batched else []) + list(array.shape))


def _data(data: dict[str, Any], model_dir: Path, rng: np.random.Generator) -> np.ndarray:
    datatype = CONFIG_TO_V2.get(data.get("data_type", ""))
    if datatype is None:
        raise ValueError(f"field 'data_type' {data.get('data_type')} is not supported")
    shape = tuple(int(d) for d in data.get("dims", ()))
    if any(d < 0 for d in shape):
        raise ValueError("warmup setting expects all variable-size dimensions are specified")
    if not any(data.get(k) for k in ("zero_data", "random_data", "input_data_file")):
        raise ValueError("warmup setting expects the input to have input_data_type set (zero_data, "
                         "random_data or input_data_file)")
    dtype = V2_TO_NUMPY[datatype]
    count = element_count(shape)
    if data.get("input_data_file"):
        path = (model_dir / "warmup" / data["input_data_file"]).resolve()
        if (model_dir / "warmup").resolve() not in path.parents:
            raise ValueError("field 'input_data_file' must name a file inside the model's warmup/ folder")
        raw = path.read_bytes()
        if datatype == "BYTES":
            try:  # Triton's BYTES form (4-byte length + bytes per element), else the whole file each time
                return deserialize_bytes(raw, count).reshape(shape)
            except InvalidArgument:
                return np.full(shape, raw, dtype=object)
        if len(raw) < count * dtype.itemsize:
            raise ValueError(f"{path.name} holds {len(raw)} bytes; {list(shape)} of {datatype} needs "
                             f"{count * dtype.itemsize}")
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)
    # Triton gives a string input zero data for random_data: random bytes are not the text a string
    # tensor holds (onnxruntime's refuses them)
    if data.get("random_data") and datatype != "BYTES":
        if dtype.kind == "f":
            return rng.random(shape).astype(dtype)
        if dtype.kind == "b":
            return rng.integers(0, 2, shape).astype(dtype)
        return rng.integers(0, 100, shape).astype(dtype)
    if datatype == "BYTES":  # Triton's zero bytes: each element's 4-byte length is 0
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=dtype)


def run(backend: Backend, spec: ModelSpec, warmups: list[Sample]) -> None:
    """Execute each sample on one instance; a failure is a load error that names the sample."""
    outputs = [o.name for o in spec.outputs]
    reshape = Reshapes.of(spec)
    if reshape is not None:  # the samples are in the config's dims, as requests are
        try:
            warmups = [replace(s, inputs=reshape.to_model(s.inputs)) for s in warmups]
        except DespinaError as exc:
            raise ConfigError(f"model '{spec.name}': a warmup sample: {exc.message}") from None
    for sample in warmups:
        for _ in range(sample.count):
            try:
                _run_one(backend, sample, outputs)
            except DespinaError as exc:
                raise ConfigError(f"model '{spec.name}': warmup sample '{sample.name}' failed: "
                                  f"{exc.message}") from None
            except Exception as exc:
                raise ConfigError(f"model '{spec.name}': warmup sample '{sample.name}' failed: {exc}"
                                  ) from None


def _run_one(backend: Backend, sample: Sample, outputs: list[str]) -> None:
    if backend.spec.decoupled:  # its responses come on stream 0, which no request has: dropped
        streams = getattr(backend, "execute_streams")  # noqa: B009 (a decoupled model's backend has it)
        for error in streams([sample.inputs] * sample.batch_size, [outputs] * sample.batch_size,
                             [0] * sample.batch_size):
            if error is not None:
                raise error
        return
    if backend.per_request:
        results = backend.execute_requests([sample.inputs] * sample.batch_size,
                                           [outputs] * sample.batch_size)
        for result in results:
            if isinstance(result, DespinaError):
                raise result
        return
    inputs = sample.inputs
    if sample.batch_size > 1:
        inputs = {n: np.concatenate([a] * sample.batch_size) for n, a in inputs.items()}
    batch_io = BatchIO.of(backend.spec)
    if batch_io is not None:  # one request of batch_size rows, as the model gets it (ragged.py)
        inputs = batch_io.assemble([inputs])
    backend.execute(inputs, outputs)
