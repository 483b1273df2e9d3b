"""The block pass: gallery rows ``g0:g1`` scored against every query on each pass side.

For each side a curve uses, a blockwise float32 matrix product
(:func:`raycompat.index.blocks.map_score_blocks`) is histogrammed against the positives'
thresholds per segment (:mod:`raycompat.simulator.side_pass`), and the near-ties -- scores within
the error band of a threshold -- are resolved exactly after the pass by their canonical score and
the index tie rule (docs/methods.md, "Ranking rule and the canonical score").  The result is
therefore the same whatever the summation order of the pass, and block passes over rows that
cover the gallery add up to one pass over the whole gallery, bit for bit, in any order: the unit
of work of a distributed simulation (docs/architecture.md, "Distributed backfill simulation").
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from raycompat.index.blocks import fp32_matmul, map_score_blocks, release_memory
from raycompat.index.canonical import pair_scores_at
from raycompat.simulator.rank_plan import RankPlan
from raycompat.simulator.side_pass import SidePass
from raycompat.upgrade.score_sides import Side

__all__ = ["SideCounts", "BlockCounts", "block_pass", "block_pass_rows"]


@dataclass
class SideCounts:
    """What a block pass over one score side found: the decided scores as histograms, and
    the near-ties resolved exactly as (item, merged threshold) pairs the item precedes."""

    histograms: dict[int, np.ndarray]  # segmentation -> int32 [segments, width]
    tie_items: np.ndarray  # int64 gallery index of each resolved near-tie
    tie_thresholds: np.ndarray  # int64 merged threshold index it precedes
    stats: dict[str, Any]


@dataclass
class BlockCounts:
    """What gallery rows ``g0:g1`` contribute, per pass side (:func:`block_pass`)."""

    g0: int
    g1: int
    sides: dict[str, SideCounts]


def block_pass(
    plan: RankPlan,
    sides: Mapping[str, Side],
    g0: int = 0,
    g1: int | None = None,
    *,
    progress=None,
    fused: bool | None = None,
) -> BlockCounts:
    """Score gallery rows ``g0:g1`` against every query for each pass side, histogram the
    scores against the positives' thresholds per segment, and resolve the near-ties exactly
    (see the module docstring).  Blocks that cover the gallery add up
    (:func:`raycompat.simulator.assembly.ranks_from_counts`) to the counts of one pass over the
    whole gallery."""
    g1 = plan.n_items if g1 is None else int(g1)
    if not 0 <= g0 < g1 <= plan.n_items:
        raise ValueError(f"gallery block {g0}:{g1} is not inside 0:{plan.n_items}")
    rows = {x: sides[x].gallery[g0:g1] for x in plan.used}
    return block_pass_rows(plan, rows, g0, plan.segs.rows(g0, g1), progress=progress, fused=fused)


def block_pass_rows(
    plan: RankPlan,
    gallery_rows: Mapping[str, np.ndarray],
    g0: int,
    seg_rows: Sequence[np.ndarray],
    *,
    progress=None,
    fused: bool | None = None,
) -> BlockCounts:
    """:func:`block_pass` given only the block: ``gallery_rows[x]`` holds gallery rows
    ``g0:g0+n`` of pass side ``x`` (float32 ``[n, D]``), ``seg_rows[si]`` their segment in
    segmentation ``si``.  What a remote task runs (with :meth:`RankPlan.for_blocks`).
    ``fused``: the CPU filter and count through the fused kernel (``None``: where it
    compiles; :class:`raycompat.simulator.side_pass.SidePass`)."""
    n = len(seg_rows[0]) if seg_rows else next(iter(gallery_rows.values())).shape[0]
    g1 = int(g0) + n
    if not 0 <= g0 < g1 <= plan.n_items:
        raise ValueError(f"gallery block {g0}:{g1} is not inside 0:{plan.n_items}")
    out: dict[str, SideCounts] = {}
    for xname in plan.used:
        rows = gallery_rows[xname]
        if rows.shape != (n, plan.queries[xname].shape[1]) or rows.dtype != np.float32:
            raise ValueError(
                f"side {xname!r}: block rows must be float32 [{n}, "
                f"{plan.queries[xname].shape[1]}], got {rows.dtype} {rows.shape}"
            )
        report = None if progress is None else (lambda frac, _x=xname: progress(_x, frac))
        out[xname] = _side_block_pass(plan, xname, rows, int(g0), seg_rows, report, fused)
    return BlockCounts(g0=int(g0), g1=g1, sides=out)


def _side_block_pass(
    plan: RankPlan, xname: str, rows: np.ndarray, g0: int, seg_rows, progress, fused=None
) -> SideCounts:
    """:func:`block_pass_rows` for one side: the blockwise float32 pass, then the exact ties."""
    t0 = time.perf_counter()
    seg_ids = plan.seg_ids(xname)
    sp = SidePass(
        plan.merged[xname], seg_ids, plan.segs, seg_rows, plan.workers, plan.device, g0, fused
    )
    sp.progress = progress
    queries = plan.queries[xname]
    with fp32_matmul(), torch.no_grad():
        sp.begin()
        map_score_blocks(
            queries,
            rows,
            sp.block,
            device=plan.device,
            query_rows=plan.query_rows,
            gallery_rows=plan.gallery_rows,
            workers=plan.workers,
        )
        release_memory()
    stats = {
        "seconds": time.perf_counter() - t0,
        "dim": int(queries.shape[1]),
        "thresholds_per_query": plan.merged[xname].tmax,
        "workers": sp.workers,
        "fused": sp.kernel is not None,
        **sp.stats(),
    }
    # a block's bucket counts are at most its rows: int32 halves what a task sends back
    dtype = np.int32 if rows.shape[0] < 2**31 else np.int64
    histograms = {si: sp.histogram(si).astype(dtype) for si in seg_ids}
    tie_items, tie_thresholds = _resolve_near_ties(plan, xname, queries, rows, g0, sp.band)
    return SideCounts(histograms, tie_items, tie_thresholds, stats)


def _resolve_near_ties(
    plan: RankPlan,
    xname: str,
    queries: np.ndarray,
    rows: np.ndarray,
    g0: int,
    band: list[tuple[np.ndarray, ...]],
) -> tuple[np.ndarray, np.ndarray]:
    """The ambiguous (survivor, threshold) pairs of a pass over gallery rows ``g0:`` decided
    by canonical scores and the index tie rule: ``(gallery indices, merged thresholds)`` of
    the pairs where the item precedes."""
    if not band:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    mx = plan.merged[xname]
    x_b, _, bhi_b, blo_b = (np.concatenate([p[i] for p in band]) for i in range(4))
    n_amb = blo_b - bhi_b  # ambiguous thresholds: merged indices [b_hi, b_lo)
    rep = np.repeat(np.arange(x_b.size), n_amb)
    first = np.repeat(np.cumsum(n_amb) - n_amb, n_amb)
    t = bhi_b[rep] + (np.arange(rep.size) - first)
    ys = mx.src_y[t]
    ps = mx.src_p[t]
    thr = np.empty(t.size, dtype=np.float64)  # canonical threshold values
    for yi, yname in enumerate(mx.ynames):
        m = ys == yi
        thr[m] = plan.values[yname].v64[ps[m]]
    # canonical scores of the ambiguous survivors (their query: that of their thresholds)
    cand = pair_scores_at(queries, mx.sorted_q[bhi_b], rows, x_b - g0)
    cv, xx = cand[rep], x_b[rep]
    above = (cv > thr) | ((cv == thr) & (xx < plan.pairs_i[ps]))
    return xx[above], t[above]
