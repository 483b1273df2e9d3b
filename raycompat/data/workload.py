"""Query logs: what users searched, and a seeded Zipf workload over a scenario's queries.

A query log is a parquet file (docs/simulator.md, "Query logs") in one of two forms:

==============  ============================  =============================================
column          type                          meaning
==============  ============================  =============================================
``query_id``    int64                         a query (form *queries*): an evaluation query's
                                              ``item_id``, or any id when the row has vectors
``new``         list<float32>, optional       the query's new-model embedding (and ``old``,
``old``                                       optional): searched instead of a known query's
``item_id``     int64                         a returned gallery item (form *results*)
``count``       int64 > 0, optional           how many times (default 1)
``order``       int64, optional               time order of the rows (the query stream)
==============  ============================  =============================================

:func:`zipf_query_log` is the built-in scenario's workload: users search the query classes
with a Zipf popularity, so a few classes get most of the searches.  The classes' popularity
ranks are a seeded permutation; class of rank ``r`` (1-based) is searched with probability
``r^-s / sum_j j^-s`` (``s``: the exponent), and a search of a class picks one of its queries
uniformly.  One row per search, in the order drawn (``order``), ``count`` 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from raycompat.config import ConfigError, nonnegative, option, positive

__all__ = [
    "COUNT",
    "ITEM_ID",
    "ORDER",
    "QUERY_ID",
    "ZipfWorkload",
    "write_query_log",
    "zipf_class_weights",
    "zipf_query_log",
]

QUERY_ID, ITEM_ID, COUNT, ORDER = "query_id", "item_id", "count", "order"


@dataclass(frozen=True)
class ZipfWorkload:
    """A seeded Zipf workload over a scenario's query classes."""

    zipf_exponent: float | None = option(
        None,
        min=0.0,
        help="generate a query log over the evaluation queries with this Zipf exponent "
        "(classes' popularity r^-s; 0: uniform); none: no generated log",
    )
    zipf_searches: int = positive(
        20000, help="searches in the generated Zipf log (one row each, in time order)"
    )
    zipf_seed: int = nonnegative(0, help="seed of the generated Zipf log")


def zipf_class_weights(n_classes: int, exponent: float, seed: int) -> np.ndarray:
    """Probability of each class (``[C]``, in class order): rank ``r`` from a permutation by
    ``numpy.random.default_rng([seed, 0])``, weight ``r^-exponent``, normalised."""
    if n_classes < 1:
        raise ConfigError("a Zipf workload needs at least one query class")
    if not np.isfinite(exponent) or exponent < 0:
        raise ConfigError(f"the Zipf exponent must be >= 0, got {exponent!r}")
    ranks = np.random.default_rng([seed, 0]).permutation(n_classes) + 1
    w = ranks.astype(np.float64) ** -float(exponent)
    return w / w.sum()


def zipf_query_log(
    query_ids, query_labels, *, searches: int, exponent: float, seed: int = 0
) -> dict[str, np.ndarray]:
    """``{query_id, count, order}`` arrays: ``searches`` searches of the queries (one row
    each), their classes drawn from :func:`zipf_class_weights` and a query of the class drawn
    uniformly (``numpy.random.default_rng([seed, 1])``)."""
    ids = np.asarray(query_ids, dtype=np.int64)
    labels = np.asarray(query_labels)
    if ids.shape != labels.shape or ids.ndim != 1 or ids.size == 0:
        raise ConfigError("a Zipf workload needs one label per query id, and some queries")
    if int(searches) < 1:
        raise ConfigError(f"a Zipf workload needs at least one search, got {searches!r}")
    classes, cls_of = np.unique(labels, return_inverse=True)
    weights = zipf_class_weights(classes.size, exponent, seed)
    rng = np.random.default_rng([seed, 1])
    drawn = rng.choice(classes.size, size=int(searches), p=weights)
    by_class = np.argsort(cls_of, kind="stable")  # query rows grouped by class
    starts = np.searchsorted(cls_of[by_class], np.arange(classes.size))
    sizes = np.bincount(cls_of, minlength=classes.size)
    pick = starts[drawn] + (rng.random(int(searches)) * sizes[drawn]).astype(np.int64)
    return {
        QUERY_ID: ids[by_class[pick]],
        COUNT: np.ones(int(searches), dtype=np.int64),
        ORDER: np.arange(int(searches), dtype=np.int64),
    }


def write_query_log(path: str, columns: dict[str, np.ndarray], overwrite: bool = False) -> str:
    """Write a query log's columns (int arrays, or ``[n, D]`` float arrays as vectors) to
    ``path``; an existing file is kept unless ``overwrite``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if os.path.exists(path) and not overwrite:
        raise ConfigError(f"query log {path} exists; pass overwrite to replace it")
    table = {}
    for name, values in columns.items():
        a = np.asarray(values)
        if a.ndim == 2:
            flat = pa.array(np.ascontiguousarray(a, dtype=np.float32).reshape(-1))
            table[name] = pa.FixedSizeListArray.from_arrays(flat, a.shape[1])
        else:
            table[name] = pa.array(a)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    pq.write_table(pa.table(table), tmp)
    os.replace(tmp, path)
    return path
