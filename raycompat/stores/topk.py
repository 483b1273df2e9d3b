"""Top-k primitives shared by the stores (docs/stores.md#search): deterministic tie-breaking by
id, the merge of two result lists by score, and the numpy brute force they are tested against.

Every score is an inner product of float32 vectors; a larger score ranks first and equal scores
rank by ascending id. Rows with fewer than ``k`` matches are padded with id ``-1`` and score
``-inf``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from raycompat.stores.errors import StoreError

__all__ = [
    "PAD_ID",
    "SearchResult",
    "brute_force_topk",
    "compatible_brute_force",
    "merge_topk",
    "rank_candidates",
    "resolve_topk",
    "scores_topk",
]

PAD_ID = -1

#: A raw engine fetch: (query rows, limit) -> per query row, (ids, scores) of at most ``limit``
#: best candidates, in any order.
Fetch = Callable[[np.ndarray, int], Sequence[tuple[np.ndarray, np.ndarray]]]


@dataclass(frozen=True)
class SearchResult:
    """``ids`` int64 [nq, k] and ``scores`` float32 [nq, k], best first, ties by ascending id;
    missing hits are id -1 with score -inf (docs/stores.md#search)."""

    ids: np.ndarray
    scores: np.ndarray

    @property
    def k(self) -> int:
        """Columns per query."""
        return int(self.ids.shape[1])


def rank_candidates(ids: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates sorted by descending score, then ascending id."""
    ids = np.asarray(ids, dtype=np.int64)
    scores = np.asarray(scores, dtype=np.float32)
    order = np.lexsort((ids, -scores.astype(np.float64)))
    return ids[order], scores[order]


def _padded(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    out_ids = np.full(k, PAD_ID, dtype=np.int64)
    out_scores = np.full(k, -np.inf, dtype=np.float32)
    n = min(k, len(ids))
    out_ids[:n] = ids[:n]
    out_scores[:n] = scores[:n]
    return out_ids, out_scores


def resolve_topk(fetch: Fetch, nq: int, k: int, cap: int, where: str) -> SearchResult:
    """Exact top-``k`` per query with ties broken by id, from an engine that returns its top
    ``limit`` in arbitrary tie order: a query whose k-th score equals its last fetched score is
    fetched again with twice the limit, up to ``cap`` (the engine's largest limit, > k)."""
    if not 0 < k < cap:
        raise StoreError(f"{where}: k must be in 1..{cap - 1}, got {k}")
    ids = np.full((nq, k), PAD_ID, dtype=np.int64)
    scores = np.full((nq, k), -np.inf, dtype=np.float32)
    pending = np.arange(nq)
    limit = min(cap, k + max(8, k // 2))
    while len(pending):
        again = []
        for row, (cand_ids, cand_scores) in zip(pending, fetch(pending, limit), strict=True):
            cand_ids, cand_scores = rank_candidates(cand_ids, cand_scores)
            tied = len(cand_ids) >= limit and cand_scores[k - 1] == cand_scores[-1]
            if tied and limit < cap:
                again.append(row)
                continue
            if tied:
                raise StoreError(f"{where}: more than {cap} items tie at the k-th score")
            ids[row], scores[row] = _padded(cand_ids, cand_scores, k)
        pending = np.asarray(again, dtype=np.int64)
        limit = min(cap, limit * 2)
    return SearchResult(ids, scores)


def merge_topk(a: SearchResult, b: SearchResult, k: int) -> SearchResult:
    """The top-``k`` of the union of two results over disjoint item sets, by score then id."""
    nq = a.ids.shape[0]
    ids = np.full((nq, k), PAD_ID, dtype=np.int64)
    scores = np.full((nq, k), -np.inf, dtype=np.float32)
    for row in range(nq):
        cand_ids = np.concatenate([a.ids[row], b.ids[row]])
        cand_scores = np.concatenate([a.scores[row], b.scores[row]])
        keep = cand_ids != PAD_ID
        ranked = rank_candidates(cand_ids[keep], cand_scores[keep])
        ids[row], scores[row] = _padded(*ranked, k)
    return SearchResult(ids, scores)


def brute_force_topk(
    queries: np.ndarray, vectors: np.ndarray, item_ids: np.ndarray, k: int
) -> SearchResult:
    """The numpy reference: inner products of float32 ``queries`` [nq, d] and ``vectors``
    [n, d], top-``k`` by score then id."""
    sims = np.asarray(queries, np.float32) @ np.asarray(vectors, np.float32).T
    return scores_topk(sims, np.asarray(item_ids, np.int64), k)


def compatible_brute_force(
    new_queries: np.ndarray,
    old_queries: np.ndarray,
    new_vectors: np.ndarray,
    old_vectors: np.ndarray,
    upgraded: np.ndarray,
    item_ids: np.ndarray,
    k: int,
) -> SearchResult:
    """The numpy reference of compatible search of a half-upgraded gallery: an upgraded item
    scores ``new_query . new_vector``, any other ``old_query . old_vector``."""
    up = np.asarray(upgraded, bool)
    new_sims = np.asarray(new_queries, np.float32) @ np.asarray(new_vectors, np.float32).T
    old_sims = np.asarray(old_queries, np.float32) @ np.asarray(old_vectors, np.float32).T
    return scores_topk(np.where(up[None, :], new_sims, old_sims), np.asarray(item_ids), k)


def scores_topk(sims: np.ndarray, item_ids: np.ndarray, k: int) -> SearchResult:
    """Top-``k`` per row of a score matrix ``sims`` [nq, n] over ``item_ids`` [n], by score
    then id."""
    sims = np.asarray(sims, np.float32)
    ids = np.full((len(sims), k), PAD_ID, dtype=np.int64)
    scores = np.full((len(sims), k), -np.inf, dtype=np.float32)
    # each row's k-th largest score: only the items at or above it (ties included) are sorted
    kth = -np.partition(-sims, k - 1, axis=1)[:, k - 1] if sims.shape[1] > k else None
    for row, row_sims in enumerate(sims):
        keep = slice(None)
        if kth is not None and not np.isnan(kth[row]):
            keep = np.flatnonzero(row_sims >= kth[row])
        ranked = rank_candidates(item_ids[keep], row_sims[keep])
        ids[row], scores[row] = _padded(*ranked, k)
    return SearchResult(ids, scores)
