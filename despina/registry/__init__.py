"""Model registries: a local folder or s3://bucket/prefix, and the content-keyed artifact cache."""
from __future__ import annotations

from ..settings import Settings
from .base import FileInfo, ModelFiles, Registry
from .cache import ArtifactCache
from .local import LocalRegistry

__all__ = ["ArtifactCache", "FileInfo", "LocalRegistry", "ModelFiles", "Registry", "open_registry",
           "open_model_registry"]


def open_registry(url: str, settings: Settings, cache: ArtifactCache | None = None) -> Registry:
    """The registry at `url`: s3://bucket/prefix, or a local folder."""
    if url.startswith("s3://"):
        from .s3 import S3Registry

        return S3Registry(url, settings, cache)
    return LocalRegistry(url)


def open_model_registry(model_url: str, settings: Settings, cache: ArtifactCache | None = None
                        ) -> tuple[Registry, str]:
    """The registry holding the model folder at `model_url`, and the model's name."""
    parent, _, name = model_url.rstrip("/").rpartition("/")
    return open_registry(parent, settings, cache), name
