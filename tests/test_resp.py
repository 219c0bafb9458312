"""The lean Redis connection of the hot loops (despina/resp/), against a real server."""
from __future__ import annotations

import asyncio
import functools
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError, ResponseError

from despina.counters import record_counts
from despina.embedded import die_with_parent, free_port
from despina.resp import Batch, Prefix, Resp, fields, gather, pack, packed, prefix

from .conftest import ipv6_loopback


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def test_pack_is_resp() -> None:
    assert pack([["SET", "k", b"\x00v", 5]]) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n\x00v\r\n$1\r\n5\r\n"
    # floats as repr's digits; what hiredis refuses (a bool, a numpy integer) as its value
    assert pack([("INCRBYFLOAT", "k", 0.1)]) == b"*3\r\n$11\r\nINCRBYFLOAT\r\n$1\r\nk\r\n$3\r\n0.1\r\n"
    assert pack([("SET", "k", True), ["SET", "k", np.int64(7)]]) == (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n1\r\n*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n7\r\n")


def test_a_prefix_packs_as_the_whole_command_would() -> None:
    xadd = Prefix("XADD", "s", "MAXLEN", "~", 100_000, "*", "m")
    for tail in [b"", b"\x00\r\n", b"x" * 70_000]:
        assert pack([xadd.command(tail)]) == pack([("XADD", "s", "MAXLEN", "~", 100_000, "*", "m", tail)])
    assert Prefix("PING").command() == pack([("PING",)])
    # the rest as pack takes it: str, int, float, what hiredis refuses (a bool, a numpy integer)
    assert Prefix("SET", "k").command("é", 7, 0.1, True, np.int64(3)) == pack([("SET", "k", "é", 7, 0.1, True, 3)])
    # commands packed already go as they are, among the others
    assert pack([("PING",), Prefix("GET", "k").command(), ["INCR", "n"]]) == pack(
        [("PING",), ("GET", "k"), ("INCR", "n")])
    # kept by its arguments and their types (1 and 1.0 pack apart)
    assert prefix("GET", "k") is prefix("GET", "k") and prefix("A", 1) is not prefix("A", 1.0)
    assert packed("SET", "k", 1.0) == pack([("SET", "k", 1.0)]) and packed("SET", "k", 1) == pack([("SET", "k", 1)])
    # Batch packs each command from a kept prefix, as the whole command would pack
    batch = Batch()
    batch.xadd("s", {b"m": b"v", "n": 3}, maxlen=10)
    batch.xadd("s", {"m": b"w"})
    batch.pexpire("s", 60_000)
    batch.hincrby("h", "f", 2)
    batch.decrby("q", 4)
    batch.eval("return 1", 2, "k1", "k2", 5, b"x")
    batch.xack("s", "g", b"1-0", b"2-0")
    batch.xdel("s", b"1-0")
    assert pack(batch.commands) == pack([
        ("XADD", "s", "MAXLEN", "~", 10, "*", b"m", b"v", "n", 3), ("XADD", "s", "*", "m", b"w"),
        ("PEXPIRE", "s", 60_000), ("HINCRBY", "h", "f", 2), ("DECRBY", "q", 4),
        ("EVAL", "return 1", 2, "k1", "k2", 5, b"x"), ("XACK", "s", "g", b"1-0", b"2-0"),
        ("XDEL", "s", b"1-0")])


async def test_counters_packed_as_one_argument_add_up(redis: aioredis.Redis, redis_url: str,
                                                      key_prefix: str) -> None:
    """record_counts' one msgpack argument, from the lean connection's Batch (its EVAL packed from a kept
    prefix) and from redis-py's pipeline alike: counters added, last_inference set, values as HINCRBY keeps them
    (the largest a Lua number holds exactly, negative ones)."""
    conn = Resp.from_url(redis_url)
    key = f"{key_prefix}:stats"
    counts = {"inference_count": 3, "batch:3": 1, "compute_infer_ns": 2**53 - 1, "fail:OTHER": -2,
              "last_inference": 1_796_461_277_129}
    try:
        for _ in range(2):
            batch = Batch()
            record_counts(batch, key, counts)
            record_counts(batch, key, {})  # nothing to count: no command
            assert len(batch.commands) == 1
            await conn.execute(batch.commands)
        pipe = redis.pipeline(transaction=False)
        record_counts(pipe, key, {**counts, "last_inference": 1_796_461_277_130})
        await pipe.execute()
        assert await redis.hgetall(key) == {b"inference_count": b"9", b"batch:3": b"3",
                                            b"compute_infer_ns": b"%d" % (3 * (2**53 - 1)),
                                            b"fail:OTHER": b"-6", b"last_inference": b"1796461277130"}
    finally:
        await redis.delete(key)
        conn.close()


async def test_pipeline_replies_in_order_and_errors(redis_url: str, key_prefix: str) -> None:
    conn = Resp.from_url(redis_url)
    k = f"{key_prefix}:k"
    try:
        batch = Batch()
        batch.hincrby(f"{k}:h", "n", 2)
        batch.xadd(f"{k}:s", {b"m": b"\x00\xffpayload"}, maxlen=10)
        batch.pexpire(f"{k}:s", 60_000)
        n, entry_id, expiring = await conn.execute(batch.commands)
        assert (n, expiring) == (2, 1) and isinstance(entry_id, bytes)
        ((stream, entries),) = (await conn.execute([["XREAD", "STREAMS", f"{k}:s", "0-0"]]))[0]
        assert stream == f"{k}:s".encode() and fields(entries[0][1]) == {b"m": b"\x00\xffpayload"}
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await conn.execute([["INCR", f"{k}:ok"], ["LPUSH", f"{k}:h", "x"]])
        # the connection stays in step after an error reply; without raising, errors are in the list
        replies = await conn.execute([["INCR", f"{k}:ok"], ["LPUSH", f"{k}:h", "x"]], errors=False)
        assert replies[0] == 2 and "WRONGTYPE" in str(replies[1])
    finally:
        conn.close()


async def test_large_arguments_are_written_as_they_are(redis_url: str, key_prefix: str) -> None:
    """A large argument is never copied into its command's or its pipeline's bytes (a 100 MB tensor was
    copied twice): gather passes it on itself, between the rest joined, and Redis gets it whole."""
    large = bytes(range(256)) * 512  # 128 kB
    batch = Batch()
    batch.hincrby(f"{key_prefix}:h", "n", 1)
    batch.xadd(f"{key_prefix}:s", {b"m": large, b"n": 1})
    batch.pexpire(f"{key_prefix}:s", 60_000)
    parts = gather(batch.commands)
    assert isinstance(parts, list) and any(part is large for part in parts) and len(parts) == 3
    assert b"".join(parts) == pack(batch.commands) == pack([
        ("HINCRBY", f"{key_prefix}:h", "n", 1), ("XADD", f"{key_prefix}:s", "*", b"m", large, b"n", 1),
        ("PEXPIRE", f"{key_prefix}:s", 60_000)])
    conn = Resp.from_url(redis_url)
    try:
        assert (await conn.execute(batch.commands))[0] == 1
        ((_, entries),) = (await conn.execute([["XREAD", "STREAMS", f"{key_prefix}:s", "0-0"]]))[0]
        assert fields(entries[0][1]) == {b"m": large, b"n": b"1"}
    finally:
        conn.close()


async def test_concurrent_callers_share_one_connection(redis_url: str, key_prefix: str) -> None:
    conn = Resp.from_url(redis_url)
    try:
        got = await asyncio.gather(*(conn.execute([["INCR", f"{key_prefix}:c"], ["GET", f"{key_prefix}:c"]])
                                     for _ in range(50)))
        assert sorted(int(r[1]) for r in got) == list(range(1, 51))
        assert all(int(r[0]) == int(r[1]) for r in got)
    finally:
        conn.close()


async def test_a_cancelled_blocking_read_leaves_the_connection_usable(redis_url: str,
                                                                      key_prefix: str) -> None:
    conn = Resp.from_url(redis_url)
    try:
        blocking = [["XREAD", "BLOCK", 5000, "STREAMS", f"{key_prefix}:s", "$"]]
        read = asyncio.ensure_future(conn.execute(blocking))
        await asyncio.sleep(0.05)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        assert await conn.execute([["PING"]]) == [b"PONG"]  # not the XREAD's late reply
    finally:
        conn.close()


async def test_pipelines_sent_together_are_answered_each_on_its_own(redis: aioredis.Redis, redis_url: str,
                                                                     key_prefix: str) -> None:
    """`send` writes several pipelines at once; a blocking read ending the last does not hold up the
    replies of those before it, and a read awaited with shield=True and cancelled keeps its reply."""
    conn = Resp.from_url(redis_url)
    stream = f"{key_prefix}:s"
    try:
        assert not conn.connected and conn.send([["PING"]]) is None  # not connected: execute connects
        assert await conn.execute([["PING"]]) == [b"PONG"] and conn.connected
        sent = conn.send([["INCR", f"{key_prefix}:n"], ["INCR", f"{key_prefix}:n"]], [],
                         [["XREAD", "BLOCK", 5000, "STREAMS", stream, "$"]])
        assert sent is not None
        first, empty, read = sent
        assert await asyncio.wait_for(conn.replies(first), 2) == [1, 2]
        assert await conn.replies(empty) == []
        assert not read.done()
        waiter = asyncio.ensure_future(conn.replies(read, shield=True))
        await asyncio.sleep(0.02)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await redis.xadd(stream, {b"f": b"v"})
        ((name, entries),) = (await asyncio.wait_for(conn.replies(read), 2))[0]
        assert name == stream.encode() and fields(entries[0][1]) == {b"f": b"v"}
        assert await conn.execute([["PING"]]) == [b"PONG"]  # still in step
        failing = conn.send([["INCR", f"{key_prefix}:n"], ["LPUSH", f"{key_prefix}:n", "x"]])
        assert failing is not None
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await conn.replies(failing[0])
    finally:
        conn.close()


async def test_reconnects_after_the_connection_dies(redis: aioredis.Redis, redis_url: str) -> None:
    conn = Resp.from_url(redis_url)
    try:
        assert await conn.execute([["CLIENT", "SETNAME", "despina-resp-test"]]) == [b"OK"]
        (own,) = [c["id"] for c in await redis.client_list() if c.get("name") == "despina-resp-test"]
        await redis.execute_command("CLIENT", "KILL", "ID", own)
        await asyncio.sleep(0.05)
        assert await conn.execute([["PING"]]) == [b"PONG"]  # on a new connection
    finally:
        conn.close()


async def test_no_server_is_a_connection_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn = Resp.from_url(f"redis://127.0.0.1:{port}/0")
    with pytest.raises(ConnectionError, match="cannot connect"):
        await conn.execute([["PING"]])


async def test_database_and_password_come_from_the_url(redis: aioredis.Redis, redis_url: str,
                                                       key_prefix: str) -> None:
    # redis://host:port/0, or unix:///path?db=0 (the embedded Valkey)
    db9 = redis_url.replace("?db=0", "?db=9") if "?db=" in redis_url else redis_url.rsplit("/", 1)[0] + "/9"
    conn = Resp.from_url(db9)
    try:
        await conn.execute([["SET", f"{key_prefix}:db9", "x", "EX", 60]])
        assert await redis.get(f"{key_prefix}:db9") is None  # not in the test database
        assert await conn.execute([["GET", f"{key_prefix}:db9"]]) == [b"x"]
        await conn.execute([["DEL", f"{key_prefix}:db9"]])
    finally:
        conn.close()
    # a password where the server asks none is taken, as redis-py takes it (HELLO AUTH default): Resp's
    # one-argument AUTH was refused, and every request failed where redis-py's connections worked. A
    # wrong one where the server asks one is refused (tests/test_redis_check.py)
    url = redis_url.replace("redis://", "redis://:needless-password@").replace("unix://",
                                                                              "unix://:needless-password@")
    needless = Resp.from_url(url)
    py = aioredis.Redis.from_url(url)
    try:
        assert await py.ping()  # the suite's server asks no password
        assert await needless.execute([["PING"]]) == [b"PONG"]
    finally:
        needless.close()
        await py.aclose()


async def test_commands_keep_their_order_across_the_connect(redis: aioredis.Redis, redis_url: str,
                                                            key_prefix: str) -> None:
    """A caller that found no connection waits for it; one that comes once the connection is up, before
    the first has sent, goes after it (a decoupled model's first response was overtaken by its last, and
    its caller, done at the final flag, never saw it)."""
    key = f"{key_prefix}:order"
    resp = Resp.from_url(redis_url)
    try:
        first = asyncio.create_task(resp.execute([["RPUSH", key, "first"]]))
        while not resp.connected:
            await asyncio.sleep(0)
        await resp.execute([["RPUSH", key, "second"]])
        await first
        assert await redis.lrange(key, 0, -1) == [b"first", b"second"]
    finally:
        resp.close()


async def test_connections_to_redis_find_a_vanished_host_dead(redis_url: str) -> None:
    """Keepalive probes and TCP_USER_TIMEOUT on every TCP connection to Redis, ours and redis-py's: a
    Redis host lost without a reset otherwise held every connection, and the requests waiting on them,
    for the kernel's ~15 minutes. (uvloop's transports take the options alike: its PseudoSocket.)"""
    from despina.redis_client import KEEPALIVE, connect, url_trouble

    assert url_trouble("unix:///tmp/valkey.sock?db=0") is None  # (a unix socket's connection takes none)
    if not redis_url.startswith("redis://"):
        pytest.skip("Redis over a unix socket: no TCP options")

    def options(sock: socket.socket) -> tuple[int, dict[int, int]]:
        return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                {option: sock.getsockopt(socket.IPPROTO_TCP, option) for option in KEEPALIVE})

    assert socket.TCP_USER_TIMEOUT in KEEPALIVE  # (Linux)
    ours = Resp.from_url(redis_url)
    client = connect(redis_url)
    try:
        await ours.execute([["PING"]])
        assert ours._protocol is not None and ours._protocol.transport is not None
        assert options(ours._protocol.transport.get_extra_info("socket")) == (1, KEEPALIVE)
        theirs = await client.connection_pool.get_connection()
        try:
            assert options(theirs._writer.transport.get_extra_info("socket")) == (1, KEEPALIVE)  # type: ignore[union-attr]
        finally:
            await client.connection_pool.release(theirs)
    finally:
        ours.close()
        await client.aclose()


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A Redis that speaks TLS only, as Redis does by default with TLS on: it asks each client for a
    certificate (tls-auth-clients yes). Its certificate and the client's are for "localhost" (and ::1, on
    which it listens too where there is IPv6), signed by a CA of this test. Its port, and the folder of
    ca.crt, client.crt and client.key."""
    server, openssl = shutil.which("redis-server"), shutil.which("openssl")
    if server is None or openssl is None:
        pytest.skip("needs redis-server and openssl")
    run = functools.partial(subprocess.run, cwd=tmp_path, check=True, capture_output=True)
    run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
         "-days", "1", "-subj", "/CN=despina-test-ca"])
    (tmp_path / "san.ext").write_text("subjectAltName=DNS:localhost,IP:::1\n")
    for name in ("server", "client"):
        run([openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", "/CN=localhost"])
        run([openssl, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "1", "-extfile", "san.ext"])
    port = free_port()
    bind = ["127.0.0.1", "::1"] if ipv6_loopback() else ["127.0.0.1"]
    proc = subprocess.Popen([server, "--port", "0", "--tls-port", str(port), "--bind", *bind,
                             "--tls-cert-file", "server.crt", "--tls-key-file", "server.key",
                             "--tls-ca-cert-file", "ca.crt", "--save", "", "--appendonly", "no",
                             "--loglevel", "warning"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                pytest.skip(f"redis-server without TLS: {proc.communicate()[0][-300:]!r}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the TLS Redis did not start"
                time.sleep(0.05)
        yield port, tmp_path
    finally:
        proc.terminate()
        proc.communicate()


async def all_three_connect(url: str) -> None:
    """redis-py, Despina's own connection from the URL, and one made like redis-py's client all reach `url`."""
    client = aioredis.Redis.from_url(url)
    conn, alike = Resp.from_url(url), Resp.like(client)
    try:
        assert await client.ping()
        assert await conn.execute([["PING"]]) == [b"PONG"]
        assert await alike.execute([["PING"]]) == [b"PONG"]
    finally:
        conn.close()
        alike.close()
        await client.aclose()


async def test_tls_options_mean_what_they_mean_to_redis_py(tls_redis: tuple[int, Path]) -> None:
    """rediss:// with a client certificate (ssl_certfile, ssl_keyfile), and ssl_check_hostname=false for a
    server reached by an address its certificate does not name: the hot loops' connection takes redis-py's
    TLS options as redis-py does. It took ssl_ca_certs and ssl_cert_reqs alone: the server reset it (no
    client certificate), or it refused the server's certificate for 127.0.0.1 (a hostname checked anyway)."""
    port, d = tls_redis
    files = f"ssl_ca_certs={d / 'ca.crt'}&ssl_certfile={d / 'client.crt'}&ssl_keyfile={d / 'client.key'}"
    for url in (f"rediss://localhost:{port}/0?{files}",
                f"rediss://127.0.0.1:{port}/0?{files}&ssl_check_hostname=false"):
        await all_three_connect(url)
    # the options still check what they are asked to: no client certificate, no connection; a hostname
    # checked, not 127.0.0.1
    for url in (f"rediss://localhost:{port}/0?ssl_ca_certs={d / 'ca.crt'}", f"rediss://127.0.0.1:{port}/0?{files}"):
        conn = Resp.from_url(url)
        try:
            with pytest.raises(ConnectionError):
                await conn.execute([["PING"]])
        finally:
            conn.close()
