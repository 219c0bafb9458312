"""Function URLs: `POST /fn/{model}[/versions/{version}]` with `{input: nested list}` in and
`{output: nested list}` out.

For curl users: shapes come from the nesting, datatypes from the model. A batched model may be sent
one row without its batch dimension; the answer then comes back without it too. A scalar is the one
element of an input whose dims hold one ([1], [-1], [1, 1]).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from ..contract.errors import InvalidArgument
from ..contract.modelspec import ModelSpec, check_inputs, check_shape, known_input
from ..contract.records import Tensor
from .http import loads
from .jsondata import holds_no_booleans, json_data_to_bytes, nonfinite_json
from .v2 import MAX_ELEMENTS
from .v2_fields import check_count

if TYPE_CHECKING:
    from .models import Model


def refuse_stateful(models: Mapping[str, Model], model: Model) -> None:
    """/fn names no sequence (V2's parameters do): a stateful model, or an ensemble that calls one, is
    refused with where a sequence can be named."""
    if model.ensemble is None and not model.spec.sequence:  # the usual model: nothing to walk
        return
    name = model.spec.name
    stateful = stateful_step(models, model, set())
    if stateful == name:
        raise InvalidArgument(f"model '{name}' is stateful (sequence batching): call it through "
                              f"/v2/models/{name}/infer or .../generate with the parameter 'sequence_id'")
    if stateful:
        raise InvalidArgument(f"ensemble '{name}' calls model '{stateful}', which is stateful (sequence "
                              f"batching): call it through /v2/models/{name}/infer or .../generate with "
                              "the parameter 'sequence_id'")


def stateful_step(models: Mapping[str, Model], model: Model, seen: set[str]) -> str | None:
    """The model itself when it is stateful, else the first stateful model its ensemble's steps call (the
    steps of ensembles it calls included); None when there is none."""
    if model.spec.sequence:
        return model.spec.name
    seen.add(model.spec.name)
    for step in model.ensemble.steps if model.ensemble is not None else ():
        called = models.get(step.model)
        if called is not None and called.spec is not None and step.model not in seen:
            found = stateful_step(models, called, seen)
            if found:
                return found
    return None


def decode_fn(body: bytes, spec: ModelSpec, max_elements: int = MAX_ELEMENTS) -> tuple[list[Tensor], bool]:
    """The body -> (input tensors, whether a batch dimension of 1 was added); InvalidArgument, and
    nothing else, on any input."""
    doc = loads(body)
    if not isinstance(doc, dict):  # a bare list (or value): the one input the model needs
        doc = {sole_input(spec): doc}
    if not doc:
        raise InvalidArgument("send a JSON object {input_name: nested list}, or a list for a "
                              "single-input model")
    tensors: list[Tensor] = []
    added = False
    booleans = not holds_no_booleans(body)
    # one input's body: its lists are the body's brackets (counted at memchr's speed); a bracket in a key
    # or a string only makes the count differ from the shape's, and then every value is looked at
    brackets = body.count(b"[") if len(doc) == 1 else -1
    for name, data in doc.items():
        expected = known_input(spec, name)
        shape = shape_of(name, data, len(expected.dims) + (1 if spec.batched else 0), brackets)
        if not shape and expected.dims and set(expected.dims) <= {1, -1}:  # one value: its one element
            shape = [1] * len(expected.dims)
            for _ in shape:
                data = [data]
        if spec.batched and len(shape) == len(expected.dims):
            shape = [1, *shape]
            added = True
        check_shape(spec, expected, shape)
        check_count(name, shape, max_elements)
        tensors.append(Tensor(name, expected.datatype, tuple(shape),
                              json_data_to_bytes(name, expected.datatype, shape, data, booleans)))
    check_inputs(spec, tensors)
    return tensors, added


def sole_input(spec: ModelSpec) -> str:
    """The input a body that is not a JSON object goes to: the model's only one, or the only one it
    needs (the others optional); InvalidArgument when there are several."""
    if len(spec.inputs) == 1:
        return spec.inputs[0].name
    needed = [t.name for t in spec.inputs if not t.optional]
    if len(needed) == 1:
        return needed[0]
    names = ", ".join(t.name for t in spec.inputs)
    raise InvalidArgument(f"model '{spec.name}' has {len(spec.inputs)} inputs ({names}): send a JSON "
                          "object keyed by input name")


def form_hint(exc: InvalidArgument, content_type: bytes | None) -> InvalidArgument:
    """decode_fn's error, with the way to send JSON when the body it could not read was a form (curl -F)."""
    if content_type is None or not content_type.lower().startswith(b"multipart/form-data"):
        return exc
    return InvalidArgument(f"{exc.message} (the body is a multipart form, as curl -F sends: send the JSON "
                           "itself as the body, with curl -d '...' or --data-binary @file.json)")


def shape_of(name: str, data: Any, max_rank: int, brackets: int = -1) -> list[int]:
    """The shape that nested lists make (a scalar: []), at most `max_rank` deep; InvalidArgument when
    they are ragged. `brackets`: how many "[" the document that holds them has, when nothing else in it
    can hold a list (-1: not known). Where that is just the lists of the shape, no list hides among the
    innermost lists' values (one would add its own), and those values need no look: 3.7 µs for 256."""
    shape: list[int] = []
    level = data
    while isinstance(level, list):
        if len(shape) == max_rank:  # also bounds the recursion of _check_regular below
            raise InvalidArgument(f"input '{name}': lists nested more than {max_rank} deep; the model "
                                  f"takes at most {max_rank} dimensions")
        shape.append(len(level))
        if not level:
            break
        level = level[0]
    lists, rows = 0, 1  # the lists a regular nesting of this shape has: 1 + d0 + d0 * d1 + ...
    for size in shape:
        lists += rows
        rows *= size
    _check_regular(name, data, shape, 0, brackets != lists)
    return shape


def _check_regular(name: str, data: Any, shape: list[int], depth: int, innermost: bool = True) -> None:
    if depth == len(shape):  # a scalar where the first element was one
        return
    if not isinstance(data, list) or len(data) != shape[depth]:
        raise InvalidArgument(f"input '{name}': nested lists are ragged (expected {shape})")
    if depth == len(shape) - 1:  # the innermost level: scalars only (checked in one pass)
        if innermost and list in set(map(type, data)):
            raise InvalidArgument(f"input '{name}': nested lists are ragged")
        return
    for item in data:
        _check_regular(name, item, shape, depth + 1, innermost)


def encode_fn(outputs: tuple[Tensor, ...], squeeze: bool) -> bytes:
    doc: dict[str, Any] = {}
    for t in outputs:
        array = t.numpy()
        if squeeze and array.ndim and array.shape[0] == 1:
            array = array[0]
        doc[t.name] = nonfinite_json(plain(array, t.datatype), array)
    return orjson.dumps(doc)


def plain(array: np.ndarray, datatype: str) -> Any:
    """A tensor as JSON takes it: nested lists of numbers, booleans or (BYTES) text."""
    if datatype == "BYTES":
        text = np.vectorize(lambda b: b.decode("utf-8", "replace"), otypes=[object])
        return text(array).tolist()  # an empty one too: [[], []] keeps its shape, as numbers' do
    if datatype == "FP16":
        return array.astype(np.float32).tolist()
    return array.tolist()
