"""Score sides: the float32 query and gallery arrays one scoring pass uses, and a side's summary.

A query mode reduces to two score sides (docs/methods.md, "Query strategies";
:mod:`raycompat.upgrade.modes` builds them); the score of a query and an item on a side is the
inner product of their float32 vectors, ranked by the canonical score (docs/methods.md, "Ranking
rule and the canonical score").  A :class:`SideSummary` is what planning the ranks needs of a
side whose gallery no process holds (docs/architecture.md, "Distributed backfill simulation").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Side", "SideSummary", "summarize_side", "row_norms", "max_row_norm"]


@dataclass(frozen=True)
class Side:
    """One score side: float32 ``queries [Q, D]`` and ``gallery [N, D]``; score = inner product."""

    queries: np.ndarray
    gallery: np.ndarray

    def __post_init__(self):
        q, g = self.queries, self.gallery
        if q.ndim != 2 or g.ndim != 2 or q.shape[1] != g.shape[1]:
            raise ValueError(f"side arrays must be [Q, D] and [N, D], got {q.shape} and {g.shape}")
        if q.dtype != np.float32 or g.dtype != np.float32:
            raise ValueError("side arrays must be float32")


@dataclass(frozen=True)
class SideSummary:
    """What a plan needs of one side's gallery without holding it: the side's ``queries``,
    the gallery rows of the positive pairs (``positive_rows[p]`` is the row of pair ``p``'s
    item, pairs as from :func:`raycompat.metrics.rank_metrics.positive_pairs`) and an upper
    bound of every gallery row norm."""

    queries: np.ndarray
    positive_rows: np.ndarray
    max_norm: float


def summarize_side(side: Side, pairs_i: np.ndarray) -> SideSummary:
    """The :class:`SideSummary` of an in-memory side."""
    return SideSummary(side.queries, side.gallery[pairs_i], max_row_norm(side.gallery))


def row_norms(a: np.ndarray, chunk: int = 8192) -> np.ndarray:
    """Row L2 norms (float64 result; chunked so the float64 temporaries stay small)."""
    out = np.empty(a.shape[0], dtype=np.float64)
    for s in range(0, a.shape[0], chunk):
        b = a[s : s + chunk].astype(np.float64)
        out[s : s + chunk] = np.sqrt(np.einsum("ij,ij->i", b, b))
    return out


def max_row_norm(a: np.ndarray, chunk: int = 8192) -> float:
    """Largest row norm, as an upper bound (float32 sums, inflated by a safe relative margin)."""
    m = 0.0
    for s in range(0, a.shape[0], chunk):
        b = a[s : s + chunk]
        m = max(m, float(np.einsum("ij,ij->i", b, b).max(initial=0.0)))
    # float32 sum of squares: relative error <= D * 2^-24 (< 1e-3 for D < 16000)
    return float(np.sqrt(m * (1.0 + 1e-3 + a.shape[1] * 2.0**-23))) if a.size else 0.0
