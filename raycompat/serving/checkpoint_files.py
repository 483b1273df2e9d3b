"""The backfill controller's files in the state directory (its checkpoint, order and canary):
written whole or not at all, refused with the disk's reason (docs/live-index.md, "Backfill
control"). The gallery itself lives in the store (:mod:`raycompat.serving.served_store`)."""

from __future__ import annotations

import os

from raycompat.storage import StorageError, resolve_location

__all__ = ["CorruptStateError", "atomic_write", "state_directory", "storage_error"]


class CorruptStateError(RuntimeError):
    """A checkpoint file that cannot be read back (named, with what to do)."""


def state_directory(location: str, what: str = "state_dir") -> str:
    """The live index's state directory as an absolute local path (``~`` expanded; a
    ``file://`` URI's path); StorageError naming ``what`` for a place off this machine's disk."""
    place = resolve_location(location, what)
    if not place.on_disk:
        raise StorageError(
            f"{what} {place.uri}: the live index's state must be a local folder "
            "(its backfill checkpoint is written there)"
        )
    return place.root


def storage_error(exc: OSError, path: str, doing: str = "") -> StorageError:
    """``"no space left on device at <path>"`` (plus what was being done) from an ``OSError``."""
    why = (exc.strerror or str(exc)).lower()
    return StorageError(f"{why} at {path}" + (f" ({doing})" if doing else ""))


def atomic_write(path: str, write, doing: str = "") -> None:
    """``write(binary file)`` into ``path.tmp``, fsync, rename over ``path``; a failure removes
    the temporary file and raises :class:`StorageError` ("no space left on device at ...")."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise storage_error(exc, tmp, doing) from None
