"""Where a job writes: ``--out`` and ``--storage`` resolved once, checked before any work.

Every job that produces a report (the main job, the reproduction report, the backfill and
hot-refresh jobs) follows the same rules:

- ``--out PATH``: the report folder is ``PATH``.
- ``--out URI`` (``s3://...``, ``file:///...``): the job writes into a local staging folder
  and publishes it to the URI when it ends (:meth:`JobOutput.publish`).
- no ``--out`` but ``--storage S``: the report goes to ``S/<kind>/<name>``.
- neither: ``default_out`` in the working directory.

A job declares the three flags with a nested :class:`OutputOptions` field in its options.

Training checkpoints go to ``S/runs`` with ``--storage`` (every node writes there; Ray Train
takes the URI directly), else to ``<out>/runs``. An unwritable location raises
:class:`raycompat.storage.StorageError` here, at start, not after an hour of training.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from raycompat.config import option
from raycompat.storage import Storage, StorageError, is_uri, open_storage

__all__ = ["JobOutput", "OutputOptions", "resolve_job_output"]


@dataclass(frozen=True)
class OutputOptions:
    """``--out``, ``--storage`` and ``--name`` of a job that writes a report: a nested field
    of its options (each job sets its own ``name`` default with ``dataclasses.replace``)."""

    out: str | None = option(
        None,
        help="report folder or URI; none: a folder in the working "
        "directory, or <storage>/<job>/<name> with --storage",
    )
    storage: str | None = option(
        None,
        help="shared storage for checkpoints, embeddings and reports: "
        "a local path or any URI pyarrow opens (s3://bucket/prefix, "
        "gs://..., file:///nfs/...); checked for writing at start; "
        "checkpoints go to <storage>/runs",
    )
    name: str = option("main", help="report folder name under <storage>/<job>")

    def resolve(self, kind: str, default_out: str) -> JobOutput:
        """:func:`resolve_job_output` for job ``kind`` with these options."""
        return resolve_job_output(
            kind, out=self.out, storage=self.storage, name=self.name, default_out=default_out
        )


@dataclass
class JobOutput:
    """``local``: the folder the driver writes; ``destination``: where the results end up
    (``local`` itself, or a URI that :meth:`publish` uploads to); ``runs``: the Ray Train
    storage path for checkpoints."""

    local: str
    destination: str
    runs: str
    storage: Storage | None = None
    _upload: tuple | None = None  # (Storage of the parent, leaf name) for a URI destination

    @property
    def remote(self) -> bool:
        return self._upload is not None

    def path(self, *parts: str) -> str:
        """A file or folder under the local output folder."""
        return os.path.join(self.local, *parts)

    def publish(self) -> str:
        """Copy the local folder to a URI destination (no-op for local ones); returns
        ``destination``."""
        if self._upload is not None:
            storage, leaf = self._upload
            storage.upload_dir(self.local, leaf)
        return self.destination


def _staging_dir(uri: str) -> str:
    """A stable local folder per URI, so a re-run resumes from what it already has."""
    key = hashlib.sha256(uri.encode()).hexdigest()[:16]
    root = os.environ.get("RAYCOMPAT_STAGING", os.path.expanduser("~/.cache/raycompat/staging"))
    return os.path.join(root, key)


def resolve_job_output(
    kind: str, *, out: str | None, storage: str | None, name: str, default_out: str
) -> JobOutput:
    """Apply the module's rules for one job (``kind``: ``quickstart``, ``reproduce``,
    ``backfill``, ``hot_refresh``...). Creates the local folder and checks every location
    for writing; raises StorageError naming the location otherwise."""
    store = open_storage(storage) if storage else None
    given = out is not None
    if not given and store is not None:
        out = store.join(kind, name)  # the storage was checked: its sub-folders are created
    out = out or default_out
    upload = None
    if is_uri(out):
        parent, leaf = out.rstrip("/").rsplit("/", 1)
        upload = (open_storage(parent), leaf)
        local = _staging_dir(out)
    else:
        local = os.path.abspath(os.path.expanduser(out))
        parent = os.path.dirname(local.rstrip(os.sep)) or os.sep
        if given and not os.path.exists(local) and not os.path.isdir(parent):
            raise StorageError(f"--out {out}: the parent folder {parent} does not exist")
    try:
        os.makedirs(local, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"--out {out}: cannot create it: {exc}") from exc
    if not upload and not os.access(local, os.W_OK):
        raise StorageError(f"--out {out} is not writable")
    runs = store.join("runs") if store is not None else os.path.join(local, "runs")
    return JobOutput(
        local=local, destination=out if upload else local, runs=runs, storage=store, _upload=upload
    )
