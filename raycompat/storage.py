"""One storage location for checkpoints, embeddings and reports: a local path or a URI.

Every job takes ``--storage``: a local folder (default ``~/raycompat_runs``) or any URI
that pyarrow's filesystems accept (``s3://bucket/prefix``, ``gs://...``, ``hdfs://...``,
``file:///shared/nfs/raycompat``). On a cluster it must be a place every node can reach:
an object store, or a network file system mounted at the same path on every node.

:func:`open_storage` resolves the location and checks, before any work starts, that it
can be written: a missing parent, a read-only folder or bad credentials stop the job at
once with a message naming the location and the reason (:class:`StorageError`), instead
of failing after an hour of training.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
import uuid
from dataclasses import dataclass

from raycompat.config import ConfigError

__all__ = ["StorageError", "Storage", "open_storage", "is_uri", "local_copy"]

DEFAULT_STORAGE = "~/raycompat_runs"


class StorageError(ConfigError):
    """The storage location cannot be used; the message names it and says why."""


def is_uri(location: str) -> bool:
    """``scheme://...`` (``s3://``, ``gs://``, ``file://``...) as opposed to a plain path."""
    return "://" in str(location)


@dataclass
class Storage:
    """A resolved location: ``filesystem`` (pyarrow) and ``root`` (a path inside it).

    ``uri`` is what Ray Train's ``RunConfig(storage_path=...)`` and the jobs print: the
    absolute local path for local storage, the URI otherwise.
    """

    uri: str
    root: str
    filesystem: object
    local: bool

    def join(self, *parts: str) -> str:
        """A location under this storage, in the same form as ``uri``."""
        if self.local:
            return os.path.join(self.uri, *parts)
        return self.uri.rstrip("/") + "/" + posixpath.join(*parts)

    def fs_path(self, *parts: str) -> str:
        """A path inside ``filesystem`` (what pyarrow calls take)."""
        return posixpath.join(self.root, *parts) if parts else self.root

    def check_writable(self) -> None:
        """Create the root if needed, write and delete a probe file; StorageError otherwise."""
        import pyarrow.fs as pafs

        probe = self.fs_path(f".raycompat-write-check-{uuid.uuid4().hex}")
        try:
            if self.local:
                parent = os.path.dirname(self.root.rstrip(os.sep)) or os.sep
                if not os.path.exists(self.root) and not os.path.isdir(parent):
                    raise StorageError(
                        f"--storage {self.uri}: the parent folder {parent} does not exist"
                    )
                os.makedirs(self.root, exist_ok=True)
                if not os.path.isdir(self.root):
                    raise StorageError(f"--storage {self.uri}: exists and is not a folder")
            else:
                self.filesystem.create_dir(self.root, recursive=True)
            with self.filesystem.open_output_stream(probe) as out:
                out.write(b"ok")
            info = self.filesystem.get_file_info(probe)
            if info.type != pafs.FileType.File:
                raise StorageError(
                    f"--storage {self.uri}: a file written there cannot be read back"
                )
            self.filesystem.delete_file(probe)
        except StorageError:
            raise
        except Exception as exc:  # OSError, PermissionError, pyarrow's credential errors
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StorageError(f"--storage {self.uri} is not writable: {reason}") from exc

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


def open_storage(location: str | None = None, check: bool = True) -> Storage:
    """Resolve ``location`` (default ``~/raycompat_runs``) and, with ``check``, make sure it
    is writable now (StorageError naming the location and the reason otherwise)."""
    import pyarrow.fs as pafs

    location = str(location or DEFAULT_STORAGE)
    if not location.strip():
        raise StorageError("--storage must not be empty")
    if is_uri(location):  # file:// URIs take this generic path too (and test it)
        try:
            filesystem, root = pafs.FileSystem.from_uri(location)
        except Exception as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StorageError(
                f"--storage {location}: not a location pyarrow can open: {reason}"
            ) from exc
        storage = Storage(
            uri=location.rstrip("/"), root=root.rstrip("/"), filesystem=filesystem, local=False
        )
    else:
        path = os.path.abspath(os.path.expanduser(location))
        storage = Storage(uri=path, root=path, filesystem=pafs.LocalFileSystem(), local=True)
    if check:
        storage.check_writable()
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
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FileNotFoundError(f"cannot read {location}: {reason}") from exc
    return target
