"""One shard's items: each held in exactly one representation (old, adapted or new), a faiss
index per representation, atomic per-item upserts, durable through snapshot + log.

docs/architecture.md, "Serving".  Every item id maps to one representation; its (L2-normalised)
vector lives in that representation's store and faiss index only.  Moving an item (an
upsert) removes it from its old representation and adds it to the new one under the
shard's lock, and a search runs under the same lock, so a concurrent query sees every item
exactly once: before or after the move, never missing, never twice.

Scores are inner products of normalised vectors (cosines, docs/methods.md, "Notation"); the
router sends one query array per representation (:mod:`raycompat.serving.scoring`), so an
old-state item is scored with the old-state side and a new-state item with the new-state
side, as in the simulator (:mod:`raycompat.backfill.modes`).  Results are ordered by
descending *canonical* score (:mod:`raycompat.index.canonical`: the float64 sum of the
products of the two float32 vectors), ties by ascending item id -- the simulator's ranking
rule, so with an exact index the served order is the simulator's whatever faiss's float32
summation order: faiss (or numpy) proposes float32 candidates, the shard re-scores them
canonically and fetches more until no unfetched item can reach the k-th canonical score.

faiss: ``factory="Flat"`` (the default) is exact (``IndexFlatIP``).  Any other factory
string works: indexes that need training are trained once a representation holds
``train_min`` items (until then that representation is searched exactly with numpy), and
indexes without ``remove_ids`` (e.g. HNSW) keep removed items as tombstones that are
filtered out of results and dropped at the next rebuild.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time

import numpy as np

from raycompat.serving.durability import (
    LOG_NAME,
    StorageError,
    UpsertLog,
    corrupt_suffix,
    read_snapshot,
    write_snapshot,
)
from raycompat.serving.rep_index import RepIndex, merge_topk

__all__ = [
    "REPRESENTATIONS",
    "RepIndex",
    "ShardState",
    "ShardLockedError",
    "UnknownItemError",
    "rep_code",
]

LOCK_NAME = "LOCK"
logger = logging.getLogger("raycompat.serving")

REPRESENTATIONS = ("old", "adapted", "new")


def rep_code(name: str) -> int:
    if name not in REPRESENTATIONS:
        raise ValueError(f"unknown representation {name!r}; allowed: {', '.join(REPRESENTATIONS)}")
    return REPRESENTATIONS.index(name)


class UnknownItemError(KeyError):
    """An upsert named item ids this shard does not hold."""

    def __init__(self, ids):
        self.ids = [int(i) for i in ids]
        super().__init__(f"unknown item id(s) {self.ids[:10]}")


class ShardLockedError(RuntimeError):
    """Another process holds the shard directory (a running index, or a reshard)."""


def lock_directory(directory: str, wait_s: float = 0.0) -> int:
    """Hold ``<directory>/LOCK`` (a POSIX record lock, released when the process exits) so
    that no two processes write one shard; waits up to ``wait_s`` (a replica restarting while
    its predecessor exits), then raises :class:`ShardLockedError`."""
    path = os.path.join(directory, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise ShardLockedError(
                    f"{directory} is in use by another process (a running index or reshard); "
                    "stop it first"
                ) from None
            time.sleep(0.2)


class ShardState:
    """The items of one shard, durable in ``directory`` (see :mod:`raycompat.serving.durability`).

    ``dims``: the vector dimension of each representation (``{"old": D_old, "adapted": D_new,
    "new": D_new}``).  If the directory holds a snapshot, the state is recovered from it and
    the log; otherwise the shard is empty until :meth:`load_initial`.
    """

    def __init__(
        self,
        directory: str,
        dims: dict[str, int],
        factory: str = "Flat",
        snapshot_every: int = 200_000,
        fsync: bool = True,
        train_min: int = 4096,
        lock_wait_s: float = 0.0,
    ):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._lock_fd = lock_directory(directory, lock_wait_s)
        self.dims = {r: int(dims[r]) for r in REPRESENTATIONS if r in dims}
        self.factory = factory
        self.snapshot_every = int(snapshot_every)
        self.fsync = fsync
        self.lock = threading.RLock()
        self.reps = {r: RepIndex(d, factory, train_min) for r, d in self.dims.items()}
        self.rep_of: dict[int, int] = {}
        self.seq = 0
        self.since_snapshot = 0
        self.recovery: dict = {}
        self.log = UpsertLog(os.path.join(directory, LOG_NAME), fsync=fsync)
        self.upserts_applied = 0
        self.snapshot_error: str | None = None
        self._snapshot_retry_at = 0.0
        self._recover()

    # ------------------------------------------------------------------ durability
    @property
    def initialized(self) -> bool:
        return bool(self.rep_of) or os.path.exists(os.path.join(self.directory, "snapshot.npz"))

    def _recover(self) -> None:
        t0 = time.perf_counter()
        snap = read_snapshot(self.directory)  # CorruptStateError names the file and the cause
        if snap is None:
            self.recovery = {"snapshot": False, "replayed_records": 0}
            return
        seq, parts, meta = snap
        for name, d in meta.get("dims", {}).items():
            if name in self.dims and int(d) != self.dims[name]:
                raise ValueError(
                    f"snapshot in {self.directory} has {name} dim {d}, expected {self.dims[name]}"
                )
        for name, (ids, vecs) in parts.items():
            if ids.size:
                self._move(ids, rep_code(name), vecs)
        self.seq = seq
        replayed = self._replay(seq)
        self.recovery = {
            "snapshot": True,
            "snapshot_seq": seq,
            "replayed_records": replayed,
            "log_seq": self.seq,
            "truncated_bytes": self.log.torn_tail_bytes,
            "corrupt_records": [d.as_json() for d in self.log.damage],
            "items": len(self.rep_of),
            "seconds": time.perf_counter() - t0,
        }
        if self.log.damage:
            self._quarantine_log()

    def _replay(self, snapshot_seq: int) -> int:
        replayed = 0
        for rec in self.log.replay():
            if rec.seq <= snapshot_seq:
                continue
            self._move(rec.ids, rec.rep, rec.vectors)
            self.seq = max(self.seq, rec.seq)
            replayed += 1
            self.since_snapshot += len(rec.ids)
        return replayed

    def _quarantine_log(self) -> None:
        """A log damaged in the middle: say so loudly, fold what was recovered into a
        snapshot, and keep the damaged file as ``upserts.log.corrupt-<time>``."""
        for d in self.log.damage:
            logger.error(
                "shard log %s is corrupt at byte %d (%d bytes, %s); lost sequence numbers %s; "
                "the valid records after it were kept",
                self.log.path,
                d.offset,
                d.nbytes,
                d.cause,
                d.lost_seqs or "unknown",
            )
        self.snapshot()
        kept = self.log.set_aside(corrupt_suffix())
        self.recovery["corrupt_log_kept_as"] = kept
        logger.error("the damaged log is kept as %s", kept)

    def snapshot(self) -> str:
        """Write the snapshot and empty the log; :class:`StorageError` when it fails (the
        log is then kept, so nothing is lost)."""
        with self.lock:
            parts = {r: ix.export() for r, ix in self.reps.items()}
            path = write_snapshot(
                self.directory,
                self.seq,
                parts,
                self.dims,
                info={"factory": self.factory, "items": len(self.rep_of)},
                fsync=self.fsync,
            )
            self.log.reset()
            self.since_snapshot = 0
            self.snapshot_error = None
            return path

    def load_initial(self, rep: str, ids: np.ndarray, vecs: np.ndarray) -> None:
        """Bulk-load items (new ids) into ``rep``; call :meth:`snapshot` afterwards."""
        with self.lock:
            ids = np.asarray(ids, np.int64)
            dup = [int(i) for i in ids if int(i) in self.rep_of]
            if dup:
                raise ValueError(f"item id(s) already present: {dup[:10]}")
            self._move(ids, rep_code(rep), vecs)

    # ------------------------------------------------------------------ state changes
    def _move(self, ids: np.ndarray, code: int, vecs: np.ndarray) -> None:
        """Put ``ids`` into representation ``code`` (removing them from where they were)."""
        ids = np.asarray(ids, np.int64)
        if ids.size == 0:
            return
        uniq, last = np.unique(ids[::-1], return_index=True)  # last write of a repeated id wins
        if uniq.size != ids.size:
            keep = np.sort(ids.size - 1 - last)
            ids, vecs = ids[keep], vecs[keep]
        target = REPRESENTATIONS[code]
        by_rep: dict[int, list] = {}
        for i in ids.tolist():
            c = self.rep_of.get(i)
            if c is not None:
                by_rep.setdefault(c, []).append(i)
        for c, lst in by_rep.items():
            self.reps[REPRESENTATIONS[c]].remove(np.asarray(lst, np.int64))
        self.reps[target].add(ids, np.asarray(vecs, np.float32))
        for i in ids.tolist():
            self.rep_of[i] = code

    def unknown(self, ids) -> list:
        with self.lock:
            return [int(i) for i in np.asarray(ids).tolist() if int(i) not in self.rep_of]

    def upsert(self, ids, rep: str, vecs: np.ndarray) -> dict:
        """Atomically move existing items to ``rep`` with the given (normalised) vectors.

        Logged (fsync) before it is applied; raises :class:`UnknownItemError` for ids this
        shard does not hold, and :class:`~raycompat.serving.durability.StorageError` when the
        log write fails (nothing is applied then, and nothing of it stays on disk)."""
        code = rep_code(rep)
        if rep not in self.dims:
            raise ValueError(f"representation {rep!r} is not served by this shard")
        ids = np.asarray(ids, np.int64)
        vecs = np.ascontiguousarray(vecs, np.float32)
        if vecs.shape != (ids.size, self.dims[rep]):
            raise ValueError(
                f"vectors for {rep!r} must be [{ids.size}, {self.dims[rep]}], "
                f"got {list(vecs.shape)}"
            )
        with self.lock:
            missing = [int(i) for i in ids.tolist() if int(i) not in self.rep_of]
            if missing:
                raise UnknownItemError(missing)
            if ids.size == 0:
                return {"applied": 0, "seq": self.seq}
            self.log.append(self.seq + 1, code, ids, vecs)  # StorageError: nothing applied
            self.seq += 1
            self._move(ids, code, vecs)
            self.upserts_applied += int(ids.size)
            self.since_snapshot += int(ids.size)
            self._maybe_snapshot()
            return {"applied": int(ids.size), "seq": self.seq}

    def _maybe_snapshot(self) -> None:
        """Snapshot once ``snapshot_every`` items were upserted since the last one.  A failed
        snapshot does not fail the (logged, applied) upsert: it is reported in
        ``snapshot_error`` and tried again 10 s later."""
        if self.since_snapshot < self.snapshot_every or time.time() < self._snapshot_retry_at:
            return
        try:
            self.snapshot()
        except StorageError as exc:
            self.snapshot_error = str(exc)
            self._snapshot_retry_at = time.time() + 10.0
            logger.error("shard snapshot failed: %s", exc)

    def close(self) -> None:
        """Close the log and release the directory's lock."""
        self.log.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def health(self) -> dict:
        """Storage problems a status should show: a failed snapshot, a log that refuses
        appends, corrupt log records found at recovery."""
        return {
            "snapshot_error": self.snapshot_error,
            "log_error": self.log.broken,
            "corrupt_records": len(self.recovery.get("corrupt_records", [])),
        }

    # ------------------------------------------------------------------ reads
    def search(self, queries: dict[str, np.ndarray], k: int):
        """Top-k over every representation that has a query array: ``(scores, ids, rep codes)``."""
        with self.lock:
            S, I, R = [], [], []
            n_q = None
            for name, q in queries.items():
                if name not in self.reps:
                    continue
                n_q = q.shape[0]
                s, i = self.reps[name].search(q, k)
                S.append(s)
                I.append(i)
                R.append(np.full(i.shape, rep_code(name), np.int8))
            if not S:
                n_q = next(iter(queries.values())).shape[0] if queries else 0
                return (
                    np.full((n_q, k), -np.inf, np.float32),
                    np.full((n_q, k), -1, np.int64),
                    np.full((n_q, k), -1, np.int8),
                )
            return merge_topk(S, I, R, k)

    def representation_of(self, ids) -> list:
        with self.lock:
            return [
                (REPRESENTATIONS[self.rep_of[int(i)]] if int(i) in self.rep_of else None)
                for i in np.asarray(ids).tolist()
            ]

    def lookup(self, ids) -> tuple[list, list]:
        """``(representation names, vectors)`` of ``ids`` (``None`` for an unknown id)."""
        with self.lock:
            reps, vecs = [], []
            for i in np.asarray(ids, np.int64).tolist():
                code = self.rep_of.get(i)
                name = None if code is None else REPRESENTATIONS[code]
                reps.append(name)
                vecs.append(None if name is None else self.reps[name].vectors_of([i])[0].copy())
            return reps, vecs

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {r: len(ix) for r, ix in self.reps.items()}

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All ``(ids, rep codes)`` (sorted by id)."""
        with self.lock:
            ids = np.fromiter(self.rep_of.keys(), np.int64, len(self.rep_of))
            codes = np.fromiter(self.rep_of.values(), np.int8, len(self.rep_of))
        o = np.argsort(ids)
        return ids[o], codes[o]
