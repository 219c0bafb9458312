"""Large files and files replaced in S3, against a real SeaweedFS: multipart downloads through the cache, a
version whose files change in place (same version number) reloaded in poll mode from the new bytes, never
from the cache's copy of the old ones. Triton re-downloads a model's folder at each load; Despina's cache
is keyed by ETag and size, so a changed object is a new blob and an unchanged one is not fetched twice."""
from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from despina.contract.errors import FailedPrecondition
from despina.registry import ArtifactCache
from despina.registry.s3 import S3Registry
from despina.registry.transfer import push

from .conftest import Server
from .control_support import expected, infer, mlp_folder, wait_until
from .seaweed import Weed

MB = 1024 * 1024


def test_a_large_file_downloads_in_parts_and_a_replaced_one_is_fetched_anew(s3_env: Weed, tmp_path: Path) -> None:
    url = s3_env.url()
    settings = s3_env.settings(s3_part_mb=5)
    folder = mlp_folder(tmp_path / "src")
    weights = os.urandom(11 * MB + 123)
    (folder / "1" / "weights.bin").write_bytes(weights)
    push(folder, url, settings, out=io.StringIO())
    cache = ArtifactCache(tmp_path / "cache")
    registry = S3Registry(url, settings, cache)
    old = registry.model("mlp")
    assert next(f for f in old.files if f.path == "1/weights.bin").etag.endswith("-3")  # multipart
    local = registry.folder(old, [1])
    assert hashlib.md5((local / "1" / "weights.bin").read_bytes()).digest() == hashlib.md5(weights).digest()

    # the same version's file replaced in place, same size: a new ETag, so a new blob, never the old copy
    changed = os.urandom(len(weights))
    (folder / "1" / "weights.bin").write_bytes(changed)
    push(folder, url, settings, out=io.StringIO())
    with pytest.raises(FailedPrecondition):  # a listing from before the change fetches nothing mixed
        S3Registry(url, settings, ArtifactCache(tmp_path / "other")).folder(old, [1])
    assert not any((tmp_path / "other" / "tmp").iterdir())
    new = registry.folder(registry.model("mlp"), [1])
    assert new != local and (new / "1" / "weights.bin").read_bytes() == changed
    assert (local / "1" / "weights.bin").read_bytes() == weights   # a loaded model's files are never rewritten


def test_poll_reloads_a_version_replaced_in_place(serve: Callable[..., Server], s3_env: Weed,
                                                  tmp_path: Path) -> None:
    url = s3_env.url()
    push(mlp_folder(tmp_path / "v1"), url, s3_env.settings(), out=io.StringIO())
    server = serve(url, "--model-control-mode", "poll", "--repository-poll-secs", "0.3", wait_models=("mlp",),
                   env={**s3_env.env, "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    assert np.allclose(infer(server.url).json()["outputs"][0]["data"], expected(0), atol=1e-4)
    push(mlp_folder(tmp_path / "v2", versions={1: 1}), url, s3_env.settings(), out=io.StringIO())

    def answers_new() -> bool:
        r = infer(server.url)
        return r.status_code == 200 and np.allclose(r.json()["outputs"][0]["data"], expected(1), atol=1e-4)

    wait_until(answers_new, 30, what="version 1's new weights to serve")
    assert infer(server.url).json()["model_version"] == "1"
