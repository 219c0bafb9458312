"""The infer hop's answers that come from the gateway itself, against a real Redis (no worker)."""
from __future__ import annotations

import asyncio
import logging

import pytest

from despina.contract.errors import Code, DespinaError
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferReply, Tensor
from despina.gateway import infer
from despina.gateway.app import Gateway
from despina.settings import Settings

SPEC = ModelSpec.from_config({"name": "m", "backend": "python", "max_batch_size": 0,
                              "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
                              "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}]})


async def test_a_request_without_an_answer_is_told_the_time_it_had(redis_url: str, key_prefix: str) -> None:
    """A request given less than request_timeout_s (woken from scale-to-zero, an ensemble's later step)
    used to be told it had no answer within request_timeout_s."""
    gw = Gateway(Settings(redis_url=redis_url, key_prefix=key_prefix, request_timeout_s=0.3))
    await gw.start()
    try:
        got: dict[str, InferReply | DespinaError] = {}
        x = [Tensor("x", "FP32", (1,), bytes(4))]
        infer.submit(gw, SPEC, 1, x, (), None, lambda r: got.__setitem__("whole", r))
        infer.submit(gw, SPEC, 1, x, (), None, lambda r: got.__setitem__("less", r), timeout=0.125)
        for _ in range(500):
            if len(got) == 2:
                break
            await asyncio.sleep(0.01)
    finally:
        await gw.close()
    for name, said in (("whole", "within 0.3 s"), ("less", "within 0.125 s")):
        error = got[name]
        assert isinstance(error, DespinaError) and error.code == Code.DEADLINE_EXCEEDED, error
        assert f"no answer from model 'm' {said}" in error.message, error.message


async def test_a_gateway_that_stops_takes_itself_out_of_the_gateways_set(redis_url: str, key_prefix: str) -> None:
    """A stopped gateway left its id in `<prefix>:gateways` (and its report hash until its TTL): only the
    metrics' read pruned the set, so with the metrics port off it grew by one id per gateway that ever ran."""
    import redis.asyncio as aioredis

    from despina.contract.keys import Keys

    keys = Keys(key_prefix)
    gw = Gateway(Settings(redis_url=redis_url, key_prefix=key_prefix))
    await gw.start()
    r = aioredis.from_url(redis_url)
    try:
        for _ in range(500):  # its first report
            if await r.sismember(keys.gateways, gw.dispatcher.id):
                break
            await asyncio.sleep(0.01)
        assert await r.exists(keys.gateway(gw.dispatcher.id))
        await gw.close()
        assert not await r.sismember(keys.gateways, gw.dispatcher.id)
        assert not await r.exists(keys.gateway(gw.dispatcher.id))
    finally:
        await r.aclose()


class Answered:
    """An exchange that keeps its answers."""

    method, path, params, body = "POST", "/v2/models/m/infer", {"model": "m"}, b""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.answers: list[tuple[int, bytes, list[tuple[bytes, bytes]]]] = []

    def respond(self, status: int, body: bytes, content_type: bytes, extra: list[tuple[bytes, bytes]]) -> None:
        self.answers.append((status, body, extra))


def test_an_answer_that_cannot_be_made_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """A fault while the answer is made is an internal error, its traceback logged; a DespinaError its own
    answer; a failed request's error its own (infer.answering, infer.answer_failed)."""
    def broken(reply: InferReply) -> None:
        raise ValueError("no encoder for it")

    def refused(reply: InferReply) -> None:
        raise DespinaError("not this one", Code.INVALID_ARGUMENT)

    faulty, wrong, failed = Answered(), Answered(), Answered()
    with caplog.at_level(logging.ERROR, logger="despina.gateway"):
        infer.answering(faulty, b"r-1", broken)(InferReply("1"))
    infer.answering(wrong, None, refused)(InferReply("1"))
    infer.answering(failed, None, broken)(DespinaError("the model is gone", Code.UNAVAILABLE))
    (status, body, extra), = faulty.answers
    assert status == 500 and b"encoding the answer failed" in body and (b"x-request-id", b"r-1") in extra
    assert "no encoder for it" in caplog.text  # the traceback
    assert [(s, b) for s, b, _ in wrong.answers] == [(400, b'{"error":"not this one"}')]
    assert [s for s, _, _ in failed.answers] == [503]
