"""despina/clock.py against a real Redis: the offset of this host's clock to Redis's, and the warning when it
is large (in a process whose clock libfaketime moves, where installed)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import orjson
import pytest

from despina import clock
from despina.redis_client import connect, connect_worker

from .conftest import ROOT
from .test_clock_skew import LIBFAKETIME, faked

MEASURE = """
import asyncio, logging, sys, time
import orjson
from despina import clock
from despina.redis_client import connect

logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(message)s")

async def main():
    redis = connect(sys.argv[1])
    skew = clock.Skew(float(sys.argv[2]), "test")
    await skew.measure(redis, clock.SAMPLES)
    await skew.measure(redis)  # a second time: no second warning
    print(orjson.dumps({"offset": clock.offset(), "now": clock.now(), "warning": skew.warning()}).decode())
    await redis.aclose()

asyncio.run(main())
"""


@pytest.fixture
def own_offset() -> Iterator[None]:
    """The test moves this process's offset: it is measured again after."""
    yield
    clock._offset = 0.0


async def test_the_offset_of_a_clock_that_agrees_with_redis_is_nothing(redis_url: str,
                                                                              own_offset: None) -> None:
    redis = connect_worker(redis_url)  # (the worker's connection: its own reply parser)
    try:
        skew = clock.Skew(1.0, "test")
        # Redis on this host reads the same clock: the offset stays exactly 0, whatever a round trip took
        # (each process on Redis's host stamps and compares times as plain time.time() did)
        for _ in range(20):
            assert await skew.measure(redis, clock.SAMPLES) == 0.0
        assert abs(clock.now() - time.time()) < 0.05
        assert skew.warning() == "" and not skew.warned
    finally:
        await redis.aclose()


async def test_a_clock_that_stepped_is_measured_again(redis_url: str, own_offset: None) -> None:
    """An offset that the next round trip's bounds rule out (the host's clock stepped) is replaced."""
    redis = connect(redis_url)
    try:
        skew = clock.Skew(1.0, "test")
        await skew.measure(redis)
        clock._offset = 5.0  # as if the host's clock had stepped back 5 s since
        assert abs(await skew.measure(redis)) < 0.05
    finally:
        await redis.aclose()


@pytest.mark.skipif(LIBFAKETIME is None, reason="libfaketime is not installed (apt-get install faketime)")
@pytest.mark.parametrize("warn_s", [1.0, 0.0])
def test_a_process_whose_clock_is_ahead_works_on_redis_time_and_says_so_once(redis_url: str,
                                                                             warn_s: float) -> None:
    environ = {**os.environ, **faked("+5s")}
    done = subprocess.run([sys.executable, "-c", MEASURE, redis_url, str(warn_s)], env=environ, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = orjson.loads(done.stdout)
    assert -5.2 < got["offset"] < -4.8
    assert abs(got["now"] - time.time()) < 1.0  # Redis's time, not the process's own
    if warn_s:
        assert "s ahead of Redis's" in got["warning"]
        assert done.stderr.count("ahead of Redis's") == 1, done.stderr
    else:  # 0: never warns
        assert got["warning"] == "" and "Redis's" not in done.stderr
