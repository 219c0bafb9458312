"""Micro-benchmarks of the hot path's pieces, in one process (CPU per call; no server):

    python bench/micro.py [--redis-url redis://127.0.0.1:6379/0]

the gateway's decoders and encoders on W1's request (binary and JSON, /fn), the stream records'
codec for a 20-request entry, and one XADD + HINCRBY round trip through redis-py's asyncio pipeline
against despina/resp.py (client CPU, process_time). Figures quoted in bench/RESULTS.md and in commit
messages come from here; run it pinned (`taskset -c 1`) on a quiet machine.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import orjson
import redis.asyncio as aioredis
import uvloop

from despina.contract import records
from despina.contract.modelconfig import ModelSpec, normalize, parse_text, to_dict
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.gateway.fn import decode_fn
from despina.gateway.v2 import decode_infer, encode_infer, json_data_to_bytes
from despina.resp import Batch, Resp

CONFIG = """name: "mlp" backend: "onnxruntime" max_batch_size: 128
input [ { name: "x", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 10 ] } ]"""


def timed(name: str, fn: Callable[[], object], n: int = 20_000) -> None:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    print(f"{name:44s} {(time.perf_counter() - t0) / n * 1e6:8.2f} us")


def codecs() -> None:
    spec = ModelSpec.from_config(to_dict(normalize("mlp", parse_text("mlp", CONFIG))))
    x = np.random.default_rng(0).random((1, 256), dtype=np.float32)
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 1024}}],
                           "outputs": [{"name": "y", "parameters": {"binary_data": True}}]})
    binary = header + x.tobytes()
    as_json = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                        "data": x[0].tolist()}]})
    timed("decode_infer, binary", lambda: decode_infer(binary, len(header), spec))
    timed("decode_infer, JSON", lambda: decode_infer(as_json, None, spec))
    row = x[0].tolist()
    timed("json_data_to_bytes, 256 floats", lambda: json_data_to_bytes("x", "FP32", [1, 256], [row]))
    timed("decode_fn, 256 floats", lambda: decode_fn(orjson.dumps(x[0].tolist()), spec))
    d = decode_infer(binary, len(header), spec)
    now = time.time()
    reqs = [InferRequest(f"{i:x}", "rep:gw", now + 30, tuple(d.inputs), ("y",), 0, 0, now, "")
            for i in range(20)]
    y = x[:, :10].copy()
    out = (Tensor("y", "FP32", (1, 10), y.tobytes()),)
    reps = [InferReply(f"{i:x}", out, None, 10, 20) for i in range(20)]
    entry, answers = records.encode(reqs), records.encode(reps)
    timed("encode_infer, binary output", lambda: encode_infer("mlp", 1, None, reps[0].outputs, {"y"}, False))
    timed("records.encode, 20 requests (per entry)", lambda: records.encode(reqs), 2000)
    timed("records.decode_requests, 20 (per entry)", lambda: records.decode_requests(entry), 2000)
    timed("records.decode_replies, 20 (per entry)", lambda: records.decode_replies(answers), 2000)


async def round_trips(url: str, n: int = 3000) -> None:
    payload, stream, counts = b"x" * 20_000, "despina-micro:s", "despina-micro:h"
    client = aioredis.Redis.from_url(url)
    lean = Resp.from_url(url)

    async def redis_py() -> None:
        pipe = client.pipeline(transaction=False)
        pipe.xadd(stream, {"m": payload}, maxlen=100, approximate=True)
        pipe.hincrby(counts, "enqueued", 27)
        await pipe.execute()

    async def resp() -> None:
        batch = Batch()
        batch.xadd(stream, {b"m": payload}, maxlen=100)
        batch.hincrby(counts, "enqueued", 27)
        await lean.execute(batch.commands)

    try:
        for name, once in (("redis-py pipeline", redis_py), ("despina.resp", resp)):
            for _ in range(200):
                await once()
            c0 = time.process_time()
            for _ in range(n):
                await once()
            cpu_us = (time.process_time() - c0) / n * 1e6
            print(f"{name + ', XADD 20 kB + HINCRBY (client CPU)':44s} {cpu_us:8.2f} us")
    finally:
        await client.delete(stream, counts)
        await client.aclose()
        lean.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    codecs()
    uvloop.run(round_trips(args.redis_url))


if __name__ == "__main__":
    main()
