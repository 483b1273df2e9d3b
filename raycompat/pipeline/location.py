"""Where a gallery run writes: a local folder or any URI pyarrow's filesystems open.

``--out DIR|URI`` names the output folder; without it, ``--storage S`` puts it at
``S/embeddings/<--name>``; without either it is ``gallery_out``. The location is resolved and
checked for writing before anything else starts (:func:`resolve_output`), so a missing or
read-only location stops the job at once with a message naming it
(:class:`raycompat.storage.StorageError`).

:class:`OutputDir` is the shard store's view of the folder: list, read, delete and write
files on its pyarrow filesystem. On a local filesystem (a plain path or ``file://``) a file
is written to a temp name, fsynced and renamed, so it appears whole or not at all; on an
object store (``s3://``, ``gs://``...) the final object is written directly (a PUT or a
multipart upload becomes visible only when it completes) and the shard completeness check
(footer and row count, ``raycompat.pipeline.writer``) guards resume on any other filesystem.
"""

from __future__ import annotations

import os
import posixpath

from raycompat.storage import Storage, StorageError, is_uri, open_storage

DEFAULT_OUT = "gallery_out"
KIND = "embeddings"


class OutputDir:
    """One output folder on a pyarrow filesystem; ``uri`` is how it is shown and returned
    (the absolute path for local folders, the URI otherwise)."""

    def __init__(self, storage: Storage):
        import pyarrow.fs as pafs

        self.storage = storage
        self.uri = storage.uri
        self.fs = storage.filesystem
        self.root = storage.root
        # a real local folder: os calls work on its paths (temp file + fsync + rename)
        self.local = isinstance(self.fs, pafs.LocalFileSystem)

    @classmethod
    def open(cls, location, what: str = "--out", check: bool = True) -> OutputDir:
        """``location``: a path, a URI, a :class:`Storage` or an ``OutputDir``. Creates the
        folder (and, for a local path, its parents) and checks that it can be written."""
        if isinstance(location, OutputDir):
            return location
        storage = (
            location if isinstance(location, Storage) else open_storage(str(location), check=False)
        )
        out = cls(storage)
        if check:
            out.ensure_writable(what)
        return out

    def ensure_writable(self, what: str = "--out") -> None:
        try:
            if self.storage.local:
                try:
                    os.makedirs(self.root, exist_ok=True)
                except OSError as exc:
                    raise StorageError(f"--storage {self.uri}: cannot create it: {exc}") from exc
            self.storage.check_writable()
        except StorageError as exc:  # Storage names the location as --storage
            message = str(exc)
            if what != "--storage" and message.startswith("--storage "):
                message = what + message[len("--storage") :]
            raise StorageError(message) from exc.__cause__

    # paths
    def path(self, name: str) -> str:
        """A path inside ``fs``."""
        return posixpath.join(self.root, name) if not self.local else os.path.join(self.root, name)

    def join(self, name: str) -> str:
        """A file under the folder in the form of ``uri``."""
        return self.storage.join(name)

    def __str__(self) -> str:
        return self.uri

    # operations
    def listdir(self) -> list[str]:
        import pyarrow.fs as pafs

        if self.local:
            return os.listdir(self.root) if os.path.isdir(self.root) else []
        infos = self.fs.get_file_info(
            pafs.FileSelector(self.root, allow_not_found=True, recursive=False)
        )
        return [i.base_name for i in infos if i.type == pafs.FileType.File]

    def isfile(self, name: str) -> bool:
        import pyarrow.fs as pafs

        if self.local:
            return os.path.isfile(self.path(name))
        return self.fs.get_file_info(self.path(name)).type == pafs.FileType.File

    def remove(self, name: str) -> None:
        if self.local:
            os.remove(self.path(name))
        else:
            self.fs.delete_file(self.path(name))

    def read_bytes(self, name: str) -> bytes:
        if self.local:
            with open(self.path(name), "rb") as fh:
                return fh.read()
        with self.fs.open_input_stream(self.path(name)) as fh:
            return fh.read()

    def open_input(self, name: str):
        """A random-access file (parquet footers)."""
        if self.local:
            return open(self.path(name), "rb")
        return self.fs.open_input_file(self.path(name))

    def write(self, name: str, writer, temp_suffix: str | None = None) -> None:
        """Write ``name`` with ``writer(file_object)``. Local: into ``.<name>.tmp<pid>``,
        fsync, rename (or ``temp_suffix`` instead of the default temp name); elsewhere: the
        final object directly."""
        if self.local:
            tmp = self.path(temp_suffix or f".{name}.tmp{os.getpid()}")
            with open(tmp, "wb") as fh:
                writer(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path(name))
            return
        with self.fs.open_output_stream(self.path(name)) as fh:
            writer(fh)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.write(name, lambda fh: fh.write(data))

    def clear(self) -> None:
        """Delete everything in the folder (``--overwrite``); the folder stays."""
        import shutil

        if self.local:
            shutil.rmtree(self.root, ignore_errors=True)
            os.makedirs(self.root, exist_ok=True)
        else:
            self.fs.delete_dir_contents(self.root, missing_dir_ok=True)
            self.fs.create_dir(self.root, recursive=True)


def resolve_output(
    out: str | None = None,
    storage: str | None = None,
    name: str = "gallery",
    default_out: str = DEFAULT_OUT,
) -> OutputDir:
    """The job's rules: ``--out`` wins; else ``<storage>/embeddings/<name>``; else
    ``default_out``. Every location involved is checked for writing now (StorageError naming
    it otherwise): the storage root itself, and the output folder."""
    if name is not None and (not name.strip() or "/" in name or name in (".", "..")):
        raise StorageError(f"--name {name!r}: must be a plain folder name")
    if out is None and storage:
        store = open_storage(storage)  # checked: names --storage in its errors
        return OutputDir.open(store.join(KIND, name), what="--storage")
    out = out or default_out
    if not is_uri(out):
        path = os.path.abspath(os.path.expanduser(out))
        parent = os.path.dirname(path.rstrip(os.sep)) or os.sep
        if not os.path.exists(path) and not os.path.isdir(parent):
            raise StorageError(f"--out {out}: the parent folder {parent} does not exist")
    if storage:  # --out given: --storage is still checked, so a bad value is not silently ignored
        open_storage(storage)
    return OutputDir.open(out, what="--out")
