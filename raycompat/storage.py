"""One way to name a place: a local path or a URI, resolved once (:class:`Location`), and one
error for every storage problem (:class:`StorageError`).

A place is a local path (``~`` expanded, made absolute against the working directory) or any
URI that pyarrow's filesystems accept (``s3://bucket/prefix``, ``gs://...``, ``hdfs://...``,
``file:///shared/nfs/raycompat``). :func:`resolve_location` resolves one without touching it;
its :attr:`Location.uri` (the absolute path, or the URI with a lower-case scheme and no
trailing ``/``) is the one form in which a place is shown, recorded and compared. Every job's
outputs (:mod:`raycompat.outputs`), the gallery pipeline's writer (:mod:`raycompat.pipeline`),
the simulator's inputs and the live index's state directory
(:func:`raycompat.serving.config.state_directory`) name their places this way.

Every job takes ``--storage``: a local folder (default ``~/raycompat_runs``) or a URI. On a
cluster it must be a place every node can reach: an object store, or a network file system
mounted at the same path on every node. :func:`open_storage` resolves it and checks, before
any work starts, that it can be written: a missing parent, a read-only folder or bad
credentials stop the job at once with a message naming the location and the reason, instead
of failing after an hour of training.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raycompat.config import ConfigError

__all__ = [
    "DEFAULT_STORAGE",
    "Location",
    "StorageError",
    "is_uri",
    "local_copy",
    "open_storage",
    "resolve_location",
]

DEFAULT_STORAGE = "~/raycompat_runs"


class StorageError(ConfigError):
    """A place cannot be used or a write to it failed; the message names it and says why.

    A ``ConfigError``: a job stops on it with one ``error: ...`` line and exit status 2
    (:mod:`raycompat.console`). The live index catches it where it writes its state directory
    (a full disk, an unwritable file) and answers 503 with the message
    (:mod:`raycompat.serving.shard`, :mod:`raycompat.serving.backfill_controller`)."""


def is_uri(location: str) -> bool:
    """``scheme://...`` (``s3://``, ``gs://``, ``file://``...) as opposed to a plain path."""
    return "://" in str(location)


def _reason(exc: BaseException) -> str:
    """The first line of an exception's message (an ``OSError``'s ``strerror``)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _normal_uri(uri: str, root: str) -> tuple[str, str]:
    """``(uri, root)`` with a lower-case scheme and no trailing ``/``; a ``file://`` URI's
    path normalised like a local path (``a/../b`` is ``b``)."""
    scheme, rest = uri.split("://", 1)
    scheme = scheme.lower()
    root = root.rstrip("/") or root
    if scheme == "file":
        root = posixpath.normpath(root)
        return f"file://{root}", root
    return f"{scheme}://{rest.rstrip('/') or rest}", root


@dataclass(frozen=True)
class Location:
    """A resolved place: ``filesystem`` (pyarrow) and ``root`` (a path inside it).

    ``uri`` is how it is shown, recorded and compared, and what Ray Train's
    ``RunConfig(storage_path=...)`` takes: the absolute path of a local place, the URI
    otherwise. ``local``: named by a plain path (not a URI; ``file://`` URIs take the URI
    code paths, as ``s3://`` does). :attr:`on_disk`: on this machine's disk (a plain path or a
    ``file://`` URI), where os calls, renames and fsync work on ``root``."""

    uri: str
    root: str
    filesystem: Any
    local: bool

    def __str__(self) -> str:
        return self.uri

    @property
    def on_disk(self) -> bool:
        import pyarrow.fs as pafs

        return isinstance(self.filesystem, pafs.LocalFileSystem)

    # -- names ------------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        """A place under this one, in the same form as ``uri``."""
        if not parts:
            return self.uri
        if self.local:
            return os.path.join(self.uri, *parts)
        return self.uri.rstrip("/") + "/" + posixpath.join(*parts)

    def fs_path(self, *parts: str) -> str:
        """A path inside ``filesystem`` (what pyarrow calls take)."""
        return posixpath.join(self.root, *parts) if parts else self.root

    def child(self, *parts: str) -> Location:
        """The :class:`Location` of a place under this one."""
        return Location(self.join(*parts), self.fs_path(*parts), self.filesystem, self.local)

    @property
    def name(self) -> str:
        """The last component (a file or folder name)."""
        return posixpath.basename(self.root.rstrip("/"))

    def parent(self) -> Location:
        """The folder that holds this place."""
        if self.local:
            up = os.path.dirname(self.root.rstrip(os.sep)) or os.sep
            return Location(up, up, self.filesystem, True)
        uri = self.uri.rstrip("/").rsplit("/", 1)[0]
        root = posixpath.dirname(self.root.rstrip("/")) or "/"
        return Location(uri, root, self.filesystem, False)

    # -- what is there ----------------------------------------------------------------------
    def kind(self, *parts: str) -> str:
        """``'missing'``, ``'file'`` or ``'folder'``; StorageError when it cannot be read."""
        import pyarrow.fs as pafs

        try:
            info = self.filesystem.get_file_info(self.fs_path(*parts))
        except Exception as exc:  # credentials, a bucket that does not exist
            raise StorageError(f"{self.join(*parts)}: cannot read it: {_reason(exc)}") from exc
        if info.type == pafs.FileType.NotFound:
            return "missing"
        return "folder" if info.type == pafs.FileType.Directory else "file"

    def exists(self, *parts: str) -> bool:
        return self.kind(*parts) != "missing"

    def is_file(self, *parts: str) -> bool:
        return self.kind(*parts) == "file"

    def listdir(self) -> list[str]:
        """The sorted names of a folder's entries (files and folders; not recursive); ``[]``
        for a missing place or a file."""
        import pyarrow.fs as pafs

        if self.kind() != "folder":
            return []
        try:
            entries = self.filesystem.get_file_info(
                pafs.FileSelector(self.root, allow_not_found=True)
            )
        except Exception as exc:
            raise StorageError(f"{self.uri}: cannot read it: {_reason(exc)}") from exc
        return sorted(e.base_name for e in entries)

    # -- reading ----------------------------------------------------------------------------
    def read_bytes(self, *parts: str) -> bytes:
        with self.filesystem.open_input_stream(self.fs_path(*parts)) as fh:
            return fh.read()

    def read_json(self, *parts: str) -> dict | None:
        """A JSON object file; ``None`` when it is missing, unreadable or not an object."""
        try:
            value = json.loads(self.read_bytes(*parts))
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def open_input(self, *parts: str):
        """A random-access file (parquet footers)."""
        if self.on_disk:
            return open(self.fs_path(*parts), "rb")
        return self.filesystem.open_input_file(self.fs_path(*parts))

    # -- writing ----------------------------------------------------------------------------
    def write(self, name: str, writer: Callable[[Any], object]) -> None:
        """Write file ``name`` of this folder with ``writer(file object)``. On disk: into
        ``.<name>.tmp<pid>``, fsync, rename, so it appears whole or not at all; elsewhere the
        final object directly (an upload becomes visible only when it is complete)."""
        if not self.on_disk:
            with self.filesystem.open_output_stream(self.fs_path(name)) as fh:
                writer(fh)
            return
        tmp = self.fs_path(f".{name}.tmp{os.getpid()}")
        with open(tmp, "wb") as fh:
            writer(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.fs_path(name))

    def write_bytes(self, name: str, data: bytes) -> None:
        self.write(name, lambda fh: fh.write(data))

    def remove(self, name: str) -> None:
        self.filesystem.delete_file(self.fs_path(name))

    def clear(self) -> None:
        """Delete everything in the folder (``--overwrite``); the folder stays."""
        self.filesystem.delete_dir_contents(self.root, missing_dir_ok=True)
        self.filesystem.create_dir(self.root, recursive=True)

    def make_dirs(self, what: str = "--out") -> None:
        """Create this folder and its missing parents; StorageError ``'<what> <uri>: ...'``
        when it cannot be created or is a file."""
        if self.kind() == "file":
            raise StorageError(f"{what} {self.uri}: exists and is not a folder")
        try:
            self.filesystem.create_dir(self.root, recursive=True)
        except Exception as exc:
            raise StorageError(f"{what} {self.uri}: cannot create it: {_reason(exc)}") from exc

    def check_writable(self, what: str = "--storage", parents: bool = False) -> None:
        """Create the folder if needed (with its missing parents when ``parents`` or for a
        URI; a plain path's parent must exist otherwise), write, read back and delete a probe
        file; StorageError naming ``what`` and the location otherwise."""
        if self.local and not parents:
            up = self.parent().root
            if not os.path.exists(self.root) and not os.path.isdir(up):
                raise StorageError(f"{what} {self.uri}: the parent folder {up} does not exist")
        if self.kind() == "file":
            raise StorageError(f"{what} {self.uri}: exists and is not a folder")
        probe = f".raycompat-write-check-{uuid.uuid4().hex}"
        try:
            self.filesystem.create_dir(self.root, recursive=True)
            self.write_bytes(probe, b"ok")
            if self.read_bytes(probe) != b"ok":
                raise StorageError(f"{what} {self.uri}: a file written there cannot be read back")
            self.remove(probe)
        except StorageError:
            raise
        except Exception as exc:  # OSError, PermissionError, pyarrow's credential errors
            raise StorageError(f"{what} {self.uri} is not writable: {_reason(exc)}") from exc

    def upload_dir(self, local_dir: str, *parts: str) -> str:
        """Copy a local folder to ``join(*parts)`` (replacing it); returns that location."""
        import pyarrow.fs as pafs

        target = self.fs_path(*parts)
        if self.local:
            tmp = target + ".partial"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(local_dir, tmp)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        else:
            self.filesystem.delete_dir_contents(target, missing_dir_ok=True)
            self.filesystem.create_dir(target, recursive=True)
            pafs.copy_files(
                local_dir,
                target,
                source_filesystem=pafs.LocalFileSystem(),
                destination_filesystem=self.filesystem,
            )
        return self.join(*parts)


#: the name this class had when it only named ``--storage``
Storage = Location


def resolve_location(location: str | os.PathLike | Location, what: str = "") -> Location:
    """The :class:`Location` of a local path or a URI, without touching it; ``what`` (a flag
    such as ``--out``) prefixes the StorageError of an empty value or a URI pyarrow cannot
    open."""
    import pyarrow.fs as pafs

    if isinstance(location, Location):
        return location
    text = os.fspath(location)
    named = f"{what} {text}".strip()
    if not text.strip():
        raise StorageError(f"{what or 'a location'} must not be empty")
    if not is_uri(text):
        path = os.path.abspath(os.path.expanduser(text))
        return Location(uri=path, root=path, filesystem=pafs.LocalFileSystem(), local=True)
    try:
        filesystem, root = pafs.FileSystem.from_uri(text)
    except Exception as exc:
        raise StorageError(f"{named}: not a location pyarrow can open: {_reason(exc)}") from exc
    uri, root = _normal_uri(text, root)
    return Location(uri, root, filesystem, local=False)


def open_storage(
    location: str | Location | None = None, check: bool = True, what: str = "--storage"
) -> Location:
    """Resolve ``location`` (default ``~/raycompat_runs``) and, with ``check``, make sure it
    is writable now (StorageError naming ``what``, the location and the reason otherwise; a
    plain path's parent folder must exist)."""
    storage = resolve_location(location or DEFAULT_STORAGE, what)
    if check:
        storage.check_writable(what)
    return storage


def local_copy(location: str, cache_dir: str | None = None) -> str:
    """A local folder with the contents of ``location``: the path itself when it is local,
    otherwise a download into ``cache_dir`` (default: a fresh temporary folder)."""
    import pyarrow.fs as pafs

    if not is_uri(location):
        return location
    try:
        filesystem, path = pafs.FileSystem.from_uri(location)
        if filesystem.get_file_info(path).type != pafs.FileType.Directory:
            raise FileNotFoundError(f"{location} is not a folder")
        target = cache_dir or tempfile.mkdtemp(prefix="raycompat-")
        pafs.copy_files(
            path,
            target,
            source_filesystem=filesystem,
            destination_filesystem=pafs.LocalFileSystem(),
        )
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise FileNotFoundError(f"cannot read {location}: {_reason(exc)}") from exc
    return target
