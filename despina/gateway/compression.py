"""Compressed infer answers, as Triton's HTTP server sends them: the request's Accept-Encoding names gzip or
deflate (tritonclient's response_compression_algorithm), and the whole answer goes in it, JSON header and
binary tensors together, its Inference-Header-Content-Length still counting the header as inflated; an
answer under SMALLEST bytes as it is.

Triton compresses the answers of the infer route alone: not errors, not generate's (a FIXME there), not
another route's. The request side (Content-Encoding) is http.py's.
"""
from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable

from .http import WBITS, Headers, header

log = logging.getLogger("despina.gateway")

LEVEL = 6  # zlib's default, which Triton's compressor uses (Z_DEFAULT_COMPRESSION)
# A larger answer is compressed in a thread, the event loop serving the others meanwhile: tensors of random
# floats go through zlib at about 11 MB/s here (0.7 ms for this much), a small JSON answer in 20 µs.
INLINE_MAX = 8 << 10
# A smaller answer goes as it is, asked or not (HTTP lets a server answer in identity whatever the request
# accepts, and tritonclient reads either): zlib costs ~20 µs a small answer, more than its bytes take on any
# link, and aiohttp, httpx and requests ask for gzip by default. Triton compresses every size.
SMALLEST = 1 << 10
_WRITTEN = (b"gzip", b"deflate", b"identity")

Respond = Callable[[int, bytes, bytes, Headers], None]  # an exchange's respond (infer.Exchange)


def response_coding(headers: Headers) -> bytes | None:
    """The coding an infer answer goes in by the request's Accept-Encoding (chosen), or None: as it is.
    Several Accept-Encoding lines read as one list (RFC 9110)."""
    accept = header(headers, b"accept-encoding")  # a request that asks nothing pays this scan alone
    if accept is None:
        return None
    return chosen(b",".join([value for key, value in headers if key == b"accept-encoding"]))


def chosen(accept: bytes) -> bytes | None:
    """An Accept-Encoding's choice as Triton's (CompressionTypeUsed): of gzip, deflate and identity, the
    listed one of the highest q (1 when not given), the first among equals; q=0 is never chosen. Other
    codings ("*" too) and entries that do not parse are passed over; nothing left is the answer as it is,
    never a 406. Names and spaces as RFC 9110 has them (any case, spaces around ';' and '='), where
    Triton's exact match takes only `gzip;q=0.5`."""
    best, weight = b"identity", 0.0
    for entry in accept.split(b","):
        name, _, parameter = entry.partition(b";")
        name = name.strip().lower()
        if name not in _WRITTEN:
            continue
        q = 1.0
        if parameter:
            key, equals, value = parameter.partition(b"=")
            if key.strip().lower() != b"q" or not equals:
                continue
            try:
                q = float(value)
            except ValueError:
                continue
        if q > weight:  # (a NaN is never greater)
            best, weight = name, q
    return None if best == b"identity" else best


def respond_encoded(respond: Respond, body: bytes, content_type: bytes, extra: Headers, coding: bytes
                    ) -> None:
    """Answer 200 with `body` in `coding` (gzip or deflate) through `respond` (an exchange's); as it is,
    as Triton does, should compressing fail."""
    if len(body) <= INLINE_MAX:
        respond(200, zlib.compress(body, LEVEL, WBITS[coding]), content_type,
                [(b"content-encoding", coding), *extra])
        return

    def compressed(future: asyncio.Future[bytes]) -> None:
        if future.cancelled() or future.exception() is not None:
            log.warning("compressing an answer in %s failed: sent as it is (%r)", coding.decode(),
                        None if future.cancelled() else future.exception())
            respond(200, body, content_type, extra)
            return
        respond(200, future.result(), content_type, [(b"content-encoding", coding), *extra])

    loop = asyncio.get_running_loop()
    loop.run_in_executor(None, zlib.compress, body, LEVEL, WBITS[coding]).add_done_callback(compressed)
