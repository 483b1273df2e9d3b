"""Counting: from the block passes' histograms to the rank of every positive at every grid point.

A positive ``i`` of query ``q`` only ever has two scores, ``s_o(q, i)`` and ``s_n(q, i)``, so its
0-based rank at grid point ``j`` (items ordered by descending canonical score, ties by ascending
gallery index: docs/methods.md, "Ranking rule and the canonical score") is

    rank_j(i) = sum_{s <= j} A_new[s](v) + sum_{s > j} A_old[s](v),
    v = s_n(q, i) if seg(i) <= j else s_o(q, i),

where ``A_side[s](v)`` counts the items of segment ``s`` (:func:`raycompat.upgrade.grid.segments`,
docs/methods.md, "Backfill grid") whose ``side`` score precedes the threshold ``(v, i)``.  The
histograms of a pass give these counts for every merged threshold at once
(:func:`threshold_counts`), the exactly resolved near-ties are added to them, and
:func:`curve_ranks` sums them into the ranks of one curve.
"""

from __future__ import annotations

import numpy as np

from raycompat.simulator.rank_plan import RankPlan
from raycompat.simulator.thresholds import MergedThresholds

__all__ = ["threshold_counts", "threshold_counts_by_role", "curve_ranks"]


def threshold_counts(mx: MergedThresholds, H: np.ndarray) -> np.ndarray:
    """int32 ``[segments, M]``: per segment, the decided items that precede each merged
    threshold (survivors of its query whose bucket lies above it), from histogram ``H``."""
    W = mx.width
    tq = mx.sorted_q
    tpos = np.arange(mx.size, dtype=np.int64)
    RC = np.zeros((H.shape[0], W + 1), dtype=np.int64)
    RC[:, :W] = np.cumsum(H[:, ::-1], axis=1)[:, ::-1]
    return (RC[:, tpos + tq + 1] - RC[:, mx.off[tq + 1] + tq + 1]).astype(np.int32)


def threshold_counts_by_role(
    plan: RankPlan,
    histograms: dict[str, dict[int, np.ndarray]],
    ties: dict[str, list[tuple[np.ndarray, np.ndarray]]],
) -> dict[tuple[int, int], np.ndarray]:
    """Per (curve, role): int32 ``[segments, M]`` items of each segment, scored on the role's
    pass side, that precede each of its merged thresholds -- the side's summed histograms
    (``histograms[side][segmentation]``) plus its resolved near-ties (``ties[side]``: one
    ``(gallery indices, merged thresholds)`` pair per block)."""
    counts_m: dict[tuple[int, int], np.ndarray] = {}
    for xname in plan.used:
        tie_items = np.concatenate([t[0] for t in ties[xname]])
        tie_thresholds = np.concatenate([t[1] for t in ties[xname]])
        for ci, role in plan.targets[xname]:
            si = plan.segs.of_curve[ci]
            cm = threshold_counts(plan.merged[xname], histograms[xname][si])
            if tie_items.size:
                np.add.at(cm, (plan.segs.arrays[si][tie_items], tie_thresholds), 1)
            counts_m[(ci, role)] = cm
    return counts_m


def _pair_counts(plan: RankPlan, ci: int, counts_m) -> dict[tuple[int, str], np.ndarray]:
    """Per (role, threshold side): int32 ``[segments, P']`` items of each segment, scored on
    the role's side, that precede each positive pair's threshold on the threshold side."""
    c = plan.curves[ci]
    n_seg = len(c.counts) + 1
    per = {}
    for role, xname in ((0, c.old_side), (1, c.new_side)):
        if xname is None:
            continue
        mx = plan.merged[xname]
        cm = counts_m[(ci, role)]
        for yi, yname in enumerate(mx.ynames):
            sel = np.flatnonzero(mx.src_y == yi)
            pair_counts = np.zeros((n_seg, plan.pairs_q.size), dtype=np.int32)
            pair_counts[:, mx.src_p[sel]] = cm[:, sel]
            per[(role, yname)] = pair_counts
    return per


def curve_ranks(plan: RankPlan, ci: int, counts_m) -> np.ndarray:
    """int64 ``[J, P']`` ranks of curve ``ci``: ``rank_j(i) = sum_{s <= j} A_new[s](v) +
    sum_{s > j} A_old[s](v)`` with ``v`` the pair's new or old threshold (module docstring)."""
    c = plan.curves[ci]
    J = len(c.counts)
    per = _pair_counts(plan, ci, counts_m)
    zero = np.zeros((J + 1, plan.pairs_q.size), dtype=np.int32)

    def rank_with(yname):
        new_c = per.get((1, yname), zero)
        old_c = per.get((0, yname), zero)
        pn = np.cumsum(new_c, axis=0, dtype=np.int64)[:J]  # sum_{s <= j} new-state items
        co = np.cumsum(old_c, axis=0, dtype=np.int64)
        so = co[-1][None, :] - co[:J]  # sum_{s > j} old-state items
        return pn + so

    r_old = rank_with(c.old_side)
    r_new = rank_with(c.new_side) if c.new_side is not None else r_old
    seg = plan.segs.arrays[plan.segs.of_curve[ci]]
    pi = plan.pairs_i
    pseg = np.where(plan.sentinel, np.iinfo(np.int32).max, seg[np.minimum(pi, plan.n_items - 1)])
    is_new = pseg[None, :] <= np.arange(J)[:, None]
    return np.where(is_new, r_new, r_old)
