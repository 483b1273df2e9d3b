"""A parquet embeddings dataset read where it lies, one row group at a time (the Ray engine).

:func:`raycompat.embeddings.gallery.load_parquet` reads a whole dataset into memory.  A
:class:`ParquetGallery` instead holds only what is query-sized or one number per item, found
by one cheap pass over the footers and the ``item_id`` / ``label`` / ``split`` /
``class_name`` columns (docs/architecture.md, "Distributed backfill simulation"):

* the row groups of every file (:class:`~raycompat.embeddings.format.RowGroup`: the
  unit of work of a block pass), with the gallery index of their first gallery row;
* the label of every gallery item (matched by class name like ``load_parquet``) and every
  item id (and, with ``cost_column``, every item's backfill cost);
* the queries' vectors (query-sized).

Gallery vectors are read by :meth:`ParquetGallery.read_block`, one row group at a time, by
whichever process scores it.  The gallery index of an item is its position among the gallery
and distractor rows of the files in sorted order, exactly as in ``load_parquet``, so both
paths rank the same items with the same tie rule.

Both read with the one reader of the schema,
:class:`~raycompat.embeddings.format.EmbeddingsParquet` (local paths or any URI
pyarrow opens), so both refuse the same input with the same message naming the file: an
unreadable file, a missing column, a vector column whose dimension differs between shards,
NaN vectors (with item ids), duplicate item ids (with both files).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import numpy as np

from raycompat.embeddings.format import (
    QUERY,
    UNCERTAINTY_PREFIX,
    BackfillInputError,
    EmbeddingsParquet,
    RowGroup,
)
from raycompat.embeddings.gallery import GalleryEmbeddings

__all__ = ["ParquetGallery", "UNCERTAINTY_PREFIX", "vector_bytes"]


@contextlib.contextmanager
def _system_allocator():
    """Arrow buffers from the C allocator inside the block: the key columns a driver frees
    after :meth:`ParquetGallery.open` go back to the operating system (``malloc_trim``)
    instead of staying in arrow's own pool.  (Block reads keep arrow's pool: it reuses one
    row group's pages for the next, twice as fast as fresh pages from the system.)"""
    import pyarrow as pa

    from raycompat.index.blocks import release_memory

    previous = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        yield
    finally:
        pa.set_memory_pool(previous)
        release_memory()


@dataclass
class ParquetGallery:
    """A parquet embeddings dataset (schema of :mod:`raycompat.embeddings.format`),
    streamed.

    Build it with :meth:`open`.  Gallery-sized attributes hold one number per item
    (``gallery_labels``, ``gallery_ids``); nothing holds a gallery vector."""

    reader: EmbeddingsParquet
    groups: list[RowGroup]
    query_labels: np.ndarray
    gallery_labels: np.ndarray
    query_ids: np.ndarray
    gallery_ids: np.ndarray
    queries: dict[str, np.ndarray]  # vector column -> [Q, D] float32
    compatible_dim: int | None = None
    label_note: str | None = None
    #: every gallery item's backfill cost (``cost_column``), or None (1 for every item)
    gallery_costs: np.ndarray | None = None
    #: a candidate's view (:meth:`candidate_view`): the column read as ``new``; None: no view
    new_column: str | None = None

    @property
    def n_items(self) -> int:
        return int(self.gallery_labels.shape[0])

    @property
    def n_queries(self) -> int:
        return int(self.query_labels.shape[0])

    @property
    def source(self) -> str:
        return self.reader.source

    @property
    def files(self) -> list[str]:
        return self.reader.files

    @property
    def columns(self) -> list[str]:
        """The columns every shard has."""
        return self.reader.columns

    @property
    def dims(self) -> dict[str, int]:
        """Vector column -> dimension."""
        return self.reader.dims

    @property
    def filesystem(self):
        return self.reader.filesystem

    @property
    def nbytes(self) -> int:
        """Compressed size of the vector columns on disk."""
        return self.reader.nbytes

    @property
    def vector_columns(self) -> list[str]:
        """The vector columns, by their role (a candidate's view: ``old`` and ``new`` only)."""
        if self.new_column is not None:
            return ["old", "new"]
        return self.reader.vector_columns

    def candidate_view(self, column: str) -> ParquetGallery:
        """The dataset as a single-candidate simulation of the new vectors of ``column`` sees
        it: ``column`` read as ``new``, no ``adapted`` (docs/simulator.md, "Several
        candidates"); a missing column, or one holding another dimension than ``old``'s
        kind of vectors, is named."""
        if column not in self.columns:
            raise BackfillInputError(
                f"candidate column {column!r} is not in {self.source}; found {self.columns}"
            )
        view = replace(self, new_column=column, queries={})
        view.queries = view._read_queries()
        return view

    def _physical(self, columns: list[str]) -> list[str]:
        if self.new_column is None:
            return list(columns)
        return [self.new_column if c == "new" else c for c in columns]

    @property
    def uncertainty_columns(self) -> list[str]:
        return self.reader.uncertainty_columns

    @property
    def item_columns(self) -> list[str]:
        """Stored uncertainty columns and the cost column: one number per item."""
        return self.reader.item_columns

    @property
    def cost_column(self) -> str | None:
        return self.reader.cost_column

    # ------------------------------------------------------------------ open
    @classmethod
    def open(
        cls, path: str, *, compatible_dim: int | None = None, cost_column: str | None = None
    ) -> ParquetGallery:
        """The footer and key-column pass: shards, row groups, labels, ids, queries (and the
        items' costs from ``cost_column``)."""
        with _system_allocator():
            return cls._open(path, compatible_dim, cost_column)

    @classmethod
    def _open(cls, path: str, compatible_dim: int | None, cost_column: str | None):
        reader = EmbeddingsParquet.open(path, cost_column=cost_column)
        keys = reader.read_keys()
        keys.require_both_sides(reader.source)
        is_q = keys.kind == QUERY
        out = cls(
            reader=reader,
            groups=reader.row_groups(keys),
            query_labels=keys.labels[is_q],
            gallery_labels=keys.labels[~is_q],
            query_ids=keys.ids[is_q],
            gallery_ids=keys.ids[~is_q],
            queries={},
            compatible_dim=compatible_dim,
            label_note=keys.label_note,
        )
        del keys, is_q
        out.queries = out._read_queries()
        if cost_column:
            out.gallery_costs = out._read_costs()
        return out

    def _read_costs(self) -> np.ndarray:
        """The cost column of every gallery row, in gallery order (checked by the reader)."""
        parts = [
            self.reader.read_group(g, [self.cost_column]).values[self.cost_column]
            for g in self.groups
            if g.gallery_rows
        ]
        return np.concatenate(parts)

    @property
    def old_dim(self) -> int:
        return int(self.queries["old"].shape[1])

    @property
    def new_dim(self) -> int:
        return int(self.queries["new"].shape[1])

    def query_arrays(self) -> dict[str, np.ndarray]:
        """The queries as :class:`GalleryEmbeddings` arguments (``query_old``, ``query_new``)."""
        return {f"query_{c}": a for c, a in self.queries.items() if c in ("old", "new")}

    def probe(self) -> GalleryEmbeddings:
        """The first row group with gallery rows, with the queries: a sample of the real data
        to tell which modes and policies its columns allow."""
        group = next(g for g in self.groups if g.gallery_rows)
        return self.block_embeddings(group, self.query_arrays())

    def _read_queries(self) -> dict[str, np.ndarray]:
        """The vector columns of the query rows (only row groups that hold queries are read;
        plain list columns: the queries fix the dimension)."""
        columns = self.vector_columns
        parts = [
            self.reader.read_group(g, self._physical(columns), side=QUERY).values
            for g in self.groups
            if g.gallery_rows != g.rows
        ]
        return {c: np.concatenate([p[p_c] for p in parts]) for c, p_c in self._named(columns)}

    def _named(self, columns: list[str]) -> list[tuple[str, str]]:
        return list(zip(columns, self._physical(columns), strict=True))

    # ------------------------------------------------------------------ blocks
    def read_block(
        self, group: RowGroup, columns: list[str] | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """``(item ids, {column: values})`` of the gallery rows of one row group: vector
        columns as float32 ``[n, D]``, uncertainty columns as float64 ``[n]``."""
        columns = self.vector_columns if columns is None else list(columns)
        rows = self.reader.read_group(group, self._physical(columns))
        return rows.ids, {c: rows.values[p] for c, p in self._named(columns)}

    def block_embeddings(
        self, group: RowGroup, queries: dict[str, np.ndarray], columns: list[str] | None = None
    ) -> GalleryEmbeddings:
        """The gallery rows of one row group with the (query-sized) ``queries`` arrays, as a
        :class:`GalleryEmbeddings` (labels are not needed by a block pass: all 0).  The reader
        has checked the vectors for NaN/inf; they are not scanned twice."""
        ids, cols = self.read_block(group, columns)
        n = ids.size
        checked = tuple(f"gallery_{c}" for c in ("old", "new", "adapted") if c in cols)
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
                item_costs=cols.get(self.cost_column) if self.cost_column else None,
                checked_finite=checked,
                **queries,
            )
        except BackfillInputError as exc:
            raise BackfillInputError(f"{group.name}: {exc}") from exc

    def without_items(self) -> ParquetGallery:
        """A copy without the per-item arrays (what a block task needs: files, row groups,
        dims, queries)."""
        empty = np.zeros(0, dtype=np.int64)
        return replace(self, gallery_labels=empty, gallery_ids=empty, gallery_costs=None)


def _stored_uncertainty(cols: dict[str, np.ndarray]) -> dict:
    """``{"uncertainty": {kind: values}}`` of the ``unc_<kind>`` columns read (``load_parquet``
    keeps them the same way)."""
    stored = {
        c[len(UNCERTAINTY_PREFIX) :]: v for c, v in cols.items() if c.startswith(UNCERTAINTY_PREFIX)
    }
    return {"uncertainty": stored} if stored else {}


def vector_bytes(path: str) -> int:
    """Compressed bytes of the vector columns of a parquet dataset, from its footers only
    (which are checked as :meth:`ParquetGallery.open` checks them)."""
    return EmbeddingsParquet.open(path).nbytes
