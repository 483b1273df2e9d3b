"""A parquet embeddings dataset read where it lies, one row group at a time.

:func:`raycompat.backfill.gallery.load_parquet` reads a whole table into memory.  A
:class:`ParquetGallery` instead holds only what is query-sized or one number per item, found
by one cheap pass over the metadata and the ``item_id`` / ``label`` / ``split`` /
``class_name`` columns (docs/architecture.md, "Distributed backfill simulation"):

* the row groups of every file (:class:`RowGroup`: the unit of work of a block pass), with
  the gallery index of their first gallery row;
* the label of every gallery item (matched by class name like ``load_parquet``) and every
  item id (to refuse duplicates across shards);
* the queries' vectors (query-sized).

Gallery vectors are read by :meth:`ParquetGallery.read_block`, one row group at a time, by
whichever process scores it.  The gallery index of an item is its position among the gallery
and distractor rows of the files in sorted order, exactly as in ``load_parquet``, so both
paths rank the same items with the same tie rule.

Paths are local files or folders, or any URI pyarrow opens (``s3://``, ``gs://``,
``file://``).  Every problem names the shard file: an unreadable file, a missing column, a
vector column whose dimension differs between shards, NaN vectors (with item ids), duplicate
item ids (with both files).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, replace

import numpy as np

from raycompat.backfill.gallery import (
    REQUIRED_COLUMNS,
    VECTOR_COLUMNS,
    BackfillInputError,
    GalleryEmbeddings,
    _ids_preview,
    _labels_by_class_name,
    _vector_column,
)

__all__ = ["RowGroup", "ParquetGallery", "UNCERTAINTY_PREFIX", "vector_bytes"]

#: stored uncertainty columns: ``unc_<kind>`` (written by the embed-gallery job)
UNCERTAINTY_PREFIX = "unc_"
_KEY_COLUMNS = ("item_id", "label", "split", "class_name")
_QUERY, _GALLERY = 0, 1


@dataclass(frozen=True)
class RowGroup:
    """One row group of one shard: the unit of work of a distributed block pass.

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


@contextlib.contextmanager
def _system_allocator():
    """Arrow buffers from the C allocator inside the block: the key columns a driver frees
    after :meth:`ParquetGallery.open` go back to the operating system (``malloc_trim``)
    instead of staying in arrow's own pool.  (Block reads keep arrow's pool: it reuses one
    row group's pages for the next, twice as fast as fresh pages from the system.)"""
    import pyarrow as pa

    from raycompat.backfill.blocks import release_memory

    previous = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        yield
    finally:
        pa.set_memory_pool(previous)
        release_memory()


def _filesystem(path: str):
    """``(pyarrow filesystem, path inside it)`` of a local path or a URI."""
    from pyarrow import fs

    if "://" in str(path):
        try:
            return fs.FileSystem.from_uri(str(path))
        except Exception as exc:  # pyarrow raises several types for bad URIs
            raise BackfillInputError(f"cannot open {path}: {exc}".splitlines()[0]) from exc
    return fs.LocalFileSystem(), os.path.abspath(path)


def _list_files(filesystem, root: str, shown: str) -> list[str]:
    """The parquet files under ``root`` (recursively, sorted; names starting with ``_`` or
    ``.`` are metadata), or ``[root]`` for a file."""
    from pyarrow import fs

    info = filesystem.get_file_info(root)
    if info.type == fs.FileType.NotFound:
        raise BackfillInputError(f"embeddings not found: {shown}")
    if info.type == fs.FileType.File:
        return [root]
    found = filesystem.get_file_info(fs.FileSelector(root, recursive=True))
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


def _vector_dim(field) -> int | None:
    """The dimension of a fixed-size vector column (``None`` for a plain list)."""
    import pyarrow as pa

    return field.type.list_size if pa.types.is_fixed_size_list(field.type) else None


@dataclass
class ParquetGallery:
    """A parquet embeddings dataset (schema of :mod:`raycompat.backfill.gallery`), streamed.

    Build it with :meth:`open`.  Gallery-sized attributes hold one number per item
    (``gallery_labels``, ``gallery_ids``); nothing holds a gallery vector."""

    source: str
    files: list[str]
    groups: list[RowGroup]
    columns: list[str]  # the columns every shard has
    dims: dict[str, int]  # vector column -> dimension
    query_labels: np.ndarray
    gallery_labels: np.ndarray
    query_ids: np.ndarray
    gallery_ids: np.ndarray
    queries: dict[str, np.ndarray]  # vector column -> [Q, D] float32
    compatible_dim: int | None = None
    label_note: str | None = None
    nbytes: int = 0  # compressed size of the vector columns on disk
    filesystem: object = field(default=None, repr=False)

    @property
    def n_items(self) -> int:
        return int(self.gallery_labels.shape[0])

    @property
    def n_queries(self) -> int:
        return int(self.query_labels.shape[0])

    @property
    def uncertainty_columns(self) -> list[str]:
        return [c for c in self.columns if c.startswith(UNCERTAINTY_PREFIX)]

    # ------------------------------------------------------------------ open
    @classmethod
    def open(cls, path: str, *, compatible_dim: int | None = None) -> ParquetGallery:
        """The metadata and key-column pass: shards, row groups, labels, ids, queries."""
        with _system_allocator():
            return cls._open(path, compatible_dim)

    @classmethod
    def _open(cls, path: str, compatible_dim: int | None) -> ParquetGallery:
        filesystem, root = _filesystem(path)
        files = _list_files(filesystem, root, path)
        metas = [_metadata(filesystem, f) for f in files]
        columns, dims = _check_schemas(files, metas)
        keys = [_read_keys(filesystem, f) for f in files]
        kinds = [_split_kinds(f, t) for f, t in zip(files, keys, strict=True)]
        labels, note = _labels(files, keys)
        ids = np.concatenate([t.column("item_id").to_numpy() for t in keys]).astype(np.int64)
        kind = np.concatenate(kinds)
        _check_duplicates(files, keys, ids)
        groups = _row_groups(files, metas, kinds)
        is_q, is_g = kind == _QUERY, kind == _GALLERY
        if not is_g.any():
            raise BackfillInputError(
                f"empty gallery: no rows with split 'gallery' or 'distractor' in {path}"
            )
        if not is_q.any():
            raise BackfillInputError(f"no queries: no rows with split 'query' in {path}")
        out = cls(
            source=path if "://" in str(path) else os.path.abspath(path),
            files=files,
            groups=groups,
            columns=columns,
            dims=dims,
            query_labels=labels[is_q],
            gallery_labels=labels[is_g],
            query_ids=ids[is_q],
            gallery_ids=ids[is_g],
            queries={},
            compatible_dim=compatible_dim,
            label_note=note,
            nbytes=sum(g.nbytes for g in groups),
            filesystem=filesystem,
        )
        del keys, labels, ids, kind
        out.queries = out._read_queries(kinds)
        for c, a in out.queries.items():  # plain list columns: the queries fix the dimension
            out.dims.setdefault(c, int(a.shape[1]))
        return out

    @property
    def old_dim(self) -> int:
        return int(self.queries["old"].shape[1])

    @property
    def new_dim(self) -> int:
        return int(self.queries["new"].shape[1])

    def query_arrays(self) -> dict[str, np.ndarray]:
        """The queries as :class:`GalleryEmbeddings` arguments (``query_old``, ``query_new``)."""
        names = {"old": "query_old", "new": "query_new"}
        return {names[c]: a for c, a in self.queries.items() if c in names}

    def probe(self) -> GalleryEmbeddings:
        """The first row group with gallery rows, with the queries: a sample of the real data
        to tell which modes and policies its columns allow."""
        group = next(g for g in self.groups if g.gallery_rows)
        return self.block_embeddings(group, self.query_arrays())

    def _read_queries(self, kinds: list[np.ndarray]) -> dict[str, np.ndarray]:
        """The vector columns of the query rows (only row groups that hold queries are read)."""
        parts: dict[str, list[np.ndarray]] = {c: [] for c in self.vector_columns}
        offsets = _row_offsets(self.groups)
        for g in self.groups:
            if g.gallery_rows == g.rows:
                continue
            kind = kinds[self.files.index(g.file)][offsets[g] : offsets[g] + g.rows]
            table = self._read_group(g, self.vector_columns + ["item_id"])
            table = table.take(np.flatnonzero(kind == _QUERY))
            ids = table.column("item_id").to_numpy()
            for c in self.vector_columns:
                parts[c].append(self._vectors(table, c, ids, g))
        return {c: np.concatenate(p) for c, p in parts.items()}

    @property
    def vector_columns(self) -> list[str]:
        return [c for c in VECTOR_COLUMNS if c in self.columns]

    # ------------------------------------------------------------------ blocks
    def _read_group(self, group: RowGroup, columns: list[str]):
        import pyarrow.parquet as pq

        try:
            with self.filesystem.open_input_file(group.file) as f:
                return pq.ParquetFile(f).read_row_group(group.index, columns=columns)
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise BackfillInputError(f"cannot read {group.name}: {exc}".splitlines()[0]) from exc

    def _vectors(self, table, column: str, ids: np.ndarray, group: RowGroup) -> np.ndarray:
        """float32 ``[n, D]`` of a vector column; NaN/inf or a wrong dimension names the file."""
        try:
            out = _vector_column(table, column, ids)
        except BackfillInputError as exc:
            raise BackfillInputError(f"{group.name}: {exc}") from exc
        if out.shape[1] != self.dims.get(column, out.shape[1]):
            raise BackfillInputError(
                f"dimension mismatch in column {column!r}: {out.shape[1]} in {group.file}, "
                f"{self.dims[column]} in the other shards"
            )
        if np.isfinite(out.sum(dtype=np.float64)):  # cannot overflow: finite iff every value is
            return out
        bad = ~np.isfinite(out).all(axis=1)
        if bad.any():
            raise BackfillInputError(
                f"NaN or inf embeddings in column {column!r} of {group.name} for "
                f"{int(bad.sum())} item(s), item ids {_ids_preview(ids[bad])}"
            )
        return out

    def read_block(
        self, group: RowGroup, columns: list[str] | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """``(item ids, {column: values})`` of the gallery rows of one row group: vector
        columns as float32 ``[n, D]``, uncertainty columns as float64 ``[n]``."""
        columns = self.vector_columns if columns is None else list(columns)
        table = self._read_group(group, columns + ["item_id", "split"])
        kind = _split_kinds(group.name, table)
        if int((kind == _GALLERY).sum()) != group.gallery_rows:
            raise BackfillInputError(f"{group.name} changed while it was being read")
        if group.gallery_rows != group.rows:
            table = table.take(np.flatnonzero(kind == _GALLERY))
        ids = table.column("item_id").to_numpy().astype(np.int64)
        out: dict[str, np.ndarray] = {}
        for c in columns:
            if c.startswith(UNCERTAINTY_PREFIX):
                out[c] = table.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
            else:
                out[c] = self._vectors(table, c, ids, group)
        return ids, out

    def block_embeddings(
        self, group: RowGroup, queries: dict[str, np.ndarray], columns: list[str] | None = None
    ) -> GalleryEmbeddings:
        """The gallery rows of one row group with the (query-sized) ``queries`` arrays, as a
        :class:`GalleryEmbeddings` (labels are not needed by a block pass: all 0)."""
        ids, cols = self.read_block(group, columns)
        n = ids.size
        try:
            return GalleryEmbeddings(
                gallery_labels=np.zeros(n, dtype=np.int64),
                gallery_old=cols.get("old"),
                gallery_new=cols.get("new"),
                gallery_adapted=cols.get("adapted"),
                query_labels=self.query_labels,
                gallery_ids=ids,
                query_ids=self.query_ids,
                compatible_dim=self.compatible_dim,
                source=group.name,
                extra=_stored_uncertainty(cols),
                **queries,
            )
        except BackfillInputError as exc:
            raise BackfillInputError(f"{group.name}: {exc}") from exc

    def without_items(self) -> ParquetGallery:
        """A copy without the per-item arrays (what a block task needs: files, row groups,
        dims, queries)."""
        empty = np.zeros(0, dtype=np.int64)
        return replace(self, gallery_labels=empty, gallery_ids=empty)


def _stored_uncertainty(cols: dict[str, np.ndarray]) -> dict:
    """``{"uncertainty": {kind: values}}`` of the ``unc_<kind>`` columns read (``load_parquet``
    keeps them the same way)."""
    stored = {
        c[len(UNCERTAINTY_PREFIX) :]: v for c, v in cols.items() if c.startswith(UNCERTAINTY_PREFIX)
    }
    return {"uncertainty": stored} if stored else {}


def vector_bytes(path: str) -> int:
    """Compressed bytes of the vector columns of a parquet dataset, from its metadata only."""
    filesystem, root = _filesystem(path)
    total = 0
    for f in _list_files(filesystem, root, path):
        meta = _metadata(filesystem, f)
        total += sum(_vector_bytes(meta, i) for i in range(meta.num_row_groups))
    return total


# ----------------------------------------------------------------------------- the first pass
def _metadata(filesystem, f: str):
    import pyarrow.parquet as pq

    try:
        with filesystem.open_input_file(f) as fh:
            return pq.ParquetFile(fh).metadata
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise BackfillInputError(f"cannot read parquet {f}: {exc}".splitlines()[0]) from exc


def _check_schemas(files: list[str], metas) -> tuple[list[str], dict[str, int]]:
    """The columns every shard has and each vector column's dimension; a shard without a
    required column, or with another dimension or other columns than the first, is named."""
    first_cols: list[str] | None = None
    dims: dict[str, tuple[int, str]] = {}
    for f, m in zip(files, metas, strict=True):
        schema = m.schema.to_arrow_schema()
        cols = schema.names
        missing = [c for c in REQUIRED_COLUMNS if c not in cols]
        if missing:
            raise BackfillInputError(f"missing column(s) {missing} in shard {f}; found {cols}")
        if first_cols is None:
            first_cols = cols
        elif set(cols) != set(first_cols):
            diff = sorted(set(cols) ^ set(first_cols))
            raise BackfillInputError(
                f"shard {f} and shard {files[0]} have different columns (differ in {diff})"
            )
        for c in VECTOR_COLUMNS:
            if c in cols:
                d = _vector_dim(schema.field(c))
                if d is None:
                    continue
                seen = dims.setdefault(c, (d, f))
                if seen[0] != d:
                    raise BackfillInputError(
                        f"dimension mismatch in column {c!r}: {seen[0]} in shard {seen[1]}, "
                        f"{d} in shard {f}"
                    )
    return list(first_cols), {c: d for c, (d, _) in dims.items()}


def _read_keys(filesystem, f: str):
    import pyarrow.parquet as pq

    try:
        with filesystem.open_input_file(f) as fh:
            pf = pq.ParquetFile(fh, read_dictionary=["split"])  # a few values, N small codes
            cols = [c for c in _KEY_COLUMNS if c in pf.schema_arrow.names]
            return pf.read(columns=cols)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise BackfillInputError(f"cannot read parquet {f}: {exc}".splitlines()[0]) from exc


def _split_kinds(where: str, table) -> np.ndarray:
    """int8 per row: 0 query, 1 gallery (or distractor); an unknown value names the shard."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column("split")
    if col.null_count or table.column("item_id").null_count:
        raise BackfillInputError(f"columns 'item_id' and 'split' must not be null in {where}")
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    enc = col if pa.types.is_dictionary(col.type) else pc.cast(col, pa.string()).dictionary_encode()
    names = [str(n) for n in enc.dictionary.to_pylist()]
    code = np.array(
        [_QUERY if n == "query" else _GALLERY if n in ("gallery", "distractor", "distractors")
         else -1 for n in names],
        dtype=np.int8,
    )  # fmt: skip
    if (code < 0).any():
        bad = sorted(n for n, c in zip(names, code, strict=True) if c < 0)
        raise BackfillInputError(
            f"unknown split value(s) {bad[:5]} in column 'split' of {where}; "
            "allowed: query, gallery, distractor"
        )
    return code[enc.indices.to_numpy(zero_copy_only=False)]


def _labels(files: list[str], keys) -> tuple[np.ndarray, str | None]:
    """One integer label per row: by class name when the shards store it, else ``label``."""
    if any(t.column("label").null_count for t in keys):
        raise BackfillInputError("column 'label' must not have null values")
    by_name, note = _labels_by_class_name(list(zip(files, keys, strict=True)))
    if by_name is not None:
        return by_name, note
    return np.concatenate([t.column("label").to_numpy(zero_copy_only=False) for t in keys]), None


def _check_duplicates(files: list[str], keys, ids: np.ndarray) -> None:
    """Refuse an item id stored twice, naming the shards that hold it."""
    srt = np.sort(ids, kind="stable")
    dup = srt[1:][srt[1:] == srt[:-1]]
    if not dup.size:
        return
    first = dup[0]
    where = [
        f
        for f, t in zip(files, keys, strict=True)
        if (t.column("item_id").to_numpy() == first).any()
    ]
    raise BackfillInputError(
        f"duplicate item ids {_ids_preview(np.unique(dup))}: id {first} is in "
        + (f"shards {where[0]} and {where[1]}" if len(where) > 1 else f"shard {where[0]} twice")
    )


def _row_groups(files: list[str], metas, kinds: list[np.ndarray]) -> list[RowGroup]:
    groups: list[RowGroup] = []
    g0 = 0
    for f, m, kind in zip(files, metas, kinds, strict=True):
        start = 0
        for i in range(m.num_row_groups):
            rows = m.row_group(i).num_rows
            n_gal = int((kind[start : start + rows] == _GALLERY).sum())
            groups.append(RowGroup(f, i, rows, g0, n_gal, _vector_bytes(m, i)))
            g0 += n_gal
            start += rows
    return groups


def _row_offsets(groups: list[RowGroup]) -> dict[RowGroup, int]:
    """The first row of each row group within its file."""
    out: dict[RowGroup, int] = {}
    pos: dict[str, int] = {}
    for g in groups:
        out[g] = pos.get(g.file, 0)
        pos[g.file] = out[g] + g.rows
    return out


def _vector_bytes(meta, i: int) -> int:
    """Compressed bytes of the vector columns of row group ``i`` (from the file's metadata)."""
    rg = meta.row_group(i)
    return sum(
        rg.column(j).total_compressed_size
        for j in range(rg.num_columns)
        if rg.column(j).path_in_schema.split(".")[0] in VECTOR_COLUMNS
    )
