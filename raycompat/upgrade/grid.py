"""Backfill grid: fractions t, how many items hold the new vector at each t, and segments.

Rounding rule (documented once, used everywhere): at fraction ``t`` of a
gallery of ``N`` items, the first

    n(t) = floor(t * N + 1/2)        (round half up; computed in float64)

items of the policy's order hold the new model's vector and the other
``N - n(t)`` hold their old-state vector.  ``n(0) = 0`` and ``n(1) = N``.
The ``cold`` refresh schedule instead has ``n(t) = 0`` for every ``t < 1`` and
``n(1) = N`` (docs/methods.md, "Query strategies", ``cold``).

Segments.  For grid counts ``n_0 <= n_1 <= ... <= n_{J-1}``, item ``x`` at
position ``pos(x)`` of the order belongs to segment
``seg(x) = #{j : n_j <= pos(x)}`` in ``0..J``; the item holds its new vector at
grid point ``j`` iff ``seg(x) <= j`` (i.e. ``pos(x) < n_j``).  So at every grid
point each item holds exactly one vector, and segments ``<= j`` are exactly the
backfilled ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "default_grid",
    "check_grid",
    "backfill_counts",
    "cold_counts",
    "segments",
    "item_states",
]


def default_grid(step_percent: float = 5.0) -> np.ndarray:
    """Fractions ``0, step, 2*step, ..., 1`` (default 0, 5, ..., 100 %).

    ``step_percent`` must divide 100 (up to 1e-9), e.g. 5 -> 21 points, 1 -> 101 points.
    """
    step = float(step_percent)
    if not np.isfinite(step) or step <= 0 or step > 100:
        raise ValueError(f"grid step must be in (0, 100] percent, got {step_percent!r}")
    n = 100.0 / step
    m = int(round(n))
    if abs(n - m) > 1e-9:
        raise ValueError(f"grid step {step_percent}% does not divide 100%")
    return np.arange(m + 1, dtype=np.float64) / m


def check_grid(fractions: Iterable[float]) -> np.ndarray:
    """Validate a grid: 1-D, finite, within [0, 1], strictly increasing."""
    t = np.asarray(
        list(fractions) if not isinstance(fractions, np.ndarray) else fractions, dtype=np.float64
    )
    if t.ndim != 1 or t.size == 0:
        raise ValueError("the grid must be a non-empty 1-D list of fractions")
    if not np.isfinite(t).all() or (t < 0).any() or (t > 1).any():
        raise ValueError("grid fractions must lie in [0, 1]")
    if (np.diff(t) <= 0).any():
        raise ValueError("grid fractions must be strictly increasing")
    return t


def backfill_counts(fractions: Sequence[float], n_items: int) -> np.ndarray:
    """``n(t) = floor(t * N + 1/2)`` for each fraction (int64), see the module docstring."""
    t = check_grid(fractions)
    counts = np.floor(t * float(n_items) + 0.5).astype(np.int64)
    return np.clip(counts, 0, int(n_items))


def cold_counts(fractions: Sequence[float], n_items: int) -> np.ndarray:
    """Cold refresh: 0 new items while ``t < 1``, all ``N`` at ``t == 1``."""
    t = check_grid(fractions)
    return np.where(t >= 1.0, int(n_items), 0).astype(np.int64)


def segments(order: np.ndarray | None, counts: np.ndarray, n_items: int) -> np.ndarray:
    """``seg[x]`` for every item (int32 ``[N]``), see the module docstring.

    ``order``: the policy's permutation of item indices (``order[p]`` is the
    item backfilled at position p); ``None`` means the identity.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if (
        counts.ndim != 1
        or (np.diff(counts) < 0).any()
        or (counts < 0).any()
        or (counts > n_items).any()
    ):
        raise ValueError("counts must be non-decreasing integers in [0, N]")
    # position p is in segment #{counts <= p}: runs of lengths counts[j] - counts[j-1]
    # (no position-sized int64 temporaries: 10M items need 40 MB here, not 200)
    runs = np.diff(np.concatenate([[0], counts, [n_items]]))
    seg_by_pos = np.repeat(np.arange(len(counts) + 1, dtype=np.int32), runs)
    if order is None:
        return seg_by_pos
    order = np.asarray(order)
    if order.dtype.kind not in "iu":
        raise ValueError(f"order must be a permutation of the {n_items} item indices")
    if order.shape != (n_items,) or (n_items and (order.min() < 0 or order.max() >= n_items)):
        raise ValueError(f"order must be a permutation of the {n_items} item indices")
    seen = np.zeros(n_items, dtype=bool)
    seen[order] = True
    if not seen.all():  # n_items indices in range that hit every item: each exactly once
        raise ValueError(f"order must be a permutation of the {n_items} item indices")
    seg = np.empty(n_items, dtype=np.int32)
    seg[order] = seg_by_pos
    return seg


def item_states(seg: np.ndarray, j: int) -> np.ndarray:
    """int8 ``[N]``: 1 where the item holds its new vector at grid point ``j``, 0 where old."""
    return (np.asarray(seg) <= j).astype(np.int8)
