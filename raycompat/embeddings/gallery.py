"""Embeddings the simulator runs on: in memory (:class:`GalleryEmbeddings`) or from parquet.

:func:`load_parquet` reads the embeddings parquet schema (docs/architecture.md, "Formats":
"Embeddings parquet") with the one reader of that schema,
:class:`~raycompat.embeddings.format.EmbeddingsParquet`, collected into memory: the
same checks, and the same messages, as the Ray engine's streamed
:class:`~raycompat.embeddings.dataset.ParquetGallery` and the live index's gallery.

Every problem with the input raises :class:`BackfillInputError` with a one-line message
naming it: a missing column, a dimension mismatch, an empty gallery, NaN/inf embeddings (with
the offending item ids), duplicate ids, unknown split values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field, replace

import numpy as np

from raycompat.embeddings.format import (
    GALLERY,
    QUERY,
    SPLITS,
    UNCERTAINTY_PREFIX,
    VECTOR_COLUMNS,
    BackfillInputError,
    EmbeddingsParquet,
    Rows,
    duplicate_ids,
    duplicate_ids_error,
    ids_preview,
    nonfinite_error,
    nonfinite_rows,
)

__all__ = [
    "BackfillInputError",
    "GalleryEmbeddings",
    "load_candidates",
    "load_item_costs",
    "load_parquet",
    "SPLITS",
    "VECTOR_COLUMNS",
]


#: The embedding arrays of a :class:`GalleryEmbeddings` (each optional but the old and new ones).
VECTOR_FIELDS = (
    "gallery_old",
    "gallery_new",
    "gallery_adapted",
    "gallery_rho",
    "gallery_fct",
    "query_old",
    "query_new",
    "query_rho",
    "query_rev",
)


@dataclass
class GalleryEmbeddings:
    """Gallery- and query-side embeddings of one upgrade, as float32 arrays.

    Gallery side (``N`` items): ``gallery_old`` phi_o(g) is required;
    ``gallery_new`` phi_n(g), ``gallery_adapted`` psi(phi_o(g)) and
    ``gallery_rho`` rho(phi_n(g)) are needed by the modes that use them, ``gallery_fct``
    h(phi_o(g)) (FCT's transformation, mode ``fct``) too.
    Query side (``Q`` queries): ``query_old`` phi_o(q) (naive_merge, cold and the
    old-old reference for NFR), ``query_new`` phi_n(q), ``query_rho``
    rho(phi_n(q)) and ``query_rev`` psi_rev(rho(phi_n(q))) (rank_merge).

    ``compatible_dim``: the first ``compatible_dim`` dims of a new embedding
    form the subspace compatible with the old model (default ``D_old`` when
    ``D_new >= D_old``).  ``normalized=True`` promises that every vector is
    already L2-normalised, so the modes skip a normalising copy.  ``item_costs``: each
    gallery item's backfill cost (float64 ``[N]``, finite and > 0; ``None``: 1 for every item;
    docs/methods.md, "cost-aware").
    """

    gallery_labels: np.ndarray
    gallery_old: np.ndarray
    query_labels: np.ndarray
    query_new: np.ndarray | None = None
    gallery_new: np.ndarray | None = None
    query_old: np.ndarray | None = None
    gallery_adapted: np.ndarray | None = None
    gallery_rho: np.ndarray | None = None
    query_rho: np.ndarray | None = None
    query_rev: np.ndarray | None = None
    gallery_ids: np.ndarray | None = None
    query_ids: np.ndarray | None = None
    compatible_dim: int | None = None
    normalized: bool = False
    source: str = "memory"
    extra: dict[str, object] = field(default_factory=dict)
    item_costs: np.ndarray | None = None
    gallery_fct: np.ndarray | None = None
    #: arrays whose values the caller has already checked for NaN/inf (a parquet block's
    #: vectors, checked by the reader); not kept: a copy (``dataclasses.replace``) checks all
    checked_finite: InitVar[tuple[str, ...]] = ()

    def __post_init__(self, checked_finite: tuple[str, ...] = ()):
        self.gallery_labels = np.asarray(self.gallery_labels)
        self.query_labels = np.asarray(self.query_labels)
        if self.gallery_ids is None:
            self.gallery_ids = np.arange(self.gallery_labels.shape[0], dtype=np.int64)
        if self.query_ids is None:
            self.query_ids = np.arange(self.query_labels.shape[0], dtype=np.int64)
        self.gallery_ids = np.asarray(self.gallery_ids)
        self.query_ids = np.asarray(self.query_ids)
        for name in VECTOR_FIELDS:
            a = getattr(self, name)
            if a is not None:
                a = np.asarray(a)
                if a.dtype != np.float32:
                    if a.dtype.kind not in "fiu":
                        raise BackfillInputError(f"{name} must be numeric, got dtype {a.dtype}")
                    a = a.astype(np.float32)
                setattr(self, name, a)
        if self.item_costs is not None:
            self.item_costs = np.asarray(self.item_costs, dtype=np.float64)
        self.validate(checked_finite)

    def costs(self) -> np.ndarray:
        """Every item's backfill cost: ``item_costs``, or 1 for every item."""
        if self.item_costs is None:
            return np.ones(self.n_items, dtype=np.float64)
        return self.item_costs

    # ------------------------------------------------------------------ shape info
    @property
    def n_items(self) -> int:
        return int(self.gallery_labels.shape[0])

    @property
    def n_queries(self) -> int:
        return int(self.query_labels.shape[0])

    @property
    def old_dim(self) -> int:
        return int(self.gallery_old.shape[1])

    @property
    def new_dim(self) -> int | None:
        for a in (self.gallery_new, self.query_new):
            if a is not None:
                return int(a.shape[1])
        return None

    @property
    def compat_dim(self) -> int | None:
        """The compatible subspace dimension (``compatible_dim`` or ``D_old`` if D_new >= D_old)."""
        if self.compatible_dim is not None:
            return int(self.compatible_dim)
        nd = self.new_dim
        if nd is not None and nd >= self.old_dim:
            return self.old_dim
        return None

    # ------------------------------------------------------------------ validation
    def validate(self, checked_finite: tuple[str, ...] = ()) -> None:
        """Raise :class:`BackfillInputError` naming the first problem found (arrays named in
        ``checked_finite`` are not scanned for NaN/inf again)."""
        self._check_shapes()
        self._check_dims()
        self._check_values(checked_finite)

    def _check_shapes(self) -> None:
        """Labels, ids and every array have one row per item (or query)."""
        n, q = self.n_items, self.n_queries
        if self.gallery_labels.ndim != 1 or self.query_labels.ndim != 1:
            raise BackfillInputError("labels must be 1-D arrays")
        if n == 0:
            raise BackfillInputError("empty gallery: no gallery or distractor items")
        if q == 0:
            raise BackfillInputError("no queries: nothing to evaluate")
        if self.gallery_ids.shape != (n,) or self.query_ids.shape != (q,):
            raise BackfillInputError(
                f"item ids do not match the labels: {self.gallery_ids.shape} gallery ids "
                f"for {n} items, "
                f"{self.query_ids.shape} query ids for {q} queries"
            )
        for _side, rows, names in (
            (
                "gallery",
                n,
                ("gallery_old", "gallery_new", "gallery_adapted", "gallery_rho", "gallery_fct"),
            ),
            ("query", q, ("query_old", "query_new", "query_rho", "query_rev")),
        ):
            for name in names:
                a = getattr(self, name)
                if a is None:
                    continue
                if a.ndim != 2 or a.shape[0] != rows:
                    raise BackfillInputError(f"{name} has shape {a.shape}, expected [{rows}, dim]")
                if a.shape[1] == 0:
                    raise BackfillInputError(f"{name} has dimension 0")
        if self.gallery_old.shape[0] != n:
            raise BackfillInputError("gallery_old is required")

    def _check_dims(self) -> None:
        """Arrays compared with each other have the same dimension; ``compatible_dim`` fits."""
        pairs = [
            ("query_old", "gallery_old"),
            ("query_new", "gallery_new"),
            ("gallery_new", "gallery_adapted"),
            ("query_new", "gallery_adapted"),
            ("query_rho", "gallery_rho"),
            ("query_new", "gallery_fct"),
            ("query_rev", "gallery_old"),
        ]
        for a_name, b_name in pairs:
            a, b = getattr(self, a_name), getattr(self, b_name)
            if a is not None and b is not None and a.shape[1] != b.shape[1]:
                raise BackfillInputError(
                    f"dimension mismatch: {a_name} has dim {a.shape[1]} "
                    f"but {b_name} has dim {b.shape[1]}"
                )
        if self.compatible_dim is not None:
            nd = self.new_dim
            if not 0 < int(self.compatible_dim) <= (nd if nd is not None else self.old_dim):
                raise BackfillInputError(
                    f"compatible_dim={self.compatible_dim} must be in [1, D_new={nd}]"
                )

    def _check_values(self, checked_finite: tuple[str, ...] = ()) -> None:
        """No NaN or inf embedding (but in ``checked_finite``); no duplicate item id."""
        for name in VECTOR_FIELDS:
            a = getattr(self, name)
            if a is None or name in checked_finite:
                continue
            bad = nonfinite_rows(a)
            if bad.any():
                ids = self.gallery_ids if name.startswith("gallery") else self.query_ids
                raise nonfinite_error(name, ids, bad)
        for what, ids in (("gallery", self.gallery_ids), ("query", self.query_ids)):
            dups = duplicate_ids(ids)
            if dups.size:
                raise duplicate_ids_error(what, dups)
        c = self.item_costs
        if c is not None:
            if c.shape != (self.n_items,):
                raise BackfillInputError(
                    f"item_costs has shape {c.shape}, expected one cost per item [{self.n_items}]"
                )
            with np.errstate(invalid="ignore"):
                bad = ~(np.isfinite(c) & (c > 0))
            if bad.any():
                raise BackfillInputError(
                    f"item costs must be finite numbers > 0: {int(bad.sum())} item(s) are not, "
                    f"item ids {ids_preview(self.gallery_ids[bad])}"
                )

    def require(self, names: Sequence[str], why: str) -> None:
        """Raise naming the first missing array among ``names`` (``why``: who needs it)."""
        for name in names:
            if getattr(self, name) is None:
                raise BackfillInputError(f"{why} needs {name}, which is missing")

    def with_arrays(self, **arrays) -> GalleryEmbeddings:
        """A copy with some arrays added or replaced (validated again)."""
        return replace(self, **arrays)


# ----------------------------------------------------------------------------- parquet
def load_parquet(
    path: str, *, compatible_dim: int | None = None, cost_column: str | None = None
) -> GalleryEmbeddings:
    """Read embeddings from a parquet file, a folder of parquet files (subfolders included)
    or a URI: the streaming reader, collected.  Queries and gallery items are matched by
    ``class_name`` when the files store it (every file this project writes does), else by
    ``label``.  ``cost_column``: the column of every item's backfill cost (``item_costs``)."""
    reader = EmbeddingsParquet.open(path, cost_column=cost_column)
    keys = reader.read_keys()
    keys.require_both_sides(reader.source)
    sides = _collect_sides(reader, reader.vector_columns + reader.item_columns)
    gallery, queries = sides[GALLERY], sides[QUERY]
    is_g = keys.kind == GALLERY
    if not (
        np.array_equal(gallery.ids, keys.ids[is_g]) and np.array_equal(queries.ids, keys.ids[~is_g])
    ):
        raise BackfillInputError(f"{reader.source} changed while it was being read")
    extra: dict[str, object] = {"label_note": keys.label_note} if keys.label_note else {}
    stored = {
        c[len(UNCERTAINTY_PREFIX) :]: v
        for c, v in gallery.values.items()
        if c.startswith(UNCERTAINTY_PREFIX)
    }
    if stored:
        extra["uncertainty"] = stored
    return GalleryEmbeddings(
        gallery_labels=keys.labels[is_g],
        gallery_old=gallery.values["old"],
        gallery_new=gallery.values["new"],
        gallery_adapted=gallery.values.get("adapted"),
        query_labels=keys.labels[~is_g],
        query_old=queries.values["old"],
        query_new=queries.values["new"],
        gallery_ids=gallery.ids,
        query_ids=queries.ids,
        compatible_dim=compatible_dim,
        source=reader.source,
        extra=extra,
        item_costs=gallery.values.get(cost_column) if cost_column else None,
    )


def load_candidates(data: GalleryEmbeddings, path: str, columns: dict[str, str]) -> dict:
    """``{name: GalleryEmbeddings}``: ``data`` (from :func:`load_parquet` of ``path``) once per
    candidate, its ``new`` vectors from that candidate's column and no ``adapted`` vectors
    (docs/simulator.md, "Several candidates"); a missing column is named."""
    reader = EmbeddingsParquet.open(path)
    missing = [c for c in columns.values() if c not in reader.columns]
    if missing:
        raise BackfillInputError(
            f"candidate column(s) {missing} not in {reader.source}; found {reader.columns}"
        )
    wanted = sorted(set(columns.values()) - {"new"})
    sides = _collect_sides(reader, wanted) if wanted else {}
    out = {}
    for name, col in columns.items():
        if col == "new":
            out[name] = replace(data, gallery_adapted=None)
            continue
        g, q = sides[GALLERY], sides[QUERY]
        if not (np.array_equal(g.ids, data.gallery_ids) and np.array_equal(q.ids, data.query_ids)):
            raise BackfillInputError(f"{reader.source} changed while it was being read")
        out[name] = replace(
            data, gallery_new=g.values[col], query_new=q.values[col], gallery_adapted=None
        )
    return out


def load_item_costs(path: str, cost_column: str, gallery_ids: np.ndarray) -> np.ndarray:
    """The cost column of an embeddings parquet for the items ``gallery_ids`` (in that order),
    read and checked by the one reader of the schema (what a served gallery's backfill reads
    when its vectors are already loaded)."""
    reader = EmbeddingsParquet.open(path, required=("item_id",), cost_column=cost_column)
    rows = _collect_sides(reader, [cost_column])[GALLERY]
    o = np.argsort(rows.ids, kind="stable")
    ids = np.asarray(gallery_ids, dtype=np.int64)
    pos = np.minimum(np.searchsorted(rows.ids[o], ids), max(rows.ids.size - 1, 0))
    missing = rows.ids.size == 0 or (rows.ids[o][pos] != ids).any()
    if missing:
        raise BackfillInputError(f"cost column {cost_column!r}: {path} lacks some gallery items")
    return rows.values[cost_column][o[pos]]


def _collect_sides(reader: EmbeddingsParquet, columns: list[str]) -> dict[int, Rows]:
    """``{GALLERY: rows, QUERY: rows}`` of the whole dataset, read a row group at a time."""
    parts: dict[int, list[Rows]] = {GALLERY: [], QUERY: []}
    for rows in reader.iter_rows(columns):
        for side, kept in parts.items():
            kept.append(rows.side(side))
        del rows
    return {side: Rows.concat(kept) for side, kept in parts.items()}
