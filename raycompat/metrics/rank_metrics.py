"""Curve metrics from the ranks of the positive pairs (docs/methods.md, "Metrics").

Every metric of a backfill curve -- mAP@k, revisited full mAP, top-1, NFR@1 -- is a function of
the 0-based ranks of each query's positives (same-label gallery items, :func:`positive_pairs`);
the formulas are those of :mod:`raycompat.metrics`, rebuilt here from ranks for stacked grid
points (docs/methods.md, "Curves of the simulator").
"""

from __future__ import annotations

import numpy as np

from raycompat.metrics import (
    correct_at_k,
    mean_average_precision_at_k,
    negative_flip_rate,
)

__all__ = ["METRIC_NAMES", "positive_pairs", "full_ap_from_ranks", "metrics_from_ranks"]


def METRIC_NAMES(k: int) -> tuple[str, str, str, str]:
    """Metric keys of a curve: ``mAP@k``, ``mAP`` (revisited full), ``top1``, ``NFR@1``."""
    return (f"mAP@{k}", "mAP", "top1", "NFR@1")


def positive_pairs(query_labels, gallery_labels) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All (query, gallery item) pairs with equal labels, sorted by query then item.

    Returns ``(pairs_q, pairs_i, npos)`` (int64).  Relevance is label equality,
    as in :func:`raycompat.metrics.relevance_from_labels`.
    """
    ql = np.asarray(query_labels)
    gl = np.asarray(gallery_labels)
    if ql.ndim != 1 or gl.ndim != 1:
        raise ValueError("labels must be 1-D")
    both = np.concatenate([ql, gl]) if ql.dtype != gl.dtype else None
    if both is not None:
        ql, gl = both[: ql.size], both[ql.size :]
    order = np.argsort(gl, kind="stable")
    sl = gl[order]
    lo = np.searchsorted(sl, ql, side="left")
    hi = np.searchsorted(sl, ql, side="right")
    npos = (hi - lo).astype(np.int64)
    total = int(npos.sum())
    pq = np.repeat(np.arange(ql.size, dtype=np.int64), npos)
    start = np.repeat(lo.astype(np.int64), npos)
    first = np.repeat(np.cumsum(npos) - npos, npos)
    pi = order[start + (np.arange(total, dtype=np.int64) - first)].astype(np.int64)
    return pq, pi, npos


def full_ap_from_ranks(ranks: np.ndarray, pairs_q: np.ndarray, npos: np.ndarray) -> np.ndarray:
    """Revisited-protocol AP per query (trapezoids, docs/methods.md, "Metrics") for stacked grid
    points.

    ``ranks``: ``[J, P]`` 0-based ranks of the positive pairs (pairs grouped by
    query, as from :func:`positive_pairs`).  Returns float64 ``[J, Q]`` with
    ``nan`` for queries without positives.  Bit-identical to
    :func:`raycompat.metrics.average_precision_from_ranks` (same elementwise
    formula and the same row-wise summation, grouped by number of positives).
    """
    ranks = np.atleast_2d(ranks)
    J = ranks.shape[0]
    n_q = npos.size
    out = np.full((J, n_q), np.nan)
    off = np.concatenate([[0], np.cumsum(npos)])
    for n in np.unique(npos[npos > 0]):
        qs = np.flatnonzero(npos == n)
        idx = off[qs][:, None] + np.arange(n)[None, :]
        # C-contiguous rows: numpy then sums each row pairwise exactly like a 1-D sum
        r = np.ascontiguousarray(np.sort(ranks[:, idx].astype(np.float64), axis=-1))  # [J, |qs|, n]
        j = np.arange(n, dtype=np.float64)
        prec0 = np.where(r == 0, 1.0, j / np.where(r == 0, 1.0, r))
        prec1 = (j + 1.0) / (r + 1.0)
        terms = np.ascontiguousarray((prec0 + prec1) / 2.0)
        out[:, qs] = terms.sum(axis=-1) / int(n)
    return out


def _mean_valid(x: np.ndarray, valid: np.ndarray) -> float:
    v = x[valid]
    return float(v.mean()) if v.size else float("nan")


def metrics_from_ranks(
    ranks: np.ndarray,
    pairs_q: np.ndarray,
    npos: np.ndarray,
    k: int,
    reference_correct: np.ndarray | None = None,
    *,
    return_per_query: bool = False,
):
    """Curve metrics at every grid point from the positives' ranks ``[J, P]``.

    * ``mAP@k`` -- :func:`raycompat.metrics.mean_average_precision_at_k` on the
      top-k relevance rebuilt from the ranks (GLDv2 AP@k);
    * ``mAP``   -- revisited full mAP (:func:`full_ap_from_ranks`), queries
      without positives excluded;
    * ``top1``  -- CMC top-1 over queries with positives;
    * ``NFR@1`` -- RACT Eq.12 against ``reference_correct`` (top-1 correctness
      under old-old), :func:`raycompat.metrics.negative_flip_rate`; ``nan``
      without a reference.

    Returns ``{metric: float64 [J]}`` (and per-query arrays with
    ``return_per_query``: ``ap@k`` [J, Q], ``ap`` [J, Q], ``correct1`` [J, Q]).
    """
    ranks = np.atleast_2d(ranks)
    J = ranks.shape[0]
    n_q = npos.size
    valid = npos > 0
    names = METRIC_NAMES(k)
    out = {n: np.empty(J) for n in names}
    aps_full = full_ap_from_ranks(ranks, pairs_q, npos)
    per = {"ap@k": np.empty((J, n_q)), "ap": aps_full, "correct1": np.empty((J, n_q), dtype=bool)}
    for j in range(J):
        rel = np.zeros((n_q, k), dtype=bool)
        sel = ranks[j] < k
        rel[pairs_q[sel], ranks[j][sel]] = True
        out[names[0]][j] = mean_average_precision_at_k(rel, npos, k)
        if return_per_query:
            from raycompat.metrics import average_precision_at_k

            per["ap@k"][j] = average_precision_at_k(rel, npos, k)
        out[names[1]][j] = _mean_valid(aps_full[j], valid)
        c1 = correct_at_k(rel, 1)
        per["correct1"][j] = c1
        out[names[2]][j] = _mean_valid(c1.astype(np.float64), valid)
        out[names[3]][j] = (
            negative_flip_rate(reference_correct, c1)
            if reference_correct is not None
            else float("nan")
        )
    return (out, per) if return_per_query else out
