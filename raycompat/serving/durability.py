"""A shard's state on disk: a snapshot plus an append-only log of the upserts applied since.

Nothing here is pickled.  Formats:

* snapshot ``snapshot.npz`` (``numpy.savez``, read with ``allow_pickle=False``): for every
  representation ``r`` the arrays ``ids_<r>`` (int64) and ``vec_<r>`` (float32 ``[n, D_r]``),
  and ``meta`` -- a UTF-8 JSON document as uint8 (``seq``: the last log sequence number the
  snapshot contains, ``dims``, free-form ``info``).  Written to a temporary file, fsynced, then
  renamed over the old one (atomic on POSIX).
* log ``upserts.log``: records ``header | ids int64[n] | vectors float32[n * dim]`` with the
  header ``<4sQIIBI`` = magic ``RCUL``, sequence number, n, dim, representation code, CRC32 of
  the payload.  A record is appended and fsynced *before* its upsert is applied in memory and
  acknowledged, so an acknowledged upsert is never lost.  Replay stops at the first torn or
  corrupt record (a crash in the middle of an append) and truncates the file there: that
  upsert was never acknowledged.

Recovery = load the snapshot, then replay the log records whose sequence number is larger
than the snapshot's (a crash between writing a snapshot and truncating the log replays
nothing twice).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["LogRecord", "UpsertLog", "write_snapshot", "read_snapshot", "SNAPSHOT_NAME", "LOG_NAME"]

SNAPSHOT_NAME = "snapshot.npz"
LOG_NAME = "upserts.log"
_HEADER = struct.Struct("<4sQIIBI")
_MAGIC = b"RCUL"


@dataclass
class LogRecord:
    seq: int
    rep: int
    ids: np.ndarray
    vectors: np.ndarray


class UpsertLog:
    """Append-only log of applied upserts (see the module docstring)."""

    def __init__(self, path: str, fsync: bool = True):
        self.path = path
        self.fsync = fsync
        self.truncated_bytes = 0
        self._fh = None

    def replay(self) -> Iterator[LogRecord]:
        """Every complete record in order; a torn tail is cut off (``truncated_bytes``)."""
        if not os.path.exists(self.path):
            return
        good = 0
        with open(self.path, "rb") as fh:
            data = fh.read()
        pos = 0
        while pos < len(data):
            if pos + _HEADER.size > len(data):
                break
            magic, seq, n, dim, rep, crc = _HEADER.unpack_from(data, pos)
            size = n * 8 + n * dim * 4
            start = pos + _HEADER.size
            if magic != _MAGIC or start + size > len(data):
                break
            payload = data[start : start + size]
            if zlib.crc32(payload) != crc:
                break
            ids = np.frombuffer(payload, dtype="<i8", count=n).astype(np.int64)
            vecs = (
                np.frombuffer(payload, dtype="<f4", offset=n * 8).astype(np.float32).reshape(n, dim)
            )
            pos = start + size
            good = pos
            yield LogRecord(int(seq), int(rep), ids, vecs)
        if good < len(data):
            self.truncated_bytes = len(data) - good
            with open(self.path, "r+b") as fh:
                fh.truncate(good)

    def _open(self):
        if self._fh is None:
            self._fh = open(self.path, "ab")
        return self._fh

    def append(self, seq: int, rep: int, ids: np.ndarray, vectors: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype="<i8")
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        n, dim = vectors.shape
        payload = ids.tobytes() + vectors.tobytes()
        fh = self._open()
        fh.write(
            _HEADER.pack(_MAGIC, int(seq), int(n), int(dim), int(rep), zlib.crc32(payload))
            + payload
        )
        fh.flush()
        if self.fsync:
            os.fsync(fh.fileno())

    def reset(self) -> None:
        """Empty the log (after a snapshot that contains every record)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        with open(self.path, "wb") as fh:
            fh.flush()
            if self.fsync:
                os.fsync(fh.fileno())

    def size_bytes(self) -> int:
        return os.path.getsize(self.path) if os.path.exists(self.path) else 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def write_snapshot(
    directory: str,
    seq: int,
    parts: dict[str, tuple[np.ndarray, np.ndarray]],
    dims: dict[str, int],
    info: dict | None = None,
    fsync: bool = True,
) -> str:
    """Atomically write ``parts`` (``{rep name: (ids, vectors)}``) as the snapshot at ``seq``."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SNAPSHOT_NAME)
    tmp = path + ".tmp"
    arrays = {}
    for name, (ids, vecs) in parts.items():
        arrays[f"ids_{name}"] = np.asarray(ids, dtype=np.int64)
        arrays[f"vec_{name}"] = np.asarray(vecs, dtype=np.float32).reshape(len(ids), dims[name])
    meta = json.dumps({"seq": int(seq), "dims": dims, "info": info or {}}).encode()
    arrays["meta"] = np.frombuffer(meta, dtype=np.uint8)
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def read_snapshot(
    directory: str,
) -> tuple[int, dict[str, tuple[np.ndarray, np.ndarray]], dict] | None:
    """``(seq, {rep: (ids, vectors)}, meta)`` or ``None`` when there is no snapshot."""
    path = os.path.join(directory, SNAPSHOT_NAME)
    if not os.path.exists(path):
        return None
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        parts = {}
        for key in z.files:
            if key.startswith("ids_"):
                name = key[4:]
                parts[name] = (z[key].astype(np.int64), z[f"vec_{name}"].astype(np.float32))
    return int(meta["seq"]), parts, meta


def list_files(directory: str) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []
