"""Retrieval metrics: AP@k / mAP@k, revisited full mAP, CMC / Recall@k, NFR.

Specification: docs/methods.md, section "Metrics".  All functions are vectorised
numpy.  Conventions used throughout:

* Relevance comes from labels: gallery item ``g`` is relevant to query ``q``
  iff ``gallery_labels[g] == query_labels[q]``; optional *junk* items are
  removed from the ranking before scoring (they neither count nor shift ranks).
* A ranking is an int array ``[Q, L]`` of gallery indices, best first
  (from :func:`raycompat.index.exact_search` or ``full_ranking``).  The padding
  index ``-1`` (k larger than the gallery) is never relevant.
* Metrics are fractions in [0, 1] (not percentages).
* Queries with no relevant item in the gallery are *excluded* from every mean
  (AP@k, mAP, top-k), as in the revisited Oxford/Paris protocol; their
  per-query AP is ``nan``.  If no query has a relevant item the mean is ``nan``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "relevance_from_labels",
    "num_relevant_from_labels",
    "average_precision_at_k",
    "mean_average_precision_at_k",
    "average_precision_from_ranks",
    "revisited_average_precision",
    "revisited_map",
    "revisited_easy_medium_hard",
    "map_full",
    "correct_at_k",
    "cmc_top_k",
    "recall_at_k",
    "negative_flips",
    "negative_flip_rate",
    "evaluate_ranking",
    "evaluate_retrieval",
]

_CHUNK_ELEMENTS = 1 << 22  # entries of a [chunk, N] working array


# --------------------------------------------------------------------------- helpers
def _as_ranking(ranked_indices, n_gallery: int | None = None) -> np.ndarray:
    r = np.asarray(ranked_indices)
    if r.ndim != 2:
        raise ValueError(f"ranked indices must be 2-D [Q, k], got shape {r.shape}")
    if r.dtype.kind not in "iu":
        raise ValueError(f"ranked indices must be integers, got dtype {r.dtype}")
    r = r.astype(np.int64, copy=False)
    if r.size:
        if r.min() < -1:
            raise ValueError("ranked indices must be >= -1 (-1 marks padding)")
        if n_gallery is not None and r.max() >= n_gallery:
            raise ValueError(
                f"ranked index {int(r.max())} out of range for a gallery of {n_gallery} items"
            )
    return r


def _as_relevance(ranked_relevance) -> np.ndarray:
    rel = np.asarray(ranked_relevance)
    if rel.ndim != 2:
        raise ValueError(f"ranked_relevance must be 2-D [Q, k], got shape {rel.shape}")
    if rel.dtype != bool:
        if rel.size and not np.isin(rel, (0, 1)).all():
            raise ValueError("ranked_relevance must be boolean (or 0/1)")
        rel = rel.astype(bool)
    return rel


def _labels(query_labels, gallery_labels) -> tuple[np.ndarray, np.ndarray]:
    ql = np.asarray(query_labels)
    gl = np.asarray(gallery_labels)
    if ql.ndim != 1 or gl.ndim != 1:
        raise ValueError(
            f"labels must be 1-D, got query_labels {ql.shape}, gallery_labels {gl.shape}"
        )
    return ql, gl


def _check_k(k, name: str = "k") -> int:
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k <= 0:
        raise ValueError(f"{name} must be a positive integer, got {k!r}")
    return int(k)


def _nanmean_or_nan(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    valid = ~np.isnan(x)
    return float(x[valid].mean()) if valid.any() else float("nan")


def _junk_rows(junk_mask, rows: slice, n_queries: int, n_gallery: int) -> np.ndarray | None:
    """Junk mask for a chunk of queries: [N] (shared) or [Q, N] (per query)."""
    if junk_mask is None:
        return None
    j = np.asarray(junk_mask, dtype=bool)
    if j.shape == (n_gallery,):
        return j[None, :]
    if j.shape == (n_queries, n_gallery):
        return j[rows]
    raise ValueError(
        f"junk_mask must have shape [N]=({n_gallery},) or [Q, N]=({n_queries}, {n_gallery}), "
        f"got {j.shape}"
    )


def relevance_from_labels(ranked_indices, query_labels, gallery_labels) -> np.ndarray:
    """Boolean ``[Q, k]``: is the item at each rank relevant (same label)?

    Padding entries (index ``-1``) are not relevant.
    """
    ql, gl = _labels(query_labels, gallery_labels)
    r = _as_ranking(ranked_indices, gl.shape[0])
    if r.shape[0] != ql.shape[0]:
        raise ValueError(f"ranking has {r.shape[0]} rows but there are {ql.shape[0]} query labels")
    valid = r >= 0
    return valid & (gl[np.where(valid, r, 0)] == ql[:, None])


def num_relevant_from_labels(query_labels, gallery_labels, junk_mask=None) -> np.ndarray:
    """Number ``m`` of relevant (same-label, non-junk) gallery items per query, int64 ``[Q]``.

    ``junk_mask``: bool ``[N]`` or ``[Q, N]``; junk items are not counted.
    """
    ql, gl = _labels(query_labels, gallery_labels)
    if junk_mask is None:
        if gl.size == 0:
            return np.zeros(ql.shape[0], dtype=np.int64)
        uniq, counts = np.unique(gl, return_counts=True)
        pos = np.minimum(np.searchsorted(uniq, ql), uniq.size - 1)
        return np.where(uniq[pos] == ql, counts[pos], 0).astype(np.int64)
    n_q, n_g = ql.shape[0], gl.shape[0]
    out = np.empty(n_q, dtype=np.int64)
    step = max(1, _CHUNK_ELEMENTS // max(n_g, 1))
    for s in range(0, n_q, step):
        sl = slice(s, s + step)
        junk = _junk_rows(junk_mask, sl, n_q, n_g)
        out[sl] = ((gl[None, :] == ql[sl, None]) & ~junk).sum(axis=1)
    return out


# --------------------------------------------------------------------------- AP@k
def average_precision_at_k(ranked_relevance, num_relevant, k: int | None = None) -> np.ndarray:
    """Per-query AP@k, GLDv2 definition (docs/methods.md, "Metrics"; RACT uses mAP@100).

    ``AP@k = (1 / min(m, k)) * sum_{i<=k} P(i) * rel(i)`` where ``P(i)`` is the
    precision at rank i and ``m`` the number of relevant items in the gallery.

    Args:
        ranked_relevance: bool ``[Q, L]``, relevance of the ranked list.
        num_relevant: ``m`` per query ``[Q]`` (see :func:`num_relevant_from_labels`).
        k: cut-off; default ``L``.  If ``k > L`` (a list shorter than k, e.g. a
            gallery smaller than k) the missing ranks count as non-relevant and
            the normaliser is still ``min(m, k)``.

    Returns:
        float64 ``[Q]``; ``nan`` where ``m == 0`` (AP undefined: such queries
        are excluded from the mean, see :func:`mean_average_precision_at_k`).
    """
    rel = _as_relevance(ranked_relevance)
    m = np.asarray(num_relevant)
    if m.shape != (rel.shape[0],):
        raise ValueError(f"num_relevant must have shape ({rel.shape[0]},), got {m.shape}")
    if m.size and (m < 0).any():
        raise ValueError("num_relevant must be >= 0")
    k = rel.shape[1] if k is None else _check_k(k)
    rel = rel[:, :k]
    hits = np.cumsum(rel, axis=1, dtype=np.float64)
    prec = hits / np.arange(1, rel.shape[1] + 1, dtype=np.float64)
    s = (prec * rel).sum(axis=1)
    denom = np.minimum(m, k).astype(np.float64)
    if rel.size and (rel.sum(axis=1) > denom).any():
        raise ValueError("a ranked list has more relevant items than num_relevant allows")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, s / np.where(denom > 0, denom, 1.0), np.nan)


def mean_average_precision_at_k(ranked_relevance, num_relevant, k: int | None = None) -> float:
    """mAP@k: mean of :func:`average_precision_at_k` over queries with ``m > 0``.

    Queries without any relevant gallery item are excluded (not counted as 0);
    returns ``nan`` if no query has one.
    """
    return _nanmean_or_nan(average_precision_at_k(ranked_relevance, num_relevant, k))


# --------------------------------------------------------------------------- revisited mAP
def average_precision_from_ranks(ranks, npos: int) -> float:
    """AP of one query by trapezoids, revisited Oxford/Paris protocol (docs/methods.md, "Metrics").

    ``AP = sum_j (prec_0 + prec_1) / 2 * (1 / npos)`` over the positives
    j = 0, 1, ... in rank order, with ``prec_0 = j / rank`` (1 if rank == 0) and
    ``prec_1 = (j + 1) / (rank + 1)``.

    Args:
        ranks: 0-based ranks of the retrieved positives in the ranking *after
            junk removal* (sorted or not; they are sorted here).
        npos: total number of positives (positives missing from the ranking
            contribute 0).

    Returns:
        float AP; ``nan`` when ``npos == 0`` (query excluded from the mean).
    """
    r = np.sort(np.asarray(ranks, dtype=np.float64).ravel())
    if npos < 0 or r.size > npos:
        raise ValueError(f"npos={npos} is smaller than the number of ranks given ({r.size})")
    if npos == 0:
        return float("nan")
    j = np.arange(r.size, dtype=np.float64)
    prec0 = np.where(r == 0, 1.0, j / np.where(r == 0, 1.0, r))
    prec1 = (j + 1.0) / (r + 1.0)
    return float(((prec0 + prec1) / 2.0).sum() / npos)


def _trapezoid_ap(pos: np.ndarray, junk: np.ndarray | None, npos: np.ndarray) -> np.ndarray:
    """Vectorised revisited AP over a chunk.

    pos, junk: bool [c, L] masks over the ranked list (junk already excludes
    padding).  Junk wins over pos.  npos: [c].
    """
    if junk is not None:
        pos = pos & ~junk
        valid = ~junk
    else:
        valid = np.ones_like(pos)
    # rank after junk removal (0-based) and index j of each positive
    new_rank = np.cumsum(valid, axis=1, dtype=np.float64) - 1.0
    j = np.cumsum(pos, axis=1, dtype=np.float64) - 1.0
    safe_rank = np.where(new_rank > 0, new_rank, 1.0)
    prec0 = np.where(new_rank == 0, 1.0, j / safe_rank)
    prec1 = (j + 1.0) / (np.maximum(new_rank, 0.0) + 1.0)  # junk-led rows: masked anyway
    contrib = np.where(pos, (prec0 + prec1) / 2.0, 0.0).sum(axis=1)
    npos = np.asarray(npos, dtype=np.float64)
    if (pos.sum(axis=1) > npos).any():
        raise ValueError("a ranking lists more positives than npos allows")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(npos > 0, contrib / np.where(npos > 0, npos, 1.0), np.nan)


def revisited_average_precision(ranking, positives, junk=None) -> np.ndarray:
    """Per-query revisited-protocol AP (trapezoids) from per-query index lists.

    Args:
        ranking: int ``[Q, L]`` gallery indices, best first (usually the full
            ranking, L = N; a partial ranking scores missing positives as 0).
        positives: sequence of Q arrays of positive gallery indices.
        junk: optional sequence of Q arrays of junk gallery indices, removed
            from the ranking before scoring.  An item listed as both positive
            and junk is treated as junk (the official ground truth never
            overlaps; revisitop's code would keep it as a positive).

    Returns:
        float64 ``[Q]``; ``nan`` for queries without positives (excluded).
    """
    r = _as_ranking(ranking)
    n_q = r.shape[0]
    if len(positives) != n_q or (junk is not None and len(junk) != n_q):
        raise ValueError(
            f"need one positives (and junk) list per query: ranking has {n_q} rows, "
            f"got {len(positives)} positives lists"
            + ("" if junk is None else f" and {len(junk)} junk lists")
        )
    out = np.empty(n_q, dtype=np.float64)
    for i in range(n_q):
        pos_set = np.unique(np.asarray(positives[i], dtype=np.int64))
        junk_set = None if junk is None else np.unique(np.asarray(junk[i], dtype=np.int64))
        row = r[i : i + 1]
        pmask = np.isin(row, pos_set) & (row >= 0)
        jmask = None
        if junk_set is not None and junk_set.size:
            jmask = np.isin(row, junk_set) & (row >= 0)
            pos_set = np.setdiff1d(pos_set, junk_set)
        out[i] = _trapezoid_ap(pmask, jmask, np.array([pos_set.size]))[0]
    return out


def revisited_map(ranking, positives, junk=None) -> tuple[float, np.ndarray]:
    """Full mAP, revisited Oxford/Paris protocol (docs/methods.md, "Metrics").

    Junk removed from the ranking, AP by trapezoids
    (:func:`average_precision_from_ranks`), queries without positives excluded.

    Returns:
        ``(mAP, per_query_ap)``; mAP is ``nan`` if no query has a positive.
    """
    aps = revisited_average_precision(ranking, positives, junk)
    return _nanmean_or_nan(aps), aps


def revisited_easy_medium_hard(ranking, easy, hard, junk) -> dict[str, float]:
    """mAP under the revisited Easy / Medium / Hard ground-truth settings.

    Per query, ``easy``, ``hard`` and ``junk`` are gallery-index lists:

    * Easy:   positives = easy,        junk = junk + hard
    * Medium: positives = easy + hard, junk = junk
    * Hard:   positives = hard,        junk = junk + easy

    Returns ``{"easy": mAP, "medium": mAP, "hard": mAP}`` (python floats).
    """
    n = len(easy)
    if len(hard) != n or len(junk) != n:
        raise ValueError(
            f"easy/hard/junk must have one list per query, got {len(easy)}/{len(hard)}/{len(junk)}"
        )

    def cat(a, b):
        return [
            np.concatenate([np.asarray(x, np.int64), np.asarray(y, np.int64)])
            for x, y in zip(a, b, strict=False)
        ]

    return {
        "easy": revisited_map(ranking, easy, cat(junk, hard))[0],
        "medium": revisited_map(ranking, cat(easy, hard), junk)[0],
        "hard": revisited_map(ranking, hard, cat(junk, easy))[0],
    }


def map_full(
    full_ranking_indices,
    query_labels,
    gallery_labels,
    junk_mask=None,
    *,
    return_per_query: bool = False,
):
    """Label-based full mAP under the revisited protocol (trapezoid AP).

    Positives are same-label gallery items that are not junk; junk items are
    removed from the ranking (junk wins over a same-label match: this is how
    to exclude e.g. the query's own image when queries are in the gallery).
    Queries without positives are excluded from the mean.

    Args:
        full_ranking_indices: int ``[Q, L]`` ranking, or an iterable of
            ``(start, ranks_chunk)`` pairs as yielded by
            :func:`raycompat.index.iter_full_ranking` (bounded memory).
        query_labels: ``[Q]``; gallery_labels: ``[N]``.
        junk_mask: optional bool ``[N]`` or ``[Q, N]`` in gallery-index space.
        return_per_query: also return the per-query AP array (nan = excluded).

    Returns:
        mAP as a python float (``nan`` if no query has a positive), or
        ``(mAP, per_query_ap)``.
    """
    ql, gl = _labels(query_labels, gallery_labels)
    n_q, n_g = ql.shape[0], gl.shape[0]
    npos = num_relevant_from_labels(ql, gl, junk_mask)
    aps = np.full(n_q, np.nan)
    if isinstance(full_ranking_indices, np.ndarray) or (
        isinstance(full_ranking_indices, (list, tuple))
        and not (len(full_ranking_indices) and isinstance(full_ranking_indices[0], tuple))
    ):
        r_all = _as_ranking(full_ranking_indices, n_g)
        if r_all.shape[0] != n_q:
            raise ValueError(f"ranking has {r_all.shape[0]} rows but there are {n_q} query labels")
        step = max(1, _CHUNK_ELEMENTS // max(r_all.shape[1], 1))
        chunks: Iterable = ((s, r_all[s : s + step]) for s in range(0, n_q, step))
    else:
        chunks = full_ranking_indices
    seen = 0
    for item in chunks:
        start, r = item[0], _as_ranking(item[1], n_g)
        c = r.shape[0]
        if start < 0 or start + c > n_q:
            raise ValueError(
                f"ranking chunk rows {start}:{start + c} out of range for {n_q} queries"
            )
        sl = slice(start, start + c)
        valid = r >= 0
        safe = np.where(valid, r, 0)
        pos = valid & (gl[safe] == ql[sl, None])
        junk = ~valid
        jm = _junk_rows(junk_mask, sl, n_q, n_g)
        if jm is not None:
            jrows = np.broadcast_to(jm, (c, n_g))
            junk = junk | np.take_along_axis(jrows, safe, axis=1)
        aps[sl] = _trapezoid_ap(pos, junk, npos[sl])
        seen += c
    if seen != n_q:
        raise ValueError(f"ranking chunks covered {seen} rows, expected {n_q}")
    m = _nanmean_or_nan(aps)
    return (m, aps) if return_per_query else m


# --------------------------------------------------------------------------- CMC / NFR
def correct_at_k(ranked_relevance, k: int = 1) -> np.ndarray:
    """Bool ``[Q]``: a relevant item is within the top k (CMC top-k / Recall@k).

    If the list has fewer than k columns, all of them are used.
    """
    rel = _as_relevance(ranked_relevance)
    k = _check_k(k)
    return rel[:, :k].any(axis=1)


def cmc_top_k(
    ranked_relevance, ks: Sequence[int] = (1, 5, 10), num_relevant=None
) -> dict[int, float]:
    """CMC top-k accuracy for each k in ``ks`` (docs/methods.md, "Metrics").

    A query is correct at k if a relevant item is in its top k.  When
    ``num_relevant`` is given, queries with ``m == 0`` are excluded (as in the
    mAP); otherwise every query counts.  Returns ``{k: fraction}`` (``nan``
    when no query is left).
    """
    rel = _as_relevance(ranked_relevance)
    keep = np.ones(rel.shape[0], dtype=bool)
    if num_relevant is not None:
        m = np.asarray(num_relevant)
        if m.shape != (rel.shape[0],):
            raise ValueError(f"num_relevant must have shape ({rel.shape[0]},), got {m.shape}")
        keep = m > 0
    out = {}
    for k in ks:
        c = correct_at_k(rel, k)[keep]
        out[int(k)] = float(c.mean()) if c.size else float("nan")
    return out


def recall_at_k(ranked_relevance, k: int = 1, num_relevant=None) -> float:
    """Recall@k in the retrieval sense (= CMC top-k): fraction of queries with a
    relevant item in the top k; see :func:`cmc_top_k` for the exclusion rule."""
    return cmc_top_k(ranked_relevance, (k,), num_relevant)[int(k)]


def negative_flips(correct_old_old, correct_now) -> np.ndarray:
    """Bool ``[Q]``: queries correct under old-old but wrong now (``Q+ & Q-``, RACT Eq.12)."""
    a = np.asarray(correct_old_old)
    b = np.asarray(correct_now)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(
            f"correctness arrays must be 1-D with equal shapes, got {a.shape} and {b.shape}"
        )
    return a.astype(bool) & ~b.astype(bool)


def negative_flip_rate(correct_old_old, correct_now) -> float:
    """NFR@k, RACT Eq.12: ``|Q+ & Q-| / |Q+|``.

    ``Q+``: queries correct at k under old-old; ``Q-``: queries wrong at k at
    the current backfill stage (use :func:`correct_at_k` with the same k for
    both; NFR@1 is the default in raycompat).  When ``|Q+| == 0`` no query can
    flip negatively, so the rate is defined as ``0.0``.
    """
    a = np.asarray(correct_old_old).astype(bool)
    flips = negative_flips(a, correct_now)
    n_plus = int(a.sum())
    return float(flips.sum() / n_plus) if n_plus else 0.0


# --------------------------------------------------------------------------- end to end
def evaluate_ranking(
    ranked_indices,
    query_labels,
    gallery_labels,
    *,
    k: int = 100,
    ks: Sequence[int] = (1, 5, 10),
    full_ranking=None,
    return_per_query: bool = False,
):
    """Metrics from a precomputed top-L ranking (L >= max(k, ks) unless the gallery is smaller).

    Returns a dict of python floats: ``mAP@{k}``, ``top{k}`` for each k in ks,
    ``mAP`` (revisited protocol, no junk) when ``full_ranking`` (array or chunk
    iterable, see :func:`map_full`) is given, plus ``num_queries`` and
    ``num_valid_queries`` (queries with >= 1 relevant item; only they are
    averaged).  With ``return_per_query`` a second dict holds per-query arrays:
    ``ap@{k}``, ``correct@{k}`` for ks, and ``ap`` when available.
    """
    k = _check_k(k)
    ks = tuple(_check_k(x, "ks entry") for x in ks)
    ql, gl = _labels(query_labels, gallery_labels)
    rel = relevance_from_labels(ranked_indices, ql, gl)
    m = num_relevant_from_labels(ql, gl)
    need = max((k,) + ks)
    if rel.shape[1] < min(need, gl.shape[0]):
        raise ValueError(
            f"ranking has {rel.shape[1]} columns, need {min(need, gl.shape[0])} for k={k}, ks={ks}"
        )
    ap_k = average_precision_at_k(rel, m, k)
    out: dict[str, float] = {f"mAP@{k}": _nanmean_or_nan(ap_k)}
    per: dict[str, np.ndarray] = {f"ap@{k}": ap_k}
    keep = m > 0
    for kk in ks:
        c = correct_at_k(rel, kk)
        per[f"correct@{kk}"] = c
        out[f"top{kk}"] = float(c[keep].mean()) if keep.any() else float("nan")
    if full_ranking is not None:
        out["mAP"], per["ap"] = map_full(full_ranking, ql, gl, return_per_query=True)
    out["num_queries"] = float(ql.shape[0])
    out["num_valid_queries"] = float(keep.sum())
    return (out, per) if return_per_query else out


def evaluate_retrieval(
    query_emb,
    gallery_emb,
    query_labels,
    gallery_labels,
    *,
    k: int = 100,
    ks: Sequence[int] = (1, 5, 10),
    normalize: bool = True,
    full_map: bool = True,
    return_per_query: bool = False,
):
    """Search and score: cosine retrieval of ``query_emb`` against ``gallery_emb``.

    Uses :func:`raycompat.index.exact_search` (top-max(k, ks), ties by gallery
    index) and, when ``full_map``, :func:`raycompat.index.iter_full_ranking`
    (query chunks, bounded memory; O(Q*N log N) time: disable for very large
    galleries).  Returns a dict of python floats with keys ``mAP@{k}``
    (GLDv2 AP@k), ``mAP`` (revisited full mAP, no junk; only if ``full_map``),
    ``top{k}`` for each k in ``ks`` (CMC), ``num_queries``, ``num_valid_queries``.
    Queries with no same-label gallery item are excluded from the means.
    See :func:`evaluate_ranking` for ``return_per_query``.
    """
    from raycompat.index.search import exact_search, iter_full_ranking

    k = _check_k(k)
    ks = tuple(_check_k(x, "ks entry") for x in ks)
    ql, gl = _labels(query_labels, gallery_labels)
    q = np.asarray(query_emb)
    g = np.asarray(gallery_emb)
    if q.ndim != 2 or q.shape[0] != ql.shape[0]:
        raise ValueError(f"query_emb shape {q.shape} does not match {ql.shape[0]} query labels")
    if g.ndim != 2 or g.shape[0] != gl.shape[0]:
        raise ValueError(f"gallery_emb shape {g.shape} does not match {gl.shape[0]} gallery labels")
    _, ranked = exact_search(q, g, max((k,) + ks), normalize=normalize)
    full = iter_full_ranking(q, g, normalize=normalize) if full_map else None
    return evaluate_ranking(
        ranked, ql, gl, k=k, ks=ks, full_ranking=full, return_per_query=return_per_query
    )
