"""Canonical scores: the one definition of "which item ranks first" shared by the backfill
simulator and the live index.

A float32 inner product depends on the order of its summation: faiss, a BLAS matrix product
on CPU and one on a GPU can return scores that differ in the last bits, and two items whose
scores are that close (near-ties, and equal vectors) can then swap places.  So that the
simulator (:mod:`raycompat.simulator.block_pass`) and the served index
(:mod:`raycompat.serving.shard_cache`) rank every item identically, both rank by the *canonical
score*

    c(q, g) = sum_k q_k g_k   in float64, over the float32 vectors q and g,

computed by :func:`pair_scores` only (each product of two float32 values is exact in float64;
the sum has a relative error near 1e-16), and break ties between equal canonical scores by
ascending gallery index / item id.  Fast float32 scores (a matrix product, faiss) still do
the bulk of the work: they are within :func:`float32_score_error` of the canonical score, so
they decide every pair that lies further apart than that, and only the pairs inside that
band are recomputed canonically (:func:`rerank_top_k` for a top-k search).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = [
    "pair_scores",
    "pair_scores_at",
    "dot_error_bound",
    "float32_score_error",
    "rerank_top_k",
]

_U32 = 2.0**-24  # unit roundoff of float32
_ROWS = 1 << 15  # pairs per float64 chunk


def pair_scores(queries: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Canonical scores of row pairs: float64 ``<queries[r], items[r]>`` for every r.

    The single routine every canonical score comes from: a pair's value does not depend on
    the other rows passed with it, so the simulator and the shards compute bit-identical
    scores for the same two float32 vectors."""
    a = np.asarray(queries)
    b = np.asarray(items)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(
            f"pair_scores needs two [n, dim] arrays of the same shape, got {a.shape} and {b.shape}"
        )
    out = np.empty(a.shape[0], dtype=np.float64)
    for s in range(0, a.shape[0], _ROWS):
        x = np.ascontiguousarray(a[s : s + _ROWS], dtype=np.float32).astype(np.float64)
        y = np.ascontiguousarray(b[s : s + _ROWS], dtype=np.float32).astype(np.float64)
        out[s : s + _ROWS] = np.einsum("ij,ij->i", x, y)
    return out


def pair_scores_at(
    queries: np.ndarray, query_rows: np.ndarray, items: np.ndarray, item_rows: np.ndarray
) -> np.ndarray:
    """:func:`pair_scores` of ``(queries[query_rows[r]], items[item_rows[r]])``, gathering the
    rows chunk by chunk (memory stays a few chunks, however many pairs)."""
    query_rows = np.asarray(query_rows, np.int64)
    item_rows = np.asarray(item_rows, np.int64)
    if query_rows.shape != item_rows.shape:
        raise ValueError(f"{query_rows.shape[0]} query rows but {item_rows.shape[0]} item rows")
    out = np.empty(query_rows.size, dtype=np.float64)
    step = _ROWS // 4
    for s in range(0, query_rows.size, step):
        out[s : s + step] = pair_scores(
            queries[query_rows[s : s + step]], items[item_rows[s : s + step]]
        )
    return out


def dot_error_bound(dim: int) -> float:
    """``gamma_D = D*u / (1 - D*u)`` (u = 2^-24): for any summation order (FMA or not),
    ``|fl(<a,b>) - <a,b>| <= gamma_D * sum_k |a_k b_k|`` for float32 inputs
    (Higham, Accuracy and Stability of Numerical Algorithms, Sec. 3.1)."""
    du = max(int(dim), 1) * _U32
    if du >= 0.5:
        raise ValueError(f"dimension {dim} too large for a float32 error bound")
    return du / (1.0 - du)


def float32_score_error(dim: int, query_norm, item_norm_max: float):
    """A guaranteed bound on ``|float32 score - canonical score|`` for a query of norm
    ``query_norm`` and items of norm at most ``item_norm_max``: the float32 error bound
    doubled (the doubling covers the canonical score's own float64 rounding, which is
    ~2^-29 times smaller)."""
    return (
        2.0 * dot_error_bound(dim) * np.asarray(query_norm, dtype=np.float64) * float(item_norm_max)
        + 1e-30
    )


def rerank_top_k(
    queries: np.ndarray,
    scores32: np.ndarray,
    ids: np.ndarray,
    k: int,
    vectors_of: Callable[[np.ndarray], np.ndarray],
    item_norm_max: float,
    complete: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The canonical top-k among float32 candidates ``(scores32, ids)`` ``[Q, F]`` (``-1``
    ids are empty slots): candidates re-scored with :func:`pair_scores`, sorted by
    (canonical score descending, id ascending).

    ``vectors_of(ids)`` returns the float32 item vectors.  ``complete``: the candidates
    are *all* the items (then every row is exact).  Otherwise row ``r`` is exact when the
    items that were not fetched cannot reach its k-th canonical score: the float32 scores
    of the unfetched items are at most the last candidate's (an exact float32 search), so
    ``last + error < k-th canonical`` proves it.

    Returns ``(scores float64 [Q, k], ids int64 [Q, k], exact bool [Q])``; slots past the
    available candidates hold ``-inf`` / ``-1``."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    n_q, fetch = ids.shape
    out_s = np.full((n_q, k), -np.inf)
    out_i = np.full((n_q, k), -1, np.int64)
    exact = np.ones(n_q, dtype=bool)
    if n_q == 0 or fetch == 0:
        return out_s, out_i, exact
    valid = ids >= 0
    canon = np.full(ids.shape, -np.inf)
    rows, cols = np.nonzero(valid)
    if rows.size:
        canon[rows, cols] = pair_scores(q[rows], vectors_of(ids[rows, cols]))
    key = np.where(valid, ids, np.iinfo(np.int64).max)
    order = np.lexsort((key, -canon), axis=-1)[:, :k]
    kk = order.shape[1]
    out_s[:, :kk] = np.take_along_axis(canon, order, axis=1)
    out_i[:, :kk] = np.where(np.isfinite(out_s[:, :kk]), np.take_along_axis(ids, order, axis=1), -1)
    if not complete:
        qn = np.sqrt(np.einsum("ij,ij->i", q.astype(np.float64), q.astype(np.float64)))
        err = float32_score_error(q.shape[1], qn, item_norm_max)
        s32 = np.where(valid, scores32, np.inf).astype(np.float64)
        last = s32.min(axis=1)  # lowest fetched float32 score
        kth = out_s[:, k - 1] if kk == k else np.full(n_q, -np.inf)
        exact = (valid.sum(axis=1) >= k) & (last + err < kth)
    return out_s, out_i, exact
