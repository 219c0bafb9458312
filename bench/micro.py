"""Micro-benchmarks of the hot path's pieces, in one process (CPU per call; no server):

    python bench/micro.py [--redis-url redis://127.0.0.1:6379/0] [--only worker codecs ...]

the gateway's decoders and encoders on W1's request (binary and JSON, /fn; encode_infer with and without
its kept reply header), the stream records' codec for a 20-request entry, resp.pack of a worker's reply
pipeline in C (hiredis) and in Python, one XADD + HINCRBY round trip through redis-py's asyncio pipeline
against despina/resp/ (client CPU, process_time), the batcher's wait (wait_for against a timer), a
call_later made and cancelled (uvicorn's keep-alive timer, per request), the timerfd Alarm armed 500 µs
and 5 s ahead, how late uvloop's call_later fires below a millisecond, a wake-up through epoll with and
without a timeout (two processes, pipes; also both on one core, and across two), and the server's CPU for
one batch's statistics as the workers' EVAL against plain HINCRBYs (the Redis at --redis-url must run on
this machine), and the Python backend's hop: one execute call to a model's own process (W3's
classify_post, and a model that returns constant outputs: the hop alone) with 0, 1, 3 and 8 requests,
against classify_post's execute run in this process, and pb_utils.Tensor() as a model makes one per
output; a worker's own CPU per request, W1 in batches of 128 from 16-request entries, and per batch
of one request, replies written to that Redis (also answered at once, not sent, and with one more round
trip before them: what a round trip costs the worker itself); and the same for W3 (`ensemble_path`): the
ensemble run in the worker over its two steps' batchers, with the Python model's process's CPU apart
(bench/out/repo must exist: bench/models.py).
Figures quoted in bench/RESULTS.md and in commit messages come from here; run it pinned
(`taskset -c 1`) on a quiet machine.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import redis
import redis.asyncio as aioredis
import uvloop
from msgpack import packb

from despina.contract import records
from despina.contract.modelconfig import normalize, parse_text, to_dict
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.counters import HINCRBY_MANY, record_counts
from despina.gateway.fn import decode_fn
from despina.gateway.jsondata import json_data_to_bytes
from despina.gateway.v2 import decode_infer
from despina.gateway.v2_reply import encode_infer
from despina.resp import Batch, Resp, pack
from despina.resp.wire import _pack_slowly

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
    # a header with an id of its own each request: a header no remembered plan fits
    headers = [header.replace(b'{"inputs"', b'{"id":"req-%d","inputs"' % i) for i in range(20_001)]
    own_headers = iter([(h + x.tobytes(), len(h)) for h in headers])
    timed("decode_infer, binary, its own id each time", lambda: decode_infer(*next(own_headers), spec))
    timed("decode_infer, JSON", lambda: decode_infer(as_json, None, spec))
    # the same with an id of its own each request, as clients that trace their requests send it
    own_ids = iter([as_json.replace(b'{"inputs"', b'{"id":"req-%d","inputs"' % i) for i in range(20_001)])
    timed("decode_infer, JSON, its own id each time", lambda: decode_infer(next(own_ids), None, spec))
    # and with a parameter of its own each request: a document that no remembered plan fits
    own_tags = iter([as_json.replace(b'{"inputs"', b'{"parameters":{"tag":%d},"inputs"' % i)
                     for i in range(20_001)])
    timed("decode_infer, JSON, its own parameter each time", lambda: decode_infer(next(own_tags), None, spec))
    # perf_analyzer's JSON body as it sends it (strace of a gateway, 2026-12-04): random float32 bit patterns
    # (the finite ones here) at full precision, the output asked with "binary_data":false (so the body holds
    # an r and an l: the check that no boolean hides among the numbers runs), and an
    # Inference-Header-Content-Length of the whole body
    bits = np.random.default_rng(0).integers(0, 2**32, 256, dtype=np.uint32).view(np.float32)
    bits = np.where(np.isfinite(bits), bits, np.float32(1.5))
    as_pa = (b'{"id":"","inputs":[{"name":"x","datatype":"FP32","shape":[1,256],"data":['
             + b",".join(repr(float(v)).encode() for v in bits)
             + b']}],"outputs":[{"name":"y","parameters":{"binary_data":false}}]}')
    timed("orjson.loads, perf_analyzer's JSON", lambda: orjson.loads(as_pa))
    timed("decode_infer, perf_analyzer's JSON", lambda: decode_infer(as_pa, len(as_pa), spec))
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
    heads: dict = {}
    timed("encode_infer, binary output, header kept", lambda: encode_infer("mlp", 1, None, reps[0].outputs,
                                                                           {"y"}, False, heads))
    rep, req, stats = "despina:rep:gw-1-abcdef", "despina:req:mlp:1", "despina:stats:mlp:1"
    done = b"1764547200000-0"
    counts = {f"field_{i}": 1234 * i for i in range(17)}  # a batch's statistics

    def reply_pipeline() -> bytes:  # a worker's for a batch of 20, as ReplyWriter.build builds it
        pipe = Batch()
        pipe.xadd(rep, {b"m": answers}, maxlen=100_000)
        pipe.pexpire(rep, 120_000)
        record_counts(pipe, stats, counts)
        pipe.xack(req, "workers", done)
        pipe.xdel(req, done)
        return pack(pipe.commands)
    commands = [("XADD", rep, "MAXLEN", "~", 100_000, "*", b"m", answers), ("PEXPIRE", rep, 120_000),
                ("EVAL", HINCRBY_MANY, 1, stats, packb(counts)), ("XACK", req, "workers", done),
                ("XDEL", req, done)]
    timed("a reply pipeline, Batch (kept prefixes) + pack", reply_pipeline)
    timed("the same commands, resp.pack (hiredis, C)", lambda: pack(commands))
    timed("the same commands, packed in Python", lambda: [_pack_slowly(c) for c in commands])
    timed("records.encode, 20 requests (per entry)", lambda: records.encode(reqs), 2000)
    timed("records.decode_requests, 20 (per entry)", lambda: records.decode_requests(entry), 2000)
    timed("records.decode_replies, 20 (per entry)", lambda: records.decode_replies(answers), 2000)
    # the same 16 requests grouped as one (records.GROUPED): the gateway's grouping and encoding, and its
    # decoding and cutting of the one answer, against encoding and decoding each
    from despina.gateway.grouping import grouped, ungrouped
    sixteen = reqs[:16]
    one_request = grouped(sixteen, 128)[0]
    answer = InferReply(one_request.id, (Tensor("y", "FP32", (16, 10), bytes(640)),), None, 10, 20)
    one = records.encode([answer])
    plain = records.encode(reps[:16])
    timed("16 requests out: encoded each", lambda: records.encode(sixteen), 2000)
    timed("16 requests out: grouped, encoded", lambda: records.encode(grouped(sixteen, 128)), 2000)
    timed("16 answers in: decoded each", lambda: records.decode_replies(plain), 2000)
    timed("16 answers in: decoded, cut", lambda: [ungrouped(r) for r in records.decode_replies(one)], 2000)


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


async def timers(n: int = 20_000) -> None:
    """The batcher's wait (asyncio.wait_for against a call_at timer setting its event), and how late
    uvloop's call_later fires for sub-millisecond delays."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    async def wait_for(delay: float) -> None:
        try:
            await asyncio.wait_for(wake.wait(), delay)
        except TimeoutError:
            pass
        wake.clear()

    async def timer(delay: float) -> None:
        handle = loop.call_later(delay, wake.set)
        await wake.wait()
        handle.cancel()
        wake.clear()

    def noop() -> None:
        pass

    c0 = time.process_time()
    for _ in range(n):
        loop.call_later(5.0, noop).cancel()  # uvicorn's keep-alive timer, armed and cancelled per request
    print(f"{'call_later(5 s) + cancel':44s} {(time.process_time() - c0) / n * 1e6:8.2f} us")
    for name, wait in (("asyncio.wait_for", wait_for), ("call_later timer", timer)):
        for case, delay, woken in (("woken by a request", 1.0, True), ("timed out", 0.00001, False)):
            c0 = time.process_time()
            for _ in range(n if woken else n // 4):
                if woken:
                    loop.call_soon(wake.set)
                await wait(delay)
            per = (time.process_time() - c0) / (n if woken else n // 4) * 1e6
            print(f"{name + ', ' + case:44s} {per:8.2f} us")
    from despina.alarm import Alarm
    alarm = Alarm.create(noop)
    if alarm is not None:  # the hold's and the batcher's timerfd (Linux); each instant a new one
        for ahead in (0.0005, 5.0):
            c0 = time.perf_counter()
            for _ in range(n):
                alarm.arm(time.monotonic() + ahead)
            per = (time.perf_counter() - c0) / n * 1e6
            print(f"{f'Alarm.arm {ahead * 1e6:,.0f} us ahead':44s} {per:8.2f} us")
        alarm.close()
    for delay_us in (200, 500, 600, 1200):
        late = []
        for _ in range(200):
            fired = loop.create_future()
            t0 = time.perf_counter()
            loop.call_later(delay_us / 1e6, fired.set_result, None)
            await fired
            late.append((time.perf_counter() - t0) * 1e6)
        print(f"{f'uvloop call_later({delay_us} us) fires after':44s} {statistics.median(late):8.0f} us")


def wakeups(n: int = 20_000) -> None:
    """One wake-up's cost with and without a timeout: two processes pass a byte back and forth through
    pipes, each waiting in epoll (as an event loop does, a timer pending or not); per round trip. Then
    with both processes on CPU 0, and on CPUs 0 and 1: the round trip and the CPU of the side that
    measures (a switch between processes on one core, against a wake-up of another core)."""
    import select

    home = os.sched_getaffinity(0)
    runs: list[tuple[str, float, tuple[set[int], set[int]] | None]] = [
        (f"epoll timeout {t}", t, None) for t in (-1, 0.05)]
    if {0, 1} <= set(range(os.cpu_count() or 1)):
        runs += [("on one core", -1, ({0}, {0})), ("across two cores", -1, ({0}, {1}))]
    for label, timeout, cpus in runs:
        a_r, a_w = os.pipe()
        b_r, b_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            if cpus:
                os.sched_setaffinity(0, cpus[1])
            poll = select.epoll()
            poll.register(a_r, select.EPOLLIN)
            for _ in range(n):
                poll.poll(timeout)
                os.read(a_r, 1)
                os.write(b_w, b"x")
            os._exit(0)
        if cpus:
            os.sched_setaffinity(0, cpus[0])
        poll = select.epoll()
        poll.register(b_r, select.EPOLLIN)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            os.write(a_w, b"x")
            poll.poll(timeout)
            os.read(b_r, 1)
        per, cpu = ((time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6)
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, home)
        for fd in (a_r, a_w, b_r, b_w):
            os.close(fd)
        extra = f", {cpu:.2f} us of this side's CPU" if cpus else ""
        print(f"{'pipe round trip, ' + label:44s} {per:8.2f} us{extra}")


# the counters as field/value pairs (HINCRBY_MANY until 2026-12-05, when it took them as one msgpack map)
# and as one "field=n field=n ..." argument (tried that day, not landed): see bench/RESULTS.md
PAIRS = """
for i = 1, #ARGV, 2 do
  if ARGV[i] == 'last_inference' then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  else redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
"""
ONE_ARGUMENT = """
for field, n in string.gmatch(ARGV[1], '(%S+)=(%S+)') do
  if field == 'last_inference' then redis.call('HSET', KEYS[1], field, n)
  else redis.call('HINCRBY', KEYS[1], field, n) end
end
"""


def statistics_record(url: str, batches: int = 10_000) -> None:
    """Valkey/Redis CPU (its /proc stat) per batch's statistics: the EVAL the workers send (one msgpack
    argument, counters.record_counts) against the same counters as plain HINCRBYs, as field/value pairs
    (PAIRS) and as one "field=n ..." argument (ONE_ARGUMENT); and this process's time to pack each EVAL.
    Needs the server on this machine."""
    client = redis.Redis.from_url(url)
    key = "despina-micro:stats"
    fields = {"inference_count": 3, "execution_count": 1, "batch:3": 1, "batch_ns:3": 90_000,
              "compute_input_count": 3, "compute_input_ns": 60_000, "compute_infer_count": 3,
              "compute_infer_ns": 270_000, "compute_output_count": 3, "compute_output_ns": 60_000,
              "success_count": 3, "success_ns": 3_000_000, "queue_count": 3, "queue_ns": 2_700_000,
              "lat:3": 3, "qlat:3": 3}
    counts = {**fields, "last_inference": int(time.time() * 1000)}
    args = [x for kv in counts.items() for x in kv]
    pid = int(client.info("server")["process_id"])

    def cpu() -> float:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    def as_eval(pipe: Any) -> None:
        record_counts(pipe, key, counts)

    def as_pairs(pipe: Any) -> None:
        pipe.eval(PAIRS, 1, key, *args)

    def as_hincrby(pipe: Any) -> None:
        for field, n in fields.items():
            pipe.hincrby(key, field, n)
        pipe.hset(key, "last_inference", counts["last_inference"])

    def as_one_argument(pipe: Any) -> None:
        pipe.eval(ONE_ARGUMENT, 1, key, " ".join([f"{field}={n}" for field, n in counts.items()]))

    def packed(add: Any) -> bytes:
        pipe = Batch()
        add(pipe)
        return pack(pipe.commands)
    timed("statistics EVAL packed, msgpack (Batch)", lambda: packed(as_eval))
    timed("statistics EVAL packed, field/value pairs", lambda: pack([("EVAL", PAIRS, 1, key, *args)]))
    timed("statistics EVAL packed, one argument", lambda: pack([("EVAL", ONE_ARGUMENT, 1, key, " ".join(
        [f"{f}={n}" for f, n in counts.items()]))]))
    try:
        for name, add in (("EVAL, msgpack", as_eval), ("EVAL, pairs", as_pairs),
                          ("HINCRBY x16 + HSET", as_hincrby), ("EVAL, one argument", as_one_argument)) * 2:
            c0 = cpu()
            for _ in range(batches // 100):
                pipe = client.pipeline(transaction=False)
                for _ in range(100):
                    add(pipe)
                pipe.execute()
            per = (cpu() - c0) / batches * 1e6
            print(f"{'statistics record as ' + name + ' (server CPU)':44s} {per:8.2f} us")
    finally:
        client.delete(key)
        client.close()


CONSTANT_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

P, L = np.zeros((1, 10), np.float32), np.zeros((1, 1), np.int64)


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("probabilities", P), pb_utils.Tensor("label", L)])
                for _ in requests]
"""


def python_model(n: int = 2000) -> None:
    """The Python backend's hop to the model's own process, and what the model itself takes."""
    import json
    import sys

    from despina.contract.modelspec import ModelSpec
    from despina.control.repository import load_model
    from despina.workers.backends.python_process import STUB, Stub
    try:  # arrays cross as raw bytes since 5d4fa53; before, as pickled ndarrays
        from despina.workers.backends.python_stub import _despina_wire as wire
    except ImportError:
        wire = None  # type: ignore[assignment]

    folder = Path(__file__).resolve().parent.parent / "model_repository" / "classify_post"
    model_file = str(folder / "1" / "model.py")
    config = ModelSpec.from_config(load_model(folder).config).config
    args = {"model_config": json.dumps(config), "model_instance_kind": "KIND_CPU",
            "model_instance_name": "bench", "model_instance_device_id": "0", "model_repository": str(folder),
            "model_version": "1", "model_name": "classify_post"}
    logits = np.random.default_rng(0).standard_normal((1, 10)).astype(np.float32)
    # a request as the worker sends it (backends/python.py _payload): inputs, asked outputs, parameters,
    # request id, sequence
    one = ({"logits": wire.pack(logits) if wire else logits}, ["probabilities", "label"], None, "", None)
    with tempfile.TemporaryDirectory() as tmp:
        constant = Path(tmp) / "model.py"  # the same outputs, computed once: the hop alone
        constant.write_text(CONSTANT_MODEL)
        for label, path in (("classify_post", model_file), ("constant", str(constant))):
            stub = Stub.start("classify_post")
            try:
                stub.call("initialize", {"model_file": path, "args": args})
                for k in (0, 1, 3, 8):
                    timed(f"python model: {label}, {k} requests, its process",
                          lambda k=k, stub=stub: stub.call("execute", [one] * k), n)
            finally:
                stub.stop()
    sys.path.insert(0, str(STUB.parent))
    import stub as in_process  # the same code the model's process runs
    from _despina_calls import ModelCalls  # beside stub.py: the model's calls to others (none here)
    local = in_process.Stub(ModelCalls(None))  # type: ignore[arg-type]  # no connection: classify_post calls no model
    local.initialize({"model_file": model_file, "args": args})
    for k in (1, 3):
        timed(f"python model: classify_post, {k} requests, in here", lambda k=k: local.execute([one] * k), n)
    import triton_python_backend_utils as pb_utils  # what a model makes per output of every request
    timed("pb_utils.Tensor(name, float32 [1, 10])", lambda: pb_utils.Tensor("probabilities", logits), 20_000)


def ensemble_check(n: int = 2000) -> None:
    """The control plane's per-tick check of an ensemble against the models it calls (bench/out/repo's
    W3: bench/models.py first)."""
    from despina.contract.keys import Keys
    from despina.control.ensembles import Ensembles
    from despina.control.repository import load_model
    from despina.control.state import Catalog

    catalog = Catalog(None, Keys("micro"))  # type: ignore[arg-type]  # in memory only: never flushed
    for name in ("mlp", "classify_post", "mlp_classify"):
        catalog.put(load_model(Path(__file__).resolve().parent / "out" / "repo" / name))
    ensembles = Ensembles(catalog, None)  # type: ignore[arg-type]  # check() reads no worker
    timed("control plane: check one ensemble (per tick)", ensembles.check, n)


def _entry(row: bytes, first: int, n: int, reply_to: str) -> tuple[str, bytes, dict[bytes, bytes]]:
    """A stream entry of `n` W1 requests (ids from `first`) as a gateway writes it, 256 said in flight."""
    from despina.contract.keys import FIELD, IN_FLIGHT

    reqs = [InferRequest(f"r{first + i}", reply_to, time.time() + 600,
                         (Tensor("x", "FP32", (1, 256), row),), enqueued=time.time()) for i in range(n)]
    return "stream", f"{first}-0".encode(), {FIELD: records.encode(reqs), IN_FLIGHT: b"256"}


async def _forget(redis_client: aioredis.Redis, prefix: str) -> None:
    """A run's keys go with it, and its connection."""
    keys_left = [k async for k in redis_client.scan_iter(f"{prefix}*")]
    if keys_left:
        await redis_client.delete(*keys_left)
    await redis_client.aclose()


async def worker_path(url: str, rounds: int = 160, entry_requests: int = 16) -> None:
    """A worker's own CPU per request, no gateway: W1 (bench/out/repo's `mlp`, max batch 128) in a
    ModelRunner, 256 requests a round in entries of 16 as a gateway writes them, batched, run, and
    their replies, statistics and acknowledgements written to the Redis at `url`."""
    import uuid

    from despina.contract.keys import FIELD, IN_FLIGHT, Keys
    from despina.control.repository import load_model
    from despina.redis_client import connect
    from despina.workers.runner import ModelRunner

    folder = Path(__file__).resolve().parent / "out" / "repo" / "mlp"
    redis_client = connect(url)
    keys = Keys(f"micro-{uuid.uuid4().hex[:8]}")
    reply_to = keys.reply_stream("micro")  # under the run's prefix: it goes with the run's other keys
    runner = ModelRunner(redis_client, keys, ModelSpec.from_config(load_model(folder).config), 1, folder,
                         "micro")
    await runner.load()
    batcher = asyncio.get_running_loop().create_task(runner.batcher.run())
    row = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32).tobytes()

    entries = [_entry(row, i, entry_requests, reply_to) for i in range(0, 256, entry_requests)]

    async def one_round() -> None:
        for e in entries:
            await runner._accept([e])
        while runner._in_flight or runner._background:
            await asyncio.sleep(0.0002)  # not a busy wait: its CPU would count

    for _ in range(10):
        await one_round()
    before = await redis_client.hgetall(keys.stats("mlp", 1))
    cpu = time.process_time()
    for _ in range(rounds):
        await one_round()
    per = (time.process_time() - cpu) / (rounds * 256) * 1e6
    after = await redis_client.hgetall(keys.stats("mlp", 1))
    model_ns = int(after[b"compute_infer_ns"]) - int(before[b"compute_infer_ns"])
    model_n = int(after[b"compute_infer_count"]) - int(before[b"compute_infer_count"])
    model = model_ns / model_n / 1000 / 128  # counted per request as its batch's time
    print(f"{'worker path, W1 batches of 128 (process CPU)':44s} {per:8.2f} us per request, "
          f"{model:.2f} of them the model")

    # one request per batch: what a batch costs the worker whatever its size (entry, batcher, run,
    # reply pipeline and its round trip), the cost that dominates at low concurrency
    def lone(k: int) -> tuple[str, bytes, dict[bytes, bytes]]:
        req = InferRequest(f"l{k}", reply_to, time.time() + 600, (Tensor("x", "FP32", (1, 256), row),),
                           enqueued=time.time())
        return "stream", f"{k}-1".encode(), {FIELD: records.encode([req]), IN_FLIGHT: b"1"}

    async def one_batch(e: tuple[str, bytes, dict[bytes, bytes]]) -> None:
        await runner._accept([e])
        while runner._in_flight or runner._background:
            if runner._background:
                await asyncio.gather(*list(runner._background))
            else:
                await asyncio.sleep(0)  # the batcher's turn: it runs at once (nothing else coming)

    async def per_batch(first: int) -> float:
        singles = [lone(k) for k in range(first, first + rounds * 8)]
        for e in singles[:50]:
            await one_batch(e)
        cpu = time.process_time()
        for e in singles[50:]:
            await one_batch(e)
        return (time.process_time() - cpu) / (len(singles) - 50) * 1e6

    print(f"{'worker path, W1 one request per batch':44s} {await per_batch(0):8.2f} us per batch")
    # what the reply pipeline's round trip costs the worker itself: answered at once (packed, not sent),
    # and with one more round trip (a PING) before it
    out = runner.writer.out
    assert out is not None
    execute = out.execute

    async def at_once(commands: Any, errors: bool = True) -> list[Any]:
        pack(commands)
        return [None] * len(commands)

    async def one_more(commands: Any, errors: bool = True) -> list[Any]:
        await execute([["PING"]])
        return await execute(commands, errors)

    for label, variant in (("no round trip", at_once), ("one more round trip", one_more)):
        out.execute = variant  # type: ignore[method-assign]
        per = await per_batch(10_000_000 if variant is at_once else 20_000_000)
        print(f"{'worker path, one per batch, ' + label:44s} {per:8.2f} us per batch")
    out.execute = execute  # type: ignore[method-assign]
    runner.batcher.close()
    await batcher
    await _forget(redis_client, keys.prefix)


async def ensemble_path(url: str, rounds: int = 60, entry_requests: int = 16) -> None:
    """A worker's own CPU per request on W3, no gateway: bench/out/repo's `mlp_classify` run by an
    EnsembleHost over a `mlp` runner (onnxruntime) and a `classify_post` runner (the Python model in its
    own process), 256 requests a round in entries of 16 as a gateway writes them, each request's two
    steps batched with the others', the replies, statistics and acknowledgements written to the Redis
    at `url`. The Python model's process is counted apart (its own /proc stat)."""
    import uuid

    from despina.contract.ensemble import Ensemble
    from despina.contract.keys import Keys
    from despina.control.repository import load_model
    from despina.counters import Deferred
    from despina.redis_client import connect
    from despina.workers.ensembles import EnsembleHost
    from despina.workers.redelivery import DeliveryPolicy
    from despina.workers.runner import ModelRunner

    repo = Path(__file__).resolve().parent / "out" / "repo"
    redis_client = connect(url)
    keys = Keys(f"micro-{uuid.uuid4().hex[:8]}")
    reply_to = keys.reply_stream("micro")
    deferred = Deferred(redis_client)
    runners = {}
    for name in ("mlp", "classify_post"):
        model = load_model(repo / name)
        runners[name] = ModelRunner(redis_client, keys, ModelSpec.from_config(model.config), 1, repo / name,
                                    "micro", deferred=deferred)
        await runners[name].load()
    batchers = [asyncio.get_running_loop().create_task(r.batcher.run()) for r in runners.values()]
    config = load_model(repo / "mlp_classify").config
    host = EnsembleHost(redis_client, keys, ModelSpec.from_config(config), Ensemble.from_config(config), 1,
                        lambda step: runners[step.model], "micro", DeliveryPolicy(), deferred=deferred)
    host.state = "READY"  # its streams are not read: entries are handed to it as its read loop would
    row = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32).tobytes()
    children = [int(c) for task in Path(f"/proc/{os.getpid()}/task").iterdir()
                for c in (task / "children").read_text().split()]

    def children_cpu() -> float:
        ticks = 0
        for pid in children:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    async def one_round() -> None:
        host._accept([_entry(row, i, entry_requests, reply_to) for i in range(0, 256, entry_requests)])
        await host._idle.wait()
        while host._writes or host._flush_soon is not None:
            await asyncio.sleep(0.0002)

    for _ in range(10):
        await one_round()
    cpu, stub = time.process_time(), children_cpu()
    for _ in range(rounds):
        await one_round()
    n = rounds * 256
    per, stub_per = (time.process_time() - cpu) / n * 1e6, (children_cpu() - stub) / n * 1e6
    print(f"{'ensemble path, W3 in entries of 16 (process CPU)':44s} {per:8.2f} us per request, "
          f"the Python model's process {stub_per:.2f}")
    for runner in runners.values():
        runner.batcher.close()
    await asyncio.gather(*batchers)
    for runner in runners.values():
        await runner.execution.unload()
    await _forget(redis_client, keys.prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--only", nargs="+", choices=["codecs", "round_trips", "timers", "wakeups",
                                                      "statistics", "python_model", "ensemble", "worker",
                                                      "ensemble_path"])
    args = parser.parse_args()
    url = args.redis_url
    pieces: dict[str, Callable[[], object]] = {
        "codecs": codecs, "round_trips": lambda: uvloop.run(round_trips(url)),
        "timers": lambda: uvloop.run(timers()), "wakeups": wakeups,
        "statistics": lambda: statistics_record(url),
        "python_model": python_model, "ensemble": ensemble_check,
        "worker": lambda: uvloop.run(worker_path(url)),
        "ensemble_path": lambda: uvloop.run(ensemble_path(url))}
    for name, run in pieces.items():
        if not args.only or name in args.only:
            run()


if __name__ == "__main__":
    main()
