"""Full rankings by the canonical score: the ranking every static retrieval number comes from.

The backfill simulator and the live index rank items by the canonical score
(:mod:`raycompat.index.canonical`: float64 over the float32 vectors, ties by ascending gallery
index); a static evaluation ranked by float32 scores (faiss) can order exact float32 ties and
near-ties differently, and a report would then give two values of the same metric. So the
static evaluations rank by the canonical score too, query block by query block:

1. a float64 matrix product of the float32 vectors scores every pair within
   :func:`float64_score_error` of its canonical score (both are float64 sums of the same exact
   products, in other orders), and a stable sort orders the gallery by it;
2. two neighbours in that order whose scores lie more than twice that bound apart are in
   canonical order already; the runs of neighbours closer than that (exact and near ties) are
   re-scored with :func:`raycompat.index.canonical.pair_scores` and sorted by (canonical score
   descending, gallery index ascending).

The result is the canonical ranking whatever the BLAS's summation order. The cost is a float64
matrix product and a sort per query block (memory: a float64 copy of the gallery and
``max_bytes`` per block); runs are short unless the model has collapsed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from raycompat.index.canonical import pair_scores_at

__all__ = ["canonical_ranking", "float64_score_error", "iter_canonical_ranking"]

_U64 = 2.0**-53  # unit roundoff of float64
_DEFAULT_MAX_BYTES = 256 * 1024 * 1024


def float64_score_error(dim: int, query_norm, item_norm_max: float):
    """A bound on ``|float64 product score - canonical score|``: ``2 gamma_D |q| max|g|`` with
    ``gamma_D = D u / (1 - D u)``, u = 2^-53 (each of the two float64 sums lies within
    ``gamma_D sum_k |q_k g_k|`` of the exact value; Higham, Sec. 3.1)."""
    du = max(int(dim), 1) * _U64
    return 2.0 * du / (1.0 - du) * np.asarray(query_norm, np.float64) * float(item_norm_max)


def _checked(queries, gallery) -> tuple[np.ndarray, np.ndarray]:
    q = np.ascontiguousarray(queries, dtype=np.float32)
    g = np.ascontiguousarray(gallery, dtype=np.float32)
    if q.ndim != 2 or g.ndim != 2 or q.shape[1] != g.shape[1]:
        raise ValueError(
            f"canonical ranking needs [Q, dim] queries and an [N, dim] gallery of the same dim, "
            f"got {q.shape} and {g.shape}"
        )
    if g.shape[0] == 0:
        raise ValueError("gallery is empty: nothing to rank")
    for name, a in (("queries", q), ("gallery", g)):
        if a.size and not np.isfinite(a.sum(dtype=np.float64)):
            raise ValueError(f"{name} contain NaN or inf")
    return q, g


def _resolve_runs(order: np.ndarray, scores: np.ndarray, bound: np.ndarray, q, g, start: int):
    """Re-sort, in place, the runs of neighbours of ``order`` (rows sorted by float64
    ``scores``) that lie within ``2 * bound`` of each other, by (canonical score desc, index)."""
    link = (scores[:, :-1] - scores[:, 1:]) <= 2.0 * bound[:, None]  # [c, N-1]
    if not link.any():
        return
    member = np.zeros(order.shape, dtype=bool)
    member[:, :-1] |= link
    member[:, 1:] |= link
    first = member.copy()
    first[:, 1:] &= ~link  # a run starts where a member is not linked to the one before
    rows, cols = np.nonzero(member)  # row-major: every run is contiguous, in place order
    run = np.cumsum(first[rows, cols])
    ids = order[rows, cols]
    canon = pair_scores_at(q, rows + start, g, ids)
    order[rows, cols] = ids[np.lexsort((ids, -canon, run))]


def iter_canonical_ranking(
    queries, gallery, *, max_bytes: int = _DEFAULT_MAX_BYTES
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(start, ranks)``: int64 ``[c, N]`` gallery indices of queries ``start:start+c``
    by descending canonical score, ties by ascending index (see the module docstring).

    ``queries`` and ``gallery`` are scored as given (float32; L2-normalise them first for
    cosine). The chunks are what :func:`raycompat.metrics.map_full` consumes."""
    q, g = _checked(queries, gallery)
    g64t = g.astype(np.float64).T
    item_norm_max = float(np.sqrt(np.einsum("ij,ij->i", g64t.T, g64t.T).max()))
    rows = max(1, int(max_bytes // (24 * g.shape[0])))  # scores, order, sorted scores
    for start in range(0, q.shape[0], rows):
        q64 = q[start : start + rows].astype(np.float64)
        scores = q64 @ g64t
        order = np.argsort(-scores, axis=1, kind="stable")
        scores = np.take_along_axis(scores, order, axis=1)
        bound = float64_score_error(
            q.shape[1], np.sqrt(np.einsum("ij,ij->i", q64, q64)), item_norm_max
        )
        _resolve_runs(order, scores, bound, q, g, start)
        yield start, order


def canonical_ranking(queries, gallery, *, max_bytes: int = _DEFAULT_MAX_BYTES) -> np.ndarray:
    """int64 ``[Q, N]``: :func:`iter_canonical_ranking`'s chunks as one array."""
    q, g = _checked(queries, gallery)
    out = np.empty((q.shape[0], g.shape[0]), dtype=np.int64)
    for start, ranks in iter_canonical_ranking(q, g, max_bytes=max_bytes):
        out[start : start + ranks.shape[0]] = ranks
    return out
