"""The floor of an HTTP front end in Python on this machine: uvloop and httptools answering every POST
with a fixed KServe V2 binary reply (W1's), and nothing else: no routing, no queue, no model.

    taskset -c 0 python bench/floor.py --port 18050 &
    python bench/loadgen.py http://127.0.0.1:18050 --cpu 1 --model mlp --format binary --conc 64
    kill -INT %1        # prints: requests answered, CPU µs per request

What Despina's gateway costs per request above this (bench/profile.py cpu on a served run) is its own
work: the routing, decoding, queueing and encoding, not HTTP. The loadgen's `wrong` count is all its
checked replies here: the reply is zeros. GET answers a minimal statistics document so that the load
generator's batch counter reads something.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time

import httptools
import numpy as np
import uvloop

HEADER = json.dumps({"model_name": "mlp", "model_version": "1", "outputs": [
    {"name": "y", "datatype": "FP32", "shape": [1, 10], "parameters": {"binary_data_size": 40}}]}).encode()
BODY = HEADER + np.zeros(10, np.float32).tobytes()
POST = (b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: %d\r\n"
        b"inference-header-content-length: %d\r\n\r\n" % (len(BODY), len(HEADER))) + BODY
STATS = json.dumps({"model_stats": [{"name": "mlp", "version": "1", "inference_count": 0,
                                     "execution_count": 0,
                                     "inference_stats": {"queue": {"count": 0, "ns": 0}}}]}).encode()
GET = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(STATS) + STATS


class Floor(asyncio.Protocol):
    answered = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.body = bytearray()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        post = self.parser.get_method() == b"POST"
        self.transport.write(POST if post else GET)
        Floor.answered += post
        self.body = bytearray()


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set_result, None)
    server = await loop.create_server(Floor, "127.0.0.1", port)
    cpu = time.process_time()
    await stop
    server.close()
    used = time.process_time() - cpu
    print(f"{Floor.answered} requests answered, {1e6 * used / max(Floor.answered, 1):.1f} µs CPU per request",
          flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=18050)
    uvloop.run(main(parser.parse_args().port))
