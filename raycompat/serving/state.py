"""One shard's items: each held in exactly one representation (old, adapted or new), an index
per representation, atomic per-item upserts, durable through snapshot + log, shared by the
shard's replicas.

docs/architecture.md, "Serving" and "Replicas".  Every item id maps to one representation; its
(L2-normalised) vector lives in that representation's :class:`~raycompat.serving.rep_index.
RepIndex` only.  Moving an item (an upsert) removes it from its old representation and adds it
to the new one under the shard's lock, and a search runs under the same lock, so a concurrent
query sees every item exactly once: before or after the move, never missing, never twice.

Every replica of a shard opens the same directory (:mod:`raycompat.serving.shared_log`): an
upsert is appended to the shared log and fsynced, under the shard's write lock, before it is
applied and acknowledged; every read (search, lookup, counts) first applies the records other
replicas appended since the last one, so every replica answers with every acknowledged upsert
applied.

Scores are inner products of normalised vectors (cosines, docs/methods.md, "Notation"); the
router sends one query array per representation (:mod:`raycompat.serving.scoring`), so an
old-state item is scored with the old-state side and a new-state item with the new-state
side, as in the simulator (:mod:`raycompat.upgrade.modes`).  Results are ordered by
descending *canonical* score (:mod:`raycompat.index.canonical`), ties by ascending item id --
the simulator's ranking rule (docs/indexes.md for the index kinds and their re-ranking).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from raycompat.serving.durability import (
    OP_FINALIZE,
    OP_ROLLBACK,
    OP_UPSERT,
    SNAPSHOT_NAME,
    CorruptStateError,
    LogDamage,
    corrupt_suffix,
    open_snapshot,
    read_snapshot_arrays,
    snapshot_seq,
    write_snapshot,
)
from raycompat.serving.kept import KeptVectors
from raycompat.serving.rep_index import RepIndex, merge_topk
from raycompat.serving.shard_content import ModelTable, ShardContent
from raycompat.serving.shared_log import (
    LogGapError,
    ShardLockedError,
    ShardLocks,
    SharedLog,
    missing_seqs,
)
from raycompat.storage import StorageError

__all__ = [
    "REPRESENTATIONS",
    "RepIndex",
    "ShardState",
    "ShardLockedError",
    "UnknownItemError",
    "rep_code",
]

logger = logging.getLogger("raycompat.serving")

REPRESENTATIONS = ("old", "adapted", "new")


def rep_code(name: str) -> int:
    if name not in REPRESENTATIONS:
        raise ValueError(f"unknown representation {name!r}; allowed: {', '.join(REPRESENTATIONS)}")
    return REPRESENTATIONS.index(name)


#: the code of the representation a backfill upgrades items to
NEW = rep_code("new")


class UnknownItemError(KeyError):
    """An upsert named item ids this shard does not hold."""

    def __init__(self, ids):
        self.ids = [int(i) for i in ids]
        super().__init__(f"unknown item id(s) {self.ids[:10]}")


#: ``initial()`` returns ``(representation, ids, vectors)``: a new shard's items
InitialItems = Callable[[], tuple[str, np.ndarray, np.ndarray]]


class ShardMemory:
    """The in-memory items of a shard at log sequence number :attr:`seq`: one
    :class:`RepIndex` per representation, every item's representation and model (a code into
    :attr:`models`), and the old vectors of upgraded items (:attr:`kept`, until finalize).

    ``default_models``: the fingerprint a vector gets when its record names none (written
    before model identity), by representation; ``kept_dir``: keep the old vectors
    memory-mapped in files there (:mod:`raycompat.serving.kept`)."""

    def __init__(
        self,
        dims: dict[str, int],
        index_options,
        name: str,
        default_models: dict[str, str] | None = None,
        kept_dir: str | None = None,
    ):
        self.reps = {r: RepIndex(d, index_options, name=f"{name}/{r}") for r, d in dims.items()}
        self.rep_of: dict[int, int] = {}
        self.model_of: dict[int, int] = {}
        self.models = ModelTable()
        self.default_models = dict(default_models or {})
        self.kept = KeptVectors({rep_code(r): d for r, d in dims.items()}, kept_dir)
        self.seq = 0

    def _model_code(self, model: str, rep: str) -> int:
        return self.models.code(model or self.default_models.get(rep, ""))

    def move(self, ids: np.ndarray, code: int, vecs: np.ndarray, model: str = "") -> None:
        """Put ``ids`` into representation ``code`` with vectors produced by ``model``
        (removing them from where they were); an item moving into ``new`` from another
        representation keeps its vector there until a finalize (:meth:`rollback`), one moving
        out of ``new`` forgets it."""
        ids = np.asarray(ids, np.int64)
        if ids.size == 0:
            return
        uniq, last = np.unique(ids[::-1], return_index=True)  # last write of a repeated id wins
        if uniq.size != ids.size:
            keep = np.sort(ids.size - 1 - last)
            ids, vecs = ids[keep], vecs[keep]
        by_rep: dict[int, list] = {}
        for i in ids.tolist():
            c = self.rep_of.get(i)
            if c is not None:
                by_rep.setdefault(c, []).append(i)
        if code == NEW:
            self._keep(by_rep)
        else:
            self.kept.pop(ids)
        for c, lst in by_rep.items():
            self.reps[REPRESENTATIONS[c]].remove(np.asarray(lst, np.int64))
        self.reps[REPRESENTATIONS[code]].add(ids, np.asarray(vecs, np.float32))
        mcode = self._model_code(model, REPRESENTATIONS[code])
        for i in ids.tolist():
            self.rep_of[i] = code
            self.model_of[i] = mcode

    def _keep(self, by_rep: dict[int, list]) -> None:
        """Keep the current vectors of items about to move into ``new`` (not those already
        there, nor those that kept one already)."""
        for c, lst in by_rep.items():
            fresh = [i for i in lst if c != NEW and i not in self.kept]
            if fresh:
                vecs = self.reps[REPRESENTATIONS[c]].vectors_of(fresh)
                models = [self.model_of[i] for i in fresh]
                self.kept.add(c, np.asarray(fresh, np.int64), vecs, np.asarray(models, np.int32))

    def rollback(self, ids) -> np.ndarray:
        """Return the items of ``ids`` that kept an old vector to it (its representation and
        model); returns the ids moved back."""
        moved = []
        for code, (rids, vecs, models) in self.kept.pop(ids).items():
            self.reps["new"].remove(rids)
            self.reps[REPRESENTATIONS[code]].add(rids, vecs)
            for i, m in zip(rids.tolist(), models.tolist(), strict=True):
                self.rep_of[i] = code
                self.model_of[i] = m
            moved.append(rids)
        return np.concatenate(moved) if moved else np.zeros(0, np.int64)

    def apply(self, rec) -> None:
        """Apply one log record (:class:`~raycompat.serving.durability.LogRecord`)."""
        if rec.op == OP_ROLLBACK:
            self.rollback(rec.ids)
        elif rec.op == OP_FINALIZE:
            self.kept.clear()
        else:
            self.move(rec.ids, rec.rep, rec.vectors, rec.model)

    def load(self, content: ShardContent) -> None:
        """Fill an empty memory from a snapshot's content."""
        for rep, (ids, vecs, codes) in content.items.items():
            if ids.size:
                self.reps[rep].add(ids, vecs)
                table = [self._model_code(m, rep) for m in content.models]
                code = rep_code(rep)
                for i, m in zip(ids.tolist(), codes.tolist(), strict=True):
                    self.rep_of[i] = code
                    self.model_of[i] = table[m]
        for rep, (ids, vecs, codes) in content.kept.items():
            table = np.array([self._model_code(m, rep) for m in content.models], np.int32)
            self.kept.add(rep_code(rep), ids, vecs, table[codes])

    def export(self) -> ShardContent:
        """Everything this memory holds (copies), ready for a snapshot."""
        out = ShardContent({r: ix.dim for r, ix in self.reps.items()}, models=self.models.names)
        for rep, ix in self.reps.items():
            ids, vecs = ix.export()
            unrecorded = self._model_code("", rep)
            codes = np.array([self.model_of.get(i, unrecorded) for i in ids.tolist()], np.int32)
            out.items[rep] = (ids, vecs, codes)
        for code, part in self.kept.export().items():
            out.kept[REPRESENTATIONS[code]] = part
        out.models = list(self.models.names)
        return out

    def model_counts(self) -> dict[str, int]:
        """Items per model fingerprint."""
        counts = np.bincount(
            np.fromiter(self.model_of.values(), np.int64, len(self.model_of)),
            minlength=len(self.models.names),
        )
        return {self.models.name(c): int(n) for c, n in enumerate(counts.tolist()) if n}

    def close(self) -> None:
        for ix in self.reps.values():
            ix.close()
        self.kept.close()


class ShardState:
    """The items of one shard, durable in ``directory`` and shared by the shard's replicas.

    ``dims``: the vector dimension of each representation (``{"old": D_old, "adapted": D_new,
    "new": D_new}``); ``index``: the index options of every representation
    (:class:`raycompat.index.ann.IndexOptions`, default exact).  A directory without a
    snapshot is loaded from ``initial`` (once, by whichever replica comes first) or stays
    empty until :meth:`load_initial`.  ``exclusive``: hold the directory alone
    (``reshard-index``); replicas share it.  ``tail_interval_s`` > 0 reads the other
    replicas' records in the background at that interval, so a replica that gets no request
    stays close to the log.  ``default_models``: the fingerprint of a vector whose record names
    no model, by representation (:mod:`raycompat.serving.identity`); ``kept_on_disk``: keep
    the old vectors of upgraded items memory-mapped in the directory, not in memory.
    """

    def __init__(
        self,
        directory: str,
        dims: dict[str, int],
        index=None,
        snapshot_every: int = 200_000,
        fsync: bool = True,
        lock_wait_s: float = 0.0,
        exclusive: bool = False,
        initial: InitialItems | None = None,
        tail_interval_s: float = 0.0,
        name: str = "",
        default_models: dict[str, str] | None = None,
        kept_on_disk: bool = False,
    ):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.locks = ShardLocks(directory, exclusive=exclusive, wait_s=lock_wait_s)
        self.dims = {r: int(dims[r]) for r in REPRESENTATIONS if r in dims}
        self.index_options = index
        self.name = name or os.path.basename(directory)
        self.snapshot_every = int(snapshot_every)
        self.fsync = fsync
        self.lock = threading.RLock()  # the in-memory state
        self._reload_lock = threading.Lock()
        self.log = SharedLog(directory, fsync=fsync)
        self.default_models = dict(default_models or {})
        self.kept_dir = directory if kept_on_disk else None
        self.mem = self._new_memory()
        self.upserts_applied = 0  # items this replica appended
        self.peer_records = 0  # records other replicas appended, applied here
        self.reloads = 0
        self.snapshot_error: str | None = None
        self._snapshot_retry_at = 0.0
        self.recovery: dict = {}
        if initial is not None:
            self._initialize(initial)
        self._recover()
        self._stop = threading.Event()
        self._tailer = None
        if tail_interval_s > 0:
            self._tailer = threading.Thread(
                target=self._tail, args=(tail_interval_s,), name="log-tail", daemon=True
            )
            self._tailer.start()

    def _new_memory(self) -> ShardMemory:
        return ShardMemory(
            self.dims, self.index_options, self.name, self.default_models, self.kept_dir
        )

    # the in-memory state, as the rest of the package reads it
    @property
    def reps(self) -> dict[str, RepIndex]:
        return self.mem.reps

    @property
    def rep_of(self) -> dict[int, int]:
        return self.mem.rep_of

    @property
    def seq(self) -> int:
        return self.mem.seq

    # ------------------------------------------------------------------ recovery
    @property
    def initialized(self) -> bool:
        return bool(self.rep_of) or os.path.exists(os.path.join(self.directory, SNAPSHOT_NAME))

    def _initialize(self, initial: InitialItems) -> None:
        """First start of the shard: its items from ``initial()`` as the snapshot at seq 0,
        written by exactly one replica (the others wait on the write lock, then find it)."""
        with self.locks.writing():
            if self.initialized:
                return
            rep, ids, vecs = initial()
            ids = np.asarray(ids, np.int64)
            order = np.argsort(ids, kind="stable")
            content = ShardContent(dict(self.dims), models=[self.default_models.get(rep, "")])
            content.items[rep] = (
                ids[order],
                np.asarray(vecs, np.float32)[order],
                np.zeros(ids.size, np.int32),
            )
            with self.locks.snapshotting(exclusive=True):
                self._write_snapshot_file(0, content)
            self.recovery["initial_load"] = int(ids.size)

    def _recover(self) -> None:
        """Load the snapshot and the log records after it into a new :class:`ShardMemory`,
        swap it in, then report a torn tail and damage (docs/architecture.md, "Durability")."""
        t0 = time.perf_counter()
        for attempt in range(3):
            try:
                mem, snap_seq, replayed = self._load()
                break
            except LogGapError:  # a snapshot was written meanwhile: start from it
                if attempt == 2:
                    raise
        with self.lock:
            old, self.mem = self.mem, mem
        old.close()
        cut = self._cut_torn_tail() if snap_seq is not None else 0
        self.recovery = {
            **self.recovery,
            "snapshot": snap_seq is not None,
            "snapshot_seq": snap_seq,
            "replayed_records": replayed,
            "log_seq": self.seq,
            "truncated_bytes": cut,
            "corrupt_records": [d.as_json() for d in self.log.damage],
            "items": len(self.rep_of),
            "seconds": time.perf_counter() - t0,
        }
        if self.log.damage:
            self._quarantine_log()

    def _load(self) -> tuple[ShardMemory, int | None, int]:
        """``(memory, snapshot seq or None, log records applied)``: the snapshot and the
        rotated logs are opened under the locks (so no snapshot or rotation comes between),
        read after; the current log is read under the write lock."""
        self.log.damage = []
        with self.locks.reading(), self.locks.snapshotting(exclusive=False):
            fh = open_snapshot(self.directory)
            seq = snapshot_seq(self.directory, fh) if fh is not None else 0
            rotated = self.log.open_rotated(seq)
        mem = self._new_memory()
        if fh is None:
            self.log.read_rotated(rotated)  # closes them: nothing to apply them to
            return mem, None, 0
        _, arrays, meta = read_snapshot_arrays(self.directory, fh)  # CorruptStateError
        self._check_dims(meta)
        try:
            mem.load(ShardContent.from_snapshot(arrays, meta, self.dims))
        except ValueError as exc:
            raise CorruptStateError(
                f"snapshot {os.path.join(self.directory, SNAPSHOT_NAME)} is corrupt ({exc}); "
                "restore it from a backup, or move the shard directory away to reload the "
                "shard from the gallery"
            ) from None
        mem.seq = seq
        replayed = self._apply_to(mem, self.log.read_rotated(rotated))
        with self.locks.reading():
            replayed += self._read_into(mem)
        return mem, seq, replayed

    def _check_dims(self, meta: dict) -> None:
        for name, d in meta.get("dims", {}).items():
            if name in self.dims and int(d) != self.dims[name]:
                raise ValueError(
                    f"snapshot in {self.directory} has {name} dim {d}, expected {self.dims[name]}"
                )

    def _cut_torn_tail(self) -> int:
        """A record left incomplete by a replica that died mid-append: cut it off (under the
        write lock, after reading every complete record); returns the bytes cut."""
        if not self.log.current.torn_tail_bytes:
            return 0
        with self.locks.writing():
            self._read_new()
            return self.log.truncate_torn()

    def _quarantine_log(self) -> None:
        """A log damaged in the middle: say so loudly, fold every valid record into a
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
        with self.locks.writing():
            self._read_new()
            content, seq = self._export()
            with self.locks.snapshotting(exclusive=True):
                self._write_snapshot_file(seq, content)
                kept = self.log.rotate(seq, suffix=corrupt_suffix())
                self.log.remove_rotated(seq)
        self.log.damage = []
        self.recovery["corrupt_log_kept_as"] = kept
        logger.error("the damaged log is kept as %s", kept)

    # ------------------------------------------------------------------ following the log
    def catch_up(self) -> int:
        """Apply every record the other replicas appended since the last read; returns how
        many.  A replica that lagged past records already removed reloads from the snapshot."""
        try:
            with self.locks.reading():
                n = self._read_new()
        except LogGapError as exc:
            with self._reload_lock:  # one reload; concurrent readers wait for it
                on_disk = snapshot_seq(self.directory)
                if on_disk is not None and on_disk > self.seq:
                    logger.warning("%s: %s; reloading from the snapshot", self.name, exc)
                    self.reloads += 1
                    self._recover()
            return 0
        if self.log.damage:
            self._quarantine_log()
        return n

    def _read_new(self) -> int:
        """(write lock held) Read and apply the records appended since the last read."""
        with self.lock:
            n = self._read_into(self.mem)
        self.peer_records += n
        return n

    def _read_into(self, mem: ShardMemory) -> int:
        """(write lock held) Apply to ``mem`` the records after ``mem.seq``; when the reading
        moved past a rotated file, a snapshot ahead of what was read means records this replica
        needed were removed (:class:`LogGapError`)."""
        n = self._apply_to(mem, self.log.read_new(mem.seq))
        if self.log.switched:
            on_disk = snapshot_seq(self.directory)
            if on_disk is not None and on_disk > mem.seq:
                raise LogGapError(
                    f"log records {mem.seq + 1}..{on_disk} were folded into the snapshot at seq "
                    f"{on_disk} and removed"
                )
        return n

    def _apply_to(self, mem: ShardMemory, records) -> int:
        """Apply log records in order (those at or below ``mem.seq`` are skipped); a missing
        sequence number is damage already reported, or a gap (:class:`LogGapError`)."""
        applied = 0
        for rec in records:
            if rec.seq <= mem.seq:
                continue
            missing = missing_seqs([rec], mem.seq)
            if missing:
                self._missing(missing)
            mem.apply(rec)
            mem.seq = rec.seq
            applied += 1
        return applied

    def _missing(self, seqs: list[int]) -> None:
        """Sequence numbers absent from the log: explained by damage found reading it, folded
        into a newer snapshot (:class:`LogGapError`: reload), or lost (reported as damage)."""
        known = {s for d in self.log.damage for s in d.lost_seqs}
        unexplained = [s for s in seqs if s not in known]
        if not unexplained:
            return
        on_disk = snapshot_seq(self.directory)
        if on_disk is not None and on_disk >= unexplained[-1]:
            raise LogGapError(
                f"log records {unexplained[0]}..{unexplained[-1]} were folded into the snapshot "
                f"at seq {on_disk} and removed"
            )
        self.log.damage.append(
            LogDamage(-1, 0, "records missing from the log", lost_seqs=unexplained)
        )

    def _tail(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.catch_up()
            except Exception as exc:  # keep following; the next read retries
                logger.error("%s: reading the shard log failed: %s", self.name, exc)

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> str:
        """Rotate the log and write the snapshot at the current sequence number;
        :class:`StorageError` when it fails (the rotated log is kept, so nothing is lost)."""
        self.catch_up()
        with self.locks.writing():
            self._read_new()
            self.log.rotate(self.seq)
            content, seq = self._export()
        return self._store_snapshot(content, seq)

    def _export(self) -> tuple[ShardContent, int]:
        with self.lock:
            return self.mem.export(), self.seq

    def _store_snapshot(self, content: ShardContent, seq: int) -> str:
        """Write the snapshot at ``seq`` unless a newer one is on disk, then delete the
        rotated logs it contains."""
        path = os.path.join(self.directory, SNAPSHOT_NAME)
        with self.locks.snapshotting(exclusive=True):
            on_disk = snapshot_seq(self.directory)
            if on_disk is None or on_disk < seq:
                path = self._write_snapshot_file(seq, content)
            self.log.remove_rotated(max(seq, on_disk or 0))
        self.snapshot_error = None
        return path

    def _write_snapshot_file(self, seq: int, content: ShardContent) -> str:
        parts, arrays, models = content.snapshot_arrays()
        return write_snapshot(
            self.directory,
            seq,
            parts,
            self.dims,
            info={"items": content.count(), "kept": content.count("kept")},
            fsync=self.fsync,
            arrays=arrays,
            models=models,
        )

    def _snapshot_due(self) -> bool:
        if self.snapshot_error is not None:
            return time.time() >= self._snapshot_retry_at
        return self.log.current.items >= self.snapshot_every

    def _snapshot_after_upsert(self, content: ShardContent, seq: int) -> None:
        """A failed snapshot does not fail the (logged, applied) upsert: it is reported in
        ``snapshot_error`` and tried again 10 s later."""
        try:
            self._store_snapshot(content, seq)
        except StorageError as exc:
            self.snapshot_error = str(exc)
            self._snapshot_retry_at = time.time() + 10.0
            logger.error("shard snapshot failed: %s", exc)

    def load_initial(self, rep: str, ids: np.ndarray, vecs: np.ndarray) -> None:
        """Bulk-load items (new ids) into ``rep`` in this process only; call :meth:`snapshot`
        afterwards (``reshard-index`` and tests; a served shard loads through ``initial``)."""
        with self.lock:
            ids = np.asarray(ids, np.int64)
            dup = [int(i) for i in ids if int(i) in self.rep_of]
            if dup:
                raise ValueError(f"item id(s) already present: {dup[:10]}")
            self.mem.move(ids, rep_code(rep), vecs)

    # ------------------------------------------------------------------ upserts
    def unknown(self, ids) -> list:
        with self.lock:
            return [int(i) for i in np.asarray(ids).tolist() if int(i) not in self.rep_of]

    def upsert(self, ids, rep: str, vecs: np.ndarray, model: str = "") -> dict:
        """Atomically move existing items to ``rep`` with the given (normalised) vectors,
        produced by the model with fingerprint ``model`` (``""``: the representation's default).

        Appended to the shared log (fsync) under the write lock, after every earlier record of
        any replica, before it is applied and acknowledged; raises :class:`UnknownItemError`
        for ids this shard does not hold, and :class:`~raycompat.serving.durability.
        StorageError` when the log write fails (nothing is applied, nothing of it stays on
        disk)."""
        code = rep_code(rep)
        ids, vecs = self._checked_upsert(ids, rep, vecs)
        if ids.size == 0:
            return {"applied": 0, "seq": self.seq}
        model = model or self.default_models.get(rep, "")
        res = self._logged(OP_UPSERT, ids, vecs, code=code, model=model)
        return {"applied": int(ids.size), "seq": res["seq"]}

    def rollback(self, ids) -> dict:
        """Return every item of ``ids`` that kept an old vector to it, in one logged record
        (atomic per item, durable before it is acknowledged); ``{"rolled_back": ids moved
        back, "not_new": the other ids, without a kept vector and not in the new
        representation, "seq"}``.  Ids without a kept vector are left as they are (a rollback is
        idempotent: ``not_new`` names those a replica that died before answering may have
        moved already); unknown ids raise :class:`UnknownItemError`."""
        ids = np.unique(np.asarray(ids, np.int64))
        missing = self.unknown(ids)
        if missing:
            raise UnknownItemError(missing)
        self.catch_up()
        with self.lock:
            kept = np.asarray([i in self.mem.kept for i in ids.tolist()], bool)
            new = np.asarray([self.rep_of.get(i) == NEW for i in ids[~kept].tolist()], bool)
        not_new = ids[~kept][~new].tolist()
        todo = ids[kept]
        if not todo.size:
            return {"rolled_back": [], "not_new": not_new, "seq": self.seq}
        res = self._logged(OP_ROLLBACK, todo, np.zeros((todo.size, 0), np.float32))
        return {"rolled_back": res["moved"].tolist(), "not_new": not_new, "seq": res["seq"]}

    def finalize(self) -> dict:
        """Drop every kept old vector (a logged record), then write a snapshot so that the disk
        is freed too; ``{"dropped", "seq", "snapshot"}`` (``snapshot``: the path, or why it
        failed -- the finalize itself is durable in the log then)."""
        self.catch_up()
        with self.lock:
            n = len(self.mem.kept)
        empty = np.zeros(0, np.int64), np.zeros((0, 0), np.float32)
        res = self._logged(OP_FINALIZE, *empty)
        try:
            snap = self.snapshot()
        except StorageError as exc:
            snap = f"snapshot failed: {exc}"
        return {"dropped": n, "seq": res["seq"], "snapshot": snap}

    def _logged(self, op: int, ids, vecs, code: int = 0, model: str = "") -> dict:
        """Append one record and apply it (retried when a snapshot overtook this replica)."""
        for attempt in range(3):
            self.catch_up()  # a replica that lagged past a snapshot reloads here, unlocked
            try:
                return self._append_and_apply(op, ids, vecs, code, model)
            except LogGapError:  # overtaken again before the write lock: nothing was written
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _append_and_apply(self, op: int, ids, vecs, code: int, model: str) -> dict:
        with self.locks.writing():
            self._read_new()
            # StorageError: nothing applied
            self.log.append(self.seq + 1, code, ids, vecs, op=op, model=model)
            with self.lock:
                moved = self.mem.rollback(ids) if op == OP_ROLLBACK else None
                if op == OP_UPSERT:
                    self.mem.move(ids, code, vecs, model)
                elif op == OP_FINALIZE:
                    self.mem.kept.clear()
                self.mem.seq += 1
                seq = self.seq
            self.upserts_applied += int(ids.size) if op == OP_UPSERT else 0
            due = self._snapshot_due()
            if due:
                self.log.rotate(seq)
                content, _ = self._export()
        if due:
            self._snapshot_after_upsert(content, seq)
        return {"seq": seq, "moved": moved}

    # ------------------------------------------------------------------ models, kept vectors
    def kept_ids(self) -> np.ndarray:
        """The ids that keep an old vector (upgraded since the last finalize), ascending."""
        self.catch_up()
        with self.lock:
            return self.mem.kept.ids()

    def models_of(self, ids) -> list:
        """The model fingerprint of each of ``ids``' vectors (``None`` for an unknown id)."""
        self.catch_up()
        with self.lock:
            mem = self.mem
            return [
                mem.models.name(mem.model_of[i]) if i in mem.model_of else None
                for i in np.asarray(ids, np.int64).tolist()
            ]

    def model_counts(self) -> dict[str, int]:
        """Items per model fingerprint."""
        self.catch_up()
        with self.lock:
            return self.mem.model_counts()

    def kept_usage(self) -> dict:
        """What the kept old vectors take: items, bytes in memory and on disk."""
        with self.lock:
            return self.mem.kept.usage()

    def _checked_upsert(self, ids, rep: str, vecs) -> tuple[np.ndarray, np.ndarray]:
        if rep not in self.dims:
            raise ValueError(f"representation {rep!r} is not served by this shard")
        ids = np.asarray(ids, np.int64)
        vecs = np.ascontiguousarray(vecs, np.float32)
        if vecs.shape != (ids.size, self.dims[rep]):
            raise ValueError(
                f"vectors for {rep!r} must be [{ids.size}, {self.dims[rep]}], "
                f"got {list(vecs.shape)}"
            )
        missing = self.unknown(ids)
        if missing:
            raise UnknownItemError(missing)
        return ids, vecs

    def close(self) -> None:
        """Stop following the log, close it and release the directory's locks."""
        if self._tailer is not None:
            self._stop.set()
            self._tailer.join(timeout=5)
        self.mem.close()
        self.log.close()
        self.locks.close()

    def health(self) -> dict:
        """Storage problems a status should show: a failed snapshot, a log that refuses
        appends (or whose last append failed: a full disk), corrupt log records found at
        recovery."""
        return {
            "snapshot_error": self.snapshot_error,
            "log_error": self.log.current.broken or self.log.current.last_error,
            "corrupt_records": len(self.recovery.get("corrupt_records", [])),
        }

    def replica_status(self) -> dict:
        """How this replica follows the shared log."""
        return {
            "seq": self.seq,
            "log_items": self.log.current.items,
            "peer_records": self.peer_records,
            "reloads": self.reloads,
        }

    # ------------------------------------------------------------------ reads
    def search(self, queries: dict[str, np.ndarray], k: int, exact: bool = False):
        """Top-k over every representation that has a query array: ``(scores, ids, rep
        codes)``, after applying the other replicas' records; ``exact``: brute force whatever
        the index kind (the reference recall is measured against)."""
        self.catch_up()
        with self.lock:
            S, I, R = [], [], []
            for name, q in queries.items():
                if name not in self.reps:
                    continue
                s, i = self.reps[name].search(q, k, exact=exact)
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
        self.catch_up()
        with self.lock:
            return [
                (REPRESENTATIONS[self.rep_of[int(i)]] if int(i) in self.rep_of else None)
                for i in np.asarray(ids).tolist()
            ]

    def lookup(self, ids) -> tuple[list, list]:
        """``(representation names, vectors)`` of ``ids`` (``None`` for an unknown id)."""
        self.catch_up()
        with self.lock:
            reps, vecs = [], []
            for i in np.asarray(ids, np.int64).tolist():
                code = self.rep_of.get(i)
                name = None if code is None else REPRESENTATIONS[code]
                reps.append(name)
                vecs.append(None if name is None else self.reps[name].vectors_of([i])[0].copy())
            return reps, vecs

    def counts(self) -> dict[str, int]:
        self.catch_up()
        with self.lock:
            return {r: len(ix) for r, ix in self.reps.items()}

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All ``(ids, rep codes)`` (sorted by id)."""
        self.catch_up()
        with self.lock:
            ids = np.fromiter(self.rep_of.keys(), np.int64, len(self.rep_of))
            codes = np.fromiter(self.rep_of.values(), np.int8, len(self.rep_of))
        o = np.argsort(ids)
        return ids[o], codes[o]
