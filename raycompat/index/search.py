"""Exact cosine / inner-product search with a deterministic tie order.

Retrieval in raycompat uses L2-normalised embeddings and cosine similarity
``s(a, b) = <a, b>`` (docs/methods.md, "Notation").  This module provides the exact
search every metric is computed from:

* :func:`l2_normalize` -- row-wise L2 normalisation (float32).
* :func:`exact_search` -- top-k by inner product with faiss ``IndexFlatIP``.
* :func:`full_ranking` / :func:`iter_full_ranking` -- the complete ranking of the
  gallery for every query (full-mAP protocol, revisited Oxford/Paris), computed
  in query chunks so that memory stays bounded.

Tie order
---------
Every ranking produced here orders items by descending score and, among equal
scores, by ascending gallery index.  faiss does *not* guarantee this (its heaps
return tied items in an arbitrary order), so :func:`exact_search` re-sorts the
candidates faiss returns with a stable lexicographic sort on ``(-score, index)``.
Ties at the k boundary need more than a re-sort: if the k-th best score is shared
by items faiss did not return, the item with the lowest index may be missing.
:func:`exact_search` therefore asks faiss for more candidates than ``k`` and
accepts a query's result only when the k-th score is strictly greater than the
score of the last candidate returned (so every item tied with the k-th is among
the candidates) or when the whole gallery was returned; otherwise it searches
that query again with four times as many candidates.  Each query's final result
comes from a single faiss call, so its scores are self-consistent.

Scores are float32 values computed by faiss (exact_search) or by a float32
matrix product (full_ranking).  Two items whose cosines are equal in exact
arithmetic can differ in the last bit after normalisation and summation, so
"tie" means equal *computed* float32 scores.  Items with bit-identical vectors
always tie.  The two functions may differ in the last bit for the same pair
(faiss and numpy sum in different orders); that only matters for near-ties.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = [
    "l2_normalize",
    "exact_search",
    "full_ranking",
    "iter_full_ranking",
]

#: memory budget (bytes) for one query chunk of scores + ranks
_DEFAULT_MAX_BYTES = 256 * 1024 * 1024
_NORM_CHUNK_ROWS = 16384  # float64 temporaries of a few MiB


def _as_2d_float32(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array [n, dim], got shape {arr.shape}")
    if arr.dtype.kind not in "fiub":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    # a float64 sum of float32 values cannot overflow: it is finite iff every value is
    if arr.size and not np.isfinite(arr.sum(dtype=np.float64)):
        bad = np.flatnonzero(~np.isfinite(arr).all(axis=1))
        raise ValueError(
            f"{name} contains NaN or inf in {bad.size} row(s) (first: {bad[:5].tolist()})"
        )
    return arr


def l2_normalize(x, *, zero: str = "raise") -> np.ndarray:
    """Return ``x / ||x||_2`` row-wise as a new float32 array.

    Retrieval uses L2-normalised embeddings and cosine similarity (docs/methods.md,
    "Notation").  Norms are computed in float64 (chunked, so memory stays
    bounded) to avoid float32 overflow; the result is float32.  Bit-identical
    input rows give bit-identical output rows.

    Args:
        x: array ``[n, dim]`` (a 1-D vector is treated as one row and a 1-D
            result is returned).
        zero: what to do with rows of zero norm, which have no direction:
            ``"raise"`` (default) raises ``ValueError`` naming how many rows
            and the first few row numbers; ``"keep"`` leaves them as zero
            vectors (their cosine with anything is then 0).

    Raises:
        ValueError: non-numeric input, NaN/inf values, wrong rank, zero-norm
            rows with ``zero="raise"``, or an unknown ``zero`` option.
    """
    if zero not in ("raise", "keep"):
        raise ValueError(f"zero must be 'raise' or 'keep', got {zero!r}")
    arr = np.asarray(x)
    squeeze = arr.ndim == 1
    if squeeze:
        arr = arr[None, :]
    arr = _as_2d_float32(arr, "x")
    out = np.empty_like(arr)
    zero_rows = []
    for start in range(0, arr.shape[0], _NORM_CHUNK_ROWS):
        b64 = arr[start : start + _NORM_CHUNK_ROWS].astype(np.float64)
        norms = np.sqrt(np.einsum("ij,ij->i", b64, b64))
        is_zero = norms == 0.0
        if is_zero.any():
            zero_rows.append(np.flatnonzero(is_zero) + start)
        safe = np.where(is_zero, 1.0, norms)
        # float64 division, rounded once to float32 (what float32 / float64 promotes to)
        np.divide(b64, safe[:, None], out=b64)
        out[start : start + _NORM_CHUNK_ROWS] = b64
    if zero_rows and zero == "raise":
        bad = np.concatenate(zero_rows)
        raise ValueError(
            f"cannot L2-normalise {bad.size} row(s) with zero norm "
            f"(first: {bad[:5].tolist()}); pass zero='keep' to leave them as zero vectors"
        )
    return out[0] if squeeze else out


def _validate_pair(queries, gallery) -> tuple[np.ndarray, np.ndarray]:
    q = _as_2d_float32(queries, "queries")
    g = _as_2d_float32(gallery, "gallery")
    if g.shape[0] == 0:
        raise ValueError("gallery is empty: nothing to search")
    if q.shape[1] != g.shape[1]:
        raise ValueError(
            f"dimension mismatch: queries have dim {q.shape[1]}, gallery has dim {g.shape[1]}"
        )
    if g.shape[1] == 0:
        raise ValueError("embeddings have dimension 0")
    return q, g


def _check_k(k) -> int:
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if k <= 0:
        raise ValueError(f"k must be a positive integer, got {k}")
    return int(k)


def _sort_ties(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each row by (-score, id): stable lexicographic sort."""
    order = np.lexsort((ids, -scores), axis=-1)
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


def _search_candidates(index, q: np.ndarray, fetch: int, kk: int, n_g: int):
    """``fetch`` candidates of each query row, ties sorted: ``(scores, ids, ok)``, ``ok`` where
    the first ``kk`` are final (every item tied with the ``kk``-th score is among them)."""
    scores, ids = index.search(q, fetch)
    if not np.isfinite(scores).all() or (ids < 0).any():
        raise ValueError(
            "inner products overflowed float32 (or faiss returned no result); "
            "rescale the embeddings or use normalize=True"
        )
    scores, ids = _sort_ties(scores, ids.astype(np.int64, copy=False))
    if fetch >= n_g:
        ok = np.ones(q.shape[0], dtype=bool)
    else:
        # every item tied with the k-th score is among the candidates
        # iff the k-th score is strictly above the last candidate's.
        ok = scores[:, kk - 1] > scores[:, fetch - 1]
    return scores, ids, ok


def exact_search(
    queries,
    gallery,
    k: int,
    *,
    normalize: bool = True,
    extra: int | None = None,
    max_bytes: int = _DEFAULT_MAX_BYTES,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k inner-product search (cosine when ``normalize=True``).

    Uses faiss ``IndexFlatIP`` (exhaustive, exact).  Results are ordered by
    descending score, ties by ascending gallery index, including ties that
    straddle the k boundary (see the module docstring: candidates are fetched
    beyond k and a query is re-searched with more candidates until every item
    tied with its k-th score is among them).

    Args:
        queries: ``[Q, D]`` query embeddings (Q may be 0).
        gallery: ``[N, D]`` gallery embeddings, N >= 1.
        k: number of results per query, > 0.  When ``k > N`` the result is
            padded with index ``-1`` and score ``-inf`` after the N real items.
        normalize: L2-normalise queries and gallery first (zero-norm rows raise
            ``ValueError``, see :func:`l2_normalize`).  With ``False`` the raw
            inner product is used.
        extra: candidates fetched beyond k in the first pass
            (default ``max(k, 16)``); only affects speed, never the result.
        max_bytes: memory budget for one chunk of queries' candidate arrays.

    Returns:
        ``(scores, indices)``: float32 ``[Q, k]`` and int64 ``[Q, k]``.

    Raises:
        ValueError: k <= 0 or not an integer, empty gallery, dimension
            mismatch, NaN/inf in the inputs, zero-norm rows when normalising,
            or scores that overflow float32 when ``normalize=False``.
    """
    import faiss  # local import: keeps `import raycompat.index` light

    k = _check_k(k)
    q, g = _validate_pair(queries, gallery)
    if normalize:
        q = l2_normalize(q)
        g = l2_normalize(g)
    n_q, n_g = q.shape[0], g.shape[0]
    kk = min(k, n_g)
    out_s = np.full((n_q, k), -np.inf, dtype=np.float32)
    out_i = np.full((n_q, k), -1, dtype=np.int64)
    if n_q == 0:
        return out_s, out_i

    index = faiss.IndexFlatIP(g.shape[1])
    index.add(g)
    if extra is None:
        extra = max(kk, 16)
    first_fetch = min(n_g, kk + max(int(extra), 1))

    pending = np.arange(n_q)
    fetch = first_fetch
    while pending.size:
        rows_per_chunk = max(1, int(max_bytes // (12 * fetch)))
        unresolved = []
        for start in range(0, pending.size, rows_per_chunk):
            rows = pending[start : start + rows_per_chunk]
            scores, ids, ok = _search_candidates(index, q[rows], fetch, kk, n_g)
            out_s[rows[ok], :kk] = scores[ok, :kk]
            out_i[rows[ok], :kk] = ids[ok, :kk]
            unresolved.append(rows[~ok])
        pending = np.concatenate(unresolved) if unresolved else np.empty(0, dtype=np.int64)
        fetch = min(n_g, fetch * 4)
    return out_s, out_i


def _rows_per_chunk(n_gallery: int, chunk_size: int | None, max_bytes: int) -> int:
    if chunk_size is not None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return int(chunk_size)
    # float32 scores + int64 argsort output + temporaries ~ 24 bytes per entry
    return max(1, int(max_bytes // (24 * n_gallery)))


def iter_full_ranking(
    queries,
    gallery,
    *,
    normalize: bool = True,
    chunk_size: int | None = None,
    max_bytes: int = _DEFAULT_MAX_BYTES,
    return_scores: bool = False,
) -> Iterator[tuple]:
    """Yield the full ranking of the gallery, one query chunk at a time.

    Yields ``(start, ranks)`` (or ``(start, ranks, scores)`` with
    ``return_scores``) where ``ranks`` is int64 ``[c, N]`` for queries
    ``start:start+c``: gallery indices by descending score, ties by ascending
    index (stable argsort of the negated float32 scores).  Peak memory is
    bounded by ``chunk_size`` rows (default: as many as fit ``max_bytes``).
    Validation as in :func:`exact_search`.
    """
    q, g = _validate_pair(queries, gallery)
    if normalize:
        q = l2_normalize(q)
        g = l2_normalize(g)
    rows = _rows_per_chunk(g.shape[0], chunk_size, max_bytes)
    for start in range(0, q.shape[0], rows):
        scores = q[start : start + rows] @ g.T
        if not np.isfinite(scores).all():
            raise ValueError(
                "inner products overflowed float32; rescale the embeddings or use normalize=True"
            )
        ranks = np.argsort(-scores, axis=1, kind="stable").astype(np.int64, copy=False)
        if return_scores:
            yield start, ranks, np.take_along_axis(scores, ranks, axis=1)
        else:
            yield start, ranks


def full_ranking(
    queries,
    gallery,
    *,
    normalize: bool = True,
    chunk_size: int | None = None,
    max_bytes: int = _DEFAULT_MAX_BYTES,
    return_scores: bool = False,
):
    """Full ranking ``[Q, N]`` of the gallery for every query (full-mAP protocol).

    Argsort of all scores, descending, ties by ascending gallery index.  The
    scores are computed in query chunks (see :func:`iter_full_ranking`), but
    the returned array itself is ``Q * N`` int64: for large galleries consume
    :func:`iter_full_ranking` instead (``metrics.map_full`` accepts chunks).

    Returns:
        int64 ``[Q, N]`` gallery indices, or ``(ranks, scores)`` with
        ``return_scores=True`` (scores float32, sorted like ``ranks``).
    """
    q, g = _validate_pair(queries, gallery)
    ranks = np.empty((q.shape[0], g.shape[0]), dtype=np.int64)
    scores = np.empty((q.shape[0], g.shape[0]), dtype=np.float32) if return_scores else None
    for item in iter_full_ranking(
        q,
        g,
        normalize=normalize,
        chunk_size=chunk_size,
        max_bytes=max_bytes,
        return_scores=return_scores,
    ):
        start, r = item[0], item[1]
        ranks[start : start + r.shape[0]] = r
        if return_scores:
            scores[start : start + r.shape[0]] = item[2]
    return (ranks, scores) if return_scores else ranks
