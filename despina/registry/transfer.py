"""`despina push` and `despina ls`: put a model folder into a registry, list what a registry holds."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from google.protobuf import text_format

from ..contract.ensemble import PLATFORM
from ..contract.errors import ConfigError, InvalidArgument
from ..contract.modelconfig import check_model_name, parse_text
from ..settings import Settings
from . import open_registry
from .base import VERSION_DIGITS, FileInfo, ModelFiles, Registry, is_version

SHARED_DIRS = ("warmup",)  # folders that stay beside the versions when a flat folder is pushed


@dataclass(frozen=True)
class Planned:
    source: Path
    path: str           # where it lands inside the model folder


def plan(folder: Path, version: int | None, ensemble: bool = False) -> list[Planned]:
    """What to upload, in order: version files first, config.pbtxt last (a poll never sees a config
    whose version files are missing). A folder without version folders is one version: `version`, or 1.
    An ensemble has no files of its own: its config may be all there is.
    """
    if version is not None and version < 0:
        raise InvalidArgument(f"version {version}: versions are numbered from 0")
    if version is not None and not is_version(str(version)):
        raise InvalidArgument(f"version {version}: a version has at most {VERSION_DIGITS} digits (a longer "
                              "version folder is skipped)")
    files = sorted(_files(folder))
    rel = [(p, p.relative_to(folder).as_posix()) for p in files]
    tops = {r.split("/", 1)[0] for _, r in rel if "/" in r}
    versions = sorted(int(t) for t in tops if is_version(t))
    if not versions and not (folder / "config.pbtxt").exists():
        configs = sorted(r for _, r in rel if r.count("/") == 1 and r.endswith("/config.pbtxt"))
        if configs:  # else it would go up as one model, version 1 holding every model's folder
            raise InvalidArgument(f"{folder} is a model repository ({configs[0]}): push each model folder "
                                  "in it")
    out: list[Planned] = []
    for p, r in rel:
        top = r.split("/", 1)[0] if "/" in r else ""
        if versions:
            if is_version(top):
                if version is None:
                    out.append(Planned(p, r))
                elif int(top) == versions[-1]:  # the newest version folder becomes `version`
                    out.append(Planned(p, f"{version}/{r.split('/', 1)[1]}"))
            else:
                out.append(Planned(p, r))
        elif r == "config.pbtxt" or top in SHARED_DIRS:
            out.append(Planned(p, r))
        else:
            out.append(Planned(p, f"{1 if version is None else version}/{r}"))  # (`or 1` would make 0 1)
    if not ensemble and not any("/" in x.path and is_version(x.path.split("/", 1)[0]) for x in out):
        raise InvalidArgument(f"{folder} holds no model files to push")
    return sorted(out, key=lambda x: (x.path == "config.pbtxt", "/" not in x.path, x.path))


def _files(folder: Path) -> list[Path]:
    """Every file in `folder` but hidden ones, through symbolic links: a version folder linked from a
    build's output is pushed as what it holds. A link to nothing, or back to a folder above it, is refused."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True, onerror=_raise):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not _hidden(Path(d))]
        for d in dirnames:
            if here.resolve().is_relative_to((here / d).resolve()):
                raise InvalidArgument(f"{here / d} links back to a folder above it")
        for name in filenames:
            path = here / name
            if _hidden(Path(name)):
                continue
            if not path.exists():
                raise InvalidArgument(f"{path} is a symbolic link to nothing: the file it stood for would be "
                                      "missing from the model")
            out.append(path)
    return out


def _raise(exc: OSError) -> None:
    raise exc


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") or part == "__pycache__" for part in rel.parts)


class ProgressBar:
    """Bytes moved out of a total, drawn on one line of stderr (plain lines when it is not a terminal)."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total, self.done, self.out = max(total, 1), 0, out
        self.tty = out.isatty()
        self.label = ""
        self._drawn = 0.0

    def start(self, label: str) -> None:
        self.label = label
        if not self.tty:
            print(f"  uploading {label}", file=self.out)

    def __call__(self, moved: int) -> None:
        self.done += moved
        now = time.monotonic()
        if self.tty and (now - self._drawn > 0.1 or self.done >= self.total):
            self._drawn = now
            share = min(1.0, self.done / self.total)
            bar = "#" * int(share * 30)
            print(f"\r[{bar:<30}] {share:4.0%} {self.done / 1e6:8.1f}/{self.total / 1e6:.1f} MB "
                  f"{self.label[-40:]:<40}", end="", file=self.out, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=self.out)


def push(folder: str | Path, url: str, settings: Settings, version: int | None = None,
         name: str | None = None, out: TextIO = sys.stderr, rename: bool = False) -> list[FileInfo]:
    """Upload one model folder to the registry at `url`, then check what landed (sizes and ETags).
    With `rename`, a config naming another model is uploaded with its name field set to `name` (a
    folder named after something else, as SageMaker unpacks an archive); without, that is an error."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InvalidArgument(f"{folder} is not a folder")
    name = check_model_name(name or folder.resolve().name)
    config = folder / "config.pbtxt"
    ensemble, renamed = False, None
    if config.exists():
        parsed = parse_text(name, config.read_bytes())  # a typo fails here, not on every worker
        if parsed.name and parsed.name != name:
            if not rename:
                raise ConfigError(f"model '{name}': field 'name' is '{parsed.name}', the folder is '{name}'")
            parsed.name = name
            renamed = text_format.MessageToString(parsed).encode()
        ensemble = parsed.platform == PLATFORM
    planned = plan(folder, version, ensemble)
    if renamed is not None:
        planned = [p for p in planned if p.path != "config.pbtxt"]
    registry = open_registry(url, settings)
    try:
        before = registry.scan_one(name)
    except ConfigError:  # a local repository not made yet (the upload makes it), or a file (it says so)
        if not registry.remote and Path(url).expanduser().exists():
            raise
        before = None
    bar = ProgressBar(sum(p.source.stat().st_size for p in planned), out)

    def upload(item: Planned) -> FileInfo:
        bar.start(item.path)
        return registry.upload(name, item.path, item.source, bar)

    # plan() puts the config last: the stale files go before it, so a poll sees the version as pushed
    landed = [upload(item) for item in planned if item.path != "config.pbtxt"]
    marked = empty_versions(folder, version) if ensemble else []
    for made in marked:  # as on disk: an empty version folder is a version (an ensemble's hold nothing)
        registry.make_folder(name, made)
    gone = remove_stale(registry, name, before, planned)
    landed += [upload(item) for item in planned if item.path == "config.pbtxt"]
    bar.close()
    verify(planned, landed, registry.remote, settings)
    if renamed is not None:  # last, as plan() orders it: a poll never sees a config without its files
        registry.put(name, "config.pbtxt", renamed)
    if gone:
        print(f"removed {len(gone)} file(s) of {name} no longer in {folder}: {', '.join(gone[:5])}"
              f"{' ...' if len(gone) > 5 else ''}", file=out)
    versions = sorted({int(x.path.split("/", 1)[0]) for x in planned if is_version(x.path.split("/", 1)[0])}
                      | {int(m) for m in marked})
    what = f"version {', '.join(map(str, versions))}" if versions else "(an ensemble: its config)"
    print(f"pushed {name} {what} to {registry.model_url(name)}: "
          f"{len(landed)} files, {sum(f.size for f in landed) / 1e6:.1f} MB, verified", file=out)
    return landed


def empty_versions(folder: Path, version: int | None) -> list[str]:
    """An ensemble's version folders to make: those of `folder` (none holds a file of its own), or with
    `version` that one (the newest folder becomes it, as plan() does for a model's files)."""
    if version is not None:
        return [str(version)]
    found = (int(p.name) for p in folder.iterdir() if p.is_dir() and is_version(p.name))
    return [str(v) for v in sorted(found)]


def remove_stale(registry: Registry, name: str, before: ModelFiles | None,
                 planned: list[Planned]) -> list[str]:
    """Take out of the version folders (and shared folders, warmup/) that this push brings the files it
    does not bring: a re-pushed version is what was pushed, not a mix with a file renamed or removed
    since (a stale module of a Python model, a checkpoint shard). Other versions, and files beside the
    versions, stay. The paths removed."""
    if before is None:
        return []
    pushed = {p.path for p in planned}
    folders = {p.path.split("/", 1)[0] for p in planned if "/" in p.path}
    gone = sorted(f.path for f in before.files
                  if "/" in f.path and f.path.split("/", 1)[0] in folders and f.path not in pushed)
    for path in gone:
        registry.delete(name, path)
    return gone


def verify(planned: list[Planned], landed: list[FileInfo], remote: bool, settings: Settings) -> None:
    from .s3 import MD5_ETAG, expected_etag

    part = max(5, settings.s3_part_mb) * 1024 * 1024
    for item, got in zip(planned, landed):
        size = item.source.stat().st_size
        if got.size != size:
            raise ConfigError(f"{item.path}: {got.size} bytes landed, {size} were sent")
        looks_md5 = MD5_ETAG.match(got.etag.split("-", 1)[0]) is not None
        if remote and looks_md5 and got.etag != expected_etag(item.source, part):
            raise ConfigError(f"{item.path}: the stored ETag {got.etag} does not match the file sent")


def listing(url: str, settings: Settings, out: TextIO = sys.stdout) -> int:
    """Print the registry's models: versions, files and size. Returns the number of models."""
    models = open_registry(url, settings).scan()
    if not models:
        print(f"no models in {url}", file=out)
        return 0
    width = max(len(n) for n in models)
    for name, m in models.items():
        versions = ",".join(map(str, m.versions)) or "-"
        config = "" if any(f.path == "config.pbtxt" for f in m.files) else "  (no config.pbtxt)"
        print(f"{name:<{width}}  versions {versions:<12} {len(m.files):>4} files "
              f"{sum(f.size for f in m.files) / 1e6:>10.1f} MB{config}", file=out)
    return len(models)
