"""A client that pipelines requests and never reads its answers, against a running gateway:

    python bench/flood.py http://127.0.0.1:8000 [--seconds 2] [--model mlp]

Prints how many MB the gateway took from it (what it read plus the kernel's socket buffers) and the
gateway's resident memory if `--gateway-pid` is given. A gateway with backpressure stops reading once
the answers back up; without it, it reads on at the rate it answers.
"""
from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import orjson


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="http://127.0.0.1:PORT")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--gateway-pid", type=int)
    args = parser.parse_args()
    host, port = args.url.removeprefix("http://").rstrip("/").split(":")
    body = orjson.dumps([0.25] * 256)
    request = b"POST /fn/%s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        args.model.encode(), host.encode(), len(body), body)
    blob = request * 200
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    sent, until = 0, time.monotonic() + args.seconds
    while time.monotonic() < until:
        try:
            sent += sock.send(blob[sent % len(blob):])
        except BlockingIOError:
            time.sleep(0.01)
    print(f"taken from a client that reads nothing in {args.seconds:g} s: {sent / 1e6:.1f} MB "
          f"({sent // len(request)} requests)")
    if args.gateway_pid:
        for line in Path(f"/proc/{args.gateway_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                print(f"gateway {line}")
    sock.close()


if __name__ == "__main__":
    main()
