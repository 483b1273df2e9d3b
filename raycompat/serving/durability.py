"""A shard's state on disk: a snapshot plus an append-only log of the upserts applied since.

docs/architecture.md, "Durability".  Nothing here is pickled.  Formats:

* snapshot ``snapshot.npz`` (``numpy.savez``, read with ``allow_pickle=False``): for every
  representation ``r`` the arrays ``ids_<r>`` (int64) and ``vec_<r>`` (float32 ``[n, D_r]``),
  and ``meta`` -- a UTF-8 JSON document as uint8 (``seq``: the last log sequence number the
  snapshot contains, ``dims``, free-form ``info``).  Written to a temporary file, fsynced,
  renamed over the old one (atomic on POSIX), then the directory is fsynced; a failed write
  removes its temporary file.  A snapshot that cannot be read raises :class:`CorruptStateError`
  naming the file and the cause.
* snapshot arrays of format 2 (``meta["format"] == 2``): ``model_<r>`` (uint16, per item: the
  index in ``meta["models"]`` of the fingerprint of the model that produced its vector), and the
  old vectors kept for a rollback by the representation they return to, ``kept_ids_<r>``,
  ``kept_vec_<r>``, ``kept_model_<r>`` (:mod:`raycompat.serving.shard_content`).  A snapshot
  without them (written before model identity) loads with every item's model unrecorded and
  nothing kept.
* log ``upserts.log``: records ``header | model | ids int64[n] | vectors float32[n * dim]`` with
  the header ``<4sQIIBBHI`` = magic ``RCU2``, sequence number, n, dim, representation code,
  operation (0 upsert, 1 rollback: ids only, 2 finalize: nothing), the model fingerprint's
  length in bytes, CRC32 of the payload (the model's UTF-8 bytes, ids, vectors).  Records of
  the first format (magic ``RCUL``, header ``<4sQIIBI``, no operation and no model: an upsert)
  are still read.  :meth:`UpsertLog.append` writes a whole record with unbuffered ``os.write``
  calls and fsyncs it *before* the upsert is applied and acknowledged.  If any write or the
  fsync fails, the file is truncated back to its last good length (nothing of a failed record
  can reach the disk with a later append) and :class:`StorageError` says what happened
  ("no space left on device at <path>").  The replicas of a shard share the file, each reading
  it through its own :class:`UpsertLog` cursor; :mod:`raycompat.serving.shared_log` holds the
  locks, the rotation at snapshots, and the reading across rotated files.

Reading (:meth:`UpsertLog.read_new`) tells two kinds of damage apart:

* a *torn tail* -- the last record is incomplete (a crash in the middle of an append; that
  upsert was never acknowledged): it is not read (``torn_tail_bytes``), and the next writer
  cuts it off (:meth:`UpsertLog.truncate_torn`);
* *corruption* -- a complete record whose CRC does not match, or bytes that are no record,
  followed by valid records: the bad region is skipped, every valid record after it is kept,
  and the damage is reported (:class:`LogDamage`: offset, bytes, cause, the sequence numbers
  lost).  The file itself is left in place; the shard then writes a snapshot and moves the
  damaged log aside as ``upserts.log.corrupt-<time>`` (:mod:`raycompat.serving.state`).

Recovery = load the snapshot, then replay the log records whose sequence number is larger
than the snapshot's (a crash between writing a snapshot and deleting the rotated logs it
contains replays nothing twice).

The state directory is named like every other place (:func:`state_directory`), but must be on
this machine's disk: the shards lock, append to and fsync its files.  Every failed write
raises the project's one :class:`raycompat.storage.StorageError`.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from raycompat.storage import StorageError, resolve_location

__all__ = [
    "LogRecord",
    "LogDamage",
    "UpsertLog",
    "StorageError",
    "CorruptStateError",
    "write_snapshot",
    "open_snapshot",
    "read_snapshot",
    "snapshot_seq",
    "storage_error",
    "atomic_write",
    "fsync_dir",
    "state_directory",
    "SNAPSHOT_NAME",
    "LOG_NAME",
    "OP_UPSERT",
    "OP_ROLLBACK",
    "OP_FINALIZE",
    "read_snapshot_arrays",
]

SNAPSHOT_NAME = "snapshot.npz"
LOG_NAME = "upserts.log"
_HEADER = struct.Struct("<4sQIIBI")  # format 1: an upsert without a model
_MAGIC = b"RCUL"
_HEADER2 = struct.Struct("<4sQIIBBHI")  # format 2: operation and model fingerprint
_MAGIC2 = b"RCU2"
#: the operations of a format-2 record
OP_UPSERT, OP_ROLLBACK, OP_FINALIZE = 0, 1, 2
_MAX_RECORD_BYTES = 1 << 34  # no legitimate record is larger (a corrupt n or dim is)


class CorruptStateError(RuntimeError):
    """A snapshot (or another state file) cannot be read; the message names file and cause."""


def state_directory(location: str, what: str = "state_dir") -> str:
    """The live index's state directory as an absolute local path (``~`` expanded; a
    ``file://`` URI's path); StorageError naming ``what`` for a place off this machine's disk,
    where files cannot be locked and fsynced."""
    place = resolve_location(location, what)
    if not place.on_disk:
        raise StorageError(
            f"{what} {place.uri}: the live index's state must be a local folder "
            "(its shards lock and fsync files there)"
        )
    return place.root


def storage_error(exc: OSError, path: str, doing: str = "") -> StorageError:
    """``"no space left on device at <path>"`` (plus what was being done) from an ``OSError``."""
    why = (exc.strerror or str(exc)).lower()
    return StorageError(f"{why} at {path}" + (f" ({doing})" if doing else ""))


@dataclass
class LogRecord:
    """One record: an upsert of ``ids`` into representation ``rep`` with ``vectors`` produced by
    ``model`` (``""``: not recorded, a format-1 record), a rollback of ``ids``, or a finalize;
    ``nbytes``: its size in the file."""

    seq: int
    rep: int
    ids: np.ndarray
    vectors: np.ndarray
    offset: int = 0
    op: int = OP_UPSERT
    model: str = ""
    nbytes: int = 0


@dataclass
class LogDamage:
    """Bytes of the log that are no valid record, with valid records after them."""

    offset: int
    nbytes: int
    cause: str
    lost_seqs: list[int] = field(default_factory=list)

    def as_json(self) -> dict:
        return {
            "offset": self.offset,
            "bytes": self.nbytes,
            "cause": self.cause,
            "lost_seqs": self.lost_seqs,
        }


def _record_at(data: bytes, pos: int) -> tuple[LogRecord | None, str]:
    """The record starting at ``pos``, or ``(None, why)``; ``why`` is ``"torn"`` when the
    bytes end before the record does."""
    if pos + _HEADER.size > len(data):
        return None, "torn"
    magic = data[pos : pos + 4]
    if magic not in (_MAGIC, _MAGIC2):
        return None, "bad magic"
    header = _HEADER2 if magic == _MAGIC2 else _HEADER
    if pos + header.size > len(data):
        return None, "torn"
    if magic == _MAGIC2:
        _, seq, n, dim, rep, op, model_len, crc = header.unpack_from(data, pos)
    else:
        _, seq, n, dim, rep, crc = header.unpack_from(data, pos)
        op, model_len = OP_UPSERT, 0
    if op > OP_FINALIZE:
        return None, "unknown operation"
    size = model_len + n * 8 + n * dim * 4
    if size > _MAX_RECORD_BYTES:
        return None, "impossible record size"
    start = pos + header.size
    if start + size > len(data):
        return None, "torn"
    payload = data[start : start + size]
    if zlib.crc32(payload) != crc:
        return None, "CRC mismatch"
    try:
        model = payload[:model_len].decode("utf-8")
    except UnicodeDecodeError:
        return None, "model fingerprint is not UTF-8"
    ids = np.frombuffer(payload, dtype="<i8", count=n, offset=model_len).astype(np.int64)
    vecs = np.frombuffer(payload, dtype="<f4", offset=model_len + n * 8).astype(np.float32)
    rec = LogRecord(int(seq), int(rep), ids, vecs.reshape(n, dim), pos, int(op), model)
    rec.nbytes = header.size + size
    return rec, ""


def _next_record(data: bytes, pos: int) -> LogRecord | None:
    """The first valid record starting after ``pos`` (a magic whose record checks out)."""
    at = data.find(_MAGIC[:3], pos + 1)
    while at >= 0:
        rec, _ = _record_at(data, at)
        if rec is not None:
            return rec
        at = data.find(_MAGIC[:3], at + 1)
    return None


def _read_log(data: bytes) -> tuple[list[LogRecord], list[LogDamage], int]:
    """``(records, damage, good_end)``: the valid records, the corrupt regions between them,
    and where the valid part of the file ends (a torn tail starts there)."""
    records: list[LogRecord] = []
    damage: list[LogDamage] = []
    pos = 0
    while pos < len(data):
        rec, why = _record_at(data, pos)
        if rec is None:
            nxt = _next_record(data, pos)
            if nxt is None:  # nothing valid follows
                if why == "torn":  # the last record is incomplete: a crash mid-append
                    return records, damage, pos
                damage.append(LogDamage(pos, len(data) - pos, why))
                return records, damage, len(data)
            damage.append(LogDamage(pos, nxt.offset - pos, why))
            rec = nxt
        records.append(rec)
        pos = rec.offset + rec.nbytes
    return records, damage, pos


def _lost_seqs(
    records: list[LogRecord], damage: list[LogDamage], before_seq: int | None = None
) -> None:
    """Fill in the sequence numbers missing around each damaged region (``before_seq``: the
    last sequence number read before these records)."""
    for d in damage:
        before = [r.seq for r in records if r.offset < d.offset]
        after = [r.seq for r in records if r.offset > d.offset]
        lo = before[-1] + 1 if before else (before_seq + 1 if before_seq is not None else None)
        hi = after[0] - 1 if after else None
        if lo is not None and hi is not None and hi >= lo:
            d.lost_seqs = list(range(lo, hi + 1))


class UpsertLog:
    """One log file, read and appended through a cursor (see the module docstring).

    Several processes (the replicas of a shard) may hold the same file open: the caller
    serialises them with the shard's write lock (:mod:`raycompat.serving.shared_log`), so a
    read under that lock never sees an append in progress.  :attr:`pos` is where the complete
    records read or appended so far end; bytes after it at the last read are a *torn tail*
    (:attr:`torn_tail_bytes`) that only a writer cuts off (:meth:`truncate_torn`)."""

    def __init__(self, path: str, fsync: bool = True, create: bool = True):
        self.path = path
        self.fsync = fsync
        flags = os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0)
        self._fd: int | None = os.open(path, flags, 0o644)
        self.inode = os.fstat(self._fd).st_ino
        self.pos = 0
        self.torn_tail_bytes = 0
        self.items = 0  # items in the records of this file read or appended so far
        self.last_seq: int | None = None
        self.damage: list[LogDamage] = []
        self.broken: str | None = None  # a failed rollback: no more appends until a restart
        self.last_error: str | None = None  # the last failed append, until one succeeds

    @property
    def truncated_bytes(self) -> int:  # the name older status readers know
        return self.torn_tail_bytes

    def read_new(self) -> list[LogRecord]:
        """The complete records after :attr:`pos`, in file order; corrupt regions between
        them are skipped and added to :attr:`damage` (the file is not modified)."""
        size = os.fstat(self._fd).st_size
        if size <= self.pos:
            self.torn_tail_bytes = 0
            return []
        data = os.pread(self._fd, size - self.pos, self.pos)
        records, damage, good = _read_log(data)
        for rec in records:
            rec.offset += self.pos
        for d in damage:
            d.offset += self.pos
        _lost_seqs(records, damage, self.last_seq)
        self.damage += damage
        self.pos += good
        self.torn_tail_bytes = size - self.pos
        if records:
            self.last_seq = records[-1].seq
            self.items += sum(int(r.ids.size) for r in records)
        return records

    def replay(self) -> Iterator[LogRecord]:
        """Every valid record of the file from its start (for inspection and tests)."""
        self.pos, self.items, self.last_seq, self.damage = 0, 0, None, []
        yield from self.read_new()

    def truncate_torn(self) -> int:
        """Cut a torn tail off (only under the shard's write lock); returns the bytes cut."""
        cut = os.fstat(self._fd).st_size - self.pos
        if cut > 0:
            os.ftruncate(self._fd, self.pos)
            if self.fsync:
                os.fsync(self._fd)
        self.torn_tail_bytes = 0
        return max(cut, 0)

    def append(
        self,
        seq: int,
        rep: int,
        ids: np.ndarray,
        vectors: np.ndarray,
        op: int = OP_UPSERT,
        model: str = "",
    ) -> None:
        """Write one whole record at :attr:`pos` (the end of the file: the caller holds the
        write lock and has read and truncated up to it) and fsync it; on any failure roll the
        file back to :attr:`pos` and raise :class:`StorageError` (also kept in
        :attr:`last_error` until an append succeeds)."""
        if self.broken:
            raise StorageError(self.broken)
        ids = np.ascontiguousarray(ids, dtype="<i8")
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        n, dim = vectors.shape
        name = model.encode("utf-8")
        payload = name + ids.tobytes() + vectors.tobytes()
        head = _HEADER2.pack(
            _MAGIC2, int(seq), int(n), int(dim), int(rep), int(op), len(name), zlib.crc32(payload)
        )
        record = memoryview(head + payload)
        try:
            written = 0
            while written < len(record):
                written += os.write(self._fd, record[written:])
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            self._rollback()
            err = storage_error(exc, self.path, f"appending log record {seq}")
            self.last_error = str(err)
            raise err from None
        self.last_error = None
        self.pos += len(record)
        self.items += int(n)
        self.last_seq = int(seq)

    def _rollback(self) -> None:
        """Cut the file back to its last good length after a failed append."""
        try:
            os.ftruncate(self._fd, self.pos)
            os.fsync(self._fd)
        except OSError as exc:
            self.broken = (
                f"{storage_error(exc, self.path, 'rolling back a failed append')}; "
                "the log refuses appends until the shard restarts"
            )

    def replaced(self) -> bool:
        """Whether :attr:`path` now names another file (the log was rotated or set aside)."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True

    def size_bytes(self) -> int:
        return os.fstat(self._fd).st_size if self._fd is not None else 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_snapshot(
    directory: str,
    seq: int,
    parts: dict[str, tuple[np.ndarray, np.ndarray]],
    dims: dict[str, int],
    info: dict | None = None,
    fsync: bool = True,
    arrays: dict[str, np.ndarray] | None = None,
    models: list[str] | None = None,
) -> str:
    """Atomically write ``parts`` (``{rep name: (ids, vectors)}``) as the snapshot at ``seq``,
    with the format-2 ``arrays`` (``model_<r>``, ``kept_*_<r>``) and the fingerprint table
    ``models`` they index; :class:`StorageError` (and no temporary file left) when the write
    fails."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SNAPSHOT_NAME)
    tmp = path + ".tmp"
    out = dict(arrays or {})
    for name, (ids, vecs) in parts.items():
        out[f"ids_{name}"] = np.asarray(ids, dtype=np.int64)
        out[f"vec_{name}"] = np.asarray(vecs, dtype=np.float32).reshape(len(ids), dims[name])
    meta = {"seq": int(seq), "dims": dims, "info": info or {}}
    if models is not None:
        meta.update(format=2, models=list(models))
    out["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    try:
        with open(tmp, "wb") as fh:
            np.savez(fh, **out)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        if fsync:
            fsync_dir(directory)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise storage_error(exc, tmp, f"writing the snapshot at seq {seq}") from None
    return path


def _corrupt_snapshot(path: str, exc: Exception) -> CorruptStateError:
    return CorruptStateError(
        f"snapshot {path} is corrupt ({type(exc).__name__}: {exc}); restore it from a "
        "backup, or move the shard directory away to reload the shard from the gallery"
    )


def open_snapshot(directory: str):
    """The snapshot file opened for reading (``None`` when there is none): open it while the
    files are consistent, read it later with :func:`read_snapshot` (an open file survives its
    replacement by a newer snapshot)."""
    path = os.path.join(directory, SNAPSHOT_NAME)
    try:
        return open(path, "rb")
    except FileNotFoundError:
        return None


def read_snapshot(
    directory: str, fh=None
) -> tuple[int, dict[str, tuple[np.ndarray, np.ndarray]], dict] | None:
    """``(seq, {rep: (ids, vectors)}, meta)`` or ``None`` when there is no snapshot (``fh``:
    the snapshot file already opened by :func:`open_snapshot`);
    :class:`CorruptStateError` naming the file and the cause when it cannot be read."""
    snap = read_snapshot_arrays(directory, fh)
    if snap is None:
        return None
    seq, arrays, meta = snap
    parts = {
        key[4:]: (arrays[key], arrays[f"vec_{key[4:]}"]) for key in arrays if key.startswith("ids_")
    }
    return seq, parts, meta


def read_snapshot_arrays(directory: str, fh=None) -> tuple[int, dict[str, np.ndarray], dict] | None:
    """``(seq, every array by name, meta)`` of the snapshot (see :func:`read_snapshot`); the
    ``ids_<r>`` / ``vec_<r>`` pairs checked for matching lengths."""
    path = os.path.join(directory, SNAPSHOT_NAME)
    fh = fh if fh is not None else open_snapshot(directory)
    if fh is None:
        return None
    try:
        with fh, np.load(fh, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            arrays = {key: z[key] for key in z.files if key != "meta"}
            for key in [k for k in arrays if k.startswith("ids_")]:
                name = key[4:]
                ids = arrays[key] = arrays[key].astype(np.int64)
                vecs = arrays[f"vec_{name}"] = arrays[f"vec_{name}"].astype(np.float32)
                if vecs.ndim != 2 or vecs.shape[0] != ids.size:
                    raise ValueError(f"{name}: {ids.size} ids but vectors {vecs.shape}")
            seq = int(meta["seq"])
    except Exception as exc:  # zip, npy, JSON or shape damage: name the file and the cause
        raise _corrupt_snapshot(path, exc) from None
    return seq, arrays, meta


def snapshot_seq(directory: str, fh=None) -> int | None:
    """The sequence number of the snapshot (``None``: none), reading only its metadata;
    ``fh``: an open snapshot file, left open at its start."""
    own = fh is None
    fh = open_snapshot(directory) if own else fh
    if fh is None:
        return None
    try:
        with np.load(fh, allow_pickle=False) as z:
            return int(json.loads(bytes(z["meta"]).decode())["seq"])
    except Exception as exc:
        raise _corrupt_snapshot(os.path.join(directory, SNAPSHOT_NAME), exc) from None
    finally:
        if own:
            fh.close()
        else:
            fh.seek(0)


def corrupt_suffix() -> str:
    """``corrupt-<UTC time>``: the name a damaged log is kept under."""
    return "corrupt-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def list_files(directory: str) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []
