"""The LanceDB store: ``lance://<database path or URI>/<table>`` (docs/stores.md#lancedb).

One table holds the gallery, with the old and the new vectors as two ``fixed_size_list<float32>``
columns (the new one null until the item is upgraded); a second small table
``<table>__raycompat_state`` holds the key-value records (progress, marks, finalize marker).
Every write is one LanceDB commit, so it is atomic; marks are LanceDB tags.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from datetime import timedelta

import numpy as np

try:
    import lancedb
    import lancedb.index
except ModuleNotFoundError as exc:  # a broken install: lancedb is a core dependency
    from raycompat.stores.errors import MissingBackendError

    raise MissingBackendError("lance", "lancedb", "") from exc
import pyarrow as pa
import pyarrow.compute as pc

from raycompat.stores import checks
from raycompat.stores.base import (
    DRIVER_KEY,
    FINALIZED_KEY,
    LOGICAL_COLUMNS,
    Capabilities,
    CheckedBlock,
    ColumnMap,
    Filter,
    GalleryBlock,
    Layout,
    ModelCounts,
    RollbackMark,
    VectorStore,
    checked_gallery,
)
from raycompat.stores.errors import StoreError, StoreExistsError, StoreNotFoundError
from raycompat.stores.topk import Fetch
from raycompat.stores.uri import StoreURI

__all__ = ["LanceStore", "STATE_SUFFIX"]

#: The state table of table ``t`` is ``t + STATE_SUFFIX``.
STATE_SUFFIX = "__raycompat_state"
#: The state table is compacted after this many writes of one handle: every write is a small
#: file of its own, and a read scans them all.
STATE_COMPACT_EVERY = 32
_STATE_SCHEMA = pa.schema(
    [pa.field("key", pa.string(), False), pa.field("value", pa.string(), False)]
)
_CAPABILITIES = Capabilities(
    drop_field=True,
    null_vectors=True,
    snapshots=True,
    hybrid_search_raw_scores=False,
    concurrent_writers=True,
    partial_update=True,
    exact_with_ann_index=True,
    write_sequence=True,
)


def _connect(uri: StoreURI) -> lancedb.DBConnection:
    # read_consistency_interval=0: every read sees the latest commit of any process.
    return lancedb.connect(uri.target, read_consistency_interval=timedelta(0))


def _open_table(db: lancedb.DBConnection, name: str):
    try:
        return db.open_table(name)
    except ValueError as exc:
        if "not found" in str(exc):
            return None
        raise


def _create_state_table(db: lancedb.DBConnection, name: str):
    """The state table, created in one commit with an empty driver record, so that claiming
    the upgrade is always a conditional update of that one row (:meth:`LanceStore.
    _swap_record`); a table another process created meanwhile is opened."""
    rows = pa.table({"key": [DRIVER_KEY], "value": [""]}, schema=_STATE_SCHEMA)
    try:
        return db.create_table(name, rows, schema=_STATE_SCHEMA, mode="create")
    except Exception:  # created by another process first (or now): open it
        table = _open_table(db, name)
        if table is None:
            raise
        return table


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _sql_list(values: Iterable) -> str:
    return ", ".join(_quote(v) if isinstance(v, str) else str(int(v)) for v in values)


def _fsl(vectors: np.ndarray) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(
        pa.array(vectors.ravel(), pa.float32()), vectors.shape[1]
    )


def _vectors(column: pa.ChunkedArray | pa.Array, dim: int) -> np.ndarray:
    """A fixed_size_list column as float32 [n, dim]; null entries become NaN rows."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    values = arr.values.slice(arr.offset * dim, len(arr) * dim)
    out = values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(arr), dim)
    if arr.null_count:
        out[~arr.is_valid().to_numpy(zero_copy_only=False)] = np.nan
    return out


def _masked_fsl(vectors: np.ndarray | None, valid: np.ndarray, dim: int) -> pa.Array:
    """Rows of ``vectors`` where ``valid``, nulls elsewhere, as a fixed_size_list column."""
    n = len(valid)
    full = np.zeros((n, dim), np.float32) if vectors is None else vectors
    values = pa.array(full.ravel(), pa.float32())
    mask = pa.array(~np.asarray(valid, bool))
    return pa.FixedSizeListArray.from_arrays(values, dim, mask=mask)


def _last_writes(writes) -> tuple[np.ndarray, np.ndarray, dict, np.ndarray]:
    """``(ids, field of each, {field: vectors [n, d] by id row}, fingerprint of each)`` of
    checked writes, each id once (its last write)."""
    last: dict[int, tuple[int, int]] = {}
    for w_i, w in enumerate(writes):
        for r_i, i in enumerate(w.ids.tolist()):
            last.pop(i, None)
            last[i] = (w_i, r_i)
    ids = np.fromiter(last, np.int64, len(last))
    fields = np.asarray([writes[w].field for w, _ in last.values()], dtype=object)
    models = np.asarray([writes[w].fingerprint for w, _ in last.values()], dtype=object)
    vectors: dict[str, np.ndarray] = {}
    for name in ("old", "new"):
        picks = [(k, w, r) for k, (w, r) in enumerate(last.values()) if writes[w].field == name]
        if picks:
            dim = writes[picks[0][1]].vectors.shape[1]
            out = np.zeros((len(ids), dim), np.float32)
            for k, w, r in picks:
                out[k] = writes[w].vectors[r]
            vectors[name] = out
    return ids, fields, vectors, models


def _strings(column: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(pc.fill_null(column, "").to_pylist(), dtype=object)


def _schema(cols: ColumnMap, layout: Layout) -> pa.Schema:
    label = pa.int64() if layout.label_type == "int64" else pa.string()
    out = [
        pa.field(cols.id, pa.int64(), False),
        pa.field(cols.label, label, False),
        pa.field(cols.old, pa.list_(pa.float32(), layout.old_dim), False),
        pa.field(cols.new, pa.list_(pa.float32(), layout.new_dim), True),
    ]
    if cols.image_uri:
        out.append(pa.field(cols.image_uri, pa.string(), False))
    out += [pa.field(cols.old_model, pa.string(), False), pa.field(cols.new_model, pa.string())]
    if cols.upgraded:
        out.append(pa.field(cols.upgraded, pa.bool_(), False))
    if cols.position:
        out.append(pa.field(cols.position, pa.int64(), False))
    if cols.write_seq:
        out.append(pa.field(cols.write_seq, pa.int64(), False))
    return pa.schema(out)


def _record_batch(
    block: CheckedBlock, cols: ColumnMap, schema: pa.Schema, old_model: str, new_model: str | None
) -> pa.RecordBatch:
    n, up = len(block.ids), block.new is not None
    data = {
        cols.id: block.ids,
        cols.label: block.labels,
        cols.old: _fsl(block.old),
        cols.new: _fsl(block.new) if up else pa.nulls(n, schema.field(cols.new).type),
        cols.old_model: [old_model] * n,
        cols.new_model: [new_model if up else None] * n,
    }
    if cols.image_uri:
        data[cols.image_uri] = block.image_uris
    if cols.upgraded:
        data[cols.upgraded] = np.full(n, up)
    if cols.position:
        data[cols.position] = block.positions
    if cols.write_seq:
        data[cols.write_seq] = np.zeros(n, dtype=np.int64)
    return pa.record_batch([data[f.name] for f in schema], schema=schema)


_EXPECTED_TYPES = {
    "id": "int64",
    "old_model": "string",
    "new_model": "string",
    "image_uri": "string",
    "upgraded": "bool",
    "position": "int64",
    "write_seq": "int64",
}


def _layout_from_schema(schema: pa.Schema, cols: ColumnMap, where: str, finalized: bool) -> Layout:
    """The layout of an existing table; a StoreError names the first column that is missing
    or of the wrong type."""
    names = set(schema.names)
    for logical in LOGICAL_COLUMNS:
        name = getattr(cols, logical)
        if name is None or (logical == "old" and finalized and name not in names):
            continue
        if logical == "write_seq" and name not in names:
            continue  # optional: a table without it is not followed (VectorStore.version)
        if name not in names:
            raise StoreError(
                f"column {name!r} ({logical}) missing from {where}; its columns: "
                f"{', '.join(schema.names)}"
            )
        kind = schema.field(name).type
        want = _EXPECTED_TYPES.get(logical)
        if want and str(kind) != want:
            raise StoreError(f"column {name!r} of {where} has type {kind}, expected {want}")
        if logical in ("old", "new") and not (
            pa.types.is_fixed_size_list(kind) and kind.value_type == pa.float32()
        ):
            raise StoreError(
                f"column {name!r} of {where} has type {kind}, expected fixed_size_list<float32>[d]"
            )
        if logical == "label" and str(kind) not in ("int64", "string"):
            raise StoreError(
                f"column {name!r} of {where} has type {kind}, expected int64 or string"
            )
    old_dim = schema.field(cols.old).type.list_size if cols.old in names else 0
    label = "int64" if str(schema.field(cols.label).type) == "int64" else "string"
    return Layout(old_dim, schema.field(cols.new).type.list_size, label)


class LanceStore(VectorStore):
    """A gallery in a LanceDB table (docs/stores.md#lancedb)."""

    backend = "lance"
    max_search_limit = 1_000_000
    keeps_write_sequence = True

    def __init__(self, uri: StoreURI, columns: ColumnMap, layout: Layout, db, table) -> None:
        super().__init__(uri, columns, layout)
        self._db = db
        self._table = table
        self._state_table = None
        self._known: np.ndarray | None = None
        self._state_lock = threading.Lock()
        self._state_writes = 0
        self._seq_high: int | None = None

    @staticmethod
    def _where(uri: StoreURI) -> str:
        return f"LanceDB table {uri.name!r} at {uri.target!r}"

    @property
    def where(self) -> str:
        return self._where(self.uri)

    @property
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    @classmethod
    def create(
        cls,
        uri: StoreURI,
        items: GalleryBlock | Iterable[GalleryBlock],
        *,
        columns: ColumnMap,
        old_model: str,
        new_model: str | None,
        new_dim: int | None,
        overwrite: bool,
    ) -> LanceStore:
        """Write the gallery as one commit (docs/stores.md#create)."""
        db, where = _connect(uri), cls._where(uri)
        layout, blocks = checked_gallery(items, columns, where, new_model, new_dim)
        existing = _open_table(db, uri.name)
        if existing is not None and existing.count_rows() and not overwrite:
            raise StoreExistsError(
                f"{where} exists and holds {existing.count_rows()} rows; "
                "pass overwrite=True to replace it"
            )
        schema = _schema(columns, layout)
        failed: list[BaseException] = []

        def batches() -> Iterator[pa.RecordBatch]:
            try:
                for block in blocks:
                    yield _record_batch(block, columns, schema, old_model, new_model)
            except BaseException as exc:  # re-raised below, unwrapped by LanceDB
                failed.append(exc)
                raise

        reader = pa.RecordBatchReader.from_batches(schema, batches())
        try:
            # The vectors are checked already: "null" only lets the new column's nulls through.
            # An existing table is replaced by one commit of a new version at the end, so a
            # gallery that fails its checks part-way leaves the old table as it was.
            table = db.create_table(
                uri.name,
                reader,
                schema=schema,
                on_bad_vectors="null",
                mode="create" if existing is None else "overwrite",
            )
        except Exception:
            if failed:
                raise failed[0] from None
            raise
        if _open_table(db, uri.name + STATE_SUFFIX) is not None:  # the old table's records
            db.drop_table(uri.name + STATE_SUFFIX)
        _create_state_table(db, uri.name + STATE_SUFFIX)  # with the driver's (empty) record
        # writes find their rows by id, followers the rows newer than a sequence number
        for column in (columns.id, columns.write_seq):
            if column:
                table.create_index(column, config=lancedb.index.BTree())
        return cls(uri, columns, layout, db, table)

    @classmethod
    def open(cls, uri: StoreURI, columns: ColumnMap) -> LanceStore:
        """Open an existing table, checking its columns (docs/stores.md#open)."""
        where = cls._where(uri)
        if "://" not in uri.target and not os.path.isdir(uri.target):
            # lancedb.connect would create the folder: opening must leave nothing behind
            raise StoreNotFoundError(f"{where} does not exist")
        db = _connect(uri)
        table = _open_table(db, uri.name)
        if table is None:
            raise StoreNotFoundError(f"{where} does not exist")
        store = cls(uri, columns, Layout(0, 0, "int64"), db, table)
        marker = store._get_record(FINALIZED_KEY) is not None
        store._layout = _layout_from_schema(table.schema, columns, where, marker)
        return store

    def close(self) -> None:
        """Drop the handles (LanceDB keeps no server or lock)."""
        self._table = self._state_table = None

    @property
    def finalized(self) -> bool:
        if self.columns.old in self._table.schema.names:
            return False
        return self._get_record(FINALIZED_KEY) is not None

    # -- reading -------------------------------------------------------------------------
    def _expr(self, flt: Filter) -> str | None:
        cols, parts = self.columns, []
        if flt.upgraded is not None:
            if cols.upgraded:
                parts.append(f"{cols.upgraded} = {str(flt.upgraded).lower()}")
            else:
                parts.append(f"{cols.position} {'>=' if flt.upgraded else '<'} 0")
        if flt.labels is not None:
            parts.append(f"{cols.label} IN ({_sql_list(flt.labels)})")
        if flt.ids is not None:
            parts.append(f"{cols.id} IN ({_sql_list(flt.ids)})")
        if flt.raw:
            parts.append(f"({flt.raw})")
        return " AND ".join(parts) or None

    def _scan(
        self, columns: list[str], flt: Filter | str | None = None, table=None, row_ids: bool = False
    ) -> pa.Table:
        query = (table or self._table).search().select(columns).with_row_id(row_ids)
        expr = self._expr(self._filter(flt))
        if expr:
            query = query.where(expr)
        return query.limit(None).to_arrow()

    def count(self, filter: Filter | str | None = None) -> int:
        return int(self._table.count_rows(self._expr(self._filter(filter))))

    def read_ids(self, filter: Filter | str | None = None) -> np.ndarray:
        ids = self._scan([self.columns.id], filter)[self.columns.id].to_numpy()
        return np.sort(ids.astype(np.int64))

    def read_blocks(
        self,
        columns: Iterable[str] = ("id", "label", "old"),
        block_rows: int = 4096,
        filter: Filter | str | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Blocks in ascending id order, all from the version current at the call
        (docs/stores.md#read)."""
        wanted = self._read_columns(columns)
        self._check_block_rows(block_rows)
        snapshot = self._db.open_table(self.uri.name)
        snapshot.checkout(self._table.version)
        index = self._scan([self.columns.id], filter, table=snapshot, row_ids=True)
        order = np.argsort(index[self.columns.id].to_numpy(), kind="stable")
        row_ids = index["_rowid"].to_numpy()[order]
        return self._iter_blocks(snapshot, wanted, row_ids, block_rows)

    def _scan_blocks(
        self, wanted: list[str], block_rows: int, flt: Filter
    ) -> Iterator[dict[str, np.ndarray]]:
        """Blocks in storage order from one streamed scan of the version current at the
        call: no id index and no takes by row id, which :meth:`read_blocks`' id order costs
        (docs/benchmarks.md, "Store backfill")."""
        query = self._table.search().select(self._physical_for(wanted))
        expr = self._expr(flt)
        if expr:
            query = query.where(expr)
        reader = query.limit(None).to_batches(block_rows)
        return (self._block_dict(pa.Table.from_batches([b]), wanted) for b in reader if len(b))

    def _physical_for(self, wanted: list[str]) -> list[str]:
        cols = self.columns
        names = {cols.id} | {cols.physical(name) for name in wanted}
        if {"new", "new_model"} & set(wanted):
            names.add(cols.upgraded or cols.position)
        return sorted(names)

    def _iter_blocks(
        self, snapshot, wanted: list[str], row_ids: np.ndarray, block_rows: int
    ) -> Iterator[dict[str, np.ndarray]]:
        physical = self._physical_for(wanted)
        for start in range(0, len(row_ids), block_rows):
            chunk = row_ids[start : start + block_rows].tolist()
            table = snapshot.take_row_ids(chunk).select(physical).to_arrow()
            table = table.sort_by(self.columns.id)
            yield self._block_dict(table, wanted)

    def _upgraded_mask(self, table: pa.Table) -> np.ndarray:
        cols = self.columns
        if cols.upgraded:
            return table[cols.upgraded].to_numpy(zero_copy_only=False).astype(bool)
        return table[cols.position].to_numpy() >= 0

    def _block_dict(self, table: pa.Table, wanted: list[str]) -> dict[str, np.ndarray]:
        cols, out = self.columns, {}
        for name in wanted:
            column = table[cols.physical(name)]
            if name in ("old", "new"):
                dim = self._layout.old_dim if name == "old" else self._layout.new_dim
                out[name] = _vectors(column, dim)
            elif name in ("id", "position", "write_seq"):
                out[name] = column.to_numpy().astype(np.int64)
            elif name == "upgraded":
                out[name] = column.to_numpy(zero_copy_only=False).astype(bool)
            elif name == "label" and self._layout.label_type == "int64":
                out[name] = column.to_numpy().astype(np.int64)
            else:
                out[name] = _strings(column)
        if {"new", "new_model"} & set(wanted):
            off = ~self._upgraded_mask(table)
            if "new" in out:
                out["new"][off] = np.nan
            if "new_model" in out:
                out["new_model"][off] = ""
        return out

    def counts_by_model(self) -> ModelCounts:
        cols = self.columns
        table = self._scan(sorted({cols.old_model, cols.new_model, cols.upgraded or cols.position}))
        up = self._upgraded_mask(table)
        old = dict(
            zip(*np.unique(_strings(table[cols.old_model]), return_counts=True), strict=True)
        )
        new = dict(
            zip(*np.unique(_strings(table[cols.new_model])[up], return_counts=True), strict=True)
        )
        return ModelCounts(
            len(table),
            int(up.sum()),
            {str(k): int(v) for k, v in old.items()},
            {str(k): int(v) for k, v in new.items()},
        )

    # -- writing -------------------------------------------------------------------------
    def _write_new(
        self, ids: np.ndarray, vectors: np.ndarray, fingerprint: str, positions: np.ndarray | None
    ) -> None:
        """One whole-row ``merge_insert`` of the batch: one commit (:meth:`_merge_rows`)."""
        cols, n = self.columns, len(ids)
        self._check_known(ids)
        updates = {cols.new: _fsl(vectors), cols.new_model: pa.array([fingerprint] * n)}
        if cols.upgraded:
            updates[cols.upgraded] = pa.array(np.ones(n, dtype=bool))
        if cols.position:
            updates[cols.position] = pa.array(np.asarray(positions, np.int64))
        if self._has_seq:
            updates[cols.write_seq] = pa.array(np.full(n, self._next_seq(), dtype=np.int64))
        self._merge_rows(ids, updates, "write_new")

    def _merge_rows(self, ids: np.ndarray, updates: dict, what: str) -> None:
        """Commit the current rows of ``ids`` (distinct) with the columns of ``updates``
        replaced, as one ``merge_insert`` of whole rows: LanceDB commits a whole-row update as
        a deletion and an append, without rewriting the columns of the fragments the rows were
        in (a partial update rewrites them: 140 ms for one row of 200,000, against 13 ms)."""
        cols = self.columns
        current = self._scan(list(self._table.schema.names), Filter(ids=tuple(ids.tolist())))
        have = current[cols.id].to_numpy()
        order = np.argsort(have)
        at = np.searchsorted(have, ids, sorter=order)
        if len(have) != len(ids) or not np.array_equal(have[order[at]], ids):
            raise StoreError(f"{self.where}: {what}: ids are not in the table (a delete?)")
        rows = current.take(pa.array(order[at]))
        for name, column in updates.items():
            k = rows.schema.get_field_index(name)
            if callable(column):  # a function of the current column
                column = column(rows[name])
            rows = rows.set_column(k, rows.schema.field(name), column)
        merge = self._table.merge_insert(cols.id).when_matched_update_all()
        result = merge.execute(rows, on_bad_vectors="null")  # the nulls of the new column
        if result.num_updated_rows != len(ids):
            raise StoreError(
                f"{self.where}: {what} updated {result.num_updated_rows} of {len(ids)} rows "
                "(a concurrent delete?)"
            )

    def _check_known(self, ids: np.ndarray) -> None:
        """Refuse ids not in the table before writing; the table's ids are read once (the
        store never adds or deletes items)."""
        if self._known is None:
            self._known = self.read_ids()
        missing = ids[~np.isin(ids, self._known)]
        if len(missing):
            raise StoreError(
                f"column {self.columns.id!r} of {self.where}: {len(missing)} ids "
                f"are not in the table, e.g. {missing[:5].tolist()}"
            )

    # -- following (the live index) ---------------------------------------------------------
    @property
    def _has_seq(self) -> bool:
        name = self.columns.write_seq
        return bool(name) and name in self._table.schema.names

    def _next_seq(self) -> int:
        """The sequence number of the next commit: one above the largest in the table (rows
        newer than the last one this handle knows are read through the index)."""
        self._seq_high = self.max_write_seq()
        self._seq_high += 1
        return self._seq_high

    def version(self) -> int | None:
        """The table's version (every commit makes one): one read of the latest manifest."""
        return int(self._table.version)

    def max_write_seq(self) -> int:
        if not self._has_seq:
            raise self._no_sequence()
        col, high = self.columns.write_seq, self._seq_high or 0
        newer = self._table.search().select([col]).where(f"{col} > {high}").limit(None)
        values = newer.to_arrow()[col].to_numpy()
        if len(values):
            high = int(values.max())
        self._seq_high = high
        return high

    def read_changes(
        self, since: int, columns: Iterable[str], block_rows: int = 65536
    ) -> Iterator[dict[str, np.ndarray]]:
        if not self._has_seq:
            raise self._no_sequence()
        wanted = list(dict.fromkeys([*self._read_columns(columns), "write_seq"]))
        self._check_block_rows(block_rows)
        flt = Filter(raw=f"{self.columns.write_seq} > {int(since)}")
        return self._scan_blocks(wanted, block_rows, flt)

    def write_items(self, writes) -> tuple[int, int]:
        """One ``merge_insert`` (when matched, update) of whole upgrade columns: one commit."""
        cols = self.columns
        if not self._has_seq or not cols.upgraded or not cols.position:
            raise (
                self._no_sequence()
                if not self._has_seq
                else StoreError(
                    f"{self.where}: write_items needs the upgraded and position columns"
                )
            )
        ids, field_of, vectors, models = _last_writes(self._checked_writes(writes))
        if not len(ids):
            return 0, self.max_write_seq()
        self._check_known(ids)
        updates = self._item_columns(field_of, vectors, models)
        self._position_high = None  # an item written by hand leaves the order (position -1)
        self._merge_rows(ids, updates, "write_items")
        return len(ids), int(updates[cols.write_seq][0].as_py())

    def revert_items(self, ids: np.ndarray) -> tuple[int, int]:
        """One ``update`` commit of the upgraded rows among ``ids``."""
        cols = self.columns
        if not self._has_seq or not cols.upgraded:
            raise self._no_sequence()
        if cols.old not in self._table.schema.names:
            raise StoreError(
                f"column {cols.old!r} of {self.where} was dropped at finalize: nothing to "
                "turn back to"
            )
        ids = checks.check_ids(np.unique(np.asarray(ids)), cols.id, self.where)
        if not len(ids):
            return 0, self.max_write_seq()
        seq = self._next_seq()
        self._position_high = None  # the largest position may have been turned back
        values = {cols.new: "NULL", cols.new_model: "NULL", cols.upgraded: "false"}
        if cols.position:
            values[cols.position] = "-1"
        values[cols.write_seq] = str(seq)
        where = f"{cols.upgraded} AND {cols.id} IN ({_sql_list(ids.tolist())})"
        result = self._table.update(where=where, values_sql=values)
        return int(result.rows_updated), seq

    def _item_columns(self, field_of: np.ndarray, vectors: dict, models: np.ndarray) -> dict:
        """The columns ``write_items`` replaces (values, or functions of the current column): a
        ``new`` write the upgrade columns (its old vector stays), an ``old`` write the old
        vector and model too, its new one cleared."""
        cols, n = self.columns, len(field_of)
        is_new = field_of == "new"
        out = {
            cols.new: _masked_fsl(vectors.get("new"), is_new, self._layout.new_dim),
            cols.new_model: pa.array(
                [m if up else None for m, up in zip(models, is_new, strict=True)], pa.string()
            ),
            cols.upgraded: pa.array(is_new),
            cols.position: pa.array(np.full(n, -1, dtype=np.int64)),
        }
        if not is_new.all():
            dim, old = self._layout.old_dim, vectors["old"]

            def old_vectors(current) -> pa.Array:  # a new write keeps its current old vector
                kept = _vectors(current, dim)
                kept[~is_new] = old[~is_new]
                return _fsl(kept)

            def old_models(current) -> pa.Array:
                kept = np.asarray(current.to_pylist(), dtype=object)
                kept[~is_new] = models[~is_new]
                return pa.array(kept.tolist(), pa.string())

            out[cols.old], out[cols.old_model] = old_vectors, old_models
        out[cols.write_seq] = pa.array(np.full(n, self._next_seq(), dtype=np.int64))
        return out

    def build_index(self, field: str, kind: str = "ivf") -> None:
        if kind not in ("ivf", "hnsw", "flat"):  # before anything is dropped
            raise StoreError(
                f"{self.where}: index kind must be 'ivf', 'hnsw' or 'flat', got {kind!r}"
            )
        column = self._vector_column(field)
        for index in self._table.list_indices():
            if list(index.columns) == [column]:
                self._table.drop_index(index.name)
        rows = max(1, self.count())
        if kind == "flat":
            return
        if kind == "ivf":
            config = lancedb.index.IvfFlat(
                distance_type="dot", num_partitions=max(1, int(np.sqrt(rows) / 2))
            )
        else:
            config = lancedb.index.IvfHnswSq(distance_type="dot", num_partitions=1)
        self._table.create_index(column, config=config, replace=True)

    def _indexes(self) -> dict[str, str | None]:
        found = {tuple(i.columns): i.index_type for i in self._table.list_indices()}
        names = {"old": self.columns.old, "new": self.columns.new}
        return {field: found.get((name,)) for field, name in names.items()}

    # -- search --------------------------------------------------------------------------
    def _fetch(self, field: str, queries: np.ndarray, flt: Filter, exact: bool) -> Fetch:
        column, id_col, expr = self.columns.physical(field), self.columns.id, self._expr(flt)

        def fetch(rows: np.ndarray, limit: int) -> list[tuple[np.ndarray, np.ndarray]]:
            query = (
                self._table.search(queries[rows], vector_column_name=column)
                .distance_type("dot")
                .select([id_col, "_distance"])
                .limit(limit)
            )
            if expr:
                query = query.where(expr, prefilter=True)
            if exact:
                query = query.bypass_vector_index()
            table = query.to_arrow()
            which = (
                table["query_index"].to_numpy()
                if "query_index" in table.column_names
                else np.zeros(table.num_rows, dtype=np.int64)
            )
            ids = table[id_col].to_numpy()
            # LanceDB's "dot" distance is 1 - inner product.
            scores = (1.0 - table["_distance"].to_numpy().astype(np.float64)).astype(np.float32)
            return [(ids[which == j], scores[which == j]) for j in range(len(rows))]

        return fetch

    # -- rollback and finalize -----------------------------------------------------------
    def rollback_to_position(self, position: int) -> int:
        """One ``update`` commit: items at ``position`` or later get a null new vector."""
        col = self._check_position_arg(position)
        if self.columns.old not in self._table.schema.names:
            raise StoreError(
                f"column {self.columns.old!r} of {self.where} was dropped at "
                "finalize; rollback(name) to a mark taken before finalize"
            )
        values = {self.columns.new: "NULL", self.columns.new_model: "NULL", col: "-1"}
        if self.columns.upgraded:
            values[self.columns.upgraded] = "false"
        if self._has_seq:
            values[self.columns.write_seq] = str(self._next_seq())
        result = self._table.update(where=f"{col} >= {int(position)}", values_sql=values)
        return int(result.rows_updated)

    def _max_position(self) -> int:
        col = self.columns.position
        if col is None:
            return -1
        values = self._scan([col], f"{col} >= 0")[col].to_numpy()
        return int(values.max()) if len(values) else -1

    def _snapshot(self, name: str) -> int | None:
        version = int(self._table.version)
        try:
            self._table.tags.create(name, version)
        except RuntimeError as exc:
            raise StoreError(
                f"{self.where}: cannot tag version {version} as {name!r}: {exc}"
            ) from exc
        return version

    def _rollback_to_mark(self, mark: RollbackMark) -> None:
        """``restore`` the tagged version: a new commit equal to it. A mark taken before
        finalize brings the old column back: the finalize record goes, and this handle's
        dimensions are read again from the restored schema."""
        self._table.restore(mark.name)
        if self.columns.old in self._table.schema.names:
            if self._get_record(FINALIZED_KEY) is not None:
                self._delete_record(FINALIZED_KEY)
            self._layout = _layout_from_schema(
                self._table.schema, self.columns, self.where, finalized=False
            )

    def _finalize(self) -> None:
        """Drop the old vector column (earlier versions, and tags, still hold it)."""
        self._table.drop_columns([self.columns.old])

    # -- state record --------------------------------------------------------------------
    def _state(self, create: bool = True):
        if self._state_table is None:
            name = self.uri.name + STATE_SUFFIX
            table = _open_table(self._db, name)
            if table is None and create:
                table = _create_state_table(self._db, name)
            self._state_table = table
        return self._state_table

    def _get_record(self, key: str) -> str | None:
        table = self._state(create=False)
        if table is None:
            return None
        query = table.search().where(f"key = {_quote(key)}").select(["value"]).limit(1)
        values = query.to_arrow()["value"].to_pylist()
        return values[0] if values else None

    def _put_record(self, key: str, text: str) -> None:
        """One ``merge_insert`` upsert on the key: one commit."""
        self._put_records({key: text})

    def _put_records(self, records: dict[str, str]) -> None:
        """One ``merge_insert`` upsert of every record: one commit."""
        if not records:
            return
        rows = pa.table(
            {"key": list(records), "value": list(records.values())}, schema=_STATE_SCHEMA
        )
        with self._state_lock:
            self._upsert_state(rows)
            self._state_written()

    def _upsert_state(self, rows: pa.Table) -> None:
        (
            self._state()
            .merge_insert("key")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute(rows)
        )

    def _swap_record(self, key: str, text: str, expect: str | None) -> bool:
        """A conditional ``merge_insert``: update the record where it still holds ``expect``
        (an absent record is first written empty, and ``None`` expects that). LanceDB re-runs
        an update that another process committed first against the newer version, so of two
        processes swapping the same record at once exactly one finds ``expect``. (Two writes of
        the empty record at once leave two equal rows, which every swap updates together.)"""
        with self._state_lock:
            if self._get_record(key) is None:
                empty = pa.table({"key": [key], "value": [""]}, schema=_STATE_SCHEMA)
                self._state().merge_insert("key").when_not_matched_insert_all().execute(empty)
            row = pa.table({"key": [key], "value": [text]}, schema=_STATE_SCHEMA)
            cond = f"target.value = {_quote(expect or '')}"
            merge = self._state().merge_insert("key").when_matched_update_all(where=cond)
            done = merge.execute(row).num_updated_rows >= 1
            self._state_written()
        return bool(done)

    def _delete_record(self, key: str) -> None:
        table = self._state(create=False)
        if table is not None:
            with self._state_lock:
                table.delete(f"key = {_quote(key)}")
                self._state_written()

    def _delete_records(self, prefix: str) -> None:
        """One ``delete`` commit of every record whose key starts with ``prefix``."""
        keys = list(self._records(prefix))
        if keys:
            with self._state_lock:
                self._state().delete(f"key IN ({_sql_list(keys)})")
                self._state_written()

    def _state_written(self) -> None:
        """(state lock held) Compact the state table every STATE_COMPACT_EVERY writes."""
        self._state_writes += 1
        if self._state_writes % STATE_COMPACT_EVERY == 0:
            try:
                self._state().optimize()
            except Exception:  # a concurrent writer or a full disk: the next one compacts
                pass

    def compact(self) -> None:
        """Merge the small files that writes leave (each ``write_new`` is one), in the
        gallery table and the state table: LanceDB's ``optimize`` (old versions are kept
        for 7 days; tagged ones, the marks, always)."""
        self._table.optimize()
        with self._state_lock:
            if self._state(create=False) is not None:
                self._state().optimize()

    def _records(self, prefix: str) -> dict[str, str]:
        table = self._state(create=False)
        if table is None:
            return {}
        rows = table.search().select(["key", "value"]).limit(None).to_arrow()
        pairs = zip(rows["key"].to_pylist(), rows["value"].to_pylist(), strict=True)
        return {k: v for k, v in pairs if k.startswith(prefix)}
