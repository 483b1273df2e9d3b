"""The store side of the store backfill job (``raycompat backfill-store``, docs/stores.md, "The
backfill job"): everything it keeps in the store, and how it finds where a killed job stopped.

The job's progress lives in the store it upgrades, never only in a local file:

* the **state record** (:meth:`~raycompat.stores.base.VectorStore.write_state`, key ``state``):
  the upgrade's state (the state machine's public name), policy, seed, the new model's
  fingerprint, position and total, ``until``, ``rate``, the guard that paused it, the rollback
  and finalize progress, the last command applied (:data:`RECORD_JOB` marks it as this job's);
* the **order** (keys ``backfill:order:<run>:<chunk>``): the item ids in the order they are
  upgraded, written once when a backfill starts, :data:`ORDER_CHUNK_IDS` ids per record;
* the **driver** (key ``backfill:driver``): which process walks the order now, and its heartbeat;
* the **command** slot (key ``backfill:command``): the last operator command posted for a
  running driver (pause, resume, rollback, finalize), answered in the state record;
* the **canary** (keys ``backfill:canary:...``): its reference answers and every point measured.

An item's upgrade position is its index in the order, so the store's own positions say how far
the order was written: a batch is one atomic :meth:`write_new`, so after a kill the largest
position in the store is the last batch written, recorded or not (:func:`reconciled_position`),
and no item is written twice.  A rollback turns items back from the end of the order in
batches (:func:`rollback_in_batches`), each one atomic.

Milvus Lite lets one process hold its file: while a driver holds it, a command of another
process goes through two files beside the ``.db`` file (:class:`SidecarChannel`): the command,
and a copy of the state record the driver writes after every change (a cache; the record in the
store stays the truth).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict

import numpy as np

from raycompat.stores.base import DRIVER_KEY, Filter, VectorStore
from raycompat.stores.errors import StoreError

__all__ = [
    "Ballast",
    "BackfillRecords",
    "DriverHeld",
    "CANARY_PREFIX",
    "COMMAND_KEY",
    "DRIVER_KEY",
    "NewVectorsParquet",
    "ORDER_CHUNK_IDS",
    "RECORD_JOB",
    "SidecarChannel",
    "is_full_disk",
    "kept_prefix",
    "new_run_id",
    "reconciled_position",
    "rollback_in_batches",
]

#: ``state["job"]`` of a state record this job wrote.
RECORD_JOB = "backfill-store"
#: Keys of the job's records beside the state record.
ORDER_PREFIX = "backfill:order:"
COMMAND_KEY = "backfill:command"
CANARY_PREFIX = "backfill:canary:"
CANARY_REFERENCE_KEY = "backfill:canary-reference"
#: The canary registered with a live index: its parquet bytes in records, and what reads them.
LIVE_CANARY_KEY = "backfill:live-canary"
LIVE_CANARY_PREFIX = "backfill:live-canary:"
#: Item ids per order record: 4,096 int64 ids are 43,692 characters of base64 (a Milvus
#: VARCHAR holds 65,535).
ORDER_CHUNK_IDS = 4096
#: Bytes per record of a file kept in records (base64: 43,692 characters, as an order's).
BLOB_CHUNK_BYTES = 8 * ORDER_CHUNK_IDS
#: Seconds between two heartbeats of a driver, and after which a silent driver counts as gone
#: (a driver on this host is also checked by its process id, so a killed one is seen at once).
BEAT_S = 5.0
STALE_S = 30.0

#: this process's drivers that are running (token -> True), for a driver in this very process
_LIVE_HERE: set[str] = set()


def new_run_id() -> str:
    """A short id of one backfill (the order's records and the rollback mark carry it)."""
    return uuid.uuid4().hex[:12]


def _host() -> str:
    return socket.gethostname()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def driver_alive(driver: dict | None, now: float | None = None) -> bool:
    """Whether the driver a record names is still at work: not ended, and its process alive
    (on this host) or its heartbeat fresh (elsewhere)."""
    if not driver or driver.get("ended"):
        return False
    now = time.time() if now is None else now
    if driver.get("host") == _host():
        if int(driver.get("pid", -1)) == os.getpid():
            return driver.get("token") in _LIVE_HERE
        return _pid_alive(int(driver.get("pid", -1)))
    return now - float(driver.get("beat", 0.0)) < STALE_S


class BackfillRecords:
    """The job's records in ``store`` (see the module docstring); writes are serialised by a
    lock, so a heartbeat thread and the walk may share the store handle."""

    def __init__(self, store: VectorStore):
        self.store = store
        self.lock = threading.RLock()

    # -- the state record ------------------------------------------------------------------
    def load(self) -> dict:
        """The state record: ``{}`` when none was written; a record another program wrote
        is refused (it is not this job's to change)."""
        state = self.store.read_state()
        if state and state.get("job") != RECORD_JOB:
            raise StoreError(
                f"the state record of {self.store.where} was not written by backfill-store "
                f"(keys {sorted(state)[:8]}); pass --overwrite to replace it"
            )
        return state

    def save(self, state: dict) -> None:
        state["job"] = RECORD_JOB
        state["updated"] = round(time.time(), 3)
        with self.lock:
            self.store.write_state(state)

    # -- the order -------------------------------------------------------------------------
    def write_order(self, run: str, ids: np.ndarray) -> dict:
        """Write the order (item ids) under ``run``; returns what the state record keeps of
        it (``{"run", "chunks", "sha256", "items"}``)."""
        ids = np.ascontiguousarray(np.asarray(ids, dtype="<i8"))
        records = {}
        for c, start in enumerate(range(0, max(len(ids), 1), ORDER_CHUNK_IDS)):
            chunk = ids[start : start + ORDER_CHUNK_IDS]
            records[f"{ORDER_PREFIX}{run}:{c:06d}"] = base64.b64encode(chunk.tobytes()).decode()
        with self.lock:
            self.store._put_records(records)
        return {
            "run": run,
            "chunks": len(records),
            "sha256": hashlib.sha256(ids.tobytes()).hexdigest()[:16],
            "items": int(len(ids)),
        }

    def read_order(self, meta: dict) -> np.ndarray:
        """The order the state record names, checked against its digest."""
        prefix = f"{ORDER_PREFIX}{meta['run']}:"
        found = self.store._records(prefix)
        keys = [f"{prefix}{c:06d}" for c in range(int(meta["chunks"]))]
        missing = [k for k in keys if k not in found]
        if missing:
            raise StoreError(
                f"{self.store.where}: the backfill order's record {missing[0]!r} is missing "
                f"({len(missing)} of {len(keys)}); start again with --restart"
            )
        parts = [np.frombuffer(base64.b64decode(found[k]), dtype="<i8") for k in keys]
        ids = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        if hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest()[:16] != meta["sha256"]:
            raise StoreError(f"{self.store.where}: the backfill order's records do not match")
        return ids

    def drop_orders(self, keep_run: str | None = None) -> None:
        """Remove the order records of every run but ``keep_run``."""
        runs = {k[len(ORDER_PREFIX) :].split(":")[0] for k in self.store._records(ORDER_PREFIX)}
        with self.lock:
            for run in sorted(runs - {keep_run}):
                self.store._delete_records(f"{ORDER_PREFIX}{run}:")

    # -- the driver ------------------------------------------------------------------------
    def driver(self) -> dict | None:
        text = self.store._get_record(DRIVER_KEY)
        return json.loads(text) if text else None

    def put_driver(self, driver: dict) -> None:
        with self.lock:
            self.store._put_record(DRIVER_KEY, json.dumps(driver))

    def claim_driver(self, driver: dict) -> dict | None:
        """Take the upgrade for ``driver``: an atomic swap of the driver record, from what it
        holds now, refused while another driver is alive. Returns the driver that holds it
        instead (``None``: taken)."""
        with self.lock:
            text = self.store._get_record(DRIVER_KEY)
            held = json.loads(text) if text else None
            if driver_alive(held) and held.get("token") != driver.get("token"):
                return held
            if self.store._swap_record(DRIVER_KEY, json.dumps(driver), text):
                return None
            now = self.store._get_record(DRIVER_KEY)
            return json.loads(now) if now else {"what": "another process"}

    # -- commands --------------------------------------------------------------------------
    def command(self) -> dict | None:
        text = self.store._get_record(COMMAND_KEY)
        return json.loads(text) if text else None

    def post_command(self, command: dict) -> int:
        """Post ``command`` for the running driver; returns its sequence number."""
        with self.lock:
            last = self.command() or {}
            state = self.store.read_state()
            seq = max(int(last.get("seq", 0)), int(state.get("command_seq", 0))) + 1
            self.store._put_record(COMMAND_KEY, json.dumps({**command, "seq": seq}))
        return seq

    # -- the canary ------------------------------------------------------------------------
    def canary_points(self, run: str) -> list[dict]:
        found = self.store._records(f"{CANARY_PREFIX}{run}:")
        return [json.loads(found[k]) for k in sorted(found)]

    def add_canary_point(self, run: str, seq: int, point: dict) -> None:
        with self.lock:
            self.store._put_record(f"{CANARY_PREFIX}{run}:{seq:06d}", json.dumps(point))

    def canary_reference(self, run: str) -> dict | None:
        text = self.store._get_record(f"{CANARY_REFERENCE_KEY}:{run}")
        return json.loads(text) if text else None

    def put_canary_reference(self, run: str, reference: dict) -> None:
        with self.lock:
            self.store._put_record(f"{CANARY_REFERENCE_KEY}:{run}", json.dumps(reference))

    # -- the live index's registered canary ---------------------------------------------------
    def put_live_canary(self, data: bytes, reg: str) -> dict:
        """Keep a canary registered with the live index (its parquet bytes, registration
        ``reg``) in records; the last one is what :meth:`live_canary` reads."""
        chunks = {
            f"{LIVE_CANARY_PREFIX}{reg}:{c:06d}": base64.b64encode(
                data[start : start + BLOB_CHUNK_BYTES]
            ).decode()
            for c, start in enumerate(range(0, max(len(data), 1), BLOB_CHUNK_BYTES))
        }
        meta = {"reg": reg, "chunks": len(chunks), "sha256": hashlib.sha256(data).hexdigest()}
        with self.lock:
            self.store._put_records(chunks)
            self.store._put_record(LIVE_CANARY_KEY, json.dumps(meta))
            for key in {k.rsplit(":", 1)[0] for k in self.store._records(LIVE_CANARY_PREFIX)}:
                if key != f"{LIVE_CANARY_PREFIX}{reg}":  # an earlier registration's bytes
                    self.store._delete_records(key + ":")
        return meta

    def live_canary_meta(self) -> dict | None:
        text = self.store._get_record(LIVE_CANARY_KEY)
        return json.loads(text) if text else None

    def live_canary(self) -> bytes | None:
        """The bytes of the canary registered last (``None``: none), checked against their
        digest."""
        meta = self.live_canary_meta()
        if meta is None:
            return None
        prefix = f"{LIVE_CANARY_PREFIX}{meta['reg']}:"
        found = self.store._records(prefix)
        keys = [f"{prefix}{c:06d}" for c in range(int(meta["chunks"]))]
        if any(k not in found for k in keys):
            raise StoreError(f"{self.store.where}: the live canary's records are missing")
        data = b"".join(base64.b64decode(found[k]) for k in keys)
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise StoreError(f"{self.store.where}: the live canary's records do not match")
        return data


class DriverHeld(StoreError):
    """Another driver holds the upgrade of a store (its record names it)."""

    def __init__(self, where: str, held: dict):
        self.held = held
        super().__init__(
            f"another backfill driver holds the upgrade of {where} ({held.get('what')}, pid "
            f"{held.get('pid')} on {held.get('host')}): one driver at a time; pause it, or wait "
            "for it to end"
        )


class Heartbeat:
    """A driver's presence in the store: written when it starts, every :data:`BEAT_S`
    seconds by a daemon thread, and marked ended when it stops (``with Heartbeat(...):``)."""

    def __init__(self, records: BackfillRecords, run: str | None, what: str):
        self.records = records
        self.token = uuid.uuid4().hex[:12]
        self.info = {
            "run": run,
            "what": what,
            "token": self.token,
            "pid": os.getpid(),
            "host": _host(),
            "started": round(time.time(), 3),
            "beat": round(time.time(), 3),
            "ended": None,
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        """Claim the upgrade (:meth:`BackfillRecords.claim_driver`), then beat;
        :class:`DriverHeld` when another driver holds it."""
        if self._thread is not None:  # entered already (a run claims before its writes)
            return self
        _LIVE_HERE.add(self.token)
        try:
            held = self.records.claim_driver(self.info)
        except BaseException:
            _LIVE_HERE.discard(self.token)
            raise
        if held is not None:
            _LIVE_HERE.discard(self.token)
            raise DriverHeld(self.records.store.where, held)
        self._thread = threading.Thread(target=self._beat, name="backfill-beat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            self.info["beat"] = round(time.time(), 3)
            try:
                self.records.put_driver(self.info)
            except Exception:  # a full disk or a closed store: the next beat tries again
                pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=BEAT_S + 1)
        _LIVE_HERE.discard(self.token)
        self.info["ended"] = round(time.time(), 3)
        try:
            self.records.put_driver(self.info)
        except Exception:  # the store refuses writes: a dead pid tells the same
            pass


class SidecarChannel:
    """Milvus Lite: one process holds the ``.db`` file, so a command of another process goes
    through ``<file>.<collection>.backfill-command.json`` and reads the driver's copy of the
    state record ``<file>.<collection>.backfill-status.json`` (both written atomically)."""

    def __init__(self, db_file: str, collection: str):
        base = f"{os.path.abspath(db_file)}.{collection}"
        self.command_path = base + ".backfill-command.json"
        self.status_path = base + ".backfill-status.json"

    @staticmethod
    def _write(path: str, doc: dict) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(doc, fh)
        os.replace(tmp, path)

    @staticmethod
    def _read(path: str) -> dict | None:
        try:
            with open(path) as fh:
                return json.load(fh)
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def status(self) -> dict | None:
        return self._read(self.status_path)

    def write_status(self, status: dict) -> None:
        self._write(self.status_path, status)

    def command(self) -> dict | None:
        return self._read(self.command_path)

    def post_command(self, command: dict) -> int:
        last = self.command() or {}
        seen = (self.status() or {}).get("command_seq", 0)
        seq = max(int(last.get("seq", 0)), int(seen or 0)) + 1
        self._write(self.command_path, {**command, "seq": seq})
        return seq


class Ballast:
    """Spare space for the record of a full disk: a file of :data:`SIZE` bytes beside a
    store on a local disk (a LanceDB folder, a Milvus Lite file), made when a driver starts
    and deleted when the store refuses a write for want of space, so that the upgrade's
    record can still say why it stopped.  No file for an object store or a Milvus server."""

    SIZE = 1 << 20

    def __init__(self, store: VectorStore):
        uri = store.uri
        self.path = None
        if uri.scheme == "lance" and "://" not in uri.target:
            self.path = os.path.join(os.path.abspath(uri.target), f".{uri.name}.ballast")
        elif uri.scheme == "milvus" and uri.is_local_file:
            folder, db = os.path.split(os.path.abspath(uri.target))
            self.path = os.path.join(folder, f".{db}.{uri.name}.ballast")

    def fill(self) -> None:
        """Make the file if it is not there (nothing if the disk has not the room)."""
        if self.path is None or os.path.exists(self.path):
            return
        try:
            with open(self.path, "wb") as fh:
                fh.write(b"\0" * self.SIZE)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            try:
                os.remove(self.path)
            except OSError:
                pass

    def release(self) -> bool:
        """Delete the file; whether there was one."""
        if self.path is None:
            return False
        try:
            os.remove(self.path)
        except OSError:
            return False
        return True


def is_full_disk(exc: BaseException) -> bool:
    """Whether a store's error is a full disk (errno 28, as each engine words it)."""
    text = str(exc)
    return getattr(exc, "errno", None) == 28 or "No space left" in text or "os error 28" in text


# -- positions ---------------------------------------------------------------------------
def _positions_of(store: VectorStore, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(position, new fingerprint)`` of ``ids`` (in the order of ``ids``)."""
    found: dict[int, tuple[int, str]] = {}
    for start in range(0, len(ids), 4096):
        chunk = tuple(int(i) for i in ids[start : start + 4096])
        for block in store.read_blocks(("id", "position", "new_model"), filter=Filter(ids=chunk)):
            for i, p, m in zip(
                block["id"].tolist(),
                block["position"].tolist(),
                block["new_model"].tolist(),
                strict=True,
            ):
                found[i] = (p, m)
    pos = np.array([found.get(int(i), (-1, ""))[0] for i in ids], np.int64)
    models = np.array([found.get(int(i), (-1, ""))[1] for i in ids], object)
    return pos, models


def reconciled_position(
    store: VectorStore, order: np.ndarray, position: int, fingerprint: str, base: int = 0
) -> int:
    """Where the order really stands: ``position`` (the record's), moved on past every batch
    the store holds beyond it (written, then killed before the record was); each such item
    must sit at its own index of the order (plus ``base``, where the order's positions in the
    store start) with ``fingerprint``."""
    high = int(store._max_position()) - int(base)
    if high + 1 <= position:
        return int(position)
    ahead = np.asarray(order[position : high + 1], np.int64)
    pos, models = _positions_of(store, ahead)
    want = np.arange(position, position + len(ahead)) + int(base)
    ok = (pos == want) & (models == fingerprint)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise StoreError(
            f"column {store.columns.position!r} of {store.where}: the store holds positions up "
            f"to {high + int(base)}, the backfill record says {position + int(base)}, but item "
            f"{int(ahead[bad])} (the order's item {position + bad}) is at position "
            f"{int(pos[bad])} with model {models[bad]!r}: the store was changed outside the job"
        )
    return high + 1


@dataclasses.dataclass(frozen=True)
class KeptPrefix:
    """What a new backfill finds already upgraded: ``ids`` (this model's items at positions
    0..n-1, by position), ``others`` (items per other new fingerprint) and ``gap_at`` (the
    first position missing among this model's items, after which they are turned back before
    the walk; ``None``: no gap)."""

    ids: np.ndarray
    others: dict[str, int]
    gap_at: int | None


def kept_prefix(store: VectorStore, fingerprint: str) -> KeptPrefix:
    """The items already upgraded to ``fingerprint`` at positions 0, 1, 2, ... (a new
    backfill keeps them as the start of its order), and the upgraded items of other models."""
    ids, pos, others = [], [], {}
    for block in store.read_blocks(
        ("id", "position", "new_model"), filter=Filter(upgraded=True), block_rows=65536
    ):
        mine = block["new_model"] == fingerprint
        for m in set(block["new_model"][~mine].tolist()):
            others[m] = others.get(m, 0) + int((block["new_model"] == m).sum())
        ids.append(block["id"][mine])
        pos.append(block["position"][mine])
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    pos = np.concatenate(pos) if pos else np.zeros(0, np.int64)
    order = np.argsort(pos, kind="stable")
    ids, pos = ids[order], pos[order]
    gap = np.flatnonzero(pos != np.arange(len(pos)))
    gap_at = int(gap[0]) if gap.size else None
    return KeptPrefix(ids[: gap_at if gap_at is not None else len(ids)], others, gap_at)


def rollback_in_batches(store: VectorStore, to: int, batch: int, between=None) -> int:
    """Turn every item at position ``to`` or later back to old, the latest upgraded first,
    at most ``batch`` positions per atomic store call; ``between(done)`` runs after each call
    and returns False to stop (a pause).  Returns the items turned back."""
    done = 0
    high = int(store._max_position())
    while high >= to:
        start = max(int(to), high + 1 - int(batch))
        done += int(store.rollback_to_position(start))
        high = start - 1
        if between is not None and high >= to and between(done) is False:
            break
    return done


# -- new vectors from a parquet file -----------------------------------------------------
class NewVectorsParquet:
    """``--new-vectors``: precomputed new vectors, a parquet file or folder of shards with
    ``item_id`` and ``new`` (fixed-size or plain lists of floats; the output of
    ``raycompat embed-gallery --columns new``), and optionally ``label`` / ``class_name``
    (compared with the store's labels) and ``split`` (``query`` rows are left out).

    The ids (and labels) are read when it is opened; vectors are read per batch, by row group,
    the last few row groups kept.  Every problem is a :class:`StoreError` whose message starts
    with ``--new-vectors <path>:`` and names the column."""

    def __init__(self, path: str, column: str = "new", cache_groups: int = 8):
        import pyarrow.parquet as pq

        self.path, self.column = path, column
        files = self._files(path)
        self._files_pf = [pq.ParquetFile(f) for f in files]
        names = self._files_pf[0].schema_arrow.names
        for need in ("item_id", column):
            if need not in names:
                raise self.error(need, f"is missing (columns: {', '.join(names)})")
        ids, groups, rows, labels, names_col, keep = [], [], [], [], [], []
        for f, pf in enumerate(self._files_pf):
            wanted = [c for c in ("item_id", "label", "class_name", "split") if c in names]
            for g in range(pf.num_row_groups):
                t = pf.read_row_group(g, columns=wanted)
                n = t.num_rows
                ids.append(t.column("item_id").to_numpy().astype(np.int64))
                groups.append(np.full(n, f * 1_000_000 + g, np.int64))
                rows.append(np.arange(n, dtype=np.int64))
                if "split" in wanted:
                    keep.append(np.asarray(t.column("split").to_pylist(), object) != "query")
                else:
                    keep.append(np.ones(n, bool))
                if "label" in wanted:
                    labels.append(np.asarray(t.column("label").to_pylist(), object))
                if "class_name" in wanted:
                    names_col.append(np.asarray(t.column("class_name").to_pylist(), object))
        keep = np.concatenate(keep)
        self.ids = np.concatenate(ids)[keep]
        self._group = np.concatenate(groups)[keep]
        self._row = np.concatenate(rows)[keep]
        self.labels = np.concatenate(labels)[keep] if labels else None
        self.class_names = np.concatenate(names_col)[keep] if names_col else None
        order = np.argsort(self.ids, kind="stable")
        self.ids, self._group, self._row = self.ids[order], self._group[order], self._row[order]
        if self.labels is not None:
            self.labels = self.labels[order]
        if self.class_names is not None:
            self.class_names = self.class_names[order]
        dup = self.ids[1:][self.ids[1:] == self.ids[:-1]]
        if dup.size:
            raise self.error("item_id", f"ids repeat, e.g. {np.unique(dup)[:5].tolist()}")
        self.dim = self._dimension()
        self._cache: OrderedDict = OrderedDict()
        self._cache_groups = int(cache_groups)

    @staticmethod
    def _files(path: str) -> list[str]:
        if os.path.isdir(path):
            files = sorted(
                os.path.join(path, f)
                for f in os.listdir(path)
                if f.endswith(".parquet") and not f.startswith(("_", "."))
            )
        elif os.path.isfile(path):
            files = [path]
        else:
            raise StoreError(f"--new-vectors {path}: no such file or folder")
        if not files:
            raise StoreError(f"--new-vectors {path}: no parquet file in the folder")
        return files

    def error(self, column: str, why: str) -> StoreError:
        return StoreError(f"--new-vectors {self.path}: column {column!r} {why}")

    def _dimension(self) -> int:
        import pyarrow as pa

        kind = self._files_pf[0].schema_arrow.field(self.column).type
        if pa.types.is_fixed_size_list(kind):
            return int(kind.list_size)
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            raise self.error(self.column, f"has type {kind}, expected a list of floats")
        if not len(self.ids):
            return 0
        return int(self._vectors_at(self._group[:1], self._row[:1]).shape[1])

    def _read_group(self, key: int) -> np.ndarray:
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        pf = self._files_pf[key // 1_000_000]
        column = pf.read_row_group(key % 1_000_000, columns=[self.column]).column(0)
        values = column.to_pylist() if not hasattr(column.type, "list_size") else None
        if values is None:
            flat = column.combine_chunks()
            arr = flat.values.to_numpy(zero_copy_only=False).reshape(len(flat), -1)
        else:
            lengths = {len(v) for v in values if v is not None}
            if None in values or len(lengths) > 1:
                raise self.error(self.column, "holds missing or ragged vectors")
            arr = np.asarray(values, np.float64)
        arr = np.asarray(arr, np.float32)
        self._cache[key] = arr
        while len(self._cache) > self._cache_groups:
            self._cache.popitem(last=False)
        return arr

    def _vectors_at(self, groups: np.ndarray, rows: np.ndarray) -> np.ndarray:
        out = None
        for key in np.unique(groups).tolist():
            at = np.flatnonzero(groups == key)
            values = self._read_group(int(key))[rows[at]]
            if out is None:
                out = np.empty((len(groups), values.shape[1]), np.float32)
            out[at] = values
        return out if out is not None else np.zeros((0, 0), np.float32)

    def missing(self, ids: np.ndarray) -> np.ndarray:
        """The ids of ``ids`` the file does not hold."""
        return np.asarray(ids)[~np.isin(ids, self.ids)]

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """The new vectors of ``ids`` (float32 [n, dim], in the order of ``ids``); refused
        naming the column for an id the file lacks or a NaN/inf vector."""
        ids = np.asarray(ids, np.int64)
        at = np.searchsorted(self.ids, ids)
        at = np.minimum(at, max(len(self.ids) - 1, 0))
        lacking = ids[self.ids[at] != ids] if len(self.ids) else ids
        if lacking.size:
            raise self.error(
                "item_id", f"lacks {lacking.size} item(s), e.g. {lacking[:5].tolist()}"
            )
        out = self._vectors_at(self._group[at], self._row[at])
        bad = ~np.isfinite(out).all(axis=1)
        if bad.any():
            raise self.error(
                self.column, f"has NaN or inf vectors for item(s) {ids[bad][:5].tolist()}"
            )
        return out
