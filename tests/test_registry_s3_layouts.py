"""S3 repositories laid out by other tools, against a real SeaweedFS: the folder markers (zero-byte keys
ending in '/') that the S3 console's "Create folder" and s3fs make, as folders and in a poll."""
from __future__ import annotations

import io
import uuid
from collections.abc import Callable
from pathlib import Path

from despina.control.repository import read_model
from despina.registry import ArtifactCache, LocalRegistry
from despina.registry.s3 import S3Registry
from despina.registry.transfer import push

from .conftest import Server
from .control_support import index, infer, mlp_folder, wait_until
from .seaweed import BUCKET, Weed

ENSEMBLE = """name: "pipe"
platform: "ensemble"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 256 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 10 ] } ]
ensemble_scheduling { step [ { model_name: "mlp" model_version: -1 input_map { key: "x" value: "x" }
  output_map { key: "y" value: "y" } } ] }
"""


def put(weed: Weed, root: str, layout: dict[str, bytes]) -> None:
    client = weed.client()
    for key, body in layout.items():
        client.put_object(Bucket=BUCKET, Key=f"{root}/{key}", Body=body)


def on_disk(root: Path, layout: dict[str, bytes]) -> LocalRegistry:
    """The same layout as a local repository: a marker is an empty folder."""
    for key, body in layout.items():
        if key.endswith("/"):
            (root / key).mkdir(parents=True, exist_ok=True)
        else:
            (root / key).parent.mkdir(parents=True, exist_ok=True)
            (root / key).write_bytes(body)
    return LocalRegistry(root)


def test_a_version_folder_made_by_a_folder_marker_is_a_version(s3_env: Weed, tmp_path: Path) -> None:
    """An ensemble's version folder holds nothing; in S3 the console's "Create folder" makes it a marker
    key ('pipe/2/'). Despina dropped markers, so the ensemble served version 1 (a request for version 2:
    404) where Triton's S3 (a directory is any key under 'pipe/2/', the marker too), and Despina on disk
    (an empty folder), serve version 2. Triton 2.51 on the same store took a marker-only '2/' of a
    Python model for its version 2 as well."""
    prefix = uuid.uuid4().hex[:10]
    layout = {"pipe/": b"", "pipe/config.pbtxt": ENSEMBLE.encode(), "pipe/2/": b"",
              "mlp/config.pbtxt": b'backend: "onnxruntime"', "mlp/1/model.onnx": b"x", "mlp/3/": b""}
    put(s3_env, prefix, layout)
    s3 = S3Registry(s3_env.url(prefix), s3_env.settings(), ArtifactCache(tmp_path / "cache"))
    local = on_disk(tmp_path / "repo", layout)
    scanned = s3.scan()
    for registry in (s3, local):
        assert registry.model("mlp").versions == [1, 3], registry
    assert scanned["pipe"].versions == [2]
    assert s3.model("pipe").versions == [2]
    entry = read_model(s3, scanned["pipe"])
    assert (entry.state, entry.versions, entry.available) == ("READY", (2,), (2,))


def test_a_poll_sees_an_empty_version_folder_come_and_go(serve: Callable[..., Server], s3_env: Weed,
                                                        tmp_path: Path) -> None:
    """Triton 2.51's poll loads an ensemble's version 2 once an empty '2/' is made, and serves version 1 again
    once it goes (held on a local repository: mkdir, rmdir). Despina's poll compared files alone: a folder
    holding none changed nothing, so version 2 never loaded, on disk or (as a marker) in S3."""
    url = s3_env.url()
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    push(mlp_folder(tmp_path / "src"), url, s3_env.settings(), out=io.StringIO())
    put(s3_env, prefix, {"pipe/config.pbtxt": ENSEMBLE.encode(), "pipe/1/": b""})
    server = serve(url, "--model-control-mode", "poll", "--repository-poll-secs", "0.3",
                   wait_models=("mlp", "pipe"), env={**s3_env.env, "DESPINA_CACHE_DIR": str(tmp_path / "cache")})

    def ready() -> list[str]:
        return [r["version"] for r in index(server.url, ready=True) if r["name"] == "pipe"]

    put(s3_env, prefix, {"pipe/2/": b""})
    wait_until(lambda: ready() == ["2"], 30, what="the ensemble's version 2 to serve")
    assert infer(server.url, "pipe", 2).status_code == 200
    s3_env.client().delete_object(Bucket=BUCKET, Key=f"{prefix}/pipe/2/")
    wait_until(lambda: ready() == ["1"], 30, what="version 1 to serve again")
    assert infer(server.url, "pipe", 1).status_code == 200


def test_push_keeps_an_ensembles_empty_version_folders(s3_env: Weed, tmp_path: Path) -> None:
    """An ensemble's folder on disk is its config and an empty version folder ('2/'); push uploaded files
    alone, so in S3 it had no version folder and served version 1 where the same folder on disk serves 2,
    and `push --version 3` of it made no version 3."""
    folder = tmp_path / "pipe"
    (folder / "2").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(ENSEMBLE)
    url = s3_env.url()
    registry = S3Registry(url, s3_env.settings(), ArtifactCache(tmp_path / "cache"))
    push(folder, url, s3_env.settings(), out=io.StringIO())
    assert registry.model("pipe").versions == LocalRegistry(tmp_path).model("pipe").versions == [2]
    push(folder, url, s3_env.settings(), version=3, out=io.StringIO())
    assert registry.model("pipe").versions == [2, 3]
    assert read_model(registry, registry.model("pipe")).versions == (3,)
