"""The one reader of the embeddings parquet schema (docs/architecture.md, "Formats":
"Embeddings parquet").

==========  ===============================  ==============================================
column      type                             meaning
==========  ===============================  ==============================================
item_id     int64                            id of the image, unique per side
label       any (int or string)              class; a query's positives share its label
split       string                           ``query`` (a query) or ``gallery`` /
                                             ``distractor`` (a gallery item)
class_name  string, optional                 the class: queries and gallery are matched by
                                             it when the files store it
old         fixed_size_list<float32>[D_old]  phi_o(x), the old model's embedding
new         fixed_size_list<float32>[D_new]  phi_n(x), the new model's embedding
adapted     fixed_size_list<float32>[D_new]  optional: psi(phi_o(x)) (DMU forward adaptation)
unc_<kind>  float64, optional                stored uncertainty (the embed-gallery job)
<cost>      number, optional                 an item's backfill cost (``cost_column``: bytes,
                                             pixels, a storage tier's price), finite and > 0
==========  ===============================  ==============================================

Plain ``list<float>`` columns with one length per column, and float16/float64 values, are
accepted too.  A location is a file, a folder of parquet files (subfolders included; names
starting with ``_`` or ``.`` are metadata) or a URI pyarrow opens, resolved by
:func:`raycompat.storage.open_storage`.

:class:`EmbeddingsParquet` reads in three steps, each with its checks:

* :meth:`~EmbeddingsParquet.open`: file list and footers only -- unreadable file, missing
  column, ``item_id`` not integer, class names in some files only, files with other columns,
  a fixed vector dimension that differs between files (both files named), ``adapted`` vs
  ``new``, a cost column that is missing or not numeric;
* :meth:`~EmbeddingsParquet.read_keys`: ``item_id`` / ``label`` / ``split`` / ``class_name``
  of every row -- nulls, unknown splits, class names vs labels (:func:`labels_by_class_name`),
  duplicate ids within a side (with the files holding them), an empty side;
* :meth:`~EmbeddingsParquet.read_group` / :meth:`~EmbeddingsParquet.iter_rows`: the asked-for
  columns only, a row group at a time, vectors straight to float32 ``[n, D]`` -- null
  vectors, list lengths, a dimension that differs from the other files', NaN/inf rows (with
  their item ids), a gallery row whose cost is null, NaN, inf or not > 0 (with its item
  ids).  :meth:`~EmbeddingsParquet.collect` is every row group in memory.

Every problem raises :class:`BackfillInputError`, one line naming the file and the column.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "BackfillInputError",
    "EmbeddingsParquet",
    "Keys",
    "Rows",
    "RowGroup",
    "GALLERY",
    "QUERY",
    "REQUIRED_COLUMNS",
    "SPLITS",
    "UNCERTAINTY_PREFIX",
    "VECTOR_COLUMNS",
    "cost_values",
    "duplicate_ids",
    "duplicate_ids_error",
    "ids_preview",
    "labels_by_class_name",
    "nonfinite_error",
    "nonfinite_rows",
]

SPLITS = {"query": "query", "gallery": "gallery", "distractor": "gallery", "distractors": "gallery"}
REQUIRED_COLUMNS = ("item_id", "label", "split", "old", "new")
VECTOR_COLUMNS = ("old", "new", "adapted")
#: stored uncertainty columns: ``unc_<kind>`` (written by the embed-gallery job)
UNCERTAINTY_PREFIX = "unc_"
KEY_COLUMNS = ("item_id", "label", "split", "class_name")
#: the side of a row (int8 codes of :attr:`Keys.kind` and :attr:`Rows.kind`)
QUERY, GALLERY = 0, 1
SIDE_NAMES = {QUERY: "query", GALLERY: "gallery"}


class BackfillInputError(ValueError):
    """Bad input to the backfill simulator; the message names the problem in one line."""


# ----------------------------------------------------------------------------- messages
def ids_preview(ids: np.ndarray, n: int = 5) -> str:
    """``[a, b, c, d, e, ...]``: the first ``n`` ids."""
    ids = np.asarray(ids)
    shown = ", ".join(str(x) for x in ids[:n].tolist())
    return f"[{shown}{', ...' if ids.size > n else ''}]"


def nonfinite_rows(a: np.ndarray, chunk: int = 1 << 15) -> np.ndarray:
    """A bool per row of ``a``: whether it holds a NaN or an inf."""
    bad = np.zeros(a.shape[0], dtype=bool)
    if np.isfinite(a.sum(dtype=np.float64)):  # cannot overflow: finite iff every value is
        return bad
    for s in range(0, a.shape[0], chunk):
        bad[s : s + chunk] = ~np.isfinite(a[s : s + chunk]).all(axis=1)
    return bad


def nonfinite_error(
    name: str, ids: np.ndarray, bad: np.ndarray, where: str | None = None
) -> BackfillInputError:
    """The error for the NaN/inf rows ``bad`` of array ``name`` (``where``: column and file)."""
    msg = (
        f"NaN or inf embeddings in {name} for {int(bad.sum())} item(s), "
        f"item ids {ids_preview(np.asarray(ids)[bad])}"
    )
    return BackfillInputError(msg + (f": {where}" if where else ""))


def duplicate_ids(ids: np.ndarray) -> np.ndarray:
    """The ids that occur more than once (sorted, each once)."""
    srt = np.sort(np.asarray(ids), kind="stable")
    return np.unique(srt[1:][srt[1:] == srt[:-1]])


def duplicate_ids_error(
    side: str, dups: np.ndarray, where: str | None = None
) -> BackfillInputError:
    """The error for the duplicated ids ``dups`` of one side (``where``: the files)."""
    msg = f"duplicate item ids {ids_preview(dups)} among the {side} rows"
    return BackfillInputError(msg + (f": {where}" if where else ""))


def _read_error(what: str, exc: Exception) -> BackfillInputError:
    return BackfillInputError(f"cannot read {what}: {exc}".splitlines()[0])


# ----------------------------------------------------------------------------- row groups
@dataclass(frozen=True)
class RowGroup:
    """One row group of one file: the unit of work of a distributed block pass.

    ``g0`` is the gallery index of its first gallery row, ``gallery_rows`` how many of its
    rows are gallery or distractor items (the others are queries)."""

    file: str
    index: int
    rows: int
    g0: int
    gallery_rows: int
    nbytes: int = 0  # compressed bytes of its vector columns

    @property
    def g1(self) -> int:
        return self.g0 + self.gallery_rows

    @property
    def name(self) -> str:
        return f"{self.file} (row group {self.index})"


@dataclass
class Keys:
    """The key columns of every row, files in order: ``ids`` (int64), ``kind`` (int8:
    :data:`QUERY` / :data:`GALLERY`), ``labels`` (matched by class name when stored)."""

    ids: np.ndarray
    kind: np.ndarray
    labels: np.ndarray
    label_note: str | None

    def require_both_sides(self, source: str) -> None:
        """Refuse a dataset without gallery items or without queries."""
        if not (self.kind == GALLERY).any():
            raise BackfillInputError(
                f"empty gallery: no rows with split 'gallery' or 'distractor' in {source}"
            )
        if not (self.kind == QUERY).any():
            raise BackfillInputError(f"no queries: no rows with split 'query' in {source}")


@dataclass
class Rows:
    """Some rows as read: ``ids``, ``kind`` and ``values`` (vector columns float32 ``[n, D]``,
    uncertainty columns float64 ``[n]``)."""

    ids: np.ndarray
    kind: np.ndarray
    values: dict[str, np.ndarray]

    def side(self, kind: int) -> Rows:
        """The rows of one side (:data:`QUERY` or :data:`GALLERY`)."""
        keep = self.kind == kind
        if keep.all():
            return self
        return Rows(self.ids[keep], self.kind[keep], {c: v[keep] for c, v in self.values.items()})

    @staticmethod
    def concat(parts: Sequence[Rows]) -> Rows:
        """The rows of ``parts``, in order, in writable arrays of their own."""
        if len(parts) == 1:  # no second copy of the one part (arrow's buffers are read-only)
            own = lambda a: a if a.flags.writeable else a.copy()  # noqa: E731
            p = parts[0]
            return Rows(own(p.ids), own(p.kind), {c: own(v) for c, v in p.values.items()})
        return Rows(
            np.concatenate([p.ids for p in parts]),
            np.concatenate([p.kind for p in parts]),
            {c: np.concatenate([p.values[c] for p in parts]) for c in parts[0].values},
        )


# ----------------------------------------------------------------------------- the reader
@dataclass
class EmbeddingsParquet:
    """An embeddings parquet dataset, opened: its files, columns and vector dimensions from
    the footers; rows are read on demand.  Small enough to send to every Ray task (one
    number per row group, no footer)."""

    source: str  # the absolute path or the URI (what reports and errors show)
    files: list[str]  # paths inside ``filesystem``, sorted
    columns: list[str]  # the columns of every file
    dims: dict[str, int]  # vector column -> dimension (plain lists: once rows are read)
    group_rows: list[list[int]]  # per file: the rows of each row group
    group_bytes: list[list[int]]  # per file: compressed bytes of each row group's vectors
    filesystem: object = field(default=None, repr=False)
    #: the column holding each item's backfill cost (read as float64, checked), or None
    cost_column: str | None = None

    @classmethod
    def open(
        cls,
        location: str,
        required: Sequence[str] = REQUIRED_COLUMNS,
        cost_column: str | None = None,
    ) -> EmbeddingsParquet:
        """Resolve ``location``, list its files and check their footers (module docstring);
        ``cost_column``: a numeric column every file must have (an item's backfill cost)."""
        storage = _open_location(location)
        files = _list_files(storage.filesystem, storage.root, location)
        metas = [_metadata(storage.filesystem, f) for f in files]
        need = tuple(required) + ((cost_column,) if cost_column else ())
        columns, dims = _check_schemas(files, metas, need, storage.uri)
        if cost_column:
            _check_cost_type(files, metas, cost_column)
        return cls(
            source=storage.uri,
            files=files,
            columns=columns,
            dims=dims,
            group_rows=[[m.row_group(i).num_rows for i in range(m.num_row_groups)] for m in metas],
            group_bytes=[[_vector_bytes(m, i) for i in range(m.num_row_groups)] for m in metas],
            filesystem=storage.filesystem,
            cost_column=cost_column or None,
        )

    @property
    def vector_columns(self) -> list[str]:
        return [c for c in VECTOR_COLUMNS if c in self.columns]

    @property
    def uncertainty_columns(self) -> list[str]:
        return [c for c in self.columns if c.startswith(UNCERTAINTY_PREFIX)]

    @property
    def item_columns(self) -> list[str]:
        """The per-item number columns a block reads: stored uncertainty, and the cost."""
        return self.uncertainty_columns + ([self.cost_column] if self.cost_column else [])

    @property
    def nbytes(self) -> int:
        """Compressed bytes of the vector columns on disk (from the footers)."""
        return sum(sum(b) for b in self.group_bytes)

    # ------------------------------------------------------------------ keys
    def read_keys(self) -> Keys:
        """``item_id``, ``label``, ``split`` (and ``class_name``) of every row, checked."""
        tables = [self._read_key_table(f) for f in self.files]
        kinds = [split_kinds(f, t) for f, t in zip(self.files, tables, strict=True)]
        for f, t in zip(self.files, tables, strict=True):
            if t.column("label").null_count:
                raise BackfillInputError(f"column 'label' of {f} must not have null values")
        labels, note = _labels(self.files, tables)
        ids = [t.column("item_id").to_numpy().astype(np.int64) for t in tables]
        _check_duplicates(self.files, ids, kinds)
        return Keys(
            ids=np.concatenate(ids),
            kind=np.concatenate(kinds),
            labels=labels,
            label_note=note,
        )

    def _read_key_table(self, f: str):
        import pyarrow.parquet as pq

        try:
            with self.filesystem.open_input_file(f) as fh:
                pf = pq.ParquetFile(fh, read_dictionary=["split"])  # a few values, small codes
                return pf.read(columns=[c for c in KEY_COLUMNS if c in self.columns])
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise _read_error(f"parquet {f}", exc) from exc

    def row_groups(self, keys: Keys) -> list[RowGroup]:
        """Every row group, with the gallery index of its first gallery row."""
        groups: list[RowGroup] = []
        g0, start = 0, 0
        for f, rows, nbytes in zip(self.files, self.group_rows, self.group_bytes, strict=True):
            for i, (n, b) in enumerate(zip(rows, nbytes, strict=True)):
                n_gal = int((keys.kind[start : start + n] == GALLERY).sum())
                groups.append(RowGroup(f, i, n, g0, n_gal, b))
                g0, start = g0 + n_gal, start + n
        return groups

    # ------------------------------------------------------------------ rows
    def read_group(self, group: RowGroup, columns: Sequence[str], side: int = GALLERY) -> Rows:
        """The ``columns`` of the rows of one side of one row group (its gallery rows by
        default; the other rows are neither converted nor checked)."""
        want = list(dict.fromkeys(columns))
        with self._parquet_file(group.file) as pf:
            table = _read_group_table(pf, group.index, self._with_keys(want), group.name)
        kind = split_kinds(group.name, table)
        if int((kind == GALLERY).sum()) != group.gallery_rows:
            raise BackfillInputError(f"{group.name} changed while it was being read")
        return self._rows(table, kind, want, side, group.name)

    def iter_rows(self, columns: Sequence[str]) -> Iterator[Rows]:
        """The ``columns`` of every row, a row group at a time (files in order)."""
        want = list(dict.fromkeys(columns))
        for f, rows in zip(self.files, self.group_rows, strict=True):
            if not sum(rows):
                continue
            with self._parquet_file(f) as pf:
                for i, n in enumerate(rows):
                    if n:
                        where = f"{f} (row group {i})"
                        table = _read_group_table(pf, i, self._with_keys(want), where)
                        yield self._rows(table, split_kinds(where, table), want, None, where)

    def collect(self, columns: Sequence[str]) -> Rows:
        """The ``columns`` of every row in memory: :meth:`iter_rows` concatenated."""
        parts = list(self.iter_rows(columns))
        if not parts:
            raise BackfillInputError(f"no rows in {self.source}")
        return Rows.concat(parts)

    def _with_keys(self, columns: list[str]) -> list[str]:
        """``columns`` and the key columns a row read needs: ``item_id`` and ``split``."""
        keys = ["item_id", "split"] if "split" in self.columns else ["item_id"]
        return list(dict.fromkeys([*columns, *keys]))

    @contextlib.contextmanager
    def _parquet_file(self, f: str):
        """``pyarrow.parquet.ParquetFile`` of ``f``, open for the block.  A local file is read
        page by page (no ``pre_buffer``): the whole column chunks are not buffered beside the
        decoded arrays, which lowers a row group read's peak memory at the same speed
        (docs/benchmarks.md, "Memory of the score step")."""
        import pyarrow.parquet as pq

        try:
            fh = self.filesystem.open_input_file(f)
            pf = pq.ParquetFile(fh, pre_buffer=self.filesystem.type_name != "local")
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise _read_error(f"parquet {f}", exc) from exc
        with fh:
            yield pf

    def _rows(self, table, kind: np.ndarray, columns: list[str], side, where: str) -> Rows:
        """:class:`Rows` of ``table`` (only the rows of ``side`` if given), checked."""
        if side is not None and not (kind == side).all():
            keep = np.flatnonzero(kind == side)
            table, kind = table.take(keep), kind[keep]
        ids = table.column("item_id").to_numpy().astype(np.int64)
        values: dict[str, np.ndarray] = {}
        vectors = []
        for c in columns:
            if c == self.cost_column:
                values[c] = cost_values(table, c, ids, kind, where)
            elif c.startswith(UNCERTAINTY_PREFIX):
                values[c] = table.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
            else:
                values[c] = self._vectors(table, c, ids, where)
                vectors.append(c)
        _check_finite({c: values[c] for c in vectors}, ids, kind, where)
        return Rows(ids, kind, values)

    def _vectors(self, table, column: str, ids: np.ndarray, where: str) -> np.ndarray:
        """float32 ``[n, D]`` of a vector column; its dimension must match the other files'."""
        out = vector_values(table, column, ids, where)
        if out.shape[0]:
            known = self.dims.setdefault(column, int(out.shape[1]))
            if known != out.shape[1]:
                raise BackfillInputError(
                    f"dimension mismatch in column {column!r}: {out.shape[1]} in {where}, "
                    f"{known} in the other shards"
                )
            _check_adapted_dim(self.dims, where)
        return out


# ----------------------------------------------------------------------------- open
def _open_location(location: str):
    """The :class:`raycompat.storage.Storage` of ``location`` (a bad URI is an input error)."""
    from raycompat.storage import StorageError, open_storage

    if not str(location or "").strip():  # open_storage would take the default storage
        raise BackfillInputError(f"embeddings not found: {location!r}")
    try:
        return open_storage(location, check=False)
    except StorageError as exc:
        raise BackfillInputError(f"cannot open {location}: {exc}".splitlines()[0]) from exc


def _list_files(filesystem, root: str, shown: str) -> list[str]:
    """The parquet files under ``root`` (recursively, sorted; a file or folder whose name
    starts with ``_`` or ``.`` is metadata), or ``[root]`` for a file."""
    from pyarrow import fs

    try:
        info = filesystem.get_file_info(root)
        if info.type == fs.FileType.File:
            return [root]
        if info.type == fs.FileType.NotFound:
            raise BackfillInputError(f"embeddings not found: {shown}")
        found = filesystem.get_file_info(fs.FileSelector(root, recursive=True))
    except BackfillInputError:
        raise
    except Exception as exc:  # OSError, pyarrow's credential errors
        raise _read_error(shown, exc) from exc
    files = sorted(
        f.path
        for f in found
        if f.type == fs.FileType.File
        and f.path.endswith(".parquet")
        and not any(p.startswith(("_", ".")) for p in os.path.relpath(f.path, root).split("/"))
    )
    if not files:
        raise BackfillInputError(f"no .parquet files under {shown}")
    return files


def _metadata(filesystem, f: str):
    import pyarrow.parquet as pq

    try:
        with filesystem.open_input_file(f) as fh:
            return pq.ParquetFile(fh).metadata
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise _read_error(f"parquet {f}", exc) from exc


def _read_group_table(pf, index: int, columns: list[str], where: str):
    """The ``columns`` of row group ``index`` of an open parquet file."""
    try:
        return pf.read_row_group(index, columns=columns)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise _read_error(where, exc) from exc


def _check_schemas(
    files: list[str], metas, required: tuple, source: str
) -> tuple[list[str], dict[str, int]]:
    """The columns every file has and each fixed-size vector column's dimension; a file
    without a required column, with class names where another has none, or with other
    columns or another dimension than the first, is named."""
    schemas = [m.schema.to_arrow_schema() for m in metas]
    for f, schema in zip(files, schemas, strict=True):
        missing = [c for c in required if c not in schema.names]
        if missing:
            raise BackfillInputError(f"missing column(s) {missing} in {f}; found {schema.names}")
        _check_key_types(f, schema)
    named = [f for f, s in zip(files, schemas, strict=True) if "class_name" in s.names]
    if named and len(named) != len(files):
        bare = next(f for f, s in zip(files, schemas, strict=True) if "class_name" not in s.names)
        raise BackfillInputError(
            f"shard {named[0]} stores class names but {bare} does not: their labels cannot be "
            "matched; embed both with this version"
        )
    first = schemas[0].names
    for f, schema in zip(files[1:], schemas[1:], strict=True):
        if set(schema.names) != set(first):
            diff = sorted(set(schema.names) ^ set(first))
            raise BackfillInputError(
                f"shard {f} and shard {files[0]} have different columns (differ in {diff})"
            )
    dims = _fixed_dims(files, schemas)
    _check_adapted_dim(dims, source)
    return list(first), dims


def _check_key_types(f: str, schema) -> None:
    import pyarrow as pa

    if "item_id" in schema.names and not pa.types.is_integer(schema.field("item_id").type):
        raise BackfillInputError(
            f"column 'item_id' of {f} must be int64, got {schema.field('item_id').type}"
        )
    for c in VECTOR_COLUMNS:
        t = schema.field(c).type if c in schema.names else None
        if t is not None and pa.types.is_fixed_size_list(t) and t.list_size == 0:
            raise BackfillInputError(f"column {c!r} of {f} has dimension 0")


def _fixed_dims(files: list[str], schemas) -> dict[str, int]:
    """The dimension of each fixed-size vector column: the same in every file."""
    import pyarrow as pa

    dims: dict[str, tuple[int, str]] = {}
    for f, schema in zip(files, schemas, strict=True):
        for c in VECTOR_COLUMNS:
            t = schema.field(c).type if c in schema.names else None
            if t is None or not pa.types.is_fixed_size_list(t):
                continue
            seen = dims.setdefault(c, (t.list_size, f))
            if seen[0] != t.list_size:
                raise BackfillInputError(
                    f"dimension mismatch in column {c!r}: {seen[0]} in shard {seen[1]}, "
                    f"{t.list_size} in shard {f}"
                )
    return {c: d for c, (d, _) in dims.items()}


def _check_adapted_dim(dims: dict[str, int], where: str) -> None:
    """``adapted`` lives in the new model's space: the dimension of ``new``."""
    if "adapted" in dims and "new" in dims and dims["adapted"] != dims["new"]:
        raise BackfillInputError(
            f"dimension mismatch: column 'adapted' has dim {dims['adapted']}, "
            f"column 'new' has dim {dims['new']} in {where}"
        )


def _check_cost_type(files: list[str], metas, column: str) -> None:
    """The cost column holds numbers (integers or floats) in every file."""
    import pyarrow as pa

    for f, m in zip(files, metas, strict=True):
        t = m.schema.to_arrow_schema().field(column).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            raise BackfillInputError(
                f"cost column {column!r} of {f} must hold numbers (bytes, pixels, a price), got {t}"
            )


def cost_values(table, column: str, ids: np.ndarray, kind: np.ndarray, where: str) -> np.ndarray:
    """float64 per row of cost column ``column``; a gallery row whose cost is null, NaN, inf or
    not > 0 names the column, ``where`` and its item ids (query rows are not checked)."""
    col = table.column(column)
    values = col.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls read as NaN
    gallery = np.asarray(kind) == GALLERY
    with np.errstate(invalid="ignore"):
        bad = gallery & ~(np.isfinite(values) & (values > 0))
    if bad.any():
        raise BackfillInputError(
            f"cost column {column!r} of {where}: {int(bad.sum())} item(s) with a cost that is "
            f"not a finite number > 0 ({ids_preview(values[bad])}), item ids "
            f"{ids_preview(ids[bad])}"
        )
    return values


def _vector_bytes(meta, i: int) -> int:
    """Compressed bytes of the vector columns of row group ``i`` (from the file's metadata)."""
    rg = meta.row_group(i)
    return sum(
        rg.column(j).total_compressed_size
        for j in range(rg.num_columns)
        if rg.column(j).path_in_schema.split(".")[0] in VECTOR_COLUMNS
    )


# ----------------------------------------------------------------------------- key checks
def split_kinds(where: str, table) -> np.ndarray:
    """int8 per row: :data:`QUERY` or :data:`GALLERY` (or distractor); a null or an unknown
    value names ``where``.  Without a ``split`` column (a reader opened without requiring it:
    the pipeline output the live index upserts from) every row is a gallery row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if "split" not in table.column_names:
        if table.column("item_id").null_count:
            raise BackfillInputError(f"column 'item_id' must not be null in {where}")
        return np.full(table.num_rows, GALLERY, np.int8)
    col = table.column("split")
    if col.null_count or table.column("item_id").null_count:
        raise BackfillInputError(f"columns 'item_id' and 'split' must not be null in {where}")
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    enc = col if pa.types.is_dictionary(col.type) else pc.cast(col, pa.string()).dictionary_encode()
    names = [str(n) for n in enc.dictionary.to_pylist()]
    code = np.array(
        [{"query": QUERY, "gallery": GALLERY}.get(SPLITS.get(n), -1) for n in names], np.int8
    )
    if (code < 0).any():
        bad = sorted(n for n, c in zip(names, code, strict=True) if c < 0)
        raise BackfillInputError(
            f"unknown split value(s) {bad[:5]} in column 'split' of {where}; "
            "allowed: query, gallery, distractor"
        )
    return code[enc.indices.to_numpy(zero_copy_only=False)]


def _labels(files: list[str], tables) -> tuple[np.ndarray, str | None]:
    """One label per row: by class name when the files store it, else ``label``."""
    by_name, note = labels_by_class_name(list(zip(files, tables, strict=True)))
    if by_name is not None:
        return by_name, note
    return np.concatenate([t.column("label").to_numpy(zero_copy_only=False) for t in tables]), None


def labels_by_class_name(parts) -> tuple[np.ndarray | None, str | None]:
    """Labels matched by the ``class_name`` column of ``[(file, table)]`` (one integer per
    class name, sorted), or ``(None, None)`` when the files store no class names (every file
    or none does: :meth:`EmbeddingsParquet.open` checks).  A label with two names in one file
    fails naming the file and the classes; label maps that differ between files (queries and
    gallery embedded from different folders) are fine: the note says so."""
    if not parts or "class_name" not in parts[0][1].column_names:
        return None, None
    import pyarrow as pa

    maps = {f: _label_map(f, t) for f, t in parts}
    names = pa.chunked_array([t.column("class_name").cast(pa.string()) for _, t in parts])
    encoded = names.combine_chunks().dictionary_encode()
    dictionary = np.asarray(encoded.dictionary.to_pylist(), dtype=str)
    rank = np.empty(len(dictionary), np.int64)
    rank[np.argsort(dictionary, kind="stable")] = np.arange(len(dictionary))
    codes = rank[encoded.indices.to_numpy(zero_copy_only=False)]  # sorted class-name order
    return codes, _label_map_note(maps)


def _label_map(f: str, table) -> dict:
    """``{label: class name}`` of one file; an empty name, or a label with two names, fails
    naming the file and the classes."""
    import pyarrow.compute as pc

    names = table.column("class_name")
    if names.null_count or pc.any(pc.equal(names, "")).as_py():
        raise BackfillInputError(f"column 'class_name' of {f} has empty values")
    pairs = table.select(["label", "class_name"]).group_by(["label", "class_name"]).aggregate([])
    local: dict = {}
    for label, name in zip(
        pairs.column("label").to_pylist(), pairs.column("class_name").to_pylist(), strict=True
    ):
        if local.setdefault(label, name) != name:
            raise BackfillInputError(
                f"label {label!r} is both class {local[label]!r} and {name!r} in {f}"
            )
    return local


def _label_map_note(maps: dict) -> str | None:
    """A note naming one label whose class differs between files, if any."""
    merged: dict = {}
    for f, local in maps.items():
        for label, name in local.items():
            other = merged.setdefault(label, (name, f))
            if other[0] != name:
                return (
                    f"label maps differ between files (label {label!r} is {other[0]!r} in "
                    f"{other[1]} and {name!r} in {f}): queries and gallery matched by class name"
                )
    return None


def _check_duplicates(files: list[str], ids: list[np.ndarray], kinds: list[np.ndarray]) -> None:
    """Refuse an item id stored twice on one side (gallery, then queries), naming the files
    that hold it.  A query may share its id with a gallery item (the two sides number their
    items apart, as :class:`~raycompat.embeddings.gallery.GalleryEmbeddings` does)."""
    for side in (GALLERY, QUERY):
        dups = duplicate_ids(
            np.concatenate([i[k == side] for i, k in zip(ids, kinds, strict=True)])
        )
        if not dups.size:
            continue
        first = dups[0]
        where = [
            f
            for f, i, k in zip(files, ids, kinds, strict=True)
            if ((i == first) & (k == side)).any()
        ]
        held = f"shards {where[0]} and {where[1]}" if len(where) > 1 else f"shard {where[0]} twice"
        raise duplicate_ids_error(SIDE_NAMES[side], dups, f"id {first} is in {held}")


# ----------------------------------------------------------------------------- vectors
def vector_values(table, name: str, ids: np.ndarray, where: str) -> np.ndarray:
    """float32 ``[n, D]`` of vector column ``name`` of ``table`` (read from ``where``), without
    per-row Python; nulls, rows of other lengths or non-numbers name the column and ids."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(name)
    if col.null_count:
        mask = pc.is_null(col).to_numpy(zero_copy_only=False)
        raise BackfillInputError(
            f"column {name!r} of {where} is null for item ids {ids_preview(ids[mask])}"
        )
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    if pa.types.is_fixed_size_list(t):
        dim = t.list_size
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
        if lengths.size and (lengths != lengths[0]).any():
            bad = np.flatnonzero(lengths != lengths[0])
            raise BackfillInputError(
                f"dimension mismatch in column {name!r} of {where}: rows have lengths "
                f"{sorted(set(lengths.tolist()))[:5]}, e.g. item ids {ids_preview(ids[bad])}"
            )
        dim = int(lengths[0]) if lengths.size else 0
    else:
        raise BackfillInputError(
            f"column {name!r} of {where} must be fixed_size_list<float32> (an embedding), got {t}"
        )
    values = arr.flatten()
    if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
        raise BackfillInputError(f"column {name!r} of {where} must hold floats, got {values.type}")
    if len(arr) and dim == 0:
        raise BackfillInputError(f"column {name!r} of {where} has dimension 0")
    out = values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return out.reshape(len(arr), dim)


def _check_finite(values: dict, ids: np.ndarray, kind: np.ndarray, where: str) -> None:
    """No NaN/inf in any vector column read (gallery rows first, then queries; a query's
    ``adapted`` value is a placeholder nobody reads): the error names the array, the ids, the
    column and ``where``.  The one check of a block's vectors
    (:meth:`raycompat.embeddings.dataset.ParquetGallery.block_embeddings` does not repeat it)."""
    bad = {c: nonfinite_rows(v) for c, v in values.items()}
    for side in (GALLERY, QUERY):
        for c, rows in bad.items():
            hit = rows & (kind == side)
            if hit.any() and not (side == QUERY and c == "adapted"):
                name = f"{SIDE_NAMES[side]}_{c}"
                raise nonfinite_error(name, ids, hit, f"column {c!r} of {where}")
