"""Planning the ranks: everything the block passes and the assembly share, before any score.

A curve (:class:`CurveSpec`) names the score side of old-state and of new-state items and the
backfill schedule: at grid point ``j`` the first ``counts[j]`` items of the policy's order hold
their new vector, the others their old one (docs/methods.md, "Backfill grid").  Planning finds
the positive pairs, their thresholds on every side (:mod:`raycompat.simulator.thresholds`), the
distinct segmentations of the gallery (:func:`raycompat.upgrade.grid.segments`) and the
score-block sizes; the ranks then follow from one block pass per score side
(:mod:`raycompat.simulator.block_pass`), however the gallery is cut into blocks
(docs/architecture.md, "Distributed backfill simulation").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from raycompat.index.blocks import (
    ENGINE_BLOCK_BYTES,
    block_rows,
    default_workers,
    resolve_device,
)
from raycompat.metrics.rank_metrics import positive_pairs
from raycompat.simulator.thresholds import MergedThresholds, ThresholdValues, key_span
from raycompat.upgrade.grid import segments
from raycompat.upgrade.score_sides import Side, SideSummary, row_norms, summarize_side

__all__ = ["CurveSpec", "Segmentations", "RankPlan", "plan_ranks"]


@dataclass
class CurveSpec:
    """One backfill curve: which sides score old- and new-state items, and the schedule.

    ``counts[j]``: number of items holding the new vector at grid point j
    (non-decreasing); ``order``: the policy's permutation (``None`` = identity).
    ``new_side`` may be ``None`` only if every count is 0 (a static search).
    """

    key: Any
    old_side: str
    new_side: str | None
    counts: np.ndarray
    order: np.ndarray | None = None

    def sides(self) -> list[str]:
        out = [self.old_side]
        if self.new_side is not None and self.new_side != self.old_side:
            out.append(self.new_side)
        return out


@dataclass(frozen=True)
class Segmentations:
    """The distinct segmentations of the curves (shared by curves with equal order and counts,
    :func:`raycompat.upgrade.grid.segments`).

    ``arrays`` (one number per item) live with the driver; a block pass gets only its rows
    (:meth:`rows`).  ``constant[si]`` is the segment of every item when segmentation ``si``
    puts them all in one (a static curve), else ``None``."""

    arrays: list[np.ndarray]  # [N] int32 segment of each item (empty in a block plan)
    sizes: list[int]  # segments of each: grid points + 1
    of_curve: list[int]  # the segmentation of each curve
    constant: list[int | None]

    def rows(self, g0: int, g1: int) -> list[np.ndarray]:
        """The segment of gallery rows ``g0:g1`` in each segmentation."""
        return [a[g0:g1] for a in self.arrays]


@dataclass(frozen=True)
class RankPlan:
    """What every block pass and the rank assembly share, built once from the inputs by
    :func:`plan_ranks` (pairs, thresholds, segmentations, block sizes); no score yet."""

    curves: list[CurveSpec]
    used: list[str]  # pass sides, in order of first use
    pairs_q: np.ndarray  # [P'] positive pairs, then (debug) one
    pairs_i: np.ndarray  #      sentinel per query at item N
    npos: np.ndarray  # [Q] positives per query
    n_real: int  # P: real pairs (the first P of P')
    n_items: int
    values: dict[str, ThresholdValues]  # per side: canonical threshold values
    merged: dict[str, MergedThresholds]  # per pass side: its merged thresholds
    targets: dict[str, list[tuple[int, int]]]  # per pass side: (curve, role 0 old / 1 new)
    segs: Segmentations
    device: torch.device
    query_rows: int
    gallery_rows: int
    workers: int
    queries: dict[str, np.ndarray]  # per pass side: its float32 queries [Q, D]

    @property
    def sentinel(self) -> np.ndarray:
        """bool [P']: which pairs are debug sentinels."""
        return np.arange(self.pairs_q.size) >= self.n_real

    def seg_ids(self, xname: str) -> list[int]:
        """The segmentations the pass over side ``xname`` histograms."""
        return sorted({self.segs.of_curve[ci] for ci, _ in self.targets[xname]})

    def for_blocks(self, device=None, workers: int = 1) -> RankPlan:
        """The plan a remote block pass needs: nothing gallery-sized (the segmentations'
        arrays stay with the driver; each block gets its rows), the thresholds on
        ``device``."""
        dev = resolve_device(device)
        segs = replace(self.segs, arrays=[])
        curves = [replace(c, order=None) for c in self.curves]  # the orders stay too
        merged = {x: m.to(dev) for x, m in self.merged.items()}
        return replace(
            self, curves=curves, segs=segs, merged=merged, device=dev, workers=max(1, int(workers))
        )


def _check_inputs(
    sides: Mapping[str, Side], curves: Sequence[CurveSpec], n_q: int, n_items: int
) -> list[str]:
    """The pass sides the curves use (in order of first use); a missing side, a backfill
    without a new side or a side of the wrong size raises."""
    if n_items == 0:
        raise ValueError("the gallery is empty")
    used: list[str] = []
    for c in curves:
        for s in c.sides():
            if s not in sides:
                raise KeyError(f"curve {c.key!r} needs score side {s!r}, which was not given")
            if s not in used:
                used.append(s)
        if c.new_side is None and np.any(np.asarray(c.counts) > 0):
            raise ValueError(f"curve {c.key!r} backfills items but has no new side")
    for s in used:
        side = sides[s]
        n_g = side.gallery.shape[0] if isinstance(side, Side) else n_items
        if side.queries.shape[0] != n_q or n_g != n_items:
            raise ValueError(
                f"side {s!r} has {side.queries.shape[0]} queries x {n_g} items, "
                f"labels say {n_q} x {n_items}"
            )
    return used


def _segmentations(curves: Sequence[CurveSpec], n_items: int) -> Segmentations:
    """One segmentation per distinct (order, counts) of the curves."""
    arrays: list[np.ndarray] = []
    sizes: list[int] = []
    constant: list[int | None] = []
    cache: dict[tuple[int, bytes], int] = {}
    of_curve: list[int] = []
    for c in curves:
        counts = np.asarray(c.counts, dtype=np.int64)
        key = (id(c.order), counts.tobytes())
        if key not in cache:
            seg = segments(c.order, counts, n_items)
            cache[key] = len(arrays)
            arrays.append(seg)
            sizes.append(len(counts) + 1)
            constant.append(int(seg[0]) if seg.min() == seg.max() else None)
        of_curve.append(cache[key])
    return Segmentations(arrays, sizes, of_curve, constant)


def _sides_sharing(curves: Sequence[CurveSpec], xname: str) -> list[str]:
    """Every side that shares a curve with side ``xname`` (itself included), in order."""
    ys: list[str] = []
    for c in curves:
        if xname in c.sides():
            for y in c.sides():
                if y not in ys:
                    ys.append(y)
    return ys


def _pass_targets(curves: Sequence[CurveSpec], used: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Per pass side: the (curve, role) pairs it scores (role 0: old-state items, 1: new)."""
    return {
        x: [
            (ci, role)
            for ci, c in enumerate(curves)
            for role, name in ((0, c.old_side), (1, c.new_side))
            if name == x
        ]
        for x in used
    }


def plan_ranks(
    sides: Mapping[str, Side | SideSummary],
    curves: Sequence[CurveSpec],
    query_labels,
    gallery_labels,
    *,
    device=None,
    block_bytes: int = ENGINE_BLOCK_BYTES,
    debug: bool = False,
    band_scale: float = 1.0,
    workers: int | None = None,
) -> RankPlan:
    """Check the inputs and compute everything but the scores: the positive pairs, their
    canonical threshold values and error bands, the merged thresholds of each pass side, the
    segmentations and the block sizes (arguments as in
    :func:`raycompat.simulator.assembly.compute_ranks`).  A side may be
    given whole (:class:`Side`) or, for a gallery that no process holds, as a
    :class:`SideSummary`."""
    dev = resolve_device(device)
    ql = np.asarray(query_labels)
    gl = np.asarray(gallery_labels)
    n_q, n_items = ql.shape[0], gl.shape[0]
    used = _check_inputs(sides, curves, n_q, n_items)
    pq, pi, npos = positive_pairs(ql, gl)
    n_real = pq.size
    summaries = {
        s: sides[s] if isinstance(sides[s], SideSummary) else summarize_side(sides[s], pi)
        for s in used
    }
    if debug:
        pq = np.concatenate([pq, np.arange(n_q, dtype=np.int64)])
        pi = np.concatenate([pi, np.full(n_q, n_items, dtype=np.int64)])
    sentinel = np.arange(pq.size) >= n_real
    norms = {s: (row_norms(summaries[s].queries), summaries[s].max_norm) for s in used}
    values = {s: ThresholdValues(summaries[s], pq, sentinel, band_scale, *norms[s]) for s in used}
    span = key_span(list(norms.values()))
    segs = _segmentations(curves, n_items)
    merged = {
        x: MergedThresholds(_sides_sharing(curves, x), values, pq, n_q, span, dev) for x in used
    }
    qc, gb = block_rows(n_q, n_items, block_bytes)
    n_workers = default_workers(dev) if workers is None else max(1, int(workers))
    return RankPlan(
        curves=list(curves),
        used=used,
        pairs_q=pq,
        pairs_i=pi,
        npos=npos,
        n_real=n_real,
        n_items=n_items,
        values=values,
        merged=merged,
        targets=_pass_targets(curves, used),
        segs=segs,
        device=dev,
        query_rows=qc,
        gallery_rows=gb,
        workers=n_workers,
        queries={s: summaries[s].queries for s in used},
    )
