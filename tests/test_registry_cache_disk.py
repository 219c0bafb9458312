"""The artifact cache on a disk that cannot take a model: a small one (a 2 MB tmpfs, far under the cache's
limit) and a read-only one. Mounting needs root; elsewhere these tests skip."""
from __future__ import annotations

import io
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from despina.contract.errors import Unavailable
from despina.registry.cache import ArtifactCache
from despina.registry.transfer import push

from .conftest import Server
from .control_support import index, mlp_folder
from .seaweed import Weed
from .test_registry_cache import HOUR_AGO, Source, last_used

MB = 1_000_000


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """mount a tmpfs with the options given; unmounted after the test."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_evicts_unused_folders_for_room_then_says_the_cache_is_full(
        disk: Callable[[str], Path]) -> None:
    # a 20 GB limit on a smaller volume never trimmed: the fetch failed with ENOSPC, as the registry's
    # fault, while folders unused for hours filled the disk
    source = Source()
    cache = ArtifactCache(disk("size=2m"), max_bytes=20 * 2**30)
    old = cache.folder("a", source.files(b"A" * (1200 * 1000)), source.download)
    last_used(old, HOUR_AGO)
    new = cache.folder("b", source.files(b"B" * (1200 * 1000)), source.download)
    assert (new / "1" / "model.onnx").read_bytes() == b"B" * (1200 * 1000)
    assert not old.exists() and cache.stats.evicted_folders == 1
    with pytest.raises(Unavailable) as caught:  # "b" is in use: nothing left to evict
        cache.folder("c", source.files(b"C" * (1200 * 1000)), source.download)
    assert f"artifact cache {cache.root}: No space left on device: no room for model 'c'" in caught.value.message
    assert not any(cache.tmp.iterdir())  # no part file left behind
    assert not (cache.models / "c").exists() and new.is_dir()


def test_a_read_only_cache_is_a_clear_error_at_each_fetch(disk: Callable[[str], Path]) -> None:
    root = disk("ro,size=1m")
    cache = ArtifactCache(root / "cache")  # no error yet: a control plane starts, its models say why
    with pytest.raises(Unavailable, match=f"artifact cache {root / 'cache'}: Read-only file system"):
        cache.folder("a", Source().files(b"A" * 10), Source().download)
    assert cache.trim() == 0


@pytest.mark.parametrize("options, says", [("size=2m", "No space left on device: no room for model 'mlp'"),
                                           ("ro,size=1m", "Read-only file system")])
def test_a_cache_that_cannot_take_the_model_is_the_models_reason(
        serve: Callable[..., Server], s3_env: Weed, tmp_path: Path, disk: Callable[[str], Path], options: str,
        says: str) -> None:
    # the load answered "registry s3://...: [Errno 28] No space left on device", blaming the store; a
    # read-only cache folder stopped the control plane at its start with a traceback
    url = s3_env.url()
    folder = mlp_folder(tmp_path / "src")
    (folder / "1" / "vocab.bin").write_bytes(b"v" * 3 * MB)
    push(folder, url, s3_env.settings(), out=io.StringIO())
    cache = disk(options)
    server = serve(url, "--model-control-mode", "explicit", env={**s3_env.env, "DESPINA_CACHE_DIR": str(cache)})
    r = httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60)
    assert r.status_code == 503 and f"artifact cache {cache}: {says}" in r.json()["error"], r.text
    [row] = index(server.url)
    assert row["state"] == "UNAVAILABLE" and f"artifact cache {cache}: {says}" in row["reason"], row
    assert not (cache / "tmp").exists() or not any((cache / "tmp").iterdir())
    assert "Traceback" not in server.logs()
