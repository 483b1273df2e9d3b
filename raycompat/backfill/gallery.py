"""Embeddings the simulator runs on: in memory (:class:`GalleryEmbeddings`) or from parquet.

Parquet schema (one row per image; docs/architecture.md, "Formats"):

==========  ===============================  ==============================================
column      type                             meaning
==========  ===============================  ==============================================
item_id     int64                            unique id of the image
label       any (int or string)              class; a query's positives share its label
split       string                           ``query`` (a query) or ``gallery`` /
                                             ``distractor`` (a gallery item)
old         fixed_size_list<float32>[D_old]  phi_o(x), the old model's embedding
new         fixed_size_list<float32>[D_new]  phi_n(x), the new model's embedding
adapted     fixed_size_list<float32>[D_new]  optional: psi(phi_o(x)) (DMU forward adaptation)
==========  ===============================  ==============================================

Plain ``list<float>`` columns with one length per column, and float16/float64
values, are accepted too.  The path may be a file or a folder of parquet files.

Every problem with the input raises :class:`BackfillInputError` with a
one-line message naming it: a missing column, a dimension mismatch, an empty
gallery, NaN/inf embeddings (with the offending item ids), duplicate ids,
unknown split values.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

__all__ = [
    "BackfillInputError",
    "GalleryEmbeddings",
    "load_parquet",
    "SPLITS",
    "VECTOR_COLUMNS",
]

SPLITS = {"query": "query", "gallery": "gallery", "distractor": "gallery", "distractors": "gallery"}
REQUIRED_COLUMNS = ("item_id", "label", "split", "old", "new")
VECTOR_COLUMNS = ("old", "new", "adapted")


class BackfillInputError(ValueError):
    """Bad input to the backfill simulator; the message names the problem in one line."""


def _ids_preview(ids: np.ndarray, n: int = 5) -> str:
    ids = np.asarray(ids)
    shown = ", ".join(str(x) for x in ids[:n].tolist())
    return f"[{shown}{', ...' if ids.size > n else ''}]"


@dataclass
class GalleryEmbeddings:
    """Gallery- and query-side embeddings of one upgrade, as float32 arrays.

    Gallery side (``N`` items): ``gallery_old`` phi_o(g) is required;
    ``gallery_new`` phi_n(g), ``gallery_adapted`` psi(phi_o(g)) and
    ``gallery_rho`` rho(phi_n(g)) are needed by the modes that use them.
    Query side (``Q`` queries): ``query_old`` phi_o(q) (naive_merge, cold and the
    old-old reference for NFR), ``query_new`` phi_n(q), ``query_rho``
    rho(phi_n(q)) and ``query_rev`` psi_rev(rho(phi_n(q))) (rank_merge).

    ``compatible_dim``: the first ``compatible_dim`` dims of a new embedding
    form the subspace compatible with the old model (default ``D_old`` when
    ``D_new >= D_old``).  ``normalized=True`` promises that every vector is
    already L2-normalised, so the modes skip a normalising copy.
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

    def __post_init__(self):
        self.gallery_labels = np.asarray(self.gallery_labels)
        self.query_labels = np.asarray(self.query_labels)
        if self.gallery_ids is None:
            self.gallery_ids = np.arange(self.gallery_labels.shape[0], dtype=np.int64)
        if self.query_ids is None:
            self.query_ids = np.arange(self.query_labels.shape[0], dtype=np.int64)
        self.gallery_ids = np.asarray(self.gallery_ids)
        self.query_ids = np.asarray(self.query_ids)
        for name in (
            "gallery_old",
            "gallery_new",
            "gallery_adapted",
            "gallery_rho",
            "query_old",
            "query_new",
            "query_rho",
            "query_rev",
        ):
            a = getattr(self, name)
            if a is not None:
                a = np.asarray(a)
                if a.dtype != np.float32:
                    if a.dtype.kind not in "fiu":
                        raise BackfillInputError(f"{name} must be numeric, got dtype {a.dtype}")
                    a = a.astype(np.float32)
                setattr(self, name, a)
        self.validate()

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
    def validate(self) -> None:
        """Raise :class:`BackfillInputError` naming the first problem found."""
        self._check_shapes()
        self._check_dims()
        self._check_values()

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
            ("gallery", n, ("gallery_old", "gallery_new", "gallery_adapted", "gallery_rho")),
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

    def _check_values(self) -> None:
        """No NaN or inf embedding; no duplicate item id."""
        for name in (
            "gallery_old",
            "gallery_new",
            "gallery_adapted",
            "gallery_rho",
            "query_old",
            "query_new",
            "query_rho",
            "query_rev",
        ):
            a = getattr(self, name)
            if a is None:
                continue
            bad = _nonfinite_rows(a)
            if bad.any():
                ids = (self.gallery_ids if name.startswith("gallery") else self.query_ids)[bad]
                raise BackfillInputError(
                    f"NaN or inf embeddings in {name} for {int(bad.sum())} item(s), "
                    f"item ids {_ids_preview(ids)}"
                )
        for what, ids in (("gallery", self.gallery_ids), ("query", self.query_ids)):
            u, c = np.unique(ids, return_counts=True)
            if (c > 1).any():
                raise BackfillInputError(f"duplicate {what} item ids {_ids_preview(u[c > 1])}")

    def require(self, names: Sequence[str], why: str) -> None:
        """Raise naming the first missing array among ``names`` (``why``: who needs it)."""
        for name in names:
            if getattr(self, name) is None:
                raise BackfillInputError(f"{why} needs {name}, which is missing")

    def with_arrays(self, **arrays) -> GalleryEmbeddings:
        """A copy with some arrays added or replaced (validated again)."""
        return replace(self, **arrays)


def _nonfinite_rows(a: np.ndarray, chunk: int = 1 << 15) -> np.ndarray:
    bad = np.zeros(a.shape[0], dtype=bool)
    if np.isfinite(a.sum(dtype=np.float64)):  # cannot overflow: finite iff every value is
        return bad
    for s in range(0, a.shape[0], chunk):
        bad[s : s + chunk] = ~np.isfinite(a[s : s + chunk]).all(axis=1)
    return bad


# ----------------------------------------------------------------------------- parquet
def _vector_column(table, name: str, ids: np.ndarray) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(name)
    if col.null_count:
        mask = pc.is_null(col).to_numpy(zero_copy_only=False)
        raise BackfillInputError(f"column {name!r} is null for item ids {_ids_preview(ids[mask])}")
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    if pa.types.is_fixed_size_list(t):
        dim = t.list_size
        values = arr.flatten()
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
        if lengths.size and (lengths != lengths[0]).any():
            bad = np.flatnonzero(lengths != lengths[0])
            raise BackfillInputError(
                f"dimension mismatch in column {name!r}: rows have lengths "
                f"{sorted(set(lengths.tolist()))[:5]}, "
                f"e.g. item ids {_ids_preview(ids[bad])}"
            )
        dim = int(lengths[0]) if lengths.size else 0
        values = arr.flatten()
    else:
        raise BackfillInputError(
            f"column {name!r} must be fixed_size_list<float32> (an embedding), got {t}"
        )
    if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
        raise BackfillInputError(f"column {name!r} must hold floats, got {values.type}")
    out = values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    if len(arr) and dim == 0:
        raise BackfillInputError(f"column {name!r} has dimension 0")
    return out.reshape(len(arr), dim)


def _parquet_files(path: str) -> list[str] | None:
    """The parquet files under a local folder (recursively, sorted; ``_``/``.`` names are
    metadata), ``[path]`` for a file, ``None`` for a URI (read as one dataset)."""
    if "://" in str(path):
        return None
    if not os.path.exists(path):
        raise BackfillInputError(f"embeddings not found: {path}")
    if os.path.isfile(path):
        return [path]
    files = sorted(
        os.path.join(d, f)
        for d, subdirs, names in os.walk(path)
        for f in names
        if f.endswith(".parquet") and not f.startswith(("_", "."))
        and not any(p.startswith(("_", ".")) for p in os.path.relpath(d, path).split(os.sep)[1:])
    )  # fmt: skip
    if not files:
        raise BackfillInputError(f"no .parquet files under {path}")
    return files


def _read_parts(path: str) -> list[tuple[str, object]]:
    """``(file, table)`` per parquet file of ``path`` (one part for a URI)."""
    import pyarrow.parquet as pq

    files = _parquet_files(path)
    parts = []
    for f in files if files is not None else [path]:
        try:
            parts.append((f, pq.read_table(f)))
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise BackfillInputError(f"cannot read parquet {f}: {exc}".splitlines()[0]) from exc
    return parts


def _check_part_schemas(parts) -> None:
    """Every file has the same columns and each vector column one dimension: a mismatch names
    the two files and the column."""
    import pyarrow as pa

    first_file, first = parts[0]
    for f, t in parts[1:]:
        if set(t.column_names) != set(first.column_names):
            diff = sorted(set(t.column_names) ^ set(first.column_names))
            raise BackfillInputError(
                f"shard {f} and shard {first_file} have different columns (differ in {diff})"
            )
    for col in VECTOR_COLUMNS:
        seen: dict[int, str] = {}
        for f, t in parts:
            typ = t.schema.field(col).type if col in t.column_names else None
            if typ is not None and pa.types.is_fixed_size_list(typ):
                seen.setdefault(typ.list_size, f)
        if len(seen) > 1:
            (d1, f1), (d2, f2) = list(seen.items())[:2]
            raise BackfillInputError(
                f"dimension mismatch in column {col!r}: {d1} in shard {f1}, {d2} in shard {f2}"
            )


def _labels_by_class_name(parts) -> tuple[np.ndarray | None, str | None]:
    """Labels matched by the ``class_name`` column (one integer per class name, sorted), or
    ``(None, None)`` when no file stores class names. Files that store them only in part, or
    a label with two names in one file, fail naming the file and the classes; label maps that
    differ between files (queries and gallery embedded from different folders) are fine: the
    note says so."""
    named = [f for f, t in parts if "class_name" in t.column_names]
    if not named:
        return None, None
    if len(named) != len(parts):
        bare = next(f for f, t in parts if "class_name" not in t.column_names)
        raise BackfillInputError(
            f"shard {named[0]} stores class names but {bare} does not: their labels cannot be "
            "matched; embed both with this version"
        )
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


def load_parquet(path: str, *, compatible_dim: int | None = None) -> GalleryEmbeddings:
    """Read embeddings from a parquet file or a folder of parquet files, subfolders included
    (schema above). Queries and gallery items are matched by ``class_name`` when the files
    store it (every file this project writes does), else by ``label``."""
    import pyarrow as pa

    parts = _read_parts(path)
    by_name, label_note = _labels_by_class_name(parts)  # first: it names a missing class_name
    _check_part_schemas(parts)
    table = pa.concat_tables([t for _, t in parts]) if len(parts) > 1 else parts[0][1]
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise BackfillInputError(
            f"missing column(s) {missing} in {path}; found {table.column_names}"
        )
    ids = table.column("item_id").to_numpy(zero_copy_only=False)
    if ids.dtype.kind not in "iu":
        raise BackfillInputError(
            f"column 'item_id' must be int64, got {table.schema.field('item_id').type}"
        )
    ids = ids.astype(np.int64)
    split = np.asarray(table.column("split").to_pylist(), dtype=object)
    unknown = sorted({str(s) for s in split if s not in SPLITS})
    if unknown:
        raise BackfillInputError(
            f"unknown split value(s) {unknown[:5]} in column 'split'; "
            "allowed: query, gallery, distractor"
        )
    kind = np.array([SPLITS[s] for s in split], dtype=object)
    is_q = kind == "query"
    is_g = kind == "gallery"
    if any(table.column(c).null_count for c in ("label", "split", "item_id")):
        raise BackfillInputError("columns 'item_id', 'label' and 'split' must not have null values")
    labels = table.column("label").to_numpy(zero_copy_only=False) if by_name is None else by_name
    vecs = {c: _vector_column(table, c, ids) for c in VECTOR_COLUMNS if c in table.column_names}
    if "adapted" in vecs and vecs["adapted"].shape[1] != vecs["new"].shape[1]:
        raise BackfillInputError(
            f"dimension mismatch: column 'adapted' has dim {vecs['adapted'].shape[1]}, "
            f"column 'new' has dim {vecs['new'].shape[1]}"
        )
    if not is_g.any():
        raise BackfillInputError(
            f"empty gallery: no rows with split 'gallery' or 'distractor' in {path}"
        )
    if not is_q.any():
        raise BackfillInputError(f"no queries: no rows with split 'query' in {path}")
    return GalleryEmbeddings(
        gallery_labels=labels[is_g],
        gallery_old=vecs["old"][is_g],
        gallery_new=vecs["new"][is_g],
        gallery_adapted=vecs["adapted"][is_g] if "adapted" in vecs else None,
        query_labels=labels[is_q],
        query_old=vecs["old"][is_q],
        query_new=vecs["new"][is_q],
        gallery_ids=ids[is_g],
        query_ids=ids[is_q],
        compatible_dim=compatible_dim,
        source=path if "://" in str(path) else os.path.abspath(path),
        extra=_extra(table, is_g, label_note),
    )


def _extra(table, is_g: np.ndarray, label_note: str | None) -> dict:
    """``label_note``, and the gallery's stored uncertainty columns ``unc_<kind>`` (float64)
    as ``{"uncertainty": {kind: [N]}}``."""
    extra: dict[str, object] = {"label_note": label_note} if label_note else {}
    stored = {
        c[len("unc_") :]: table.column(c).to_numpy(zero_copy_only=False).astype(np.float64)[is_g]
        for c in table.column_names
        if c.startswith("unc_")
    }
    if stored:
        extra["uncertainty"] = stored
    return extra
