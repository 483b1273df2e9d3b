"""Where a job writes: ``--out`` and ``--storage`` resolved once, checked before any work.

Every job that produces a report (the main job, the reproduction report, the backfill and
hot-refresh jobs) follows the same rules:

- ``--out PATH``: the report folder is ``PATH`` (its missing parent folders are created).
- ``--out URI`` (``s3://...``, ``file:///...``): the job writes into a local staging folder
  and publishes it to the URI when it ends (:meth:`JobOutput.publish`); the URI's parent is
  created (recursively) and checked for writing at start.
- no ``--out`` but ``--storage S``: the report goes to ``S/<kind>/<name>``.
- neither: ``default_out`` in the working directory.

A job declares the three flags with a nested :class:`OutputOptions` field in its options.

Training checkpoints go to ``S/runs`` with ``--storage`` (every node writes there; Ray Train
takes the URI directly), else to ``<out>/runs``. An unwritable location raises
:class:`raycompat.storage.StorageError` here, at start, not after an hour of training.

Every place is a :class:`raycompat.storage.Location`: a local path made absolute against the
working directory, or a URI.

Nothing is overwritten by accident. The job records what it is (``job.json``: the job, the
options that decide its results, :func:`config_record`, and the report folder ``out``) in the
folder when it starts. Options that name files or folders (:data:`PATH_OPTIONS`, such as
``--embeddings`` or ``--old-model``) are recorded resolved, as absolute paths or URIs: the same
relative flags run from another working directory name other inputs, and the same run given
absolute paths names the same ones. A folder that already holds anything else is refused
(``ConfigError`` naming the folder and the first options that differ) unless ``--overwrite``
is given, or unless its ``job.json`` is the same job with identical options: then the job
resumes in it (the main job reuses its trained models). ``--overwrite`` writes into the
folder anyway: the files this run writes replace the old ones, nothing else is deleted. A
folder the job created and left with nothing but ``job.json`` (a run that failed before
writing anything) is removed when the process exits (:meth:`JobOutput.cleanup_if_empty`).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

from raycompat.config import ConfigError, option
from raycompat.storage import Location, StorageError, is_uri, open_storage, resolve_location

__all__ = [
    "JobOutput",
    "OutputOptions",
    "PATH_OPTIONS",
    "STAMP",
    "check_report_target",
    "config_differences",
    "config_record",
    "remove_if_empty",
    "resolve_job_output",
]

#: the file in a report folder that says which job wrote it, with which options
STAMP = "job.json"
#: options that say where a job writes, where and how many at a time it runs or what it prints:
#: never compared
NEUTRAL_OPTIONS = (
    "out",
    "storage",
    "name",
    "overwrite",
    "address",
    "parallel",
    "verbose",
    "quiet",
)
#: options (at any depth) whose value names a file or folder: recorded resolved
PATH_OPTIONS = (
    "embeddings",
    "old_model",
    "new_model",
    "models",
    "newstar_metrics",
    "old_features",
    "scenario",
    "path",
    "image_root",
)


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
    storage: Location | None = None
    _upload: tuple | None = None  # (Location of the parent, leaf name) for a URI destination
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


# -- what a job records ------------------------------------------------------------------
def resolved_option(value: str) -> str:
    """The value of a :data:`PATH_OPTIONS` option as recorded: the :class:`Location` ``uri``
    (absolute path or URI) when it names a place -- a URI, an absolute or ``~`` path, a path
    with a folder in it, or a name that exists in the working directory -- else as typed (a
    name such as a built-in scenario's)."""
    named = is_uri(value) or os.path.isabs(value) or value.startswith("~") or os.sep in value
    return resolve_location(value).uri if named or os.path.exists(value) else value


def _resolve_paths(values: Any) -> Any:
    """``values`` (JSON-like) with every :data:`PATH_OPTIONS` string resolved, at any depth."""
    if not isinstance(values, dict):
        return values
    return {
        key: resolved_option(value)
        if key in PATH_OPTIONS and isinstance(value, str) and value
        else _resolve_paths(value)
        for key, value in values.items()
    }


def config_record(config: Any, ignore: tuple[str, ...] = ()) -> dict | None:
    """The options that decide a job's results, as JSON: ``config`` (an options dataclass or
    a dict) less its :class:`OutputOptions` fields, :data:`NEUTRAL_OPTIONS` and ``ignore``;
    :data:`PATH_OPTIONS` resolved (:func:`resolved_option`)."""
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
    return _resolve_paths(json.loads(json.dumps(kept, sort_keys=True, default=str)))


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


def _identity(stamp: dict | None) -> dict | None:
    """What makes two runs the same: the job and its options (not where the folder is)."""
    return None if stamp is None else {"job": stamp.get("job"), "config": stamp.get("config")}


def check_report_target(
    target: Location, record: dict, overwrite: bool, shown: str | None = None
) -> str:
    """``'new'`` (nothing there but maybe an empty folder), ``'identical'`` (the same job
    with the same options wrote it: resume) or ``'overwrite'``; any other folder raises
    ``ConfigError`` naming it (``shown``, default its ``uri``) and what it holds.
    ``record``: ``{job, config}``."""
    shown = shown or target.uri
    kind = target.kind()
    content = [n for n in target.listdir() if n != STAMP]
    if kind == "missing" or (kind == "folder" and not content):
        return "new"
    if kind == "file":
        raise StorageError(f"{shown} is a file, not a folder: choose another --out")
    if overwrite:
        return "overwrite"
    there = target.read_json(STAMP)
    if _identity(there) == _identity(record) and record.get("config") is not None:
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
        f"{shown} holds {holds}: pass --overwrite to write into it anyway, or another --out"
    )


def _staging_dir(uri: str) -> str:
    """A stable local folder per URI, so a re-run resumes from what it already has."""
    key = hashlib.sha256(uri.encode()).hexdigest()[:16]
    root = os.environ.get("RAYCOMPAT_STAGING", os.path.expanduser("~/.cache/raycompat/staging"))
    return os.path.join(root, key)


def _check_existing(
    local: Location, destination: Location | None, record: dict, overwrite: bool
) -> None:
    """:func:`check_report_target` on the local folder, or for a URI ``destination`` whose
    staging folder holds nothing yet, on the destination itself (errors name the
    destination, not the staging folder)."""
    if destination is None:
        check_report_target(local, record, overwrite)
    elif [n for n in local.listdir() if n != STAMP]:
        check_report_target(local, record, overwrite, shown=destination.uri)
    else:
        check_report_target(destination, record, overwrite)


def _folders(out: str) -> tuple[Location, Location | None]:
    """``(local folder, URI destination or None)`` of report location ``out``: for a URI, a
    staging folder and the URI, whose parent is created and checked for writing now."""
    place = resolve_location(out, "--out")
    if place.local:
        return place, None
    place.parent().check_writable("--out", parents=True)
    return resolve_location(_staging_dir(place.uri)), place


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
    :func:`config_record`), creates the local folder and its parents, records ``job.json``
    and checks every location for writing; raises StorageError naming the location
    otherwise."""
    store = open_storage(storage) if storage else None
    if out is None and store is not None:
        out = store.join(kind, name)  # the storage was checked: its sub-folders are created
    local, destination = _folders(out or default_out)
    record = {"job": kind, "config": config_record(config, ignore)}
    _check_existing(local, destination, record, overwrite)
    created = not local.exists()
    local.make_dirs("--out")
    if destination is None and not os.access(local.root, os.W_OK):
        raise StorageError(f"--out {local.uri} is not writable")
    stamp = dict(record, out=(destination or local).uri)
    local.write_bytes(STAMP, json.dumps(stamp, indent=2, sort_keys=True).encode())
    runs = store.join("runs") if store is not None else local.join("runs")
    upload = None if destination is None else (destination.parent(), destination.name)
    output = JobOutput(
        local=local.uri,
        destination=(destination or local).uri,
        runs=runs,
        storage=store,
        _upload=upload,
        created=created,
    )
    if created:  # a run that fails before writing anything leaves no folder behind
        atexit.register(output.cleanup_if_empty)
    return output
