"""Searching a half-upgraded store the way an application does, in a query mode
(docs/stores.md#searching-in-a-query-mode).

Each mode scores an item by one of two *sides*, as the simulator and the live index do
(docs/methods.md, "Query strategies"): an upgraded item with the new model's query against its
new vector, any other item with a query side against its old vector.  The two result lists are
merged by score, ties by ascending id, so the answer is the exact top ``k`` of the mixed
gallery.

=============== ================================== ===========================================
mode            item not upgraded                  upgraded item
=============== ================================== ===========================================
``compatible``  ``unit(phi_n(q)[:D_old]) . old``   ``unit(phi_n(q)) . new``
``naive_merge`` ``unit(phi_o(q)) . old``           ``unit(phi_n(q)) . new``
``adapted``     ``unit(phi_n(q)) . unit(psi(old))`` ``unit(phi_n(q)) . new``
``fct``         ``unit(phi_n(q)) . unit(h(old))``   ``unit(phi_n(q)) . new``
``rank_merge``  ``unit(psi_rev(rho(q))) . old``    ``unit(rho(q)) . unit(rho(new))``
=============== ================================== ===========================================

The stored vectors are used as they are (write L2-normalised vectors: the inner product is
then the cosine).  Each side gives its candidates: a side over stored vectors through the
store's exact filtered search, a side over transformed vectors (psi, h, rho: a module of the
new model's bundle) by reading the vectors it needs in blocks and scoring them in numpy.  The
candidates of both sides are then scored again in float64 from their vectors and ranked, as
the simulator ranks near ties (float32 scores of two items can tie or swap where their exact
scores differ), so the answer is the simulator's ranking.  ``cold``
has no mixed form: search ``"old"`` until every item is upgraded, then ``"new"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from raycompat.index.search import l2_normalize
from raycompat.stores.base import Filter, VectorStore
from raycompat.stores.errors import StoreError
from raycompat.stores.topk import SearchResult, merge_topk, scores_topk

__all__ = ["STORE_MODES", "StoreQueries", "search", "search_field"]

#: the modes a store can be searched in, and the bundle modules each needs
STORE_MODES: Mapping[str, tuple[str, ...]] = {
    "compatible": (),
    "naive_merge": (),
    "adapted": ("psi",),
    "fct": ("fct",),
    "rank_merge": ("rho", "psi_rev"),
}


@dataclass(frozen=True)
class StoreQueries:
    """The queries, embedded: ``new`` by the new model [nq, d_new]; ``old`` by the old model
    [nq, d_old] (``naive_merge`` only)."""

    new: np.ndarray
    old: np.ndarray | None = None


def search(
    store: VectorStore,
    queries: StoreQueries,
    k: int,
    mode: str = "compatible",
    *,
    bundle=None,
    filter: Filter | str | None = None,
    block_rows: int = 65536,
) -> SearchResult:
    """The exact top-``k`` of ``store`` in ``mode`` (see the module docstring); ``bundle``: the
    new model's :class:`raycompat.models.ModelBundle`, for the modes that transform vectors
    (psi, h, rho and psi_rev); ``filter``: labels, ids or an expression (not ``upgraded``)."""
    sides = _sides(store, queries, mode, _modules(mode, bundle))
    flt = store._filter(filter)
    if flt.upgraded is not None:
        raise StoreError(f"{store.where}: a mode search filters on upgraded itself")
    fetch = min(k + max(8, k // 2), store.max_search_limit - 1)
    if sides[0].transform is None and sides[1].transform is None:
        # both sides over stored vectors: one merged search (Milvus: one hybrid_search)
        merged = store.search_compatible(sides[1].queries, sides[0].queries, fetch, filter=flt)
        return _rescored(store, sides, [merged.ids], k)
    candidates = [
        _side_candidates(store, side, fetch, flt.and_upgraded(up), block_rows)
        for up, side in ((False, sides[0]), (True, sides[1]))
    ]
    return _rescored(store, sides, candidates, k)


def search_field(
    store: VectorStore,
    field: str,
    queries: np.ndarray,
    k: int,
    *,
    filter: Filter | str | None = None,
) -> SearchResult:
    """The exact top-``k`` of one vector field by ``unit(queries) . vector`` (``"old"``: every
    item the filter lets through, upgraded or not; ``"new"``: the upgraded ones), ranked as
    :func:`search` ranks: the store's exact candidates scored again in float64, ties by
    ascending id.  The canary's old-old reference (the old model's queries against the
    all-old gallery) is ``search_field(store, "old", old_queries, k)``."""
    side = _Side(_unit(queries, "queries"), field)
    flt = store._filter(filter)
    fetch = min(k + max(8, k // 2), store.max_search_limit - 1)
    candidates = store.search(field, side.queries, fetch, filter=flt).ids
    return _rescored(store, (side, side), [candidates], k)


@dataclass(frozen=True)
class _Side:
    """Queries [nq, d] (unit rows) against ``field``'s vectors, through ``transform`` (a
    bundle module, as :class:`raycompat.models.FeatureMap` s built once: the exact float64
    map and a float32 one for finding candidates) if set."""

    queries: np.ndarray
    field: str
    transform: object = None
    quick_transform: object = None

    def vectors(self, stored: np.ndarray, where: str, *, exact: bool = True) -> np.ndarray:
        if self.transform is None:
            return np.asarray(stored, np.float32)
        fmap = self.transform if exact else self.quick_transform
        return _unit(fmap(stored), f"{self.field} vectors of {where}")


def _sides(store: VectorStore, queries: StoreQueries, mode: str, modules: dict):
    """``(side of items not upgraded, side of upgraded items)`` of ``mode``."""
    new_q = _unit(queries.new, "queries.new")
    new_side = _Side(new_q, "new")
    if mode == "compatible":
        old_dim = store.old_dim or 0
        if new_q.shape[1] < old_dim:
            raise StoreError(
                f"mode 'compatible' compares phi_n(q)[:D_old] with the old vectors of "
                f"{store.where}: the new queries have {new_q.shape[1]} dims, D_old is {old_dim}"
            )
        cut = np.ascontiguousarray(np.asarray(queries.new, np.float32)[:, :old_dim])
        return _Side(_unit(cut, "queries.new[:, :D_old]"), "old"), new_side
    if mode == "naive_merge":
        if queries.old is None:
            raise StoreError("mode 'naive_merge' needs the old model's queries (queries.old)")
        return _Side(_unit(queries.old, "queries.old"), "old"), new_side
    if mode in ("adapted", "fct"):
        return _Side(new_q, "old", *_feature_maps(modules[STORE_MODES[mode][0]])), new_side
    rho, quick_rho = _feature_maps(modules["rho"])
    rho_q = rho(np.asarray(queries.new, np.float32))
    rev_q = _unit(_feature_maps(modules["psi_rev"])[0](rho_q), "psi_rev(rho(queries.new))")
    return _Side(rev_q, "old"), _Side(_unit(rho_q, "rho(queries.new)"), "new", rho, quick_rho)


def _side_candidates(store: VectorStore, side: _Side, k: int, flt: Filter, rows: int) -> np.ndarray:
    """Ids [nq, k] (-1 padded) of a side's best items by float32 score (vectors through the
    float32 map: the candidates are scored again exactly, as a store search's are)."""
    if side.transform is None:
        return store.search(side.field, side.queries, k, filter=flt).ids
    best = SearchResult(
        np.full((len(side.queries), k), -1, np.int64),
        np.full((len(side.queries), k), -np.inf, np.float32),
    )
    for block in store.scan_blocks(("id", side.field), block_rows=rows, filter=flt):
        if len(block["id"]):
            sims = side.queries @ side.vectors(block[side.field], store.where, exact=False).T
            best = merge_topk(best, scores_topk(sims, block["id"], k), k)
    return best.ids


def _rescored(store: VectorStore, sides, candidates: list[np.ndarray], k: int) -> SearchResult:
    """The top-``k`` of both sides' candidates by their float64 scores, ties by id."""
    ids = np.unique(np.concatenate([c[c >= 0] for c in candidates]))
    vectors = _candidate_vectors(store, sides, ids) if ids.size else {}
    nq = len(sides[0].queries)
    out_ids = np.full((nq, k), -1, np.int64)
    out_scores = np.full((nq, k), -np.inf, np.float32)
    for row in range(nq):
        cand = np.unique(np.concatenate([c[row][c[row] >= 0] for c in candidates]))
        if not cand.size:
            continue
        scores = np.array(
            [vectors[i][1] @ sides[int(vectors[i][0])].queries[row].astype(np.float64)
             for i in cand.tolist()]
        )  # fmt: skip
        order = np.lexsort((cand, -scores))[:k]
        out_ids[row, : order.size] = cand[order]
        out_scores[row, : order.size] = scores[order]
    return SearchResult(out_ids, out_scores)


def _candidate_vectors(store: VectorStore, sides, ids: np.ndarray) -> dict:
    """``{id: (upgraded, float64 vector of its side)}`` of the candidates ``ids``, from one
    read of their rows (the upgraded flag, or the position where only it is mapped)."""
    flag = "upgraded" if store.columns.upgraded else "position"
    fields = tuple(dict.fromkeys(side.field for side in sides))
    out = {}
    for block in store.read_blocks(("id", flag, *fields), filter=Filter(ids=tuple(ids.tolist()))):
        upgraded = block[flag] if flag == "upgraded" else block[flag] >= 0
        for up in (False, True):
            rows = np.flatnonzero(upgraded == up)
            side = sides[int(up)]
            vecs = side.vectors(block[side.field][rows], store.where).astype(np.float64)
            out.update((i, (up, v)) for i, v in zip(block["id"][rows].tolist(), vecs, strict=True))
    return out


def _modules(mode: str, bundle) -> dict:
    if mode not in STORE_MODES:
        extra = " (cold has no mixed form: search 'old', then 'new')" if mode == "cold" else ""
        raise StoreError(f"unknown store search mode {mode!r}{extra}; known: {list(STORE_MODES)}")
    needed = STORE_MODES[mode]
    have = getattr(bundle, "modules", None) or {}
    missing = [m for m in needed if m not in have]
    if missing:
        raise StoreError(
            f"mode {mode!r} needs the new model's bundle with module(s) {missing}"
            + ("" if bundle is None else f"; the bundle has {sorted(have)}")
        )
    return {m: have[m] for m in needed}


def _unit(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if x.ndim != 2:
        raise StoreError(f"{what}: expected a 2-D array [queries, dims], got shape {x.shape}")
    try:
        return l2_normalize(x)
    except ValueError as exc:
        raise StoreError(f"{what}: {exc}") from None


def _feature_maps(module):
    """The exact (float64) and the quick (float32) :class:`raycompat.models.FeatureMap`."""
    from raycompat.models import FeatureMap

    return FeatureMap(module), FeatureMap(module, exact=False)
