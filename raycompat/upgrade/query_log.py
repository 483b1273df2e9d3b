"""A query log and its searches: what the ``demand`` and ``upgrade-on-read`` policies and the
frequency-weighted metrics read (docs/methods.md, "demand"; schema in
:mod:`raycompat.data.workload`).

:func:`read_query_log` reads and checks the parquet (one error naming the file and the column:
no id column, nulls, a count that is not > 0, NaN vectors, two vectors for one query id).
:func:`log_searches` matches it with a gallery: query ids with the evaluation queries (a
known query needs no vectors), returned item ids with the gallery's ids (unknown ids are named),
vector dimensions with the embeddings'.  Its :class:`LogSearches` then gives, per query mode,

* ``results(mode)``: every distinct query's top-k gallery indices in the mode's t=0 serving
  state (everything old; compatible: new queries against the old gallery), ranked by the
  canonical score with ties by lower gallery index (:func:`block_topk`: exact, and the same
  however the gallery is cut into blocks, so the in-memory and the Ray engines agree);
* ``popularity(mode)``: ``pop_i = sum_q f_q * 1[i in top-k(q)]``;
* ``stream(seed)``: the searches in time order (the ``order`` column, else a seeded shuffle).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from raycompat.data.workload import COUNT, ITEM_ID, ORDER, QUERY_ID
from raycompat.embeddings.format import BackfillInputError, ids_preview, vector_values

__all__ = [
    "QueryLog",
    "LogSearches",
    "read_query_log",
    "log_searches",
    "log_query_side",
    "memory_log_searches",
    "block_topk",
    "merge_topk",
    "RESULTS",
    "QUERIES_FORM",
]

QUERIES_FORM, RESULTS = "queries", "results"
_VECTORS = ("new", "old")


@dataclass(frozen=True)
class QueryLog:
    """A query log, read and checked: its distinct ``keys`` (query ids, or returned item ids
    for a *results* log, ascending) with their summed ``counts``, each row's key
    (``row_keys``: an index into ``keys``), count and time ``order`` (None without the
    column), and the distinct queries' vectors (``{"new": [U, D], "old": ...}``; empty when the
    log names known queries only)."""

    source: str
    kind: str
    keys: np.ndarray
    counts: np.ndarray
    row_keys: np.ndarray
    row_counts: np.ndarray
    row_order: np.ndarray | None = None
    vectors: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def searches(self) -> int:
        return int(self.counts.sum())

    def stream(self, seed: int = 0) -> np.ndarray:
        """One key index per search, in time order: rows sorted by ``order`` (ties by row),
        each repeated ``count`` times; without ``order`` the searches in a seeded shuffle
        (``numpy.random.default_rng([seed, 7])``)."""
        if self.row_order is None:
            events = np.repeat(self.row_keys, self.row_counts)
            return events[np.random.default_rng([seed, 7]).permutation(events.size)]
        rows = np.argsort(self.row_order, kind="stable")
        return np.repeat(self.row_keys[rows], self.row_counts[rows])


def read_query_log(path: str) -> QueryLog:
    """Read a query log parquet (a file); every problem is one :class:`BackfillInputError`
    naming the file and the column."""
    import pyarrow.parquet as pq

    if "://" not in str(path) and not os.path.isfile(path):
        raise BackfillInputError(f"query log not found: {path} (a parquet file)")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise BackfillInputError(f"cannot read query log {path}: {exc}".splitlines()[0]) from exc
    names = table.column_names
    has_q, has_i = QUERY_ID in names, ITEM_ID in names
    if has_q == has_i:
        raise BackfillInputError(
            f"query log {path} needs exactly one of the columns {QUERY_ID!r} (the queries "
            f"searched) or {ITEM_ID!r} (the items returned); found {names}"
        )
    if table.num_rows == 0:
        raise BackfillInputError(f"query log {path} has no rows")
    id_col = QUERY_ID if has_q else ITEM_ID
    ids = _int_column(table, id_col, path)
    counts = _int_column(table, COUNT, path) if COUNT in names else np.ones(ids.size, np.int64)
    if (counts <= 0).any():
        raise BackfillInputError(
            f"column {COUNT!r} of query log {path} must be > 0; ids {ids_preview(ids[counts <= 0])}"
        )
    order = _int_column(table, ORDER, path) if ORDER in names else None
    keys, row_keys = np.unique(ids, return_inverse=True)
    summed = np.bincount(row_keys, weights=counts, minlength=keys.size).astype(np.int64)
    vectors = {}
    if has_q:
        vectors = {c: _vectors(table, c, ids, row_keys, keys.size, path) for c in _VECTORS}
        vectors = {c: v for c, v in vectors.items() if v is not None}
    elif any(c in names for c in _VECTORS):
        raise BackfillInputError(
            f"query log {path}: a log of returned items ({ITEM_ID!r}) has no query vectors"
        )
    return QueryLog(
        source=str(path),
        kind=QUERIES_FORM if has_q else RESULTS,
        keys=keys,
        counts=summed,
        row_keys=row_keys.astype(np.int64),
        row_counts=counts,
        row_order=order,
        vectors=vectors,
    )


def _int_column(table, name: str, path: str) -> np.ndarray:
    import pyarrow as pa

    col = table.column(name)
    if not pa.types.is_integer(col.type):
        raise BackfillInputError(
            f"column {name!r} of query log {path} must be int64, got {col.type}"
        )
    if col.null_count:
        raise BackfillInputError(f"column {name!r} of query log {path} has null values")
    return col.to_numpy().astype(np.int64)


def _vectors(table, column: str, ids, row_keys, n_keys: int, path: str) -> np.ndarray | None:
    """``[U, D]``: the first row's vector of every distinct query; NaN values, or two different
    vectors for one query id, name the column and the ids."""
    if column not in table.column_names:
        return None
    where = f"query log {path}"
    rows = vector_values(table, column, ids, where)
    bad = ~np.isfinite(rows).all(axis=1)
    if bad.any():
        raise BackfillInputError(
            f"NaN or inf vectors in column {column!r} of {where}, query ids {ids_preview(ids[bad])}"
        )
    first = np.full(n_keys, -1, np.int64)
    first[row_keys[::-1]] = np.arange(row_keys.size)[::-1]
    out = rows[first]
    differ = (rows != out[row_keys]).any(axis=1)
    if differ.any():
        raise BackfillInputError(
            f"column {column!r} of {where} holds two different vectors for query ids "
            f"{ids_preview(np.unique(ids[differ]))}"
        )
    return out


# ----------------------------------------------------------------------------- top-k
def block_topk(
    queries: np.ndarray, gallery: np.ndarray, g0: int, k: int, max_bytes: int = 16 << 20
) -> tuple[np.ndarray, np.ndarray]:
    """The canonical top-k of ``queries`` among gallery rows ``g0, g0+1, ...``: ``(scores
    float64 [Q, k], gallery indices int64 [Q, k])``, by descending canonical score (float64 over
    the float32 vectors, :func:`raycompat.index.canonical.pair_scores`), ties by lower index,
    padded with ``-inf`` / ``-1``.  A float32 product finds the candidates: every item within
    twice the float32 error bound of a chunk's k-th float32 score, re-scored canonically, so the
    result does not depend on how the gallery is cut."""
    from raycompat.index.canonical import float32_score_error, pair_scores

    q = np.ascontiguousarray(queries, dtype=np.float32)
    n_q, n = q.shape[0], gallery.shape[0]
    best = (np.full((n_q, k), -np.inf), np.full((n_q, k), -1, np.int64))
    qn = np.sqrt(np.einsum("ij,ij->i", q.astype(np.float64), q.astype(np.float64)))
    step = max(64, max_bytes // max(1, 4 * n_q))
    for s in range(0, n, step):
        g = np.ascontiguousarray(gallery[s : s + step], dtype=np.float32)
        S = q @ g.T
        kk = min(k, g.shape[0])
        kth = np.partition(S, g.shape[0] - kk, axis=1)[:, g.shape[0] - kk].astype(np.float64)
        g64 = g.astype(np.float64)
        gmax = float(np.sqrt(np.einsum("ij,ij->i", g64, g64).max()))
        bound = kth - 2.0 * float32_score_error(q.shape[1], qn, gmax)
        r, c = np.nonzero(S >= bound[:, None])
        canon = pair_scores(q[r], g[c])
        best = merge_topk([best, _rows_top(r, c + g0 + s, canon, n_q, k)], k)
    return best


def _rows_top(rows, idx, scores, n_q: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row the ``k`` best (score descending, index ascending) of scattered candidates."""
    o = np.lexsort((idx, -scores, rows))
    rows, idx, scores = rows[o], idx[o], scores[o]
    start = np.searchsorted(rows, np.arange(n_q))
    rank = np.arange(rows.size) - start[rows]
    keep = rank < k
    out_s = np.full((n_q, k), -np.inf)
    out_i = np.full((n_q, k), -1, np.int64)
    out_s[rows[keep], rank[keep]] = scores[keep]
    out_i[rows[keep], rank[keep]] = idx[keep]
    return out_s, out_i


def merge_topk(parts, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge top-k lists ``[(scores [Q, *], indices [Q, *])]`` of disjoint gallery parts:
    descending score, ties by lower index, ``-1`` slots last."""
    s = np.concatenate([p[0] for p in parts], axis=1)
    i = np.concatenate([p[1] for p in parts], axis=1)
    key = np.where(i >= 0, i, np.iinfo(np.int64).max)
    o = np.lexsort((key, -s), axis=-1)[:, :k]
    return np.take_along_axis(s, o, axis=1), np.take_along_axis(i, o, axis=1)


# ----------------------------------------------------------------------------- with a gallery
@dataclass
class LogSearches:
    """A query log matched with a gallery (:func:`log_searches`).  ``eval_rows``: per distinct
    query, the row of the evaluation query with its id, or -1 (a *results* log: all -1);
    ``search(mode)``: the distinct queries' top-``k`` in the mode's t=0 state (computed once per
    mode); ``fixed``: a *results* log's ``[U, 1]`` gallery indices."""

    log: QueryLog
    k: int
    eval_rows: np.ndarray
    search: Callable[[str], np.ndarray] | None = None
    fixed: np.ndarray | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def results(self, mode: str) -> np.ndarray:
        """``[U, k]`` gallery indices (``-1``: fewer items than k) of every distinct entry."""
        if self.fixed is not None:
            return self.fixed
        if mode not in self._cache:
            self._cache[mode] = np.asarray(self.search(mode), dtype=np.int64)
        return self._cache[mode]

    def popularity(self, mode: str, n_items: int) -> np.ndarray:
        """``pop_i = sum_q f_q * 1[i in top-k(q)]`` (float64 ``[N]``)."""
        ids = self.results(mode)
        f = np.broadcast_to(self.log.counts[:, None], ids.shape)
        ok = ids >= 0
        return np.bincount(ids[ok], weights=f[ok].astype(np.float64), minlength=n_items)

    def weights(self) -> tuple[np.ndarray, np.ndarray]:
        """``(evaluation query rows, counts)`` of the distinct queries that are evaluation
        queries: the frequency weights of the weighted metrics."""
        known = self.eval_rows >= 0
        return self.eval_rows[known], self.log.counts[known].astype(np.float64)

    def summary(self) -> dict:
        rows, _ = self.weights()
        return {
            "source": self.log.source,
            "form": self.log.kind,
            "distinct": int(self.log.keys.size),
            "searches": self.log.searches,
            "evaluation_queries": int(rows.size),
            "k": self.k,
            "time_order": self.log.row_order is not None,
        }


def log_searches(
    log: QueryLog, data, gallery_ids: np.ndarray, k: int, search: Callable[[str], np.ndarray]
) -> LogSearches:
    """``log`` matched with a gallery: ``data`` holds its queries (a
    :class:`~raycompat.embeddings.gallery.GalleryEmbeddings`, the gallery rows may be a part),
    ``gallery_ids`` every item's id in gallery order, ``search(mode)`` the t=0 top-k of the
    log's queries (see :func:`log_query_side`)."""
    if int(k) < 1:
        raise BackfillInputError(f"the top-k of a query log needs k >= 1, got {k!r}")
    if log.kind == RESULTS:
        rows = _rows_of_ids(np.asarray(gallery_ids), log.keys)
        if (rows < 0).any():
            raise BackfillInputError(
                f"column {ITEM_ID!r} of query log {log.source}: {int((rows < 0).sum())} item "
                f"id(s) not in the gallery: {ids_preview(log.keys[rows < 0])}"
            )
        return LogSearches(log, 1, np.full(log.keys.size, -1, np.int64), fixed=rows[:, None])
    if data is None:
        raise BackfillInputError(
            f"query log {log.source}: searching its queries needs the gallery's embeddings (a "
            f"parquet gallery); a log of returned items ({ITEM_ID!r}) needs only their ids"
        )
    eval_rows = _rows_of_ids(np.asarray(data.query_ids), log.keys)
    if not log.vectors and (eval_rows < 0).any():
        raise BackfillInputError(
            f"column {QUERY_ID!r} of query log {log.source}: query ids "
            f"{ids_preview(log.keys[eval_rows < 0])} are not queries of the embeddings, and the "
            "log has no vectors ('new') to search them with"
        )
    for c, v in log.vectors.items():
        want = getattr(data, f"query_{c}")
        if want is not None and v.shape[1] != want.shape[1]:
            raise BackfillInputError(
                f"dimension mismatch: column {c!r} of query log {log.source} has dim "
                f"{v.shape[1]}, the embeddings' queries have {want.shape[1]}"
            )
    return LogSearches(log, int(k), eval_rows, search=search)


def _rows_of_ids(known: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Row in ``known`` of every id (-1 when absent)."""
    if known.size == 0:
        return np.full(ids.size, -1, np.int64)
    o = np.argsort(known, kind="stable")
    pos = np.minimum(np.searchsorted(known[o], ids), known.size - 1)
    return np.where(known[o][pos] == ids, o[pos], -1).astype(np.int64)


def log_query_side(log: QueryLog, data, eval_rows: np.ndarray, side_name: str) -> np.ndarray:
    """The query rows of score side ``side_name`` (the t=0 side of a mode) for the log's
    distinct queries: the evaluation queries' own rows when the log has no vectors, else the
    log's vectors through the same side construction."""
    from raycompat.upgrade.modes import SideBuilder

    if not log.vectors:
        return SideBuilder(data).side(side_name).queries[eval_rows]
    if side_name.split(":")[0] in ("rev-old", "rho-rho"):
        raise BackfillInputError(
            f"query log {log.source}: the rank_merge mode searches rho / psi_rev of the queries; "
            "give the evaluation queries' ids without vectors"
        )
    stand_in = data.with_arrays(
        query_new=log.vectors.get("new"),
        query_old=log.vectors.get("old"),
        query_labels=np.zeros(log.keys.size, np.int64),
        query_ids=log.keys,
        query_rho=None,
        query_rev=None,
    )
    try:
        return SideBuilder(stand_in).side(side_name).queries
    except BackfillInputError as exc:
        raise BackfillInputError(f"query log {log.source}: {exc}") from None


def memory_log_searches(
    log: QueryLog, data, builder=None, k: int = 10, distance: str = "sq_l2"
) -> LogSearches:
    """``log`` matched with in-memory embeddings (``data``, a
    :class:`~raycompat.embeddings.gallery.GalleryEmbeddings`; ``builder``: its shared
    :class:`~raycompat.upgrade.modes.SideBuilder`): each mode's t=0 top-k searched over the
    whole gallery side with :func:`block_topk`."""
    from raycompat.upgrade.modes import SideBuilder, mode_spec

    builder = builder if builder is not None else SideBuilder(data)
    holder: dict = {}

    def search(mode: str) -> np.ndarray:
        side = mode_spec(mode, distance).old_side
        queries = log_query_side(log, data, holder["reads"].eval_rows, side)
        return block_topk(queries, builder.side(side).gallery, 0, k)[1]

    holder["reads"] = log_searches(log, data, data.gallery_ids, k, search)
    return holder["reads"]
