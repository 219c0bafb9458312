"""KServe V2 / Open Inference Protocol replies: a model's output tensors to a JSON body, or to a JSON header
followed by Triton's binary tensors, or into the client's shared memory. The request side is v2.py.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from ..contract.datatypes import V2_TO_NUMPY
from ..contract.records import NO_PARAMETERS, Parameters, Tensor
from .jsondata import nonfinite_json
from .shm import ShmOutput

HEADS_MAX = 64  # reply headers remembered per request header (BYTES outputs vary in size)


def encode_infer(model: str, version: int, req_id: str | None, outputs: tuple[Tensor, ...],
                 binary: set[str], binary_all: bool, heads: dict[tuple[Any, ...], bytes] | None = None,
                 parameters: Parameters = NO_PARAMETERS, shm: dict[str, ShmOutput] | None = None
                 ) -> tuple[bytes, int | None]:
    """Reply tensors (and the model's response parameters) -> (body, JSON header length or None when
    the body is all JSON). The outputs in `shm` are written into their shared memory instead.

    `heads` (Decoded.heads) remembers the JSON header of replies whose outputs are all binary or in
    shared memory: it depends only on the version that ran, the request's id and the outputs' names,
    shapes and sizes, the same for every reply of a shape; a reply with response parameters is encoded
    afresh. (A request plan's heads serve every version of its model and, for JSON, every id.)"""
    if parameters:
        heads = None
    if heads is not None:
        if len(outputs) == 1:  # the usual case, without a comprehension's function made and called
            t = outputs[0]
            key: tuple[Any, ...] = (version, req_id, (t.name, t.datatype, t.shape, len(t.data)))
        else:
            key = (version, req_id, *[(t.name, t.datatype, t.shape, len(t.data)) for t in outputs])
        header = heads.get(key)
        if header is not None:
            if not shm:
                if len(outputs) == 1:
                    return header + outputs[0].data, len(header)
                return b"".join([header, *[t.data for t in outputs]]), len(header)
            chunks = [t.data for t in outputs if t.name not in shm]
            for t in outputs:
                if t.name in shm:
                    shm[t.name].write(t.name, t.data)
            return (b"".join([header, *chunks]), len(header)) if chunks else (header, None)
    described: list[dict[str, Any]] = []
    chunks = []
    for t in outputs:
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if shm and t.name in shm:  # its name, datatype and shape alone, as Triton answers it (tritonclient's
            shm[t.name].write(t.name, t.data)  # C++ client reads binary_data_size from any parameters)
        elif binary_all or t.name in binary:
            entry["parameters"] = {"binary_data_size": len(t.data)}
            chunks.append(t.data)
        else:
            entry["data"] = json_data(t)
        described.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if req_id is not None:
        doc["id"] = req_id
    if parameters:
        doc["parameters"] = parameters
    doc["outputs"] = described
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if header.find(b"null") >= 0:  # orjson writes a non-finite float as null: written again as Triton does
        again = False
        for entry in described:
            data = entry.get("data")
            if isinstance(data, np.ndarray) and (written := nonfinite_json(data, data)) is not data:
                entry["data"], again = written, True
        if again:  # (not for a "null" in a string)
            header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    no_json = len(chunks) + (sum([t.name in shm for t in outputs]) if shm else 0) == len(outputs)
    if heads is not None and no_json and len(heads) < HEADS_MAX:
        heads[key] = header
    return (b"".join([header, *chunks]), len(header)) if chunks else (header, None)


def json_data(t: Tensor) -> Any:
    if t.datatype == "BYTES":
        return [b.decode("utf-8", "replace") for b in t.numpy().reshape(-1)]
    array = np.frombuffer(t.data, dtype=V2_TO_NUMPY[t.datatype])
    if t.datatype in ("FP16",):
        return array.astype(np.float32)
    return array
