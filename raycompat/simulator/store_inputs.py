"""The simulator's inputs from a vector store: the gallery where it lives (docs/simulator.md,
"A gallery in a vector store").

``simulate-backfill --store URI --queries FILE`` (and ``plan-upgrade --store ...``) read the
gallery from a LanceDB table or a Milvus collection (:mod:`raycompat.stores`): every item's id,
label, old vector and new vector, in ascending id order (the store's order: the gallery index
the simulator breaks ties by, and the order of the ``sequential`` policy). The queries, embedded
by both models, come from an embeddings parquet (its ``query`` rows), since a store holds the
gallery only. The result is the :class:`~raycompat.embeddings.gallery.GalleryEmbeddings` that
:func:`~raycompat.embeddings.gallery.load_parquet` reads from the same gallery exported to
parquet in ascending id order, so the curves are the same, number for number.

A simulation needs every item's new vector: a store where some items are not upgraded is
refused, naming the column and how many items lack one. Labels are matched by value: integer
labels in the store with the queries' ``label``; string labels (class names) with the queries'
``class_name`` when the file stores one, else with their ``label``, and then numbered in sorted
order of the names, as the parquet reader numbers class names.

Every problem raises :class:`~raycompat.embeddings.gallery.BackfillInputError`, one line that
starts with ``--store <uri>:`` (or ``--queries <file>:``) and names the column.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from raycompat.config import ConfigError, option
from raycompat.embeddings.format import (
    QUERY,
    BackfillInputError,
    EmbeddingsParquet,
    Rows,
    ids_preview,
    nonfinite_rows,
)
from raycompat.embeddings.gallery import GalleryEmbeddings

__all__ = [
    "StoreGallery",
    "StoreInputOptions",
    "check_store_inputs",
    "load_store_gallery",
    "parse_store_columns",
]

#: rows read from the store per block
READ_BLOCK_ROWS = 16_384


@dataclass(frozen=True)
class StoreInputOptions:
    """``--store``, ``--store-columns`` and ``--queries``: a nested field of the options of
    ``simulate-backfill`` and ``plan-upgrade``."""

    store: str | None = option(
        None,
        help="the gallery in a vector store: lance://<database>/<table> or "
        "milvus://<file.db or host:port>/<collection> (docs/stores.md); every item's old and "
        "new vector and label are read from it, in ascending id order; needs --queries",
    )
    store_columns: str | None = option(
        None,
        help="with --store: comma-separated LOGICAL=COLUMN where the store's columns are not "
        "raycompat's defaults; logical names: id (item_id), label, old, new, old_model, "
        "new_model, upgraded, position (upgrade_position), image_uri; 'none' unmaps "
        "upgraded, position or image_uri",
    )
    queries: str | None = option(
        None,
        help="with --store: an embeddings parquet (item_id, label, split, old, new; class_name "
        "optional) whose 'query' rows are the queries; its gallery rows are not read",
    )


def parse_store_columns(text: str | None):
    """``--store-columns``: ``LOGICAL=COLUMN,...`` -> a :class:`~raycompat.stores.ColumnMap`
    (the defaults for the names not given); a bad item is a ``ConfigError``."""
    from raycompat.stores import ColumnMap, StoreError

    known = [f.name for f in fields(ColumnMap)]
    given: dict[str, str | None] = {}
    for item in (t.strip() for t in (text or "").split(",")):
        if not item:
            continue
        logical, sep, name = (s.strip() for s in item.partition("="))
        if not sep or not name:
            raise ConfigError(f"--store-columns: {item!r} must look like LOGICAL=COLUMN")
        if logical not in known:
            raise ConfigError(
                f"--store-columns: unknown column {logical!r}; known: {', '.join(known)}"
            )
        if logical in given:
            raise ConfigError(f"--store-columns: {logical!r} is given twice")
        given[logical] = None if name.lower() == "none" else name
    try:
        return ColumnMap(**given)
    except (StoreError, TypeError) as exc:
        raise ConfigError(f"--store-columns: {exc}") from None


@dataclass(frozen=True)
class StoreGallery:
    """What the cheap checks found: the store's size and layout and the queries' file."""

    uri: str
    where: str
    columns: object  # the ColumnMap
    rows: int
    upgraded: int
    old_dim: int
    new_dim: int
    label_type: str
    queries: EmbeddingsParquet


def _store_error(uri: str, exc: Exception) -> BackfillInputError:
    return BackfillInputError(f"--store {uri}: {exc}".splitlines()[0])


def _column(uri: str, column: str, where: str, why: str) -> BackfillInputError:
    return BackfillInputError(f"--store {uri}: column {column!r} of {where}: {why}")


def _open(opts: StoreInputOptions):
    from raycompat.stores import StoreError, open_store

    if not opts.queries:
        raise ConfigError("--store needs --queries (the queries, embedded by both models)")
    columns = parse_store_columns(opts.store_columns)
    try:
        return open_store(opts.store, columns)
    except StoreError as exc:
        raise _store_error(opts.store, exc) from None


def _check(store, opts: StoreInputOptions) -> StoreGallery:
    """The checks that read no vector: finalize, items without a new vector, the queries'
    file and its dimensions against the store's."""
    uri, cols, where = opts.store, store.columns, store.where
    info = store.describe()
    if info.finalized:
        raise _column(
            uri,
            cols.old,
            where,
            "the store is finalized, the old vectors are no longer in use (the simulation "
            "starts from them)",
        )
    if info.rows == 0:
        raise BackfillInputError(f"--store {uri}: empty gallery: {where} holds no items")
    if info.upgraded < info.rows:
        raise _missing_new(uri, cols.new, where, info.rows - info.upgraded, info.rows)
    try:
        queries = EmbeddingsParquet.open(opts.queries)
    except BackfillInputError as exc:
        raise BackfillInputError(f"--queries {opts.queries}: {exc}") from None
    for side, dim in (("old", info.old_dim), ("new", info.new_dim)):
        _check_dim(uri, cols.physical(side), where, dim, side, queries.dims.get(side), queries)
    return StoreGallery(
        uri=uri,
        where=where,
        columns=cols,
        rows=info.rows,
        upgraded=info.upgraded,
        old_dim=int(info.old_dim),
        new_dim=int(info.new_dim),
        label_type=info.label_type,
        queries=queries,
    )


def _missing_new(uri: str, column: str, where: str, missing: int, rows: int):
    return _column(
        uri,
        column,
        where,
        f"{missing:,} of {rows:,} items have no new vector (not upgraded); a simulation needs "
        "every item's new vector: write the others' (store.write_new), or embed the gallery "
        "with the new model (raycompat embed-gallery) and simulate that parquet (--embeddings)",
    )


def _check_dim(uri, column, where, dim, side, query_dim, queries) -> None:
    if query_dim is not None and query_dim != dim:
        raise _column(
            uri,
            column,
            where,
            f"dimension mismatch: the store's {side} vectors have {dim} dims, column {side!r} "
            f"of the queries ({queries.source}) has {query_dim}",
        )


def check_store_inputs(opts: StoreInputOptions) -> StoreGallery:
    """Open the store and the queries' file and run every check that reads no vector (what
    ``plan-upgrade --store`` checks before it makes its output folder)."""
    with _open(opts) as store:
        return _check(store, opts)


def _read_store(store, uri: str) -> dict[str, np.ndarray]:
    from raycompat.stores import StoreError

    parts: dict[str, list[np.ndarray]] = {"id": [], "label": [], "old": [], "new": []}
    try:
        for block in store.read_blocks(tuple(parts), block_rows=READ_BLOCK_ROWS):
            for name, kept in parts.items():
                kept.append(block[name])
    except StoreError as exc:
        raise _store_error(uri, exc) from None
    return {name: np.concatenate(kept) for name, kept in parts.items()}


def _raw_query_labels(reader: EmbeddingsParquet, is_query: np.ndarray) -> dict[str, np.ndarray]:
    """The queries' ``label`` (and ``class_name``) as stored, every file in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = [c for c in ("label", "class_name") if c in reader.columns]
    tables = []
    for f in reader.files:
        with reader.filesystem.open_input_file(f) as fh:
            tables.append(pq.read_table(fh, columns=names))
    out = {}
    for name in names:
        column = pa.chunked_array([t.column(name) for t in tables])
        if pa.types.is_dictionary(column.type):
            column = column.cast(column.type.value_type)
        values = column.to_numpy(zero_copy_only=False)[is_query]
        kind = "int64" if pa.types.is_integer(column.type) else None
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            kind = "string"
        out[name] = (values, kind)
    return out


def _labels(found: StoreGallery, g_labels: np.ndarray, raw: dict) -> tuple:
    """Gallery and query labels as the simulator compares them (module docstring)."""
    uri, where, col = found.uri, found.where, found.columns.label
    source = found.queries.source
    if found.label_type == "int64":
        values, kind = raw["label"]
        if kind != "int64":
            raise _column(
                uri,
                col,
                where,
                f"integer labels, but column 'label' of the queries ({source}) is not "
                "integer: store class names as string labels, or integer labels in both",
            )
        return g_labels.astype(np.int64), values.astype(np.int64)
    name = "class_name" if "class_name" in raw else "label"
    values, kind = raw[name]
    if kind != "string":
        raise _column(
            uri,
            col,
            where,
            f"string labels (class names), but column {name!r} of the queries ({source}) "
            "holds no strings: store integer labels, or give the queries a class_name column",
        )
    g, q = g_labels.astype(str), values.astype(str)
    names = np.unique(np.concatenate([g, q]))  # sorted: the parquet reader's class numbering
    return np.searchsorted(names, g).astype(np.int64), np.searchsorted(names, q).astype(np.int64)


def _read_queries(found: StoreGallery) -> tuple[Rows, dict, int]:
    """The query rows' ids and old / new vectors, their labels as stored, and how many
    gallery rows the file holds besides (not read)."""
    reader = found.queries
    try:
        keys = reader.read_keys()
        is_query = keys.kind == QUERY
        if not is_query.any():
            raise BackfillInputError(f"no queries: no rows with split 'query' in {reader.source}")
        groups = [g for g in reader.row_groups(keys) if g.rows > g.gallery_rows]
        rows = Rows.concat([reader.read_group(g, ["old", "new"], side=QUERY) for g in groups])
    except BackfillInputError as exc:
        raise BackfillInputError(f"--queries {reader.source}: {exc}") from None
    if not np.array_equal(rows.ids, keys.ids[is_query]):
        raise BackfillInputError(f"--queries {reader.source} changed while it was being read")
    return rows, _raw_query_labels(reader, is_query), int((~is_query).sum())


def load_store_gallery(
    opts: StoreInputOptions, *, compatible_dim: int | None = None, say=None
) -> GalleryEmbeddings:
    """The gallery of ``--store`` and the queries of ``--queries``, checked, as the
    simulator's :class:`GalleryEmbeddings` (module docstring)."""
    say = say or (lambda message: None)
    with _open(opts) as store:
        found = _check(store, opts)
        say(
            f"reading {found.rows:,} items from {found.where} (old dim {found.old_dim}, new dim "
            f"{found.new_dim}, {found.label_type} labels)"
        )
        g = _read_store(store, found.uri)
    cols = found.columns
    missing = nonfinite_rows(g["new"])  # read NaN: an item without a new vector
    if missing.any():
        raise _missing_new(found.uri, cols.new, found.where, int(missing.sum()), len(missing))
    bad = nonfinite_rows(g["old"])
    if bad.any():
        raise _column(
            found.uri,
            cols.old,
            found.where,
            f"NaN or inf vectors for {int(bad.sum())} item(s), item ids "
            + ids_preview(g["id"][bad]),
        )
    for side in ("old", "new"):
        _check_unit(found, cols.physical(side), g[side])
    queries, raw, n_gallery_rows = _read_queries(found)
    for side in ("old", "new"):  # plain-list columns have their dimension only once read
        dim = found.old_dim if side == "old" else found.new_dim
        column = cols.physical(side)
        got = queries.values[side].shape[1]
        _check_dim(found.uri, column, found.where, dim, side, got, found.queries)
    g_labels, q_labels = _labels(found, g["label"], raw)
    if n_gallery_rows:
        say(
            f"queries: {len(queries.ids):,} query rows of {found.queries.source} (its "
            f"{n_gallery_rows:,} gallery rows are not read: the gallery is the store's)"
        )
    return GalleryEmbeddings(
        gallery_labels=g_labels,
        gallery_old=g["old"],
        gallery_new=g["new"],
        query_labels=q_labels,
        query_old=queries.values["old"],
        query_new=queries.values["new"],
        gallery_ids=g["id"],
        query_ids=queries.ids,
        compatible_dim=compatible_dim,
        source=found.uri,
        extra={"store": {"uri": found.uri, "where": found.where, "queries": found.queries.source}},
        checked_finite=("gallery_old", "gallery_new", "query_old", "query_new"),
    )


def _check_unit(found, column: str, vectors: np.ndarray) -> None:
    """A store scores by inner product, which is the cosine the simulation computes only for
    unit vectors: a store that holds others would search otherwise than it simulates."""
    from raycompat.stores.checks import not_unit_rows

    bad = not_unit_rows(vectors)
    if bad.any():
        norms = np.linalg.norm(vectors[bad].astype(np.float64), axis=1)
        raise _column(
            found.uri,
            column,
            found.where,
            f"{int(bad.sum()):,} of {len(bad):,} vectors are not unit length (norms "
            f"{norms.min():.4g} to {norms.max():.4g}): the store's searches score by inner "
            "product, the cosine that the simulation computes only for unit vectors; store "
            "L2-normalised vectors (create_store and backfill-store write them so)",
        )
