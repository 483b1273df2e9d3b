"""Recall of an approximate index against the exact one (docs/indexes.md, "Recall").

Not the retrieval Recall@k of :mod:`raycompat.metrics.retrieval` (relevance by label): here
the reference is the exact index's own top-k, and recall@k says how much of it an
approximate index returned.
"""

from __future__ import annotations

import numpy as np

from raycompat.metrics.bootstrap import Bootstrap, BootstrapOptions, Interval, Sample

__all__ = ["recall_at_k", "recall_interval"]


def recall_at_k(served_ids, exact_ids, k: int) -> tuple[float, np.ndarray]:
    """Neighbour recall@k: per query, ``|served top-k & exact top-k| / min(k, e)``, with ``e``
    the number of valid ids in the exact top-k (``-1`` pads both and never counts); a query
    whose exact top-k is empty has recall 1.  Returns ``(mean, per-query array [Q])``.

    ``served_ids`` / ``exact_ids``: ``[Q, >= k]`` int ids, each row the ranked answer of one
    query (only the first ``k`` columns are read)."""
    served = np.asarray(served_ids)[:, :k]
    exact = np.asarray(exact_ids)[:, :k]
    if served.shape[0] != exact.shape[0]:
        raise ValueError(f"{served.shape[0]} served rows but {exact.shape[0]} exact rows")
    per_query = np.ones(exact.shape[0])
    for r in range(exact.shape[0]):
        truth = set(exact[r][exact[r] >= 0].tolist())
        if truth:
            hits = truth & set(served[r][served[r] >= 0].tolist())
            per_query[r] = len(hits) / min(k, len(truth))
    mean = float(per_query.mean()) if per_query.size else 1.0
    return mean, per_query


def recall_interval(per_query, options: BootstrapOptions | None = None, groups=None) -> Interval:
    """Mean recall@k with its bootstrap interval over the queries (docs/methods.md,
    "Uncertainty"); ``groups``: labels whose queries are resampled together (default: every
    query on its own, as for independent synthetic queries)."""
    values = np.asarray(per_query, np.float64)
    boot = Bootstrap(options or BootstrapOptions())
    boot.add_query_set("queries", np.arange(values.size) if groups is None else groups)
    return boot.interval(value=Sample.mean("queries", values))
