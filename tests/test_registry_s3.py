"""The S3 registry against a real SeaweedFS: push (multipart, verified), ls, the content-keyed cache."""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from despina.contract.errors import DespinaError, Unavailable
from despina.registry import ArtifactCache, open_registry
from despina.registry.s3 import S3Registry, etag_is_md5, expected_etag
from despina.registry.transfer import listing, plan, push

from .control_support import mlp_folder
from .seaweed import Weed


def test_push_then_ls_with_the_cli(s3_env: Weed, tmp_path: Path) -> None:
    folder = mlp_folder(tmp_path / "src")
    url = s3_env.url()
    env = {**os.environ, **s3_env.env}
    r = subprocess.run([sys.executable, "-m", "despina", "push", str(folder), url], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"pushed mlp version 1 to {url}/mlp" in r.stderr and "verified" in r.stderr
    r = subprocess.run([sys.executable, "-m", "despina", "push", str(folder / "1"), url, "--name", "mlp",
                        "--version", "3"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr  # a bare folder of model files becomes version 3
    r = subprocess.run([sys.executable, "-m", "despina", "ls", url], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:3] == ["mlp", "versions", "1,3"]


def test_push_goes_multipart_and_verifies_the_etags(s3_env: Weed, tmp_path: Path) -> None:
    folder = mlp_folder(tmp_path / "src")
    (folder / "1" / "weights.bin").write_bytes(os.urandom(11 * 1024 * 1024))
    settings = s3_env.settings(s3_part_mb=5)
    out = io.StringIO()
    landed = {f.path: f for f in push(folder, s3_env.url(), settings, version=2, out=out)}
    assert set(landed) == {"config.pbtxt", "2/model.onnx", "2/weights.bin"}
    assert landed["2/weights.bin"].etag.endswith("-3")  # three parts of 5 MiB, 5 MiB, 1 MiB
    assert landed["2/weights.bin"].etag == expected_etag(folder / "1" / "weights.bin", 5 * 1024 * 1024)
    assert "verified" in out.getvalue()


def test_push_order_puts_the_config_last(tmp_path: Path) -> None:
    folder = mlp_folder(tmp_path, versions={1: 0, 2: 1})
    (folder / "warmup").mkdir()
    (folder / "warmup" / "x.bin").write_bytes(b"\0")
    assert [p.path for p in plan(folder, None)] == ["1/model.onnx", "2/model.onnx", "warmup/x.bin",
                                                    "config.pbtxt"]
    assert [p.path for p in plan(folder, 7)] == ["7/model.onnx", "warmup/x.bin", "config.pbtxt"]


def test_push_refuses_a_version_below_0(tmp_path: Path) -> None:
    """A negative version is no folder name (version 0 is one: test_version_zero.py)."""
    version = -3
    folder = mlp_folder(tmp_path / "src")
    flat = folder / "1"
    registry = tmp_path / "registry"
    r = subprocess.run([sys.executable, "-m", "despina", "push", str(flat), str(registry), "--name", "mlp",
                        f"--version={version}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "numbered from 0" in r.stderr, r.stderr
    assert not registry.exists()
    with pytest.raises(DespinaError, match="numbered from 0"):
        plan(folder, version)


def test_push_refuses_a_version_of_more_than_18_digits(tmp_path: Path) -> None:
    """Registries skip such a version folder (no URL can name it): the push said the folder "holds no model
    files to push"."""
    folder = mlp_folder(tmp_path / "src")
    r = subprocess.run([sys.executable, "-m", "despina", "push", str(folder), str(tmp_path / "registry"),
                        f"--version={10**18}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "a version has at most 18 digits" in r.stderr, r.stderr
    assert [p.path for p in plan(folder, 10**18 - 1)] == [f"{10**18 - 1}/model.onnx", "config.pbtxt"]


def test_push_follows_a_symlinked_version_folder_and_refuses_a_broken_link(tmp_path: Path) -> None:
    """A version folder linked from a build's output was skipped (rglob does not follow links to folders):
    `push` said "pushed mlp version 1" without version 2, or "holds no model files" with it alone. A link
    to nothing was skipped as silently: the model went up without that file."""
    folder = mlp_folder(tmp_path / "src")
    build = mlp_folder(tmp_path / "build", versions={1: 3}) / "1"
    (folder / "2").symlink_to(build, target_is_directory=True)
    (folder / "loop").symlink_to(folder, target_is_directory=True)  # back to itself: not walked for ever
    registry = tmp_path / "registry"
    r = subprocess.run([sys.executable, "-m", "despina", "push", str(folder), str(registry)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "loop" in r.stderr and "links back" in r.stderr, r.stderr
    (folder / "loop").unlink()
    r = subprocess.run([sys.executable, "-m", "despina", "push", str(folder), str(registry)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pushed mlp version 1, 2" in r.stderr, r.stderr
    assert (registry / "mlp" / "2" / "model.onnx").read_bytes() == (build / "model.onnx").read_bytes()
    (folder / "1" / "weights.bin").symlink_to(tmp_path / "nothing")
    r = subprocess.run([sys.executable, "-m", "despina", "push", str(folder), str(registry)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "1/weights.bin" in r.stderr and "link to nothing" in r.stderr, r.stderr


def test_push_refuses_a_model_repository_for_a_model(s3_env: Weed, tmp_path: Path) -> None:
    """A repository's root (model folders, each with its config) was taken for a flat folder of model files:
    it went up as one model named after the root, version 1 holding every model's config and versions."""
    repo = tmp_path / "model_repository"
    mlp_folder(repo, "a")
    mlp_folder(repo, "b")
    url = s3_env.url()
    r = subprocess.run([sys.executable, "-m", "despina", "push", str(repo), url], capture_output=True,
                       text=True, env={**os.environ, **s3_env.env}, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"despina push: {repo} is a model repository (a/config.pbtxt)"), r.stderr
    assert open_registry(url, s3_env.settings()).scan() == {}


def test_push_of_a_config_that_is_not_utf8_says_so(tmp_path: Path) -> None:
    """A comment written by a Latin-1 editor made push end in a UnicodeDecodeError traceback. Such a comment
    is read now, as Triton reads it (test_control_repository.py); such a value is not."""
    folder = mlp_folder(tmp_path / "src")
    with (folder / "config.pbtxt").open("ab") as f:
        f.write(b'parameters { key: "k" value { string_value: "caf\xe9" } }\n')
    r = subprocess.run([sys.executable, "-m", "despina", "push", str(folder), str(tmp_path / "registry")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("despina push: model 'mlp': config.pbtxt is not UTF-8"), r.stderr
    assert not (tmp_path / "registry").exists()


def test_push_to_a_folder_it_cannot_write_says_so(tmp_path: Path) -> None:
    folder = mlp_folder(tmp_path / "src")
    (tmp_path / "registry").write_text("a file, not a folder")
    r = subprocess.run([sys.executable, "-m", "despina", "push", str(folder), str(tmp_path / "registry")],
                       capture_output=True, text=True, timeout=60)
    # as `despina ls` says it, before anything is uploaded (it began, then said "[Errno 20] Not a directory")
    assert r.returncode == 1 and r.stderr == f"despina push: model repository {tmp_path / 'registry'} is not a " \
        "folder\n", r.stderr
    r = subprocess.run([sys.executable, "-m", "despina", "push", str(folder), str(tmp_path / "new" / "registry")],
                       capture_output=True, text=True, timeout=60)  # one not made yet: the push makes it
    assert r.returncode == 0 and (tmp_path / "new" / "registry" / "mlp" / "config.pbtxt").is_file(), r.stderr


def test_the_cache_downloads_each_file_once(s3_env: Weed, tmp_path: Path) -> None:
    url = s3_env.url()
    push(mlp_folder(tmp_path / "src"), url, s3_env.settings(), out=io.StringIO())
    cache = ArtifactCache(tmp_path / "cache")
    registry = S3Registry(url, s3_env.settings(), cache)
    model = registry.model("mlp")
    first = registry.folder(model, [1])
    assert (first / "1" / "model.onnx").stat().st_size > 1_000_000
    assert cache.stats.downloads == 2
    assert registry.folder(registry.model("mlp"), [1]) == first           # a reload: nothing to fetch
    assert cache.stats.downloads == 2
    again = ArtifactCache(tmp_path / "cache")                               # another process, same disk
    assert S3Registry(url, s3_env.settings(), again).folder(model, [1]) == first
    assert again.stats.downloads == 0
    push(mlp_folder(tmp_path / "v2", versions={1: 5}), url, s3_env.settings(), version=2, out=io.StringIO())
    registry.folder(registry.model("mlp"), [2])
    assert cache.stats.downloads == 3                                       # only the new model.onnx


def test_a_file_changed_after_the_listing_is_never_half_loaded(s3_env: Weed, tmp_path: Path) -> None:
    url = s3_env.url()
    push(mlp_folder(tmp_path / "src"), url, s3_env.settings(), out=io.StringIO())
    cache = ArtifactCache(tmp_path / "cache")
    registry = S3Registry(url, s3_env.settings(), cache)
    stale = registry.model("mlp")
    bucket, key = url[5:].split("/", 1)
    s3_env.client().put_object(Bucket=bucket, Key=f"{key}/mlp/1/model.onnx", Body=b"replaced")
    with pytest.raises(DespinaError):
        registry.folder(stale, [1])
    assert not any((cache.models / "mlp").glob("*")) if (cache.models / "mlp").exists() else True
    assert not any(cache.tmp.iterdir())
    assert (registry.folder(registry.model("mlp"), [1]) / "1" / "model.onnx").read_bytes() == b"replaced"


def test_a_key_that_is_both_a_file_and_a_folder_is_the_models_fault_not_the_stores(s3_env: Weed,
                                                                                  tmp_path: Path) -> None:
    # keys 'mlp/1' and 'mlp/1/model.onnx' (an object store takes both) used to fail the cache's folder as
    # "registry ...: [Errno 17] File exists: .../cache/tmp/mlp-.../1", an Unavailable: the control plane
    # took it for the store failing and tried again at every look
    url = s3_env.url()
    push(mlp_folder(tmp_path / "src"), url, s3_env.settings(), out=io.StringIO())
    bucket, key = url[5:].split("/", 1)
    s3_env.client().put_object(Bucket=bucket, Key=f"{key}/mlp/1", Body=b"a file named like the folder")
    registry = S3Registry(url, s3_env.settings(), ArtifactCache(tmp_path / "cache"))
    with pytest.raises(DespinaError, match="model 'mlp': '1' is both a file and a folder in the registry") as info:
        registry.folder(registry.model("mlp"), [1])
    assert not isinstance(info.value, Unavailable)
    assert not any((tmp_path / "cache" / "tmp").iterdir())


def test_an_unreachable_store_is_a_clear_error(tmp_path: Path, s3_env: Weed) -> None:
    from despina.embedded import free_port

    settings = s3_env.settings(s3_endpoint_url=f"http://127.0.0.1:{free_port()}")
    registry = open_registry("s3://models/nowhere", settings, ArtifactCache(tmp_path))
    started = time.monotonic()
    with pytest.raises(Unavailable, match="s3://models/nowhere is unreachable"):
        registry.scan()
    assert time.monotonic() - started < 15
    out = io.StringIO()
    assert listing(s3_env.url(), s3_env.settings(), out) == 0 and "no models" in out.getvalue()


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_models_files_are_put_and_deleted_one_by_one(kind: str, s3_env: Weed, tmp_path: Path) -> None:
    # what `despina push` uses for a renamed model's config, and to remove files a new push replaces
    # (registry/transfer.py)
    url = s3_env.url() if kind == "s3" else str(tmp_path / "repo")
    if kind == "local":
        (tmp_path / "repo").mkdir()
    registry = open_registry(url, s3_env.settings(), ArtifactCache(tmp_path / "cache"))
    assert registry.scan_one("m") is None or not registry.scan_one("m").files  # type: ignore[union-attr]
    registry.put("m", "config.pbtxt", b"max_batch_size: 4")
    registry.put("m", "1/sub/model.onnx", b"onnx")
    assert sorted(f.path for f in registry.model("m").files) == ["1/sub/model.onnx", "config.pbtxt"]
    registry.delete("m", "1/sub/model.onnx")
    registry.delete("m", "1/sub/model.onnx")  # nothing there: nothing happens
    assert [f.path for f in registry.model("m").files] == ["config.pbtxt"]
    registry.delete("m", "config.pbtxt")
    assert registry.scan_one("m") is None or not registry.scan_one("m").files  # type: ignore[union-attr]
    if kind == "local":
        assert not (tmp_path / "repo" / "m").exists()  # the folders it left empty go too
    with pytest.raises(DespinaError):
        registry.put("m", "../escape", b"")


@pytest.mark.parametrize("url", ["s3://", "s3://store:http/prod", "s3://my models/prod"])
def test_a_malformed_s3_repository_is_refused_at_start(url: str, redis_url: str, key_prefix: str) -> None:
    # a URL that names no bucket ended in a traceback; Triton's s3://host:port/bucket form is taken
    # (test_registry_s3_urls.py), one whose port is no number is refused, not retried as unreachable
    r = subprocess.run([sys.executable, "-m", "despina", "serve", "--model-repository", url, "--redis-url",
                        redis_url, "--key-prefix", key_prefix, "--http-port", "22101"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith(f"despina serve: DESPINA_MODEL_REPOSITORY (or --model-repository): {url}"
                               if url != "s3://" else "despina serve: DESPINA_MODEL_REPOSITORY"), r.stderr


def test_an_etag_is_taken_for_an_md5_only_where_s3_makes_it_one() -> None:
    """S3 documents an object's ETag as its bytes' MD5 only for a single-part upload stored plainly or
    with SSE-S3; under SSE-KMS (the default encryption of many buckets) or SSE-C it is not. Every file of
    such a bucket failed its download ("the downloaded bytes do not match the ETag"), and every push its
    check: no model in such a bucket could load. SeaweedFS encrypts nothing, so the rule is tested alone."""
    md5 = "0123456789abcdef0123456789abcdef"
    assert etag_is_md5(md5, {})
    assert etag_is_md5(md5, {"ServerSideEncryption": "AES256"})
    assert not etag_is_md5(md5, {"ServerSideEncryption": "aws:kms"})
    assert not etag_is_md5(md5, {"ServerSideEncryption": "aws:kms:dsse"})
    assert not etag_is_md5(md5, {"SSECustomerAlgorithm": "AES256"})
    assert not etag_is_md5(f"{md5}-3", {})  # multipart



@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_version_pushed_again_holds_only_what_was_pushed(kind: str, s3_env: Weed, tmp_path: Path) -> None:
    """A file removed or renamed locally stayed in the registry's copy of the version when it was pushed
    again (a stale module beside a Python model, an old checkpoint shard). The version folders and shared
    folders a push brings now hold what it brings; other versions and other files stay."""
    url = s3_env.url() if kind == "s3" else str(tmp_path / "repo")
    if kind == "local":
        (tmp_path / "repo").mkdir()
    folder = mlp_folder(tmp_path / "src", versions={1: 0, 2: 1})
    (folder / "2" / "old.bin").write_bytes(b"old")
    (folder / "warmup").mkdir()
    (folder / "warmup" / "a.bin").write_bytes(b"\0")
    (folder / "labels.txt").write_text("a\n")
    settings = s3_env.settings()
    push(folder, url, settings, out=io.StringIO())
    (folder / "2" / "old.bin").unlink()
    (folder / "2" / "new.bin").write_bytes(b"new")
    (folder / "warmup" / "a.bin").rename(folder / "warmup" / "b.bin")
    out = io.StringIO()
    push(folder, url, settings, out=out)
    registry = open_registry(url, settings, ArtifactCache(tmp_path / "cache"))
    assert sorted(f.path for f in registry.model("mlp").files) == [
        "1/model.onnx", "2/model.onnx", "2/new.bin", "config.pbtxt", "labels.txt", "warmup/b.bin"]
    assert "removed 2 file(s) of mlp no longer in" in out.getvalue() and "2/old.bin" in out.getvalue()
    # a push of one version leaves the others as they are
    (folder / "1" / "model.onnx").rename(folder / "1" / "renamed.onnx")
    shutil.rmtree(folder / "2")
    push(folder, url, settings, out=io.StringIO())
    assert sorted(f.path for f in registry.model("mlp").files) == [
        "1/renamed.onnx", "2/model.onnx", "2/new.bin", "config.pbtxt", "labels.txt", "warmup/b.bin"]
