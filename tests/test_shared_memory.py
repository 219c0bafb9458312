"""Triton's system shared-memory extension on a real `despina serve` (two gateways on one port), driven by
tritonclient and its shared memory utilities: regions registered, listed and unregistered; inputs read
from them and outputs written into them; the server's regions seen by each of its gateways; the errors
for every bad registration and request; the CUDA API's refusal; the extension off by default."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from despina.contract.errors import DespinaError, InvalidArgument, NotFound
from despina.embedded import free_port
from despina.gateway.shm import Registry, object_path

from .conftest import Server, module_server, start_server, stop_server

A = np.arange(8, dtype=np.float32).reshape(2, 4)
B = np.full((2, 4), 0.5, dtype=np.float32)
SIZE = A.nbytes  # 32 bytes a tensor


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, example_repository: Path) -> Iterator[Server]:
    yield from module_server(example_repository, tmp_path_factory, redis_url, ("add_sub",),
                             env={"DESPINA_ALLOW_CLIENT_SHM": "1", "DESPINA_GATEWAYS": "2"})


@pytest.fixture
def client(server: Server) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.unregister_system_shared_memory()  # each test starts with none
    c.close()


class Objects(dict[str, shm.SharedMemoryRegion]):
    """The test's shared memory objects by name, each of 64 bytes, made on first mention."""

    def __missing__(self, name: str) -> shm.SharedMemoryRegion:
        handle = self[name] = shm.create_shared_memory_region(name, f"/despina-test-{uuid.uuid4().hex[:12]}",
                                                              2 * SIZE)
        return handle


@pytest.fixture
def regions() -> Iterator[Objects]:
    made = Objects()
    yield made
    for handle in made.values():
        shm.destroy_shared_memory_region(handle)


def key_of(handle: shm.SharedMemoryRegion) -> str:
    return handle._shm_key


def shm_inputs(region: str) -> list[httpclient.InferInput]:
    a, b = httpclient.InferInput("a", [2, 4], "FP32"), httpclient.InferInput("b", [2, 4], "FP32")
    a.set_shared_memory(region, SIZE)
    b.set_shared_memory(region, SIZE, offset=SIZE)
    return [a, b]


def shm_outputs(region: str) -> list[httpclient.InferRequestedOutput]:
    total, diff = httpclient.InferRequestedOutput("sum"), httpclient.InferRequestedOutput("diff")
    total.set_shared_memory(region, SIZE)
    diff.set_shared_memory(region, SIZE, offset=SIZE)
    return [total, diff]


def test_inputs_from_and_outputs_into_registered_regions(client: httpclient.InferenceServerClient,
                                                         regions: Objects) -> None:
    assert "system_shared_memory" in client.get_server_metadata()["extensions"]
    inp, out = regions["in"], regions["out"]
    client.register_system_shared_memory("in", key_of(inp), 2 * SIZE)
    client.register_system_shared_memory("out", key_of(out), 2 * SIZE)
    status = {r["name"]: r for r in client.get_system_shared_memory_status()}
    assert status == {"in": {"name": "in", "key": key_of(inp), "offset": 0, "byte_size": 64},
                      "out": {"name": "out", "key": key_of(out), "offset": 0, "byte_size": 64}}
    assert client.get_system_shared_memory_status("in") == [status["in"]]
    for scale in (1.0, 3.0):  # the same request again reads the region's new contents
        shm.set_shared_memory_region(inp, [A * scale, B])
        result = client.infer("add_sub", shm_inputs("in"), outputs=shm_outputs("out"))
        # as Triton answers: no data, no parameters (tritonclient's C++ client reads binary_data_size from any)
        assert result.get_output("sum") == {"name": "sum", "datatype": "FP32", "shape": [2, 4]}
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [2, 4]), A * scale + B)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [2, 4], offset=SIZE), A * scale - B)
    client.unregister_system_shared_memory("in")
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["out"]
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'in'"):
        client.infer("add_sub", shm_inputs("in"), outputs=shm_outputs("out"))
    other = regions["other"]  # the name again, on another object: the same request reads that one
    shm.set_shared_memory_region(other, [B, A])
    client.register_system_shared_memory("in", key_of(other), 2 * SIZE)
    client.infer("add_sub", shm_inputs("in"), outputs=shm_outputs("out"))
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [2, 4], offset=SIZE), B - A)
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []


def test_a_region_inside_an_object_and_binary_inputs_beside_it(client: httpclient.InferenceServerClient,
                                                               regions: Objects) -> None:
    handle = regions["both"]
    shm.set_shared_memory_region(handle, [A], offset=SIZE)  # the region is the object's second half
    client.register_system_shared_memory("half", key_of(handle), SIZE, offset=SIZE)
    a = httpclient.InferInput("a", [2, 4], "FP32")
    a.set_shared_memory("half", SIZE)
    for b_value in (B, B * 4):  # b in the body's binary part, a in shared memory, twice with one header
        b = httpclient.InferInput("b", [2, 4], "FP32")
        b.set_data_from_numpy(b_value, binary_data=True)
        result = client.infer("add_sub", [a, b], outputs=[httpclient.InferRequestedOutput("sum", binary_data=True)])
        np.testing.assert_array_equal(result.as_numpy("sum"), A + b_value)
    shm.set_shared_memory_region(handle, [A * 2], offset=SIZE)
    b = httpclient.InferInput("b", [2, 4], "FP32")
    b.set_data_from_numpy(B, binary_data=True)
    np.testing.assert_array_equal(client.infer("add_sub", [a, b]).as_numpy("sum"), A * 2 + B)


def infer_through_every_gateway(server: Server, client: httpclient.InferenceServerClient, inp: object) -> None:
    """Register `inp` holding A and B as region "in", then add them through it on twelve new connections,
    which the kernel spreads over both gateways: each maps the region."""
    shm.set_shared_memory_region(inp, [A, B])
    client.register_system_shared_memory("in", key_of(inp), 2 * SIZE)
    body = {"inputs": [{"name": n, "shape": [2, 4], "datatype": "FP32",
                        "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": SIZE,
                                       "shared_memory_offset": offset}} for n, offset in (("a", 0), ("b", SIZE))]}
    for _ in range(12):
        with httpx.Client() as fresh:
            r = fresh.post(f"{server.url}/v2/models/add_sub/infer", json=body, headers={"connection": "close"})
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == (A + B).reshape(-1).tolist()


def test_every_gateway_of_the_server_sees_its_regions(server: Server, client: httpclient.InferenceServerClient,
                                                      regions: Objects) -> None:
    infer_through_every_gateway(server, client, regions["in"])


def holders(root: int, key: str) -> dict[int, int]:
    """The processes of the server started as `root` that map the object `key` or hold a descriptor of it:
    pid -> how many such mappings and descriptors. By its inode: a gateway may open it through the
    registry's link to it, another name."""
    inode, found = os.stat(f"/dev/shm/{key.lstrip('/')}").st_ino, {}
    family, pending = set(), [root]
    while pending:  # the server's process tree, from each process's parent in /proc/N/stat
        parent = pending.pop()
        family.add(parent)
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    pending.append(int(entry.name))
    for pid in family:
        with contextlib.suppress(OSError):
            maps = [line.split() for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]
            count = sum(len(f) >= 6 and f[4] == str(inode) and f[5].startswith("/dev/shm/") for f in maps)
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    count += os.readlink(fd).startswith("/dev/shm/") and os.stat(fd).st_ino == inode
            if count:
                found[pid] = count
    return found


def test_an_unregistered_region_is_let_go_by_every_gateway(server: Server, client: httpclient.InferenceServerClient,
                                                          regions: Objects) -> None:
    """As Triton unmaps a region it unregisters: the gateways that mapped it for requests let it go too, even
    without another request, so that the object's memory is freed when its client unlinks it."""
    inp = regions["in"]
    infer_through_every_gateway(server, client, inp)
    assert len(holders(server.process.pid, key_of(inp))) == 2
    client.unregister_system_shared_memory("in")
    deadline = time.monotonic() + 10
    while holders(server.process.pid, key_of(inp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert holders(server.process.pid, key_of(inp)) == {}


def test_registrations_are_shared_through_the_servers_file(tmp_path: Path) -> None:
    """Two registries of one server (as two gateway processes have): what one registers, the other reads;
    an unregistration, a registration again under the name, and the server's clear the same."""
    first, second = Registry("s", tmp_path), Registry("s", tmp_path)
    other = Registry("another server", tmp_path)
    data = tmp_path / "obj"
    data.write_bytes(bytes(range(64)))

    import despina.gateway.shm as shm_module
    shm_module.SHM_DIR, saved = tmp_path, shm_module.SHM_DIR  # keys resolve in tmp_path
    try:
        first.register("r", "/obj", 16, 32)
        assert second.region("r").read(4, 4, "x") == bytes([20, 21, 22, 23])
        assert other.status() == []
        second.region("r").write(0, b"\xff\xff", "y")
        assert data.read_bytes()[16:18] == b"\xff\xff"
        first.unregister("r")
        with pytest.raises(NotFound, match="Unable to find shared memory region: 'r'"):
            second.region("r")
        second.register("r", "/obj", 0, 8)  # the name again, another region
        assert first.region("r").read(0, 2, "z") == bytes([0, 1])
        with pytest.raises(InvalidArgument, match=r"Invalid offset \+ byte size for shared memory region: 'r'"):
            first.region("r").read(4, 8, "z")
        # the client truncates the object: a gateway that maps the region only now (a request's first use
        # there) says so as one that had it mapped does, not as a registration would
        data.write_bytes(b"\0" * 4)
        third = Registry("s", tmp_path)
        with pytest.raises(InvalidArgument, match="'/obj' of region 'r' is smaller than the region now"):
            third.region("r")
        with pytest.raises(InvalidArgument, match="'/obj' of region 'r' is smaller than the region now"):
            first.region("r").read(0, 2, "z")
        second.clear()
        assert first.status() == [] and not second.path.exists()
    finally:
        shm_module.SHM_DIR = saved


def test_a_region_an_output_is_under_way_into_is_not_unregistered(tmp_path: Path) -> None:
    """As Triton 2.51 refuses it ("currently in use"): while a request of any gateway is to write an output
    into a region, unregistering the region is refused, and unregistering all leaves it and says so; once
    the request is done with it (its decoded form gone), it unregisters. A region inputs were read from is
    not held: they are copied as the request arrives."""
    first, second = Registry("s", tmp_path), Registry("s", tmp_path)  # two gateways of one server
    (tmp_path / "obj").write_bytes(bytes(64))
    (tmp_path / "other").write_bytes(bytes(64))

    import despina.gateway.shm as shm_module
    shm_module.SHM_DIR, saved = tmp_path, shm_module.SHM_DIR  # keys resolve in tmp_path
    try:
        first.register("r", "/obj", 0, 64)
        first.register("o", "/other", 0, 64)
        second.region("r").read(0, 8, "input")  # an input's use ends as it is read
        out = second.region("r").output("y", 8, 8)  # a request of the second gateway, under way
        with pytest.raises(DespinaError, match="Cannot unregister shared memory region 'r', it is currently in use"):
            first.unregister("r")
        with pytest.raises(DespinaError, match="Failed to unregister the following system shared memory regions: r"):
            first.unregister()
        assert [r["name"] for r in first.status()] == ["r"]  # the other one went
        out.write("y", b"\1" * 8)
        del out  # the request is answered
        first.unregister("r")
        assert first.status() == []
    finally:
        shm_module.SHM_DIR = saved


def test_a_region_whose_object_its_client_unlinked_serves_on_in_every_gateway(tmp_path: Path) -> None:
    """A client may unlink its object once it is registered (so that none is left behind if it dies):
    Triton's one process maps it as it registers it and serves on. Every gateway does, the ones that map it
    only for a later request included, and the object's memory goes with the region's registration."""
    first, second = Registry("s", tmp_path), Registry("s", tmp_path)  # two gateways of one server
    data = tmp_path / "obj"
    data.write_bytes(bytes(range(64)))

    import despina.gateway.shm as shm_module
    shm_module.SHM_DIR, saved = tmp_path, shm_module.SHM_DIR  # keys resolve in tmp_path
    try:
        first.register("r", "/obj", 16, 32)
        data.unlink()
        assert second.region("r").read(0, 4, "x") == bytes([16, 17, 18, 19])
        data.write_bytes(bytes(64))  # another object of that name: the region is still the first one's
        assert Registry("s", tmp_path).region("r").read(0, 4, "x") == bytes([16, 17, 18, 19])
        kept = {p.name for p in tmp_path.iterdir()} - {"obj"}
        first.unregister("r")
        assert {p.name for p in tmp_path.iterdir()} - {"obj"} < kept  # nothing keeps its memory now
        first.register("r", "/obj", 0, 8)
        first.clear()
        assert [p.name for p in tmp_path.iterdir()] == ["obj"]
    finally:
        shm_module.SHM_DIR = saved


def start_gateway_on(server: Server, redis_url: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    """A `despina gateway` started by hand on `port` with DESPINA_REUSE_PORT, beside the server's own roles:
    returned once it serves (its log says so; the port may be answered by another gateway)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DESPINA_REDIS_URL")}
    environ.update(DESPINA_REUSE_PORT="1", DESPINA_ALLOW_CLIENT_SHM="1")
    cmd = [sys.executable, "-m", "despina", "gateway", "--redis-url", redis_url, "--key-prefix", server.prefix,
           "--http-port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=True)
    deadline = time.monotonic() + 30
    while "Application startup complete" not in log.read_text(errors="replace"):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.1)
    return process


def status_on_every_gateway(url: str) -> list[list[dict[str, object]]]:
    """The regions' status asked on twelve new connections, which the kernel spreads over the port's
    gateways: each answer."""
    answers = []
    for _ in range(12):
        with httpx.Client() as fresh:
            answers.append(fresh.get(f"{url}/v2/systemsharedmemory/status",
                                     headers={"connection": "close"}).json())
    return answers


def test_gateways_started_by_hand_on_one_port_keep_the_regions_as_one_joins_and_leaves(
        server: Server, redis_url: str, tmp_path: Path, regions: Objects) -> None:
    """Gateways started by hand on one port (DESPINA_REUSE_PORT) are one server: a gateway that joins
    them, or one that stops while another serves on, leaves the regions registered through the others
    (it wiped them all); the last to stop ends them."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = start_gateway_on(server, redis_url, port, tmp_path / "first.log")
    second = None
    try:
        r = httpx.post(f"{url}/v2/systemsharedmemory/region/r/register",
                       json={"key": key_of(regions["r"]), "offset": 0, "byte_size": SIZE})
        assert r.status_code == 200, r.text
        registered = [{"name": "r", "key": key_of(regions["r"]), "offset": 0, "byte_size": SIZE}]
        second = start_gateway_on(server, redis_url, port, tmp_path / "second.log")
        assert all(answer == registered for answer in status_on_every_gateway(url))
        second.terminate()
        second.wait(30)  # (a clean stop: uvicorn ends by the signal it got)
        assert all(answer == registered for answer in status_on_every_gateway(url))
    finally:
        for process in (second, first):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(30)
    assert not Registry.of(server.prefix, port).path.exists()


def test_an_unreadable_registrations_file_is_a_despina_error(tmp_path: Path) -> None:
    """A registrations file that cannot be read (here a folder where it should be) is an error with its
    path, as a malformed one is: the request that met it answers it, and a gateway's once-a-second look
    for regions to let go (which catches DespinaError) goes on."""
    registry = Registry("s", tmp_path)
    registry.path.mkdir()
    with pytest.raises(DespinaError, match="registrations .* are unreadable"):
        registry.region("r")
    with pytest.raises(DespinaError, match="are unreadable"):
        registry.let_go()


def test_a_key_names_its_object_as_shm_open_does() -> None:
    """glibc's shm_open skips every leading slash of a key and refuses a name of NAME_MAX - 1 characters
    or more: Triton (which calls it) registers '//obj' as '/obj', and so must a gateway."""
    assert object_path("//obj") == object_path("/obj") == object_path("obj") == Path("/dev/shm/obj")
    assert object_path("/" + "n" * 253) == Path("/dev/shm/" + "n" * 253)
    for key in ("/", "//", "", "/a/b", "/" + "n" * 254):
        with pytest.raises(InvalidArgument, match="not a shared memory key"):
            object_path(key)


def http_error(call: object, *args: object, **kwargs: object) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)  # type: ignore[operator]
    return str(caught.value)


def test_bad_registrations(server: Server, client: httpclient.InferenceServerClient,
                           regions: Objects) -> None:
    handle = regions["r"]
    client.register_system_shared_memory("r", key_of(handle), 2 * SIZE)
    with pytest.raises(InferenceServerException) as taken:
        client.register_system_shared_memory("r", key_of(handle), 8)
    # Triton's ALREADY_EXISTS, which its HTTP frontend answers with 400 (HttpCodeFromError), not 409
    assert taken.value.status() == "400" and "already in manager" in taken.value.message()
    assert "under a different name" in http_error(client.register_system_shared_memory, "r2", key_of(handle), 8)
    assert "Unable to open shared memory region" in http_error(
        client.register_system_shared_memory, "gone", "/despina-test-no-such-object", 8)
    assert "invalid args" in http_error(client.register_system_shared_memory, "big", key_of(regions["s"]), 65)
    assert "invalid args" in http_error(client.register_system_shared_memory, "far", key_of(regions["t"]), 8,
                                        offset=60)
    assert "not a shared memory key" in http_error(client.register_system_shared_memory, "up", "/../etc/passwd", 8)
    # an empty region, which Triton cannot map (mmap of 0 bytes: EINVAL)
    assert "failed to register shared memory region 'empty'" in http_error(
        client.register_system_shared_memory, "empty", key_of(regions["v"]), 0)
    with httpx.Client(base_url=server.url) as h:
        r = h.post("/v2/systemsharedmemory/region/x/register", json={"key": key_of(regions["u"])})
        assert r.status_code == 400 and "byte_size" in r.json()["error"]
        r = h.post("/v2/systemsharedmemory/region/x/register", json={"key": 3, "byte_size": 8})
        assert r.status_code == 400 and "key" in r.json()["error"]
        r = h.post("/v2/systemsharedmemory/region/x/register", content=b"{not json")
        assert r.status_code == 400
        r = h.post("/v2/systemsharedmemory/region/r/register", json={"key": key_of(handle), "byte_size": 8})
        assert r.status_code == 400
        r = h.get("/v2/systemsharedmemory/region/nope/status")
        assert r.status_code == 404 and "Unable to find system shared memory region: 'nope'" in r.json()["error"]
        assert h.post("/v2/systemsharedmemory/region/nope/unregister").status_code == 200  # nothing to do
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["r"]


def test_bad_requests_through_shared_memory(server: Server, client: httpclient.InferenceServerClient,
                                            regions: Objects) -> None:
    handle = regions["r"]
    shm.set_shared_memory_region(handle, [A, B])
    client.register_system_shared_memory("r", key_of(handle), 2 * SIZE)

    def infer(a_params: dict[str, object], *, a_data: bool = False, outputs: object = None) -> httpx.Response:
        a = {"name": "a", "shape": [2, 4], "datatype": "FP32", "parameters": a_params}
        if a_data:
            a["data"] = A.reshape(-1).tolist()
        body = {"inputs": [a, {"name": "b", "shape": [2, 4], "datatype": "FP32", "data": B.reshape(-1).tolist()}]}
        if outputs is not None:
            body["outputs"] = outputs
        return httpx.post(f"{server.url}/v2/models/add_sub/infer", json=body)

    cases = [
        ({"shared_memory_region": "r"}, {}, "must be given together"),
        ({"shared_memory_byte_size": SIZE}, {}, "must be given together"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 16}, {}, "16 bytes of data do not match"),
        # Triton's words, which its own tests (L0_shared_memory) look for
        ({"shared_memory_region": "r", "shared_memory_byte_size": SIZE, "shared_memory_offset": 40}, {},
         "Invalid offset + byte size for shared memory region: 'r'"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": SIZE, "shared_memory_offset": 2**64 - 32}, {},
         "Invalid offset for shared memory region: 'r'"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": -1}, {}, "non-negative integer"),
        ({"shared_memory_region": 5, "shared_memory_byte_size": SIZE}, {}, "region's name"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": SIZE}, {"a_data": True}, "give one of"),
    ]
    for params, extra, message in cases:
        r = infer(params, **extra)  # type: ignore[arg-type]
        assert r.status_code == 400 and message in r.json()["error"], (params, r.text)
    r = infer({"shared_memory_region": "nope", "shared_memory_byte_size": SIZE})  # Triton's NOT_FOUND
    assert r.status_code == 404 and r.json()["error"] == "Unable to find shared memory region: 'nope'", r.text
    ok = {"shared_memory_region": "r", "shared_memory_byte_size": SIZE}
    small = [{"name": "sum", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8}}]
    r = infer(ok, outputs=small)
    assert r.status_code == 400 and "should be at least 32 bytes" in r.json()["error"]
    both = [{"name": "sum", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": SIZE,
                                           "classification": 2}}]
    r = infer(ok, outputs=both)
    assert r.status_code == 400 and "classification" in r.json()["error"]
    binary = [{"name": "sum", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": SIZE,
                                             "binary_data": True}}]  # as Triton: one place or the other
    r = infer(ok, outputs=binary)
    assert r.status_code == 400 and "can't set both 'shared_memory_region' and 'binary_data'" in r.json()["error"]
    binary[0]["parameters"]["binary_data"] = False  # as tritonclient's set_shared_memory sends it
    assert infer(ok, outputs=binary).status_code == 200
    # the client truncates the object under its region: an error, not a fault of the gateway
    os.truncate(f"/dev/shm/{key_of(handle).lstrip('/')}", 8)
    r = infer(ok)
    assert r.status_code == 400 and "smaller than the region now" in r.json()["error"]
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


def test_an_output_that_overruns_its_region_is_refused_before_the_model_runs(
        server: Server, client: httpclient.InferenceServerClient, regions: Objects) -> None:
    """As Triton checks an output's offset and byte size against its region as the request arrives
    (SharedMemoryManager::GetMemoryInfo): not only the result's bytes when they are written."""
    handle = regions["r"]
    shm.set_shared_memory_region(handle, [A, B])
    client.register_system_shared_memory("r", key_of(handle), 2 * SIZE)
    inputs = [{"name": n, "shape": [2, 4], "datatype": "FP32",
               "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": SIZE,
                              "shared_memory_offset": offset}} for n, offset in (("a", 0), ("b", SIZE))]
    past = [{"name": "sum", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 2 * SIZE,
                                           "shared_memory_offset": SIZE}}]
    for _ in range(3):  # the first sight of the header, and its plan's
        r = httpx.post(f"{server.url}/v2/models/add_sub/infer", json={"inputs": inputs, "outputs": past})
        assert r.status_code == 400, r.text
        assert "Invalid offset + byte size for shared memory region: 'r'" in r.json()["error"]
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [2, 4], offset=SIZE), B)


def test_cuda_shared_memory_is_refused_with_the_reason(client: httpclient.InferenceServerClient) -> None:
    assert client.get_cuda_shared_memory_status() == []
    assert "CUDA shared memory is not supported" in http_error(client.register_cuda_shared_memory, "c", b"x" * 64, 0, 8)
    assert "Unable to find cuda shared memory region: 'c'" in http_error(client.get_cuda_shared_memory_status, "c")
    client.unregister_cuda_shared_memory()


def test_off_unless_allowed_and_gone_when_the_server_stops(tmp_path: Path, redis_url: str, key_prefix: str,
                                                           example_repository: Path, regions: Objects) -> None:
    prefix = key_prefix
    plain = start_server(example_repository, tmp_path, redis_url, prefix, wait_models=("add_sub",))
    try:
        r = httpx.get(f"{plain.url}/v2/systemsharedmemory/status")
        assert r.status_code == 400 and "--allow-client-shm" in r.json()["error"]
        body = {"inputs": [{"name": n, "shape": [2, 4], "datatype": "FP32",
                            "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": SIZE}}
                           for n in ("a", "b")]}
        r = httpx.post(f"{plain.url}/v2/models/add_sub/infer", json=body)
        assert r.status_code == 400 and "--allow-client-shm" in r.json()["error"]
        assert "system_shared_memory" not in httpx.get(f"{plain.url}/v2").json()["extensions"]
    finally:
        stop_server(plain)
    allowed = start_server(example_repository, tmp_path, redis_url, prefix, "--allow-client-shm",
                           wait_models=("add_sub",))
    port = int(allowed.url.rsplit(":", 1)[1])
    registry = Registry.of(prefix, port)
    try:
        c = httpclient.InferenceServerClient(allowed.url.removeprefix("http://"))
        c.register_system_shared_memory("r", key_of(regions["r"]), 8)
        c.close()
        assert registry.path.exists()
    finally:
        stop_server(allowed)
    assert not registry.path.exists()
