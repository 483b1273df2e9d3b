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

Nothing is overwritten by accident. The job records what it is (``job.json``: the job and
the options that decide its results, :func:`config_record`) in the folder when it starts. A
folder that already holds anything else is refused (``ConfigError`` naming the path and the
first options that differ) unless ``--overwrite`` is given, or unless its ``job.json`` is the
same job with identical options: then the job resumes in it (the main job reuses its trained
models). ``--overwrite`` writes into the folder anyway: the files this run writes replace the
old ones, nothing else is deleted. A folder the job created and left with nothing but
``job.json`` (a run that failed before writing anything) is removed when the process exits
(:meth:`JobOutput.cleanup_if_empty`).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import os
import posixpath
import shutil
from dataclasses import dataclass
from typing import Any

from raycompat.config import ConfigError, option
from raycompat.storage import Storage, StorageError, is_uri, open_storage

__all__ = [
    "JobOutput",
    "Location",
    "OutputOptions",
    "STAMP",
    "check_report_target",
    "config_differences",
    "config_record",
    "inspect_location",
    "remove_if_empty",
    "resolve_job_output",
]

#: the file in a report folder that says which job wrote it, with which options
STAMP = "job.json"
#: options that say where a job writes, where it runs or what it prints: never compared
NEUTRAL_OPTIONS = ("out", "storage", "name", "overwrite", "address", "verbose", "quiet")


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
    overwrite: bool = option(
        False,
        help="write into a report folder that holds another run's report (its files are "
        "replaced as this run writes them); without it such a folder is refused, and one "
        "written by this job with identical options is resumed",
    )

    def resolve(
        self, kind: str, default_out: str, config: Any = None, ignore: tuple[str, ...] = ()
    ) -> JobOutput:
        """:func:`resolve_job_output` for job ``kind`` with these options; ``config``: the
        job's options (compared with an existing folder's, less ``ignore``)."""
        return resolve_job_output(
            kind,
            out=self.out,
            storage=self.storage,
            name=self.name,
            default_out=default_out,
            config=config,
            overwrite=self.overwrite,
            ignore=ignore,
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
    created: bool = False  # this job created ``local``

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

    def cleanup_if_empty(self) -> bool:
        """Remove ``local`` when this job created it and it holds nothing but ``job.json`` and
        empty folders (the run failed before writing anything); returns whether it did."""
        return self.created and remove_if_empty(self.local)


def remove_if_empty(path: str, ignore: tuple[str, ...] = (STAMP,)) -> bool:
    """Delete folder ``path`` if it holds no file but ``ignore`` (at its top) and empty
    folders; returns whether it did."""
    if not os.path.isdir(path):
        return False
    for root, _, files in os.walk(path):
        if any(root != path or name not in ignore for name in files):
            return False
    shutil.rmtree(path, ignore_errors=True)
    return True


# -- what is already there ----------------------------------------------------------------
@dataclass(frozen=True)
class Location:
    """What a path or URI holds now: ``kind`` is ``missing``, ``file`` or ``folder``;
    ``names``: a folder's entries (not recursive)."""

    shown: str
    kind: str
    names: tuple[str, ...] = ()
    filesystem: Any = None
    root: str = ""

    def read_json(self, name: str) -> dict | None:
        """File ``name`` of the folder as JSON; ``None`` if it is missing or not JSON."""
        if name not in self.names:
            return None
        try:
            with self.filesystem.open_input_stream(posixpath.join(self.root, name)) as fh:
                value = json.loads(fh.read())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None


def inspect_location(location: str) -> Location:
    """The :class:`Location` of a local path (``~`` expanded) or a storage URI."""
    import pyarrow.fs as pafs

    try:
        if is_uri(location):
            fs, root = pafs.FileSystem.from_uri(location)
        else:
            fs, root = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(location))
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            return Location(location, "missing")
        if info.type != pafs.FileType.Directory:
            return Location(location, "file")
        entries = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except Exception as exc:  # credentials, a bad URI
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StorageError(f"{location}: cannot read it: {reason}") from exc
    names = tuple(sorted(e.base_name for e in entries))
    return Location(location, "folder", names, fs, root)


def config_record(config: Any, ignore: tuple[str, ...] = ()) -> dict | None:
    """The options that decide a job's results, as JSON: ``config`` (an options dataclass or
    a dict) less its :class:`OutputOptions` fields, :data:`NEUTRAL_OPTIONS` and ``ignore``."""
    if config is None:
        return None
    if dataclasses.is_dataclass(config):
        skip = {
            f.name
            for f in dataclasses.fields(config)
            if isinstance(getattr(config, f.name), OutputOptions)
        }
        values = {k: v for k, v in dataclasses.asdict(config).items() if k not in skip}
    else:
        values = dict(config)
    drop = set(NEUTRAL_OPTIONS) | set(ignore)
    kept = {k: v for k, v in values.items() if k not in drop}
    return json.loads(json.dumps(kept, sort_keys=True, default=str))


def _flat(values: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(there: dict, here: dict, limit: int = 3) -> str:
    """``'epochs 16 vs 1, lr 0.1 vs 0.05'``: the first ``limit`` options (nested ones as
    ``a.b``) whose values differ, what is there first; ``''`` when none does."""
    old, new = _flat(there), _flat(here)
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k, "unset") != new.get(k, "unset")]
    shown = [f"{k} {old.get(k, 'unset')} vs {new.get(k, 'unset')}" for k in keys[:limit]]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(shown) + more


def _some(names: tuple[str, ...] | list[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_report_target(target: Location, record: dict, overwrite: bool) -> str:
    """``'new'`` (nothing there but maybe an empty folder), ``'identical'`` (the same job
    with the same options wrote it: resume) or ``'overwrite'``; any other folder raises
    ``ConfigError`` naming it and what it holds. ``record``: ``{job, config}``."""
    content = [n for n in target.names if n != STAMP]
    if target.kind == "missing" or (target.kind == "folder" and not content):
        return "new"
    if target.kind == "file":
        raise StorageError(f"{target.shown} is a file, not a folder: choose another --out")
    if overwrite:
        return "overwrite"
    there = target.read_json(STAMP)
    if there == record and record.get("config") is not None:
        return "identical"
    job = record["job"]
    if there is None:
        holds = f"files ({_some(content)}) that no job of this version wrote (no {STAMP})"
    elif there.get("job") != job:
        holds = f"the output of job {there.get('job')!r}, not {job!r}"
    elif record.get("config") is None or there.get("config") is None:
        holds = f"an earlier {job} report whose options cannot be compared"
    else:
        diff = config_differences(there["config"], record["config"])
        holds = f"a {job} report made with other options ({diff})"
    raise ConfigError(
        f"{target.shown} holds {holds}: pass --overwrite to write into it anyway, or another --out"
    )


def _staging_dir(uri: str) -> str:
    """A stable local folder per URI, so a re-run resumes from what it already has."""
    key = hashlib.sha256(uri.encode()).hexdigest()[:16]
    root = os.environ.get("RAYCOMPAT_STAGING", os.path.expanduser("~/.cache/raycompat/staging"))
    return os.path.join(root, key)


def _check_existing(local: str, destination: str | None, record: dict, overwrite: bool) -> None:
    """:func:`check_report_target` on the local folder, or for a URI ``destination`` whose
    staging folder holds nothing yet, on the destination itself."""
    target = inspect_location(local)
    if destination is not None:  # errors name the destination, not the staging folder
        staged = [n for n in target.names if n != STAMP]
        target = dataclasses.replace(target, shown=destination) if staged else None
        target = target or inspect_location(destination)
    check_report_target(target, record, overwrite)


def _local_folder(out: str, given: bool) -> tuple[str, tuple | None]:
    """``(local folder, upload)`` of report location ``out``: for a URI, a staging folder
    and ``(Storage of its parent, leaf name)``; a given local path's parent must exist."""
    if is_uri(out):
        parent, leaf = out.rstrip("/").rsplit("/", 1)
        return _staging_dir(out), (open_storage(parent), leaf)
    local = os.path.abspath(os.path.expanduser(out))
    parent = os.path.dirname(local.rstrip(os.sep)) or os.sep
    if given and not os.path.exists(local) and not os.path.isdir(parent):
        raise StorageError(f"--out {out}: the parent folder {parent} does not exist")
    return local, None


def _write_stamp(local: str, record: dict) -> None:
    tmp = os.path.join(local, f".{STAMP}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(local, STAMP))


def resolve_job_output(
    kind: str,
    *,
    out: str | None,
    storage: str | None,
    name: str,
    default_out: str,
    config: Any = None,
    overwrite: bool = False,
    ignore: tuple[str, ...] = (),
) -> JobOutput:
    """Apply the module's rules for one job (``kind``: ``quickstart``, ``reproduce``,
    ``backfill``, ``hot_refresh``...). Refuses a folder holding another run's output unless
    ``overwrite`` (``ConfigError``; ``config``: the job's options, see
    :func:`config_record`), creates the local folder, records ``job.json`` and checks every
    location for writing; raises StorageError naming the location otherwise."""
    store = open_storage(storage) if storage else None
    given = out is not None
    if not given and store is not None:
        out = store.join(kind, name)  # the storage was checked: its sub-folders are created
    out = out or default_out
    local, upload = _local_folder(out, given)
    record = {"job": kind, "config": config_record(config, ignore)}
    _check_existing(local, out if upload else None, record, overwrite)
    created = not os.path.exists(local)
    try:
        os.makedirs(local, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"--out {out}: cannot create it: {exc}") from exc
    if not upload and not os.access(local, os.W_OK):
        raise StorageError(f"--out {out} is not writable")
    _write_stamp(local, record)
    runs = store.join("runs") if store is not None else os.path.join(local, "runs")
    output = JobOutput(
        local=local,
        destination=out if upload else local,
        runs=runs,
        storage=store,
        _upload=upload,
        created=created,
    )
    if created:  # a run that fails before writing anything leaves no folder behind
        atexit.register(output.cleanup_if_empty)
    return output
