"""The artifact cache on disk: content-keyed blobs, model folders of hard links, and eviction of what
was used least recently once it holds more than its limit. Files come from a local source here (the
S3 tests fetch them from SeaweedFS); "an hour ago" is set on the files' own clocks (mtime), which is
what the cache reads."""
from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from despina.contract.errors import DespinaError, InvalidArgument
from despina.registry.base import FileInfo
from despina.registry.cache import ArtifactCache

CONFIG = b'backend: "onnxruntime"\n' * 4          # the same bytes in every model: one blob for all
HOUR_AGO = time.time() - 3600


class Source:
    """A registry stand-in: files by content, counting what is fetched."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.fetched = 0

    def files(self, weights: bytes) -> list[FileInfo]:
        out = []
        for path, data in (("config.pbtxt", CONFIG), ("1/model.onnx", weights)):
            etag = hashlib.md5(data).hexdigest()
            self.blobs[etag] = data
            out.append(FileInfo(path, len(data), etag))
        return out

    def download(self, f: FileInfo, dest: Path) -> None:
        self.fetched += 1
        dest.write_bytes(self.blobs[f.etag])


def last_used(folder: Path, when: float) -> None:
    """As if the folder (and so its files, hard links to the blobs) was last used at `when`."""
    for path in [folder, *folder.rglob("*")]:
        os.utime(path, (when, when))


def blob_count(cache: ArtifactCache) -> int:
    return sum(1 for _ in cache.blobs.glob("*/*"))


def test_a_full_cache_evicts_the_folders_used_least_recently_and_their_own_blobs(tmp_path: Path) -> None:
    source = Source()
    cache = ArtifactCache(tmp_path / "cache", max_bytes=2 * 1000 + len(CONFIG) + 50)
    a = cache.folder("a", source.files(b"A" * 1000), source.download)
    b = cache.folder("b", source.files(b"B" * 1000), source.download)
    assert blob_count(cache) == 3 and cache.usage() == 2000 + len(CONFIG)  # the config once for both
    last_used(a, HOUR_AGO)
    c = cache.folder("c", source.files(b"C" * 1000), source.download)      # over the limit: a goes
    assert not a.exists() and not a.parent.exists() and b.is_dir() and c.is_dir()
    assert blob_count(cache) == 3 and cache.usage() == 2000 + len(CONFIG)  # A's weights went, not the config
    assert (b / "config.pbtxt").read_bytes() == CONFIG and (c / "1/model.onnx").read_bytes() == b"C" * 1000
    assert cache.stats.evicted_folders == 1 and cache.stats.evicted_bytes == 1000
    fetched = source.fetched
    assert cache.folder("a", source.files(b"A" * 1000), source.download).is_dir()
    assert source.fetched == fetched + 1                                     # the weights again, not the config


def test_folders_in_use_stay_over_the_limit_and_the_cache_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = Source()
    cache = ArtifactCache(tmp_path / "cache", max_bytes=500)
    with caplog.at_level(logging.WARNING, "despina.registry"):
        a = cache.folder("a", source.files(b"A" * 1000), source.download)
    assert a.is_dir() and cache.usage() > 500                                # used just now: in use
    assert "over its limit" in caplog.text and "all of it in use" in caplog.text
    last_used(a, HOUR_AGO)
    assert cache.trim() == 1000 + len(CONFIG)
    assert not a.exists() and cache.usage() == 0 and blob_count(cache) == 0


def test_a_folder_read_again_is_used_again(tmp_path: Path) -> None:
    """Reading a cached folder (a reload, another worker) counts as a use: it is not the one evicted."""
    source = Source()
    cache = ArtifactCache(tmp_path / "cache", max_bytes=2 * 1000 + len(CONFIG) + 50)
    a = cache.folder("a", source.files(b"A" * 1000), source.download)
    b = cache.folder("b", source.files(b"B" * 1000), source.download)
    last_used(a, HOUR_AGO)
    last_used(b, HOUR_AGO + 60)
    assert cache.folder("a", source.files(b"A" * 1000), source.download) == a  # a is read again
    cache.folder("c", source.files(b"C" * 1000), source.download)
    assert a.is_dir() and not b.exists()


def test_no_limit_keeps_everything(tmp_path: Path) -> None:
    source = Source()
    cache = ArtifactCache(tmp_path / "cache", max_bytes=0)
    a = cache.folder("a", source.files(b"A" * 1000), source.download)
    last_used(a, HOUR_AGO)
    cache.folder("b", source.files(b"B" * 1000), source.download)
    assert cache.trim() == 0 and a.is_dir()


def test_a_blob_evicted_between_its_look_up_and_its_link_is_fetched_again(tmp_path: Path) -> None:
    """Another process's trim may remove a cached blob after this one found it and before it linked
    it: the folder is still built, whole, with the blob fetched again."""
    class Racing(ArtifactCache):
        raced = False

        def blob(self, f: FileInfo, download: Callable[[FileInfo, Path], None]) -> Path:
            path = super().blob(f, download)
            if f.size == 1000 and not self.raced:   # A's weights, the first time
                self.raced = True
                path.unlink()                       # the other process's trim, at the worst moment
            return path

    source = Source()
    cache = Racing(tmp_path / "cache")
    cache.folder("warm", source.files(b"W" * 100), source.download)     # the config blob is cached
    fetched = source.fetched
    folder = cache.folder("a", source.files(b"A" * 1000), source.download)
    assert (folder / "1" / "model.onnx").read_bytes() == b"A" * 1000
    assert (folder / "config.pbtxt").read_bytes() == CONFIG
    assert cache.raced and source.fetched == fetched + 2     # A's weights twice; the config reused


@pytest.mark.parametrize("path", ["/{outside}/model.onnx", "1/../../../../../outside/model.onnx"])
def test_a_file_path_that_leaves_the_folder_is_refused(tmp_path: Path, path: str) -> None:
    """An object store keeps a key as written: `prod/mlp//model.onnx` (a doubled slash) lists as the file
    '/model.onnx', which the cache linked at the root of the file system, outside the folder it built."""
    outside = tmp_path / "outside"
    source = Source()
    files = [FileInfo(path.format(outside=outside), 4, "e" * 32)]
    source.blobs["e" * 32] = b"onnx"
    with pytest.raises(DespinaError, match="invalid file path"):
        ArtifactCache(tmp_path / "cache" / "deep").folder("a", files, source.download)
    assert not outside.exists() and source.fetched == 0
    assert not any((tmp_path / "cache" / "deep" / "tmp").iterdir())


@pytest.mark.parametrize("max_bytes", [10**9, 0])
def test_what_a_killed_fetch_left_half_done_is_removed_and_nothing_in_progress(tmp_path: Path,
                                                                             max_bytes: int) -> None:
    # a worker killed mid-download (OOM, SIGKILL) left its part file and its folder being built in tmp/
    # for ever, uncounted by the limit; a download in progress writes to its part file all along
    source = Source()
    cache = ArtifactCache(tmp_path / "cache", max_bytes=max_bytes)
    part = cache.tmp / "0123.abcd.part"
    part.write_bytes(b"x" * 5000)
    building = cache.tmp / "other-abcd" / "1"
    building.mkdir(parents=True)
    (building / "model.onnx").write_bytes(b"y" * 3000)
    for path in (part, building / "model.onnx", building, building.parent):
        os.utime(path, (HOUR_AGO, HOUR_AGO))
    seen: list[list[str]] = []

    def download(f: FileInfo, dest: Path) -> None:
        seen.append(sorted(p.name for p in cache.tmp.iterdir()))
        source.download(f, dest)
        cache.trim()  # another process's trim, while this download is under way

    folder = cache.folder("mlp", source.files(b"W" * 100), download)
    assert (folder / "1" / "model.onnx").read_bytes() == b"W" * 100
    assert not any(cache.tmp.iterdir())
    assert all(not name.startswith("mlp-") for names in seen for name in names)  # no folder while fetching


def test_two_processes_fetching_one_version_download_each_file_once(tmp_path: Path) -> None:
    # workers on one machine loading the same model each downloaded every file (N workers, N times the
    # bytes, on the network and at once on disk); one now waits for the other and takes its blobs
    import threading

    source = Source()
    files = source.files(b"W" * 100_000)
    started = threading.Event()

    def slow(f: FileInfo, dest: Path) -> None:
        started.set()
        time.sleep(0.5)  # a download under way while the other one asks
        source.download(f, dest)

    first, second = ArtifactCache(tmp_path / "cache"), ArtifactCache(tmp_path / "cache")  # two processes' views
    folders: list[Path] = []
    thread = threading.Thread(target=lambda: folders.append(first.folder("mlp", files, slow)))
    thread.start()
    started.wait(10)
    folders.append(second.folder("mlp", files, slow))
    thread.join(30)
    assert folders[0] == folders[1] and (folders[0] / "1" / "model.onnx").read_bytes() == b"W" * 100_000
    assert source.fetched == 2, source.fetched  # config.pbtxt and model.onnx, once each
    assert not any(first.tmp.iterdir())


def test_a_folder_taken_while_another_process_evicts_it_is_whole(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # a trim removed an old folder where it stood: a process taking that folder meanwhile (a model
    # scaled back from zero, on the worker beside) was handed it, and its files went a moment later
    import shutil
    import threading

    source = Source()
    files = source.files(b"W" * 1000)
    trimmer, taker = ArtifactCache(tmp_path / "cache", max_bytes=1), ArtifactCache(tmp_path / "cache")
    last_used(trimmer.folder("mlp", files, source.download), HOUR_AGO)
    removing, resume = threading.Event(), threading.Event()
    rmtree = shutil.rmtree

    def slow_rmtree(path: Path, *args: object, **kw: object) -> None:
        if not removing.is_set():  # the eviction's removal, held open while the other process looks
            removing.set()
            resume.wait(10)
        rmtree(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    trimming = threading.Thread(target=trimmer.trim)
    trimming.start()
    assert removing.wait(10)
    taken = taker.folder("mlp", files, source.download)
    resume.set()
    trimming.join(10)
    assert (taken / "1" / "model.onnx").read_bytes() == b"W" * 1000
    assert (taken / "config.pbtxt").read_bytes() == CONFIG


def test_a_folder_evicted_for_room_without_a_limit_says_so_not_of_0_mb(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With no limit (DESPINA_CACHE_MAX_GB=0) only a full disk evicts; the log line said '... of 0.0 MB used'."""
    source = Source()
    cache = ArtifactCache(tmp_path / "cache", max_bytes=0)
    a = cache.folder("a", source.files(b"A" * 1000), source.download)
    last_used(a, HOUR_AGO)
    with caplog.at_level(logging.INFO, "despina.registry"):
        assert not cache.make_room(1 << 62)  # more than any disk has: everything unused goes, then no room
    assert not a.exists()
    evicted = [r.getMessage() for r in caplog.records if "evicted a/" in r.getMessage()]
    assert len(evicted) == 1 and evicted[0].endswith("0.0 MB used, no limit set: evicted for room on a full disk")


def test_a_file_name_longer_than_the_disk_takes_is_the_models_fault(tmp_path: Path) -> None:
    """S3 takes a key of 1,024 bytes, a file system a name of 255: the link into the folder failed with
    ENAMETOOLONG, which the S3 registry passed on as the store being unavailable (503), and a worker waited
    for the store to come back, for ever. Said as the model's fault (as a local registry says it), before
    anything is downloaded."""
    source = Source()
    files = source.files(b"onnx") + [FileInfo("1/" + "n" * 300 + ".json", 4, "e" * 32)]
    source.blobs["e" * 32] = b"{}\n\n"
    with pytest.raises(InvalidArgument, match=r"model 'a': '1/n{300}\.json' cannot be a file of the model "
                                              r"on this disk: a name longer than 255 bytes"):
        ArtifactCache(tmp_path / "cache").folder("a", files, source.download)
    assert source.fetched == 0
