"""A model repository in an S3-compatible object store, through boto3.

Credentials come from boto3's usual chain (environment, ~/.aws, instance roles); the endpoint from
the settings, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (boto3 reads them), else AWS itself.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract.errors import DespinaError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from ..settings import Settings
from .base import FileInfo, ModelFiles, Progress, Registry, check_relative
from .cache import ArtifactCache

MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")


def etag_is_md5(etag: str, response: Any) -> bool:
    """Whether an object's ETag is the MD5 of its bytes, as S3 documents it: one uploaded in a single
    part, and encrypted (if at all) with SSE-S3; under SSE-KMS or SSE-C it is no digest of the bytes."""
    encryption = str(response.get("ServerSideEncryption") or "")
    return MD5_ETAG.match(etag) is not None and not encryption.startswith("aws:kms") \
        and not response.get("SSECustomerAlgorithm")


# Triton's s3://[http://|https://]host:port/bucket/path names the store in the URL; a bucket name has no colon
ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[0-9A-Za-z.-]+)(?::([0-9]{1,5}))?")
BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")  # botocore's rule (AWS's own is narrower: 3-63, lowercase)


@dataclass(frozen=True)
class S3Location:
    """Where a registry lives: a bucket, a prefix in it, and the store's address when the URL names one."""

    bucket: str
    prefix: str              # without slashes at either end; "" for the bucket's root
    address: str = ""        # as the URL wrote it: "host:port", "https://host:port"; "" when it names none

    @property
    def endpoint(self) -> str | None:
        """The address as boto3 takes it: Triton speaks plain HTTP to a store named without a scheme."""
        if not self.address:
            return None
        return self.address if "://" in self.address else f"http://{self.address}"

    @property
    def url(self) -> str:
        return "s3://" + "/".join(p for p in (self.address, self.bucket, self.prefix) if p)


def parse_url(url: str) -> S3Location:
    """Triton's forms: s3://bucket/path, s3://host:port/bucket/path, s3://http(s)://host:port/bucket/path.
    Empty segments go, as Triton's: leading, doubled and trailing slashes read as one or none."""
    if not url.startswith("s3://"):
        raise InvalidArgument(f"not an S3 URL: {url}")
    rest, scheme = url[5:], ""
    for prefix in ("https://", "http://"):
        if rest.startswith(prefix):
            rest, scheme = rest[len(prefix):], prefix
    parts = [p for p in rest.split("/") if p]
    address = ""
    if parts and (scheme or ":" in parts[0]):
        address = parts.pop(0)
        found = ADDRESS.fullmatch(address)
        if found is None or not (scheme or found[2]) or (found[2] and not 0 < int(found[2]) < 65536):
            raise InvalidArgument(f"{url}: '{address}' is not a store's host:port (Triton's "
                                  "s3://host:port/bucket/path, or s3://https://host:port/bucket/path)")
    if not parts:
        raise InvalidArgument(f"S3 URL without a bucket: {url}")
    if not BUCKET.fullmatch(parts[0]):
        raise InvalidArgument(f"{url}: '{parts[0]}' is not a bucket name (letters, digits, '.', '-', '_')")
    return S3Location(parts[0], "/".join(parts[1:]), scheme + address)


def client(settings: Settings, endpoint: str | None = None) -> Any:
    """A boto3 S3 client: to `endpoint` (the URL's own), else the settings', else boto3's."""
    import boto3
    from botocore.config import Config

    for name in ("botocore", "boto3", "s3transfer"):  # their INFO lines ("Found credentials ...") are noise
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    endpoint = endpoint or settings.s3_endpoint_url or None
    style = settings.s3_addressing_style
    if style == "auto" and (endpoint or os.environ.get("AWS_ENDPOINT_URL_S3")
                            or os.environ.get("AWS_ENDPOINT_URL")):
        style = "path"  # S3-compatible stores (SeaweedFS, MinIO, Ceph) rarely have per-bucket DNS names
    config = Config(s3={"addressing_style": style}, connect_timeout=3, read_timeout=60,
                    retries={"max_attempts": 3, "mode": "standard"})
    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=settings.s3_region or None,
                                          config=config)


def transfer_config(settings: Settings) -> Any:
    from boto3.s3.transfer import TransferConfig

    part = max(5, settings.s3_part_mb) * 1024 * 1024  # S3's smallest part is 5 MiB
    return TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=4)


def registry_error(url: str, exc: Exception) -> DespinaError:
    """A boto3 failure as a domain error that says which registry and what went wrong."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        message = exc.response.get("Error", {}).get("Message", "") or str(exc)
        if code in ("NoSuchBucket", "NoSuchKey", "404"):
            return NotFound(f"registry {url}: {code}: {message}")
        if code in ("PreconditionFailed", "412"):  # If-Match: the file changed since it was listed
            return FailedPrecondition(f"registry {url}: a file changed since it was listed ({code}); the "
                                      "next look at the registry sees the new one")
        # refused (AccessDenied, SignatureDoesNotMatch, an expired token) or failing (InternalError,
        # SlowDown): the store's or the deployment's fault, not the caller's, and it may pass
        return Unavailable(f"registry {url}: {code}: {message}")
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return Unavailable(f"registry {url}: {exc} (boto3 reads AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                           "~/.aws/credentials, or an instance role)")
    if isinstance(exc, ConnectionError):
        return Unavailable(f"registry {url} is unreachable: {exc}")
    if isinstance(exc, BotoCoreError):
        return Unavailable(f"registry {url}: {exc}")
    return Unavailable(f"registry {url}: {exc}")


class S3Registry(Registry):
    remote = True

    def __init__(self, url: str, settings: Settings, cache: ArtifactCache | None = None) -> None:
        location = parse_url(url)
        self.bucket, self.prefix, self.url = location.bucket, location.prefix, location.url
        self.settings = settings
        self.client = client(settings, location.endpoint)
        self.transfer = transfer_config(settings)
        self._cache = cache

    @property
    def cache(self) -> ArtifactCache:
        if self._cache is None:
            self._cache = ArtifactCache.from_settings(self.settings)
        return self._cache

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                yield from page.get("Contents", ())
        except DespinaError:
            raise
        except Exception as exc:
            raise registry_error(self.url, exc) from None

    def names(self) -> list[str]:
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key("") + "/" if self.prefix else "", Delimiter="/")
            found = [p["Prefix"].rstrip("/").rsplit("/", 1)[-1]
                     for page in pages for p in page.get("CommonPrefixes", ())]
        except Exception as exc:
            raise registry_error(self.url, exc) from None
        return sorted(n for n in found if n and not n.startswith("."))

    def scan(self) -> dict[str, ModelFiles]:
        root = self._key("") + "/" if self.prefix else ""
        grouped: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for obj in self._objects(root):
            name, _, path = obj["Key"][len(root):].partition("/")
            if path and not name.startswith("."):  # else a model folder's own marker, or a file beside them
                grouped.setdefault(name, []).append((path, obj))
        found = {n: self._model(n, listed) for n, listed in sorted(grouped.items())}
        return {n: m for n, m in found.items() if m is not None}

    def scan_one(self, name: str) -> ModelFiles | None:
        root = self._key(name) + "/"
        return self._model(name, [(obj["Key"][len(root):], obj) for obj in self._objects(root)])

    def _model(self, name: str, listed: Iterable[tuple[str, dict[str, Any]]]) -> ModelFiles | None:
        """A model folder from its keys (paths inside it): its files, and its top folders, a marker's
        ('2/', S3 console's "Create folder") too: an empty version folder (an ensemble's) is a version, as
        in Triton's S3 and on disk. None when it holds no file."""
        files, folders = [], set()
        for path, obj in listed:
            if "/" in path:
                folders.add(path.partition("/")[0])
            if path and not path.endswith("/"):
                files.append(FileInfo(path, int(obj["Size"]), obj["ETag"].strip('"')))
        if not files:
            return None
        return ModelFiles(name, self.model_url(name), tuple(sorted(files)), tuple(sorted(folders)))

    def folder(self, model: ModelFiles, versions: Iterable[int], also: Iterable[str] = ()) -> Path:
        return self.fetch(model.name, model.of_versions(versions, also))

    def fetch(self, name: str, files: Iterable[FileInfo]) -> Path:
        """A local folder holding `files` of model `name`: from the cache, else downloaded into it."""
        try:
            return self.cache.folder(name, tuple(files), lambda f, dest: self._download(name, f, dest))
        except DespinaError:
            raise
        except Exception as exc:
            raise registry_error(self.url, exc) from None

    def _download(self, name: str, f: FileInfo, dest: Path) -> None:
        """One file, as the listing saw it: a file replaced since fails (IfMatch) instead of mixing two."""
        key = self._key(name, f.path)
        if f.size < self.transfer.multipart_threshold:
            response = self.client.get_object(Bucket=self.bucket, Key=key, IfMatch=f'"{f.etag}"')
            with dest.open("wb") as out:
                for chunk in response["Body"].iter_chunks(1024 * 1024):
                    out.write(chunk)
        else:  # ranged, parallel GETs; the ETag is checked once they are all in
            self.client.download_file(self.bucket, key, str(dest), Config=self.transfer)
            response = self.client.head_object(Bucket=self.bucket, Key=key, IfMatch=f'"{f.etag}"')
        if dest.stat().st_size != f.size:
            raise OSError(f"{key}: {dest.stat().st_size} bytes came, the listing said {f.size}")
        if etag_is_md5(f.etag, response) and md5_file(dest) != f.etag:
            raise OSError(f"{key}: the downloaded bytes do not match the ETag {f.etag}")

    def put(self, name: str, path: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(name, check_relative(path)), Body=data)
        except Exception as exc:
            raise registry_error(self.url, exc) from None

    def delete(self, name: str, path: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name, check_relative(path)))
        except Exception as exc:
            raise registry_error(self.url, exc) from None

    def make_folder(self, name: str, path: str) -> None:
        try:
            key = self._key(name, check_relative(path)) + "/"
            self.client.put_object(Bucket=self.bucket, Key=key, Body=b"")
        except Exception as exc:
            raise registry_error(self.url, exc) from None

    def upload(self, name: str, path: str, source: Path, progress: Progress | None = None) -> FileInfo:
        key = self._key(name, check_relative(path))
        try:
            self.client.upload_file(str(source), self.bucket, key, Config=self.transfer, Callback=progress)
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            raise registry_error(self.url, exc) from None
        etag = head["ETag"].strip('"')
        # an ETag that is no digest of the bytes (SSE-KMS, SSE-C) is not given: push cannot verify by it
        digest = etag_is_md5(etag.split("-", 1)[0], head)
        return FileInfo(path, int(head["ContentLength"]), etag if digest else "")


def md5_file(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def expected_etag(path: Path, part_size: int) -> str:
    """The ETag S3 gives a file uploaded with parts of `part_size` (boto3 goes multipart from that size
    on): its MD5, or the MD5 of the parts' MD5s followed by -N."""
    if path.stat().st_size < part_size:
        return md5_file(path)
    parts = []
    with path.open("rb") as f:
        while chunk := f.read(part_size):
            parts.append(hashlib.md5(chunk, usedforsecurity=False).digest())
    return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"
