"""Where a gallery run writes: a local folder or any URI pyarrow's filesystems open.

``--out DIR|URI`` names the output folder (its missing parents are created); without it,
``--storage S`` puts it at ``S/embeddings/<--name>``; without either it is ``gallery_out``.
The location is resolved and checked for writing before anything else starts
(:func:`resolve_output`), so an unwritable location stops the job at once with a message
naming it (:class:`raycompat.storage.StorageError`).

The folder is a :class:`raycompat.storage.Location`, through which the shard store lists,
reads, deletes and writes files. On this machine's disk (a plain path or ``file://``) a file
is written to a temp name, fsynced and renamed, so it appears whole or not at all; on an
object store (``s3://``, ``gs://``...) the final object is written directly (a PUT or a
multipart upload becomes visible only when it completes) and the shard completeness check
(footer and row count, ``raycompat.pipeline.writer``) guards resume on any other filesystem.
"""

from __future__ import annotations

import os

from raycompat.storage import Location, StorageError, open_storage, resolve_location

__all__ = ["DEFAULT_OUT", "KIND", "open_output", "resolve_output"]

DEFAULT_OUT = "gallery_out"
KIND = "embeddings"


def open_output(
    location: str | os.PathLike | Location, what: str = "--out", check: bool = True
) -> Location:
    """The output folder ``location`` (a path, a URI or a :class:`Location`); with ``check``,
    created with its missing parents and checked for writing (StorageError naming ``what``
    and the location otherwise)."""
    place = resolve_location(location, what)
    if check:
        place.check_writable(what, parents=True)
    return place


def resolve_output(
    out: str | None = None,
    storage: str | None = None,
    name: str = "gallery",
    default_out: str = DEFAULT_OUT,
) -> Location:
    """The job's rules: ``--out`` wins; else ``<storage>/embeddings/<name>``; else
    ``default_out``. Every location involved is checked for writing now (StorageError naming
    it otherwise): the storage root itself, and the output folder."""
    if name is not None and (not name.strip() or "/" in name or name in (".", "..")):
        raise StorageError(f"--name {name!r}: must be a plain folder name")
    if out is None and storage:
        store = open_storage(storage)  # checked: names --storage in its errors
        return open_output(store.child(KIND, name), what="--storage")
    if storage:  # --out given: --storage is still checked, so a bad value is not silently ignored
        open_storage(storage)
    return open_output(out or default_out, what="--out")
