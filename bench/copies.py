"""What one large tensor costs in memory along the hot path, hop by hop, in one process (no server):

    python bench/copies.py [--shape 8,3,224,224] [--datatype FP32]

Each hop is run as the gateway and the worker run it, on a tensor of `--shape` (default: a batch of 8
images, 4.8 MB of FP32; ~15 MB as JSON), its sizes counted in N, the tensor's raw bytes:

  gateway, request:  body (binary, or JSON: the first sight of its document and a remembered one) ->
                     decode_infer -> InferRequest -> records.encode, the message for Redis (the body is let
                     go of before the message is made, as InferRoute.queue lets go of it)
  worker:            the message -> decode_requests -> request_inputs -> Execution.run_batch (onnxruntime,
                     an identity model, its arena off; one request, and two in one batch) -> records.encode
  gateway, reply:    the worker's message -> decode_replies -> encode_infer, the HTTP body (binary, JSON)

Two counts per hop, which noise does not move: `peak`, the most memory the hop's Python objects held at
once beyond what was there before it (tracemalloc; it counts what was asked for, so a buffer grown by
doubling counts double, and it does not see onnxruntime's own allocations), and `kept`, what it held at
its end (its result). `VmHWM` is the process's peak resident memory over what it held before the hop
(/proc/self/clear_refs; glibc's heap trimmed before each hop and blocks of 1 MB or more mmapped, so that
a hop cannot reuse unseen what an earlier one freed): what the machine paid, onnxruntime included. All
three count the body or message a hop starts from while the hop holds it.

The copies of a tensor's data each hop makes, as the code makes them (np.shares_memory says where a hop
only views):
  gateway, binary request:  the body's slice (1), msgpack's buffer and the bytes it returns (2)
  gateway, JSON request:    the numbers packed (1; a chunk's Python floats at a time), joined (1), and
                            msgpack's (2)
  worker:                   msgpack's bytes of the message (1; the array is a view of them), the batch's
                            concatenation (1, two requests or more), onnxruntime's output (1), its bytes
                            (1), each request's rows of them (1, two requests or more), msgpack's (2)
  gateway, reply:           msgpack's bytes of the message (1), the body (1)
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from onnx import TensorProto

from despina.contract import records
from despina.contract.datatypes import V2_TO_NUMPY
from despina.contract.modelconfig import normalize, parse_text, to_dict
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferRequest
from despina.examples import build_identity
from despina.gateway import v2
from despina.gateway.v2 import decode_infer
from despina.gateway.v2_reply import encode_infer
from despina.workers.backends.base import request_inputs
from despina.workers.execution import Execution
from despina.workers.runner import Pending

ONNX_TYPES = {"FP32": TensorProto.FLOAT, "FP64": TensorProto.DOUBLE, "INT64": TensorProto.INT64,
              "UINT8": TensorProto.UINT8, "FP16": TensorProto.FLOAT16, "INT32": TensorProto.INT32}


M_MMAP_THRESHOLD = -3
LIBC = ctypes.CDLL("libc.so.6")


def allocate_plainly() -> None:
    """Blocks of 1 MB or more mmapped, each, and unmapped when freed: glibc's threshold moves up to 32 MB
    as it frees large blocks, which then stay in its heap and hide what later hops allocate from VmHWM."""
    LIBC.mallopt(M_MMAP_THRESHOLD, 1 << 20)


def hwm_mb() -> tuple[float, float]:
    """The process's peak resident memory since clear_refs, and its resident memory now (MB)."""
    status = Path("/proc/self/status").read_text()
    return tuple(int(status.split(f"{field}:")[1].split()[0]) / 1024  # type: ignore[return-value]
                 for field in ("VmHWM", "VmRSS"))


def measured(name: str, n: int, hop: Callable[[], Any]) -> Any:
    """Run `hop` and print its peak and kept memory in units of n bytes."""
    gc.collect()
    LIBC.malloc_trim(0)  # what earlier hops freed in the heap goes back: else this hop reuses it unseen
    Path("/proc/self/clear_refs").write_text("5")
    _, rss = hwm_mb()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    result = hop()
    now, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    hwm, _ = hwm_mb()
    print(f"{name:46s} peak {(peak - base) / n:5.2f} N   kept {(now - base) / n:5.2f} N   "
          f"VmHWM {(hwm - rss) * 2**20 / n:5.2f} N")
    return result


class Held:
    """What a hop starts from, made inside the hop (so that it counts) and let go of where the real hop
    lets go of it."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def take(self) -> bytes:
        fresh = bytes(memoryview(self.data))  # a new object, as the HTTP layer or the Redis reader makes
        return fresh


def gateway_request(spec: ModelSpec, body: bytes, header_length: int | None) -> Callable[[], bytes]:
    def hop() -> bytes:
        held = [Held(body).take()]
        decoded = decode_infer(held[0], header_length, spec, 1 << 40)
        req = InferRequest("r1", "rep", time.time() + 60, tuple(decoded.inputs))
        held.clear()  # InferRoute.queue: the body let go of once submitted; the message is made afterwards
        del decoded
        return records.encode([req])
    return hop


def gateway_reply(reply: bytes, binary: bool) -> Callable[[], bytes]:
    def hop() -> bytes:
        held = [Held(reply).take()]
        (answer,) = records.decode_replies(held.pop())
        out, _ = encode_infer("ident", 1, None, answer.outputs, set(), binary)
        return out
    return hop


def worker(loop: asyncio.AbstractEventLoop, execution: Execution, message: bytes, requests: int
           ) -> Callable[[], bytes]:
    def hop() -> bytes:
        live = []
        for i in range(requests):
            (req,) = records.decode_requests(Held(message).take())
            req.id = f"r{i}"
            live.append(Pending(req, None, request_inputs(req)))
        rows = [int(next(iter(p.inputs.values())).shape[0]) for p in live]
        replies = loop.run_until_complete(execution.run_batch(live, rows, time.time(), {}))
        assert all(r.error is None for r in replies), replies[0].error
        del live
        return records.encode(replies)
    return hop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8,3,224,224")
    parser.add_argument("--datatype", default="FP32", choices=sorted(ONNX_TYPES))
    args = parser.parse_args()
    allocate_plainly()
    shape = [int(d) for d in args.shape.split(",")]
    datatype = args.datatype
    rng = np.random.default_rng(0)
    x = (rng.random(shape) * 100).astype(V2_TO_NUMPY[datatype])
    n = x.nbytes
    columns = int(np.prod(shape[1:]))
    print(f"{datatype} {shape}: N = {n / 2**20:.1f} MB")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ident"
        build_identity(root / "1" / "model.onnx", ONNX_TYPES[datatype], columns)
        dims = ", ".join(map(str, shape[1:]))
        config = (f'name: "ident" backend: "onnxruntime" max_batch_size: {2 * shape[0]}\n'
                  f'input [{{ name: "in", data_type: TYPE_{datatype}, dims: [{dims}] '
                  f'reshape {{ shape: [{columns}] }} }}]\n'
                  f'output [{{ name: "out", data_type: TYPE_{datatype}, dims: [{columns}] }}]\n'
                  'parameters { key: "enable_mem_arena" value: { string_value: "0" } }\n')
        (root / "config.pbtxt").write_text(config)
        spec = ModelSpec.from_config(to_dict(normalize("ident", parse_text("ident", config))))

        header = orjson.dumps({"inputs": [{"name": "in", "datatype": datatype, "shape": shape,
                                           "parameters": {"binary_data_size": n}}],
                               "parameters": {"binary_data_output": True}})
        binary = header + x.tobytes()
        flat_json = orjson.dumps({"id": "1", "inputs": [{"name": "in", "datatype": datatype, "shape": shape,
                                                         "data": x.reshape(-1).tolist()}]})
        nested_json = orjson.dumps({"inputs": [{"name": "in", "datatype": datatype, "shape": shape,
                                                "data": x.tolist()}]})
        print(f"JSON body: {len(flat_json) / n:.1f} N flat, {len(nested_json) / n:.1f} N nested")
        message = measured("gateway request, binary (first sight)", n,
                           gateway_request(spec, binary, len(header)))
        measured("gateway request, binary (remembered)", n, gateway_request(spec, binary, len(header)))
        measured("gateway request, binary (remembered)", n, gateway_request(spec, binary, len(header)))
        v2._seen.clear()
        measured("gateway request, JSON flat (first sight)", n, gateway_request(spec, flat_json, None))
        measured("gateway request, JSON flat (second sight)", n, gateway_request(spec, flat_json, None))
        measured("gateway request, JSON flat (remembered)", n, gateway_request(spec, flat_json, None))
        measured("gateway request, JSON nested", n, gateway_request(spec, nested_json, None))

        execution = Execution(spec, root, 1, 1, None, lambda *a: None, lambda *a: None, lambda: None)
        loop = asyncio.new_event_loop()  # one for every hop: asyncio.run's ending allocates (its threads)
        loop.run_until_complete(execution.load())
        reply = measured("worker, one request", n, worker(loop, execution, message, 1))
        measured("worker, one request", n, worker(loop, execution, message, 1))
        measured("worker, two requests in one batch", n, worker(loop, execution, message, 2))

        measured("gateway reply, binary", n, gateway_reply(reply, True))
        measured("gateway reply, JSON", n, gateway_reply(reply, False))
        loop.run_until_complete(execution.unload())
        loop.close()
        (req,) = records.decode_requests(message)
        print("the worker's input array is a view of its message's bytes:",
              np.shares_memory(request_inputs(req)["in"], np.frombuffer(req.inputs[0].data, np.uint8)))
        check = records.decode_replies(reply)[0].outputs[0]
        assert np.array_equal(check.numpy().reshape(x.shape), x), "the identity model changed the tensor"


if __name__ == "__main__":
    main()
