"""One shard's log, shared by the shard's replicas: locks, rotation, and catching up.

docs/architecture.md, "Replicas".  Every replica of a shard opens the same directory and
recovers from the same snapshot and log.  An upsert goes to any one replica, which, holding
the shard's *write lock*, first reads every record the other replicas appended, then appends
its own record with the next sequence number and fsyncs it before acknowledging.  Before it
answers a query, a replica reads (under the same lock, shared) every record appended since
its last read, so any replica answers with every acknowledged upsert applied.

Files in the shard directory (besides the snapshot, :mod:`raycompat.serving.durability`):

* ``LOCK`` -- held shared by every replica for its lifetime, exclusively by ``reshard-index``
  (which therefore refuses a running index, and a replica refuses a reshard in progress);
* ``WRITE.lock`` -- exclusive while a replica appends or rotates, shared while one reads;
* ``SNAPSHOT.lock`` -- exclusive while a snapshot is written, shared while one is opened;
* ``upserts.log`` -- the current log; ``upserts.log.rotated-<seq>`` -- earlier logs whose last
  record is ``<seq>``, kept until a snapshot at or after ``<seq>`` is on disk.

A snapshot *rotates* the log under the write lock (the current file is renamed, a new one
started), copies the state at that sequence number, and writes the snapshot without the lock;
a snapshot never replaces a newer one.  A replica whose open file was rotated reads it to its
end, then the rotated files after it, then the current one; if a file it needs was already
removed (it lagged past two snapshots) it reloads from the snapshot.  Sequence numbers are
consecutive, so a gap is always noticed.  ``flock`` locks are released by the kernel when a
process dies, so a killed replica never leaves a lock behind.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from raycompat.serving.durability import (
    LOG_NAME,
    LogRecord,
    UpsertLog,
    fsync_dir,
    storage_error,
)

__all__ = [
    "ShardLocks",
    "SharedLog",
    "ShardLockedError",
    "LogGapError",
    "missing_seqs",
    "rotated_logs",
]

LOCK_NAME = "LOCK"
WRITE_LOCK_NAME = "WRITE.lock"
SNAPSHOT_LOCK_NAME = "SNAPSHOT.lock"
_ROTATED = re.compile(re.escape(LOG_NAME) + r"\.rotated-(\d+)$")


class ShardLockedError(RuntimeError):
    """Another process holds the shard directory in a way that excludes this one (a running
    index during a reshard, or a reshard while an index runs)."""


class LogGapError(RuntimeError):
    """Records this replica needs were already folded into a snapshot and removed from disk:
    it must reload from the snapshot."""


def _flock(fd: int, mode: int, wait_s: float, what: str) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise ShardLockedError(what) from None
            time.sleep(0.1)


class ShardLocks:
    """The three lock files of a shard directory, each with an in-process mutex in front of it
    (``flock`` is per open file, so threads of one replica must not share one concurrently).
    Whoever needs both takes the write lock first, then the snapshot lock."""

    def __init__(self, directory: str, exclusive: bool = False, wait_s: float = 0.0):
        self.directory = directory
        self._fds: dict[str, int] = {}
        for name in (LOCK_NAME, WRITE_LOCK_NAME, SNAPSHOT_LOCK_NAME):
            self._fds[name] = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT, 0o644)
        why = (
            f"{directory} is in use by another process (a running index or reshard); stop it first"
        )
        try:
            _flock(self._fds[LOCK_NAME], fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, wait_s, why)
        except ShardLockedError:
            self.close()
            raise
        self._mutexes = {name: threading.Lock() for name in self._fds}

    @contextmanager
    def _held(self, name: str, mode: int) -> Iterator[None]:
        with self._mutexes[name]:
            fcntl.flock(self._fds[name], mode)
            try:
                yield
            finally:
                fcntl.flock(self._fds[name], fcntl.LOCK_UN)

    def writing(self):
        """Exclusive: append, rotate, truncate a torn tail."""
        return self._held(WRITE_LOCK_NAME, fcntl.LOCK_EX)

    def reading(self):
        """Shared: read the records other replicas appended."""
        return self._held(WRITE_LOCK_NAME, fcntl.LOCK_SH)

    def snapshotting(self, exclusive: bool):
        """Exclusive while a snapshot is written; shared while one is opened with its logs."""
        return self._held(SNAPSHOT_LOCK_NAME, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def missing_seqs(records: list[LogRecord], last_seq: int) -> list[int]:
    """Sequence numbers between ``last_seq`` and the last of ``records`` that no record has."""
    have = {r.seq for r in records}
    end = max(have, default=last_seq)
    return [s for s in range(last_seq + 1, end + 1) if s not in have]


def rotated_logs(directory: str) -> list[tuple[int, str]]:
    """``[(last seq, path)]`` of the rotated logs, oldest first."""
    out = []
    for name in os.listdir(directory):
        m = _ROTATED.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(out)


class SharedLog:
    """A replica's view of the shard's log files: which file it reads, how far, and the
    operations that need the write lock (see the module docstring)."""

    def __init__(self, directory: str, fsync: bool = True):
        self.directory = directory
        self.path = os.path.join(directory, LOG_NAME)
        self.fsync = fsync
        self.current = UpsertLog(self.path, fsync=fsync)
        self.damage: list = []  # LogDamage of every file read
        self.switched = False  # the last read_new moved on from a rotated file

    # ------------------------------------------------------------------ reading
    def open_rotated(self, after_seq: int) -> list[UpsertLog]:
        """(write lock held) The rotated logs that hold records after ``after_seq``, opened
        (a rotated file never changes, so it can be read after the lock is released), and
        the cursor moved to the start of the current file."""
        logs = [
            UpsertLog(path, fsync=self.fsync, create=False)
            for last, path in rotated_logs(self.directory)
            if last > after_seq
        ]
        self.current.close()
        self.current = UpsertLog(self.path, fsync=self.fsync)
        return logs

    def read_rotated(self, logs: list[UpsertLog]) -> list[LogRecord]:
        """Every record of ``logs`` (from :meth:`open_rotated`), which are closed."""
        records: list[LogRecord] = []
        for log in logs:
            records += self._take(log)
            log.close()
        return records

    def read_new(self, last_seq: int) -> list[LogRecord]:
        """The records after ``last_seq`` appended since the last read (write lock held): the
        rest of the file this replica has open and, if it was rotated since, the files after
        it (:attr:`switched`).  The caller checks that the sequence numbers follow on
        (:func:`missing_seqs`), and after a switch that no snapshot is ahead of them."""
        records = self._take(self.current)
        self.switched = self.current.replaced()
        if self.switched:
            seen = max([last_seq] + [r.seq for r in records])
            records += self.read_rotated(self.open_rotated(seen))
            records += self._take(self.current)
        return [r for r in records if r.seq > last_seq]

    def _take(self, log: UpsertLog) -> list[LogRecord]:
        records = log.read_new()
        self.damage += log.damage
        log.damage = []
        return records

    # ------------------------------------------------------------------ writing
    def append(self, seq: int, rep: int, ids, vectors, op: int = 0, model: str = "") -> None:
        """Append to the current file (write lock held exclusively, records read up to its
        end); a torn tail left by a replica that died mid-append is cut off first.  ``op``,
        ``model``: the record's operation and model fingerprint (:mod:`.durability`)."""
        if self.current.torn_tail_bytes or self.current.size_bytes() > self.current.pos:
            self.truncate_torn()
        self.current.append(seq, rep, ids, vectors, op=op, model=model)

    def truncate_torn(self) -> int:
        try:
            return self.current.truncate_torn()
        except OSError as exc:
            raise storage_error(exc, self.path, "cutting off a torn log tail") from None

    def rotate(self, last_seq: int, suffix: str | None = None) -> str:
        """Rename the current file (to ``rotated-<last_seq>``, or ``<suffix>``) and start a
        new one (write lock held exclusively); returns the old file's new path."""
        dest = f"{self.path}.{suffix or f'rotated-{last_seq:020d}'}"
        try:
            os.replace(self.path, dest)
            fresh = UpsertLog(self.path, fsync=self.fsync)
            if self.fsync:
                fsync_dir(self.directory)
        except OSError as exc:
            raise storage_error(exc, self.path, "starting a new log file") from None
        self.current.close()
        self.current = fresh
        return dest

    def remove_rotated(self, upto_seq: int) -> None:
        """Delete the rotated logs a snapshot at ``upto_seq`` contains."""
        for last, path in rotated_logs(self.directory):
            if last <= upto_seq:
                os.unlink(path)

    def close(self) -> None:
        self.current.close()
