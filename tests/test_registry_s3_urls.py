"""The S3 repository URLs and AWS variables Triton takes, against a real SeaweedFS: the store named in the
URL (s3://host:port/bucket/path, with http:// or https://), slashes as Triton cleans them, a bucket's root,
AWS_REGION and TRITON_AWS_MOUNT_DIRECTORY."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from despina.contract.errors import InvalidArgument
from despina.registry import ArtifactCache, open_model_registry, open_registry
from despina.registry.s3 import S3Registry, parse_url
from despina.registry.transfer import push
from despina.settings import Settings

from .control_support import mlp_folder
from .seaweed import Weed


@pytest.fixture
def no_endpoint(s3_env: Weed, monkeypatch: pytest.MonkeyPatch) -> str:
    """The store's keys in the environment but not its address: only a URL naming it reaches it. Returns
    its host:port."""
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    return s3_env.endpoint.removeprefix("http://")


def test_a_url_naming_the_store_reaches_it_as_tritons_does(s3_env: Weed, no_endpoint: str,
                                                            tmp_path: Path) -> None:
    """Triton's s3://host:port/bucket/path (plain HTTP) and s3://http://host:port/... were refused at start
    ("give s3://bucket/prefix, and the store's address in DESPINA_S3_ENDPOINT_URL"): a Triton deployment's
    --model-repository did not start Despina. Checked against Triton's core/src/filesystem/implementations/
    s3.h: its regex s3://(http://|https://|)host:port/bucket/path, HTTP unless https:// is given, and
    CleanPath dropping leading, doubled and trailing slashes."""
    prefix = uuid.uuid4().hex[:10]
    push(mlp_folder(tmp_path / "src"), s3_env.url(prefix), s3_env.settings(), out=io.StringIO())
    canonical = f"s3://{no_endpoint}/models/{prefix}"
    for url in (canonical, f"s3://http://{no_endpoint}/models/{prefix}/",
                f"s3://{no_endpoint}//models//{prefix}//"):
        registry = open_registry(url, Settings(), ArtifactCache(tmp_path / "cache"))
        assert registry.url == (canonical if "http://" not in url else f"s3://http://{no_endpoint}/models/{prefix}")
        model = registry.model("mlp")
        # a worker opens the model's own URL (the catalog's path): the store must come with it
        again, name = open_model_registry(model.url, Settings(), ArtifactCache(tmp_path / "cache"))
        assert name == "mlp" and again.url == registry.url
        assert (again.folder(model, [1]) / "1" / "model.onnx").stat().st_size > 1_000_000
    assert parse_url(f"s3://https://{no_endpoint}/models/x").endpoint == f"https://{no_endpoint}"
    assert parse_url("s3://https://store.example/models").endpoint == "https://store.example"
    assert parse_url("s3://[fd00::7]:9000/models/a/b").endpoint == "http://[fd00::7]:9000"
    assert parse_url("s3:///models//a/").url == "s3://models/a"  # Triton's CleanPath: leading slashes too


def test_a_buckets_root_is_a_repository(s3_env: Weed, tmp_path: Path) -> None:
    bucket = f"root-{uuid.uuid4().hex[:8]}"
    s3_env.client().create_bucket(Bucket=bucket)
    push(mlp_folder(tmp_path / "src"), f"s3://{bucket}", s3_env.settings(), out=io.StringIO())
    for url in (f"s3://{bucket}", f"s3://{bucket}/", f"s3://{bucket}//"):
        registry = open_registry(url, s3_env.settings(), ArtifactCache(tmp_path / "cache"))
        assert registry.url == f"s3://{bucket}" and list(registry.scan()) == ["mlp"]
        assert registry.names() == ["mlp"]
        assert (registry.folder(registry.model("mlp"), [1]) / "config.pbtxt").is_file()


@pytest.mark.parametrize("url, why", [
    ("s3://", "S3 URL without a bucket"),
    ("s3://127.0.0.1:8333/", "S3 URL without a bucket"),
    ("s3://store:http/models", "'store:http' is not a store's host:port"),
    ("s3://store:99999/models", "'store:99999' is not a store's host:port"),
    ("s3://my models/prod", "'my models' is not a bucket name")])
def test_a_malformed_url_says_what_is_wrong(url: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        parse_url(url)


def test_aws_region_is_the_stores_region_as_other_aws_sdks_read_it(s3_env: Weed, tmp_path: Path) -> None:
    """boto3 reads AWS_DEFAULT_REGION only: a deployment setting AWS_REGION (Lambda, ECS, the AWS CLI v2,
    the other SDKs set or read it) signed for us-east-1, which a bucket elsewhere refuses."""
    settings = Settings.from_sources({}, {"AWS_REGION": "eu-west-3"})
    assert settings.s3_region == "eu-west-3"
    assert S3Registry(s3_env.url(), settings).client.meta.region_name == "eu-west-3"
    assert Settings.from_sources({}, {"AWS_REGION": "eu-west-3", "DESPINA_S3_REGION": "ap-south-1"}
                                 ).s3_region == "ap-south-1"


def test_triton_aws_mount_directory_holds_the_fetched_files(s3_env: Weed, tmp_path: Path) -> None:
    """Triton copies a remote repository's models into TRITON_AWS_MOUNT_DIRECTORY (often a volume mounted
    for them); Despina's cache ignored it and filled ~/.cache on the container's own disk."""
    mount = tmp_path / "mount"
    mount.mkdir()
    url = s3_env.url()
    push(mlp_folder(tmp_path / "src"), url, s3_env.settings(), out=io.StringIO())
    settings = Settings.from_sources({}, {**s3_env.env, "TRITON_AWS_MOUNT_DIRECTORY": str(mount)})
    registry = S3Registry(url, settings.with_(s3_endpoint_url=s3_env.endpoint))
    folder = registry.folder(registry.model("mlp"), [1])
    assert folder.is_relative_to(mount) and (folder / "1" / "model.onnx").is_file()
    assert Settings.from_sources({}, {"TRITON_AWS_MOUNT_DIRECTORY": str(mount),
                                      "DESPINA_CACHE_DIR": str(tmp_path / "own")}).cache_dir == str(tmp_path / "own")


def test_ls_takes_tritons_url_form(s3_env: Weed, no_endpoint: str, tmp_path: Path) -> None:
    """`despina ls` (and serve, which checks the URL as it does) take Triton's form end to end."""
    url = f"s3://{no_endpoint}/models/{uuid.uuid4().hex[:10]}"
    push(mlp_folder(tmp_path / "src"), url, Settings(), out=io.StringIO())
    r = subprocess.run([sys.executable, "-m", "despina", "ls", url], capture_output=True, text=True,
                       env=dict(os.environ), timeout=60)  # the fixture took the endpoint's variables out
    assert r.returncode == 0 and r.stdout.split()[:3] == ["mlp", "versions", "1"], r.stderr
