"""Which MetaGraph and signature of a SavedModel are served, read from saved_model.pb without TensorFlow.

As Triton's TensorFlow backend chooses: the MetaGraph whose tags are exactly {TF_GRAPH_TAG}, "serve" when
the parameter is unset or empty (a SavedModel with one MetaGraph and no TF_GRAPH_TAG: that one, whatever
its tags); its signature TF_SIGNATURE_DEF, "serving_default" when unset or empty, and without one of that
name the one other serving signature it has (Triton takes the first its map gives; with several, Despina
asks for TF_SIGNATURE_DEF instead).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

DEFAULT_TAG = "serve"
DEFAULT_SIGNATURE = "serving_default"
NOT_SERVING = ("__saved_model_init_op", "__saved_model_train_op")


@dataclass(frozen=True)
class Served:
    tags: list[str]
    name: str
    signature: Any  # the SignatureDef (wire-compatible schema below)


def served(path: Path, parameters: Mapping[str, str]) -> Served:
    """The MetaGraph and signature served from the saved_model.pb at `path`; ValueError says why none."""
    saved = _schema()()
    saved.ParseFromString(path.read_bytes())
    graph = _meta_graph(list(saved.meta_graphs), parameters.get("TF_GRAPH_TAG", ""))
    name, signature = _signature(graph, parameters.get("TF_SIGNATURE_DEF", ""))
    return Served(list(graph.meta_info_def.tags), name, signature)


def _meta_graph(graphs: list[Any], tag: str) -> Any:
    if not tag and len(graphs) == 1:
        return graphs[0]
    wanted = tag or DEFAULT_TAG
    for graph in graphs:
        if set(graph.meta_info_def.tags) == {wanted}:
            return graph
    sets = ", ".join(f"[{', '.join(g.meta_info_def.tags)}]" for g in graphs)
    raise ValueError(f"no MetaGraph tagged exactly '{wanted}' (its tag sets: {sets}); name the tag with the "
                     "parameter TF_GRAPH_TAG")


def _signature(graph: Any, name: str) -> tuple[str, Any]:
    signatures = {e.key: e.value for e in graph.signature_def}
    wanted = name or DEFAULT_SIGNATURE
    if wanted in signatures:
        return wanted, signatures[wanted]
    serving = sorted(k for k in signatures if k not in NOT_SERVING)
    if not name and len(serving) == 1:
        return serving[0], signatures[serving[0]]
    raise ValueError(f"no signature '{wanted}' (it has: {', '.join(serving) or 'none'})"
                     + ("" if name else "; name one with the parameter TF_SIGNATURE_DEF"))


@cache
def _schema() -> Any:
    """The fields of TensorFlow's SavedModel protos that auto-complete reads, wire-compatible.

    Maps are declared as repeated key/value entries, which is how protobuf encodes them.
    """
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    messages: dict[str, list[tuple[str, int, int, str | None]]] = {
        "Dim": [("size", 1, F.TYPE_INT64, None), ("name", 2, F.TYPE_STRING, None)],
        "Shape": [("dim", 2, F.TYPE_MESSAGE, "Dim"), ("unknown_rank", 3, F.TYPE_BOOL, None)],
        "TensorInfo": [("name", 1, F.TYPE_STRING, None), ("dtype", 2, F.TYPE_INT32, None),
                       ("tensor_shape", 3, F.TYPE_MESSAGE, "Shape")],
        "TensorEntry": [("key", 1, F.TYPE_STRING, None), ("value", 2, F.TYPE_MESSAGE, "TensorInfo")],
        "SignatureDef": [("inputs", 1, F.TYPE_MESSAGE, "TensorEntry"),
                         ("outputs", 2, F.TYPE_MESSAGE, "TensorEntry"),
                         ("method_name", 3, F.TYPE_STRING, None)],
        "SignatureEntry": [("key", 1, F.TYPE_STRING, None), ("value", 2, F.TYPE_MESSAGE, "SignatureDef")],
        "MetaInfoDef": [("tags", 4, F.TYPE_STRING, None)],
        "MetaGraphDef": [("meta_info_def", 1, F.TYPE_MESSAGE, "MetaInfoDef"),
                         ("signature_def", 5, F.TYPE_MESSAGE, "SignatureEntry")],
        "SavedModel": [("meta_graphs", 2, F.TYPE_MESSAGE, "MetaGraphDef")],
    }
    repeated = {("Shape", "dim"), ("SignatureDef", "inputs"), ("SignatureDef", "outputs"),
                ("MetaInfoDef", "tags"), ("MetaGraphDef", "signature_def"), ("SavedModel", "meta_graphs")}
    file = descriptor_pb2.FileDescriptorProto(name="despina_savedmodel.proto", package="despina_tf",
                                              syntax="proto3")
    for message, fields in messages.items():
        proto = file.message_type.add(name=message)
        for field, number, kind, ref in fields:
            label = F.LABEL_REPEATED if (message, field) in repeated else F.LABEL_OPTIONAL
            proto.field.add(name=field, number=number, type=kind, label=label,
                            type_name=f".despina_tf.{ref}" if ref else None)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("despina_tf.SavedModel"))
