"""Triton's system shared-memory extension: a client on the gateway's host hands tensors over in a POSIX
shared-memory object (tritonclient.utils.shared_memory, perf_analyzer --shared-memory system) instead of
the HTTP body, and gets outputs written there.

A region is a name for (key, offset, byte_size): `key` is the object's shm_open name, the region its
bytes from `offset` on. Registrations are the server's, not one process's: every gateway of a server
(`serve --gateways N` shares one port) sees the same ones, as a client of Triton's one process does. They
are kept where the objects are, in a file in /dev/shm named after the server (key prefix and port):
written whole under a lock and renamed into place, read again by a gateway whenever it changed (one
stat per request that uses shared memory). A server starts with none (Registry.clear) and drops them
when it stops, as Triton does: `serve` clears them itself; gateways started by hand on one port
(DESPINA_REUSE_PORT) each hold a shared lock while they serve, so that only the first to start and the
last to stop clear them, not one that joins or leaves the others (Registry.join, Registry.leave).

Each gateway maps a region on its first use, through the registry's link to the object registered (one
unlinked by its client since lives on, as Triton's mapping keeps it), and keeps the mapping while the
region stays registered (it looks every RELEASE_S whether it still is: Registry.let_go). A request that
is to write an output into a region holds it (Held) from its decoding to its answer, in whichever gateway
it runs: as Triton 2.51, unregistering a region held is refused ("currently in use"), so that once a client
has unregistered a region the server writes nothing more there. (Inputs are copied as a request arrives:
they hold nothing.)
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ..contract.errors import Code, DespinaError, InvalidArgument, NotFound

SHM_DIR = Path("/dev/shm")
RELEASE_S = 1.0  # how soon a gateway unmaps a region unregistered through another


class AlreadyExists(DespinaError):
    code = Code.ALREADY_EXISTS


@dataclass(frozen=True, slots=True)
class Registration:
    name: str
    key: str
    offset: int
    byte_size: int
    id: str  # this registration's own: a name registered again is another region

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


def object_path(key: str) -> Path:
    """Where shm_open(key) finds the object: /dev/shm/NAME for key /NAME (NAME, //NAME), as glibc's, which
    skips every leading slash and refuses a name of NAME_MAX - 1 (254) characters or more."""
    name = key.lstrip("/")
    if not name or len(name) >= 254 or "/" in name or name in (".", "..") or "\0" in name:
        raise InvalidArgument(f"Unable to open shared memory region: '{key}' (not a shared memory key)")
    return SHM_DIR / name


def _shrunk(reg: Registration) -> str:
    """A mapped region's object that shrank under it (the client truncated it): the request's error."""
    return (f"shared memory object '{reg.key}' of region '{reg.name}' is smaller than the region now "
            "(was it truncated?)")


class Region:
    """A registration mapped into this process. Reads and writes check first that the object is still as
    large as the region (one that shrank would fault the process), then copy."""

    def __init__(self, reg: Registration, registering: bool = True, path: Path | None = None) -> None:
        """`registering`: mapped for its registration; else for a request, in a gateway that had not mapped
        it yet (another gateway registered it): an object that shrank since is the request's error.
        `path`: where the object is, if not at its key (the registry's own link to it)."""
        self.reg = reg
        try:
            # O_NOFOLLOW as shm_open has it: a link in /dev/shm does not lead elsewhere
            fd = os.open(path or object_path(reg.key), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidArgument(f"Unable to open shared memory region: '{reg.key}' "
                                  f"({exc.strerror})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidArgument(f"Unable to open shared memory region: '{reg.key}' (not a shared "
                                      "memory object)")
            if reg.offset + reg.byte_size > info.st_size:
                raise InvalidArgument(
                    f"failed to register shared memory region '{reg.name}': invalid args (offset "
                    f"{reg.offset} + byte_size {reg.byte_size} is past the end of '{reg.key}', "
                    f"{info.st_size} bytes)"
                    if registering else _shrunk(reg))
            self.map = mmap.mmap(fd, info.st_size) if info.st_size else None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.users = 0  # this gateway's requests that hold it (Held)

    def __del__(self) -> None:  # the mapping goes with its last holder; the descriptor with it
        fd = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)

    def _span(self, offset: int, size: int, what: str) -> int:
        reg = self.reg  # errors in Triton's words (SharedMemoryManager::GetMemoryInfo): its tests read them
        if offset < 0 or offset >= reg.byte_size:
            raise InvalidArgument(f"{what}: Invalid offset for shared memory region: '{reg.name}' (offset "
                                  f"{offset}, a region of {reg.byte_size} bytes)")
        if size < 0 or offset + size > reg.byte_size:
            raise InvalidArgument(f"{what}: Invalid offset + byte size for shared memory region: "
                                  f"'{reg.name}' (offset {offset} + byte size {size}, a region of "
                                  f"{reg.byte_size} bytes)")
        if os.fstat(self.fd).st_size < reg.offset + reg.byte_size:
            raise InvalidArgument(f"{what}: {_shrunk(reg)}")
        return reg.offset + offset

    def read(self, offset: int, size: int, what: str) -> bytes:
        start = self._span(offset, size, what)
        return self.map[start:start + size] if self.map is not None and size else b""

    def write(self, offset: int, data: bytes, what: str) -> None:
        start = self._span(offset, len(data), what)
        if self.map is not None and data:
            self.map[start:start + len(data)] = data

    def output(self, name: str, offset: int, byte_size: int) -> ShmOutput:
        """Where output `name` goes, checked to fit the region as the request arrives, as Triton checks it:
        before the model runs, not only when the result is written."""
        self._span(offset, byte_size, f"output '{name}'")
        return ShmOutput(self, byte_size, offset, Held(self))


class Held:
    """A request's hold on a region, for as long as the request keeps it: the gateways' holds on a region
    are a shared flock on their descriptors of its object, which unregistering tries to take exclusively
    (Registry.unregister). Let go when dropped, so that no way a request ends can leave a region held."""

    __slots__ = ("region",)

    def __init__(self, region: Region) -> None:
        self.region = region
        if not region.users:
            with contextlib.suppress(OSError):  # (held exclusively this instant: an unregistration's look)
                fcntl.flock(region.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        region.users += 1

    def __del__(self) -> None:
        region = self.region
        region.users -= 1
        if not region.users:
            with contextlib.suppress(OSError):
                fcntl.flock(region.fd, fcntl.LOCK_UN)


def _in_use(path: Path) -> bool:
    """Whether a request of some gateway holds the region whose object is at `path` (Held). An object
    gone cannot be asked: its region is not held, as far as anyone can tell."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, InvalidArgument):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (and the lock with it)
    return False


class Registry:
    """The regions of one server, shared by its gateways on this host (the module's docstring)."""

    def __init__(self, server: str, folder: Path = SHM_DIR) -> None:
        digest = hashlib.sha256(server.encode()).hexdigest()[:16]
        self._stem = f"despina-shm-regions-{digest}"
        self.path = folder / f"despina-shm-regions-{digest}.json"
        self._lock_path = folder / f"despina-shm-regions-{digest}.lock"
        self._users_path = folder / f"despina-shm-regions-{digest}.users"  # locked shared by each gateway
        self._user: int | None = None  # this gateway's descriptor of it, while it serves
        self.available = folder.is_dir() and os.access(folder, os.W_OK)
        self._seen: tuple[int, int] | None = None  # (inode, mtime) of the file last read
        self._registered: dict[str, Registration] = {}
        self._mapped: dict[str, Region] = {}  # name -> its mapping here, for the registration it has now

    @classmethod
    def of(cls, key_prefix: str, port: int) -> Registry:
        return cls(f"{key_prefix}\0{port}")

    # -- what is registered ----------------------------------------------------------------------

    def _current(self) -> dict[str, Registration]:
        """The registrations as the file has them now, read again only when it changed."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._registered, self._mapped = None, {}, {}
            return self._registered
        seen = (info.st_ino, info.st_mtime_ns)
        if seen != self._seen:
            try:
                raw = orjson.loads(self.path.read_bytes())
                registered = {name: Registration(name, r["key"], r["offset"], r["byte_size"], r["id"])
                              for name, r in raw.items()}
            except FileNotFoundError:
                registered = {}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise DespinaError(f"the shared memory registrations ({self.path}) are unreadable: {exc}",
                                   Code.INTERNAL) from None
            self._seen, self._registered = seen, registered
            self._mapped = {n: r for n, r in self._mapped.items()
                            if n in registered and registered[n].id == r.reg.id}
        return self._registered

    def region(self, name: str, looked: bool = False) -> Region:
        """The registered region `name`, mapped here; NotFound (Triton's 404) if none. `looked`: the
        registrations were read for this request already (a request's second region needs no stat)."""
        reg = (self._registered if looked else self._current()).get(name)
        if reg is None:
            raise NotFound(f"Unable to find shared memory region: '{name}'")
        region = self._mapped.get(name)
        if region is None:
            region = self._mapped[name] = Region(reg, registering=False, path=self._object(reg))
        return region

    def _link(self, reg: Registration) -> Path:
        """The registry's own link to a region's object (made as it is registered): through it each gateway
        maps the object registered, even once its client unlinked it or made another of its name."""
        return self.path.parent / f"{self._stem}.{reg.id}.obj"

    def _object(self, reg: Registration) -> Path:
        link = self._link(reg)
        return link if link.exists() else object_path(reg.key)  # (no link: one could not be made)

    def let_go(self) -> None:
        """Unmap the regions unregistered since (through another gateway) without waiting for a request
        here: Triton unmaps a region when it is unregistered, and the object's memory is freed only when
        no process maps it."""
        self._current()

    def status(self, name: str = "") -> list[dict[str, Any]]:
        registered = self._current()
        if not name:
            return [r.status() for r in registered.values()]
        if name not in registered:
            raise NotFound(f"Unable to find system shared memory region: '{name}'")
        return [registered[name].status()]

    # -- changes ---------------------------------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if byte_size == 0:  # Triton maps a region as it registers it, and mmap maps no empty one
            raise InvalidArgument(f"failed to register shared memory region '{name}': invalid args "
                                  "(byte_size 0: a region holds one byte or more)")
        with self._locked() as registered:
            if name in registered:
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
            if any(r.key == key for r in registered.values()):
                raise InvalidArgument(f"registering an active shared memory key, \"{key}\", under a "
                                      "different name is not currently supported")
            reg = Registration(name, key, offset, byte_size, uuid.uuid4().hex)
            region = Region(reg)  # it opens and fits, or the error says why
            self._keep(region)
            registered[name] = reg
        self._mapped[name] = region

    def _keep(self, region: Region) -> None:
        """Link the inode just opened as _link names it (src_dir_fd: a linkat that follows /proc's link)."""
        folder = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(f"/proc/self/fd/{region.fd}", self._link(region.reg), src_dir_fd=folder)
        except OSError:
            pass  # (no /proc, say: the gateways open the object at its key)
        finally:
            os.close(folder)

    def unregister(self, name: str = "") -> None:
        """Unregister `name`, or every region (''); a name that is not registered is no error. A region
        that a request holds stays, and the error says so (every other one goes), as Triton answers."""
        with self._locked() as registered:
            held = [n for n in ([name] if name else list(registered))
                    if n in registered and _in_use(self._object(registered[n]))]
            for n in [name] if name else list(registered):
                if n not in held and n in registered:
                    self._link(registered.pop(n)).unlink(missing_ok=True)  # (memory goes with its last map)
        if held and name:
            raise DespinaError(f"Cannot unregister shared memory region '{name}', it is currently in use.",
                               Code.FAILED_PRECONDITION)
        if held:
            raise DespinaError("Failed to unregister the following system shared memory regions: "
                               f"{', '.join(held)} (currently in use)", Code.FAILED_PRECONDITION)

    def clear(self) -> None:
        """No regions: a server starting, or stopping."""
        for path in (self.path, self._lock_path, *self.path.parent.glob(f"{self._stem}.*.obj")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._seen, self._registered, self._mapped = None, {}, {}

    def join(self) -> None:
        """A gateway of the server starts: when no other serves (none holds the users' lock), the server
        starts, with no regions; one joining gateways that serve keeps theirs."""
        if not self.available:
            return
        fd = os.open(self._users_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            self.clear()
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._user = fd

    def leave(self) -> None:
        """A gateway of the server stops: the last one to stop ends the server's regions."""
        if self._user is None:
            return
        os.close(self._user)  # (and its shared lock with it)
        self._user = None
        fd = os.open(self._users_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another gateway serves on
        else:
            self.clear()
            self._users_path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Registration]]:
        """The registrations to change, under the server's lock; written back when the block ends well."""
        if not self.available:
            raise DespinaError(f"system shared memory is not available here: {SHM_DIR} is missing or "
                               "read-only", Code.FAILED_PRECONDITION)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._seen = None  # read afresh: another gateway may have written it a moment ago
            registered = dict(self._current())
            yield registered
            doc = {n: {"key": r.key, "offset": r.offset, "byte_size": r.byte_size, "id": r.id}
                   for n, r in registered.items()}
            partial = self.path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(orjson.dumps(doc))
            os.replace(partial, self.path)  # whole or not at all, for the readers without the lock
        finally:
            os.close(fd)  # (and its lock with it)
        self._current()


@dataclass(frozen=True, slots=True)
class ShmOutput:
    """A requested output the reply writes into shared memory."""

    region: Region
    byte_size: int
    offset: int
    held: Held  # the region, while the request keeps this

    def write(self, name: str, data: bytes) -> None:
        """Write the output's bytes, if they fit."""
        if len(data) > self.byte_size:
            raise InvalidArgument(f"shared memory size specified with the request for output '{name}' "
                                  f"({self.byte_size} bytes) should be at least {len(data)} bytes to hold "
                                  "the results")
        self.region.write(self.offset, data, f"output '{name}'")
