"""Assembly: block passes added up and turned into the ranks of every curve; the whole engine.

:func:`compute_ranks` is the exact backfill-curve engine in one process: :func:`plan_ranks
<raycompat.simulator.rank_plan.plan_ranks>` (pairs, thresholds, segmentations), one
:func:`block_pass <raycompat.simulator.block_pass.block_pass>` over the whole gallery (scores,
histograms, near-ties resolved exactly) and :func:`ranks_from_counts` (histograms added,
:mod:`raycompat.simulator.counting` turns them into ranks).  A distributed simulation runs the
block passes as tasks and adds them up as they arrive (:class:`CountsSum`, docs/architecture.md,
"Distributed backfill simulation").  Curves of several policies and modes that use the same
score side share its pass, so a simulation costs one matrix product per distinct side; the
ranks equal a brute-force masked exact search at every grid point (docs/methods.md, "Ranking
rule and the canonical score").  Nothing gallery-sized is kept per grid point: the
grid-dependent state is ``O(J * (P + Q))`` integers, about the size of the output.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raycompat.index.blocks import ENGINE_BLOCK_BYTES
from raycompat.simulator.block_pass import BlockCounts, block_pass
from raycompat.simulator.counting import curve_ranks, threshold_counts_by_role
from raycompat.simulator.rank_plan import CurveSpec, RankPlan, plan_ranks
from raycompat.simulator.side_pass import PASS_STAT_KEYS
from raycompat.upgrade.score_sides import Side

__all__ = [
    "CurveRanks",
    "EngineResult",
    "CountsSum",
    "ranks_from_counts",
    "compute_ranks",
]


@dataclass
class CurveRanks:
    """Ranks of every positive pair at every grid point of one curve."""

    key: Any
    counts: np.ndarray  # [J]
    seg: np.ndarray  # [N] int32 segment of each item
    ranks: np.ndarray  # [J, P] int64, 0-based rank in the mixed gallery

    def states(self, j: int) -> np.ndarray:
        """int8 [N]: 1 = item holds its new vector at grid point j, 0 = old (one vector each)."""
        return (self.seg <= j).astype(np.int8)


@dataclass
class EngineResult:
    """The ranks of every curve, and the positive pairs (real ones only) they rank."""

    pairs_q: np.ndarray  # [P] query of each positive pair (sorted by query, then item)
    pairs_i: np.ndarray  # [P] gallery index of each positive pair
    npos: np.ndarray  # [Q] positives per query
    n_items: int
    curves: list[CurveRanks]
    stats: dict[str, Any] = field(default_factory=dict)
    debug: dict[str, Any] = field(default_factory=dict)

    def curve(self, key) -> CurveRanks:
        for c in self.curves:
            if c.key == key:
                return c
        raise KeyError(key)


class CountsSum:
    """The running sum of block passes (:class:`BlockCounts`) over disjoint gallery rows: what
    a driver keeps while blocks arrive, in any order.  A block counted twice, or rows
    overlapping another block, raise; :meth:`ranks` checks that every row was counted."""

    def __init__(self, plan: RankPlan):
        self.plan = plan
        self.hist: dict[str, dict[int, np.ndarray]] = {}
        self.ties: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {x: [] for x in plan.used}
        self.stats: dict[str, list[dict[str, Any]]] = {x: [] for x in plan.used}
        self.spans: list[tuple[int, int]] = []

    def add(self, block: BlockCounts) -> None:
        """Add one block's histograms and resolved ties."""
        # spans kept sorted: a new block can only overlap its neighbours (log time per block)
        at = bisect.bisect_left(self.spans, (block.g0, block.g1))
        for a, b in self.spans[max(0, at - 1) : at + 1]:
            if block.g0 < b and a < block.g1:
                raise ValueError(
                    f"gallery rows {block.g0}:{block.g1} overlap rows {a}:{b}, already counted"
                )
        self.spans.insert(at, (block.g0, block.g1))
        for xname in self.plan.used:
            part = block.sides[xname]
            acc = self.hist.setdefault(xname, {})
            for si, h in part.histograms.items():
                if si in acc:
                    acc[si] += h
                else:
                    acc[si] = h.astype(np.int64)  # a copy: the sum of many blocks
            # copies: a task's result read from Ray's object store is a view of it, and a kept
            # view would pin the whole result (its histograms too) for the rest of the run
            self.ties[xname].append((np.array(part.tie_items), np.array(part.tie_thresholds)))
            self.stats[xname].append(part.stats)

    @property
    def rows_counted(self) -> int:
        return sum(b - a for a, b in self.spans)

    def ranks(self) -> EngineResult:
        """The ranks of every positive pair at every grid point (needs every row counted and
        the driver's plan, whose segmentations hold every item)."""
        plan = self.plan
        if self.rows_counted != plan.n_items:
            raise ValueError(
                f"the blocks cover {self.rows_counted} gallery rows, the gallery has {plan.n_items}"
            )
        counts_m = threshold_counts_by_role(plan, self.hist, self.ties)
        return _engine_result(plan, counts_m, self.stats)


def ranks_from_counts(plan: RankPlan, blocks: Sequence[BlockCounts]) -> EngineResult:
    """Add the block passes' histograms and resolved ties (blocks that cover the gallery
    once) and turn them into the ranks of every positive pair at every grid point."""
    total = CountsSum(plan)
    for b in blocks:
        total.add(b)
    return total.ranks()


def _engine_result(plan: RankPlan, counts_m, stats_parts) -> EngineResult:
    """The ranks of every curve from the per (curve, role) threshold counts."""
    out_curves: list[CurveRanks] = []
    items_counted = {}
    for ci, c in enumerate(plan.curves):
        ranks = curve_ranks(plan, ci, counts_m)
        if plan.n_real < plan.pairs_q.size:  # sentinel: every item precedes it
            items_counted[c.key] = ranks[:, plan.n_real :].copy()
        out_curves.append(
            CurveRanks(
                key=c.key,
                counts=np.asarray(c.counts, dtype=np.int64),
                seg=plan.segs.arrays[plan.segs.of_curve[ci]],
                ranks=np.ascontiguousarray(ranks[:, : plan.n_real]),
            )
        )
    stats: dict[str, Any] = {
        "sides": {x: _sum_stats(stats_parts[x]) for x in plan.used},
        "device": str(plan.device),
        "pairs": int(plan.n_real),
    }
    result = EngineResult(
        pairs_q=plan.pairs_q[: plan.n_real],
        pairs_i=plan.pairs_i[: plan.n_real],
        npos=plan.npos,
        n_items=plan.n_items,
        curves=out_curves,
        stats=stats,
    )
    if items_counted:
        result.debug["items_counted"] = items_counted
        _check_items_counted(items_counted, plan.n_items)
    return result


def _sum_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's pass statistics over several blocks: seconds and counters summed."""
    out = dict(parts[0])
    for p in parts[1:]:
        for key in ("seconds",) + PASS_STAT_KEYS:
            out[key] += p[key]
    return out


def _check_items_counted(items_counted: dict[Any, np.ndarray], n_items: int) -> None:
    """Debug: at every grid point every item precedes the sentinel once (one vector per item)."""
    for key, cnt in items_counted.items():
        if not (cnt == n_items).all():
            raise AssertionError(
                f"curve {key!r}: an item was counted {cnt.min()}..{cnt.max()} "
                f"times instead of once per grid point ({n_items} items)"
            )


def compute_ranks(
    sides: Mapping[str, Side],
    curves: Sequence[CurveSpec],
    query_labels,
    gallery_labels,
    *,
    device=None,
    block_bytes: int = ENGINE_BLOCK_BYTES,
    debug: bool = False,
    band_scale: float = 1.0,
    progress=None,
    workers: int | None = None,
) -> EngineResult:
    """Ranks of every positive pair at every grid point of every curve (see module docstring):
    :func:`plan_ranks`, one :func:`block_pass` over the whole gallery, :func:`ranks_from_counts`.

    Args:
        sides: score sides by name; every side must have the same Q and N.
        curves: the curves to compute; sides named here are computed once each.
        query_labels, gallery_labels: relevance = equal labels.
        device: torch device for the matrix products (default: CUDA if available).
        block_bytes: memory budget of one float32 score block.
        debug: add one sentinel threshold (-inf) per query and check that at every
            grid point every item is counted exactly once (one vector per item);
            the counts are returned in ``result.debug['items_counted']``.  Slow:
            every score becomes a survivor.
        band_scale: multiplies the error band (tests use a huge value to push
            every comparison through the exact after-pass resolution).
        progress: optional callable ``(side_name, fraction_done)`` (called from the
            pass's worker threads, one call at a time).
        workers: threads of a pass on CPU (default: torch's intra-op thread count; see
            :func:`raycompat.index.blocks.map_score_blocks`); 1 on other devices.
    """
    t_start = time.perf_counter()
    plan = plan_ranks(
        sides,
        curves,
        query_labels,
        gallery_labels,
        device=device,
        block_bytes=block_bytes,
        debug=debug,
        band_scale=band_scale,
        workers=workers,
    )
    result = ranks_from_counts(plan, [block_pass(plan, sides, progress=progress)])
    result.stats["seconds"] = time.perf_counter() - t_start
    return result
