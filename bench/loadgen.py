"""Despina's closed-loop load generator: KServe V2 JSON or Triton binary tensors over raw asyncio.

    python bench/loadgen.py http://127.0.0.1:8000 [--model mlp] [--format json binary]
        [--conc 1 8 32 64 128] [--warmup 1] [--duration 5] [--cpu 1] [--reference model.onnx]

CONC keep-alive connections each send their next request as soon as the last reply is in. The
client is a bare asyncio.Protocol (in a quick check, a third of aiohttp's CPU per request), so one
core drives a one-core server without saturating first. Each request is one row out of 16 distinct rows; one
reply in --check-every is compared with the reference model (wrong answers, or replies crossed
between requests, show up as `wrong`). mean_batch = rows / model calls over the measured window,
from the server's Triton statistics; client_cpu = this process's CPU time over the window, in cores
(near 1.0 means the client, not the server, may set the pace). One JSON line per (format, conc).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

ROWS = 16
D_IN = 256
# the output a model's replies are checked by (W1's and W2's `y`); W3, the ensemble, answers the MLP's
# logits' softmax as `probabilities` (and `label`)
OUTPUT = {"mlp_classify": "probabilities"}


@dataclass
class Tally:
    t_meas: float
    t_end: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    checked: int = 0
    wrong: int = 0


def request(host: str, path: str, fmt: str, row: np.ndarray, output: str = "y") -> bytes:
    x = {"name": "x", "shape": [1, D_IN], "datatype": "FP32"}
    headers = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
    if fmt == "json":
        body = json.dumps({"inputs": [{**x, "data": row.tolist()}]}).encode()
        headers += "Content-Type: application/json\r\n"
    else:
        header = json.dumps({"inputs": [{**x, "parameters": {"binary_data_size": row.nbytes}}],
                             "outputs": [{"name": output, "parameters": {"binary_data": True}}]}).encode()
        body = header + row.tobytes()
        headers += ("Content-Type: application/octet-stream\r\n"
                    f"Inference-Header-Content-Length: {len(header)}\r\n")
    return f"{headers}Content-Length: {len(body)}\r\n\r\n".encode() + body


def reply_output(fmt: str, body: bytes, d_out: int, output: str = "y") -> np.ndarray:
    if fmt == "binary":
        return np.frombuffer(body[-4 * d_out:], dtype=np.float32)
    outputs = json.loads(body)["outputs"]
    return np.asarray(next(o for o in outputs if o["name"] == output)["data"], dtype=np.float32)


class Client(asyncio.Protocol):
    """One connection in a closed loop: send, wait for the whole reply, record, send again."""

    def __init__(self, bodies: list[bytes], expected: np.ndarray, fmt: str, tally: Tally,
                 check_every: int, offset: int, output: str = "y") -> None:
        self.bodies, self.expected, self.fmt, self.tally, self.output = bodies, expected, fmt, tally, output
        self.check_every, self.i = check_every, offset
        self.buf = bytearray()
        self.need = -1  # total bytes of the reply in flight, once its headers are in
        self.start = 0  # where its body starts
        self.status = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.failed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.send()

    def send(self) -> None:
        assert self.transport
        self.t0 = time.perf_counter()
        if self.t0 >= self.tally.t_end:
            self.transport.close()
            return
        self.i += 1
        self.transport.write(self.bodies[self.i % ROWS])

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.need < 0:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buf[:end + 2]).lower()
                self.status = int(head[9:12])
                at = head.find(b"\r\ncontent-length:")
                if at < 0:  # chunked or close-delimited replies: not what a V2 server sends
                    self.fail()
                    return
                self.start = end + 4
                self.need = self.start + int(head[at + 17:head.index(b"\r\n", at + 2)])
            if len(self.buf) < self.need:
                return
            body = bytes(self.buf[self.start:self.need])
            del self.buf[:self.need]
            self.need = -1
            self.finish(body)

    def finish(self, body: bytes) -> None:
        t1, tally = time.perf_counter(), self.tally
        if self.status != 200:
            tally.errors += 1
        else:
            if self.t0 >= tally.t_meas and t1 <= tally.t_end:
                tally.latencies.append(t1 - self.t0)
            if self.i % self.check_every == 0:
                tally.checked += 1
                got = reply_output(self.fmt, body, self.expected.shape[1], self.output)
                tally.wrong += not np.allclose(got, self.expected[self.i % ROWS], rtol=1e-3, atol=1e-4)
        self.send()

    def fail(self) -> None:
        self.tally.errors += 1
        self.failed = True
        if self.transport:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if time.perf_counter() < self.tally.t_end and not self.failed:
            self.tally.errors += 1  # the server hung up on a live request
        if not self.done.done():
            self.done.set_result(None)


async def http_get(host: str, port: int, path: str) -> Any:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


async def batch_counters(host: str, port: int, model: str) -> tuple[int, int] | None:
    try:
        stats = (await http_get(host, port, f"/v2/models/{model}/stats"))["model_stats"][0]
        return int(stats["inference_count"]), int(stats["execution_count"])
    except (OSError, ValueError, KeyError, IndexError, TimeoutError):
        return None


async def drive(args: argparse.Namespace, fmt: str, conc: int, expected: np.ndarray,
                bodies: list[bytes]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    tally = Tally(start + args.warmup, start + args.warmup + args.duration)
    clients = [Client(bodies, expected, fmt, tally, args.check_every, k, OUTPUT.get(args.model, "y"))
               for k in range(conc)]
    for c in clients:
        await loop.create_connection(lambda c=c: c, args.host, args.port)  # type: ignore[misc]
    await asyncio.sleep(max(0.0, tally.t_meas - time.perf_counter()))
    before, cpu0 = await batch_counters(args.host, args.port, args.model), time.process_time()
    await asyncio.sleep(max(0.0, tally.t_end - time.perf_counter()))
    after, cpu1 = await batch_counters(args.host, args.port, args.model), time.process_time()
    _, stuck = await asyncio.wait([c.done for c in clients], timeout=args.grace)
    for c in clients:
        if c.transport:
            c.transport.abort()
    lat = sorted(tally.latencies)

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 3) if lat else None

    mean_batch = None
    if before and after and after[1] > before[1]:
        mean_batch = round((after[0] - before[0]) / (after[1] - before[1]), 1)
    return {"n": len(lat), "rps": round(len(lat) / args.duration, 1), "p50_ms": pct(0.5), "p90_ms": pct(0.9),
            "p99_ms": pct(0.99), "errors": tally.errors + len(stuck), "stuck": len(stuck),
            "mean_batch": mean_batch, "checked": tally.checked, "wrong": tally.wrong,
            "client_cpu": round((cpu1 - cpu0) / args.duration, 2)}


def reference(model: str, path: Path | None, rows: np.ndarray) -> np.ndarray:
    """What the model should answer to `rows`: the ONNX file given, else bench/models.py's build of the
    model (W2's), else W1's MLP (the peers serve it as `mlp`)."""
    from models import DEFAULT_REPO, session
    if model == "mlp_classify" and path is None:  # the ensemble: the MLP, then classify_post's softmax
        logits = reference("mlp", None, rows)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
    own = DEFAULT_REPO / model / "1" / "model.onnx"
    if path is None and model != "mlp" and own.exists():
        path = own
    if path is None:
        from despina.examples import mlp_numpy
        return mlp_numpy(rows)
    return np.asarray(session(path).run(None, {"x": rows})[0])


async def main_async(args: argparse.Namespace) -> None:
    rows = np.random.default_rng(1).standard_normal((ROWS, D_IN)).astype(np.float32)
    expected = reference(args.model, args.reference, rows)
    path = f"/v2/models/{args.model}/infer"
    for fmt in args.format:
        output = OUTPUT.get(args.model, "y")
        bodies = [request(args.host, path, fmt, rows[k:k + 1], output) for k in range(ROWS)]
        for conc in args.conc:
            result = await drive(args, fmt, conc, expected, bodies)
            line = {"peer": args.peer, "client": f"raw-{fmt}", "model": args.model, "conc": conc, **result}
            print(json.dumps(line), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(line) + "\n")
            await asyncio.sleep(0.5)  # let the server drain between points


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", help="http://127.0.0.1:PORT")
    p.add_argument("--model", default="mlp")
    p.add_argument("--format", nargs="+", choices=["json", "binary"], default=["json", "binary"])
    p.add_argument("--conc", nargs="+", type=int, default=[1, 8, 32, 64, 128])
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--grace", type=float, default=30.0, help="seconds to wait for replies after the window")
    p.add_argument("--check-every", type=int, default=16)
    p.add_argument("--reference", type=Path, help="ONNX model to check replies (default: bench/out/repo's "
                   "build of --model, else the W1 MLP)")
    p.add_argument("--cpu", type=int, help="pin this process to one core")
    p.add_argument("--peer", default="despina")
    p.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = p.parse_args()
    if not args.url.startswith("http://127.0.0.1:"):
        p.error("only http://127.0.0.1:PORT targets: all traffic stays on loopback")
    args.host, args.port = "127.0.0.1", int(args.url.rstrip("/").rsplit(":", 1)[1])
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    try:
        import uvloop
        uvloop.run(main_async(args))
    except ImportError:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
