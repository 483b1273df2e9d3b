"""Exact backfill curves from one scoring pass per score side.

Problem (docs/methods.md, "Query strategies").
A query mode fixes two *score sides*: old-state items are scored with
``s_o(q, x) = <q_o, g_o(x)>`` and new-state items with ``s_n(q, x) = <q_n, g_n(x)>``
(``raycompat.backfill.modes`` reduces every mode to such float32 arrays).  At
grid point ``j`` the items of the policy's order up to ``n_j`` hold their new
vector, the others their old vector -- exactly one vector per item
(``raycompat.backfill.grid``).  The union is ranked by score.

Ranking rule (:mod:`raycompat.index.canonical`, shared with the live index): items are
ordered by descending *canonical score* ``c(q, x)`` -- the float64 sum of the products of
the two float32 vectors -- and among equal canonical scores by ascending *gallery index*
(the item's row in the gallery, not its position in the policy order).  Item ``x``
precedes item ``i`` iff ``c(x) > c(i)`` or ``c(x) == c(i) and x < i``.

Brute force would re-run a masked exact search at each grid point.  This engine
instead observes that every metric of the curve (mAP@k, revisited full mAP,
top-1, NFR@1) is a function of the *ranks of the positives* (same-label
gallery items) at each grid point, and that a positive ``i`` of query ``q``
only ever has two scores, ``s_o(q, i)`` and ``s_n(q, i)``.  Its rank at grid
point ``j`` is

    rank_j(i) = sum_{s <= j} A_new[s](v) + sum_{s > j} A_old[s](v),
    v = s_n(q, i) if seg(i) <= j else s_o(q, i),

where ``A_side[s](v)`` counts the items of segment ``s`` (``raycompat.backfill.grid``)
whose ``side`` score precedes the threshold ``(v, i)``.  So one pass over the
gallery per score side (a blockwise float32 matrix product,
:mod:`raycompat.backfill.blocks`) that histograms every score against the (few)
positive thresholds of its query, per segment, gives every grid point at once;
the metrics are then rebuilt from the ranks (:func:`metrics_from_ranks`) with
the same formulas as :mod:`raycompat.metrics`.  No candidate list is truncated,
so nothing can "run short".  Nothing gallery-sized is kept per grid point: the
grid-dependent state is ``O(J * (P + Q))`` integers (J grid points, P positive
pairs, Q queries; once per worker thread for the pass histograms), about the
size of the output itself (``J * P`` ranks).

Cost.  Only scores at or above a query's lowest threshold ("survivors") can
precede a positive.  A block is filtered with one max-reduction per tile of
``_TILE`` columns (or, while survivors are dense, one compare and one scan of
the block), and each survivor is located among the thresholds of its query --
all thresholds of every side that shares a curve with the pass's side, merged
and sorted -- by a sorted search in the query's own row of a float32 edge table
(float64 keys over all queries when a query has more than ``_TABLE_MAX``
thresholds), then added to one histogram ``[segment, bucket]`` per distinct
segmentation (static curves, one segment, are derived from another histogram
after the pass).  A pass costs the matrix product, about one read of each score
block, and a few tens of nanoseconds per survivor.  On CPU the blocks are spread
over worker threads that run their matrix products with one intra-op thread
each (:func:`raycompat.backfill.blocks.map_score_blocks`), so this bookkeeping
on one core overlaps a matrix product on the other; each worker has its own
histogram, summed after the pass.

Exactness.  The pass computes float32 scores (a matrix product, whose rounding depends on
the BLAS, the block shapes and the device).  A threshold is the canonical score ``v64`` of
a positive (:func:`raycompat.index.canonical.pair_scores`), and every float32 score lies
within a guaranteed band ``delta`` of its canonical score
(:func:`raycompat.index.canonical.float32_score_error`): scores outside the band of a
threshold are decided at once, scores inside it (near-ties and exact ties) are kept and
resolved after the pass by their own canonical score and the index tie rule.  The result
is therefore identical to ranking the canonical scores with the tie rule, whatever the
summation order of the pass -- and identical to the served index, whose shards re-rank
their faiss candidates by the same canonical scores (:mod:`raycompat.serving.state`).

Side passes are shared: curves of several policies and modes that use the same
score side (same name) are served by one pass, so a simulation costs one
matrix product per distinct side (policies never add a pass).

Steps.  :func:`compute_ranks` is :func:`plan_ranks` (pairs, thresholds, segmentations),
:func:`block_pass` (a) over the whole gallery (scores, histograms, near-ties resolved
exactly), and :func:`ranks_from_counts` (b) (histograms added, turned into ranks).  Block
passes over gallery rows ``g0:g1`` that cover the gallery add up to the same ranks, bit for
bit, in any order: the unit of work of a distributed simulation.
"""

from __future__ import annotations

import bisect
import copy
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from raycompat.backfill.blocks import (
    ENGINE_BLOCK_BYTES,
    block_rows,
    default_workers,
    fp32_matmul,
    map_score_blocks,
    nonzero_2d,
    release_memory,
    resolve_device,
    rows_at_least,
)
from raycompat.backfill.grid import segments
from raycompat.index.canonical import float32_score_error, pair_scores_at
from raycompat.metrics import (
    correct_at_k,
    mean_average_precision_at_k,
    negative_flip_rate,
)

__all__ = [
    "Side",
    "CurveSpec",
    "CurveRanks",
    "EngineResult",
    "positive_pairs",
    "compute_ranks",
    "RankPlan",
    "Segmentations",
    "SideCounts",
    "BlockCounts",
    "CountsSum",
    "SideSummary",
    "summarize_side",
    "plan_ranks",
    "block_pass",
    "block_pass_rows",
    "ranks_from_counts",
    "metrics_from_ranks",
    "full_ap_from_ranks",
    "METRIC_NAMES",
]

#: columns per tile of the survivor filter (a tile is skipped when its max is below the
#: query's lowest threshold)
_TILE = 128
#: most thresholds per query for which survivors are located in per-query float32 tables
#: (beyond it the [survivors, thresholds] gather costs more than one float64 sorted search)
_TABLE_MAX = 32


def METRIC_NAMES(k: int) -> tuple[str, str, str, str]:
    """Metric keys of a curve: ``mAP@k``, ``mAP`` (revisited full), ``top1``, ``NFR@1``."""
    return (f"mAP@{k}", "mAP", "top1", "NFR@1")


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


# ----------------------------------------------------------------------------- pairs
def positive_pairs(query_labels, gallery_labels) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All (query, gallery item) pairs with equal labels, sorted by query then item.

    Returns ``(pairs_q, pairs_i, npos)`` (int64).  Relevance is label equality,
    as in :func:`raycompat.metrics.relevance_from_labels`.
    """
    ql = np.asarray(query_labels)
    gl = np.asarray(gallery_labels)
    if ql.ndim != 1 or gl.ndim != 1:
        raise ValueError("labels must be 1-D")
    both = np.concatenate([ql, gl]) if ql.dtype != gl.dtype else None
    if both is not None:
        ql, gl = both[: ql.size], both[ql.size :]
    order = np.argsort(gl, kind="stable")
    sl = gl[order]
    lo = np.searchsorted(sl, ql, side="left")
    hi = np.searchsorted(sl, ql, side="right")
    npos = (hi - lo).astype(np.int64)
    total = int(npos.sum())
    pq = np.repeat(np.arange(ql.size, dtype=np.int64), npos)
    start = np.repeat(lo.astype(np.int64), npos)
    first = np.repeat(np.cumsum(npos) - npos, npos)
    pi = order[start + (np.arange(total, dtype=np.int64) - first)].astype(np.int64)
    return pq, pi, npos


# ----------------------------------------------------------------------------- keys
# With more than _TABLE_MAX thresholds per query, a survivor (query q, score v) is located
# among the thresholds of all queries at once with one sorted search on the float64 key
# fl(q * C + v).  For a fixed q the key is
# non-decreasing in v (rounding is monotone), and |v| < C/2 keeps queries apart.  Keys
# may merge two close values; that can only turn a decided comparison into an ambiguous
# one (resolved exactly after the pass), never into a wrong decision:
#   key(v) > key(hi)  =>  v > hi;      v >= lo  =>  key(v) >= key(lo).


def _key_span(norms: Sequence[tuple[np.ndarray, float]]) -> float:
    """C: a power of two with every score (and error band) strictly inside (-C/2, C/2).

    ``norms``: per side, (query row norms, an upper bound of the gallery row norms).
    """
    bound = 0.0
    for qn, gmax in norms:
        bound = max(bound, float(qn.max(initial=0.0)) * gmax)
    if not bound * 1.001 < float(np.finfo(np.float32).max):
        # the passes rely on finite scores (a +inf score would pass every threshold table)
        raise ValueError(
            f"scores may overflow float32 (|q| * |g| up to {bound:.3g}); rescale the embeddings"
        )
    # every score lies within +-bound*(1 + gamma_D) < C/2 - 1 (rounding of the float32 dot)
    return float(2.0 ** np.ceil(np.log2(2.0 * bound * 1.001 + 4.0)))


def _round_f32(x: np.ndarray, direction: str) -> np.ndarray:
    """float64 -> float32 rounded towards -inf ('down') or +inf ('up')."""
    f = x.astype(np.float32)
    back = f.astype(np.float64)
    if direction == "down":
        fix = back > x
        f[fix] = np.nextafter(f[fix], np.float32(-np.inf))
    else:
        fix = back < x
        f[fix] = np.nextafter(f[fix], np.float32(np.inf))
    return f


def _row_norms(a: np.ndarray, chunk: int = 8192) -> np.ndarray:
    """Row L2 norms (float64 result; chunked so the float64 temporaries stay small)."""
    out = np.empty(a.shape[0], dtype=np.float64)
    for s in range(0, a.shape[0], chunk):
        b = a[s : s + chunk].astype(np.float64)
        out[s : s + chunk] = np.sqrt(np.einsum("ij,ij->i", b, b))
    return out


def _max_row_norm(a: np.ndarray, chunk: int = 8192) -> float:
    """Largest row norm, as an upper bound (float32 sums, inflated by a safe relative margin)."""
    m = 0.0
    for s in range(0, a.shape[0], chunk):
        b = a[s : s + chunk]
        m = max(m, float(np.einsum("ij,ij->i", b, b).max(initial=0.0)))
    # float32 sum of squares: relative error <= D * 2^-24 (< 1e-3 for D < 16000)
    return float(np.sqrt(m * (1.0 + 1e-3 + a.shape[1] * 2.0**-23))) if a.size else 0.0


# ----------------------------------------------------------------------------- thresholds
class _SideValues:
    """Threshold values of one side Y: for positive pair p, the canonical score
    ``v64 = c_Y(q_p, i_p)`` (:func:`raycompat.index.canonical.pair_scores`), and
    ``delta_q[q]``, a guaranteed bound on ``|float32 pass score - canonical score|`` of
    query q on Y (:func:`raycompat.index.canonical.float32_score_error`).
    """

    def __init__(
        self,
        side: SideSummary,
        pq: np.ndarray,
        sentinel: np.ndarray,
        band_scale: float,
        qn: np.ndarray,
        gmax: float,
    ):
        n_pairs = pq.size
        real = np.flatnonzero(~sentinel)  # the real pairs come first, in pair order
        self.v64 = np.full(n_pairs, -np.inf)
        self.v64[real] = pair_scores_at(side.queries, pq[real], side.positive_rows, real)
        self.delta_q = float32_score_error(side.queries.shape[1], qn, gmax) * float(band_scale)


class _Merged:
    """All thresholds a pass over side X is compared with (those of every side that
    shares a curve with X), merged per query and sorted by value.

    An item of X's pass is located among its query's thresholds by its score:
    ``b_hi`` thresholds have an upper edge below the score (decided: the item
    precedes them), thresholds in ``[b_hi, b_lo)`` are ambiguous (resolved exactly
    after all passes), the others are decided above it.  With at most
    ``_TABLE_MAX`` thresholds per query the search runs in the query's own row of
    a float32 edge table (a few comparisons, exact float32 edges); with more, one
    sorted search over all queries' edges on float64 keys (see _key_span), whose
    cost grows only with the logarithm of the number of thresholds.
    """

    def __init__(
        self,
        ynames: list[str],
        values: dict[str, _SideValues],
        pq: np.ndarray,
        n_queries: int,
        span: float,
        device: torch.device,
    ):
        n_pairs = pq.size
        self.ynames = ynames
        src_y = np.repeat(np.arange(len(ynames)), n_pairs)
        src_p = np.tile(np.arange(n_pairs), len(ynames))
        v = np.concatenate([values[y].v64 for y in ynames])
        # one band half-width per query (the largest of the merged sides), so that the
        # lower and upper edges are sorted exactly like the values
        dq = np.max(np.stack([values[y].delta_q for y in ynames]), axis=0)
        d = np.where(np.isneginf(v), 0.0, dq[pq[src_p]])
        q = pq[src_p]
        order = np.lexsort((src_y, src_p, v, q))  # query, value, pair, side
        self.src_y, self.src_p = src_y[order], src_p[order]
        self.sorted_q = q[order]
        m = order.size
        self.size = m
        off = np.zeros(n_queries + 1, dtype=np.int64)
        np.add.at(off, self.sorted_q + 1, 1)
        self.off = np.cumsum(off)
        lo, hi = self._edges(v[order], d[order])
        self.lo_min = np.full(n_queries, np.inf, dtype=np.float32)
        has = self.off[1:] > self.off[:-1]
        self.lo_min[has] = lo[self.off[:-1][has]]
        self.width = m + n_queries
        self.rowoff = torch.from_numpy(self.off[:-1] + np.arange(n_queries)).to(device)
        self.tmax = int((self.off[1:] - self.off[:-1]).max(initial=0))
        self._set_keys(lo, hi, n_queries, span, device)
        self.use_table = self.tmax <= _TABLE_MAX
        if self.use_table:
            self._set_tables(lo, hi, n_queries, device)

    def to(self, device: torch.device) -> _Merged:
        """A copy whose tensors live on ``device``."""
        out = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(out, name, value.to(device))
        return out

    @staticmethod
    def _edges(sv: np.ndarray, sd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 lower and upper edges ``v -+ delta`` of the sorted thresholds (rounded
        outwards; ``-inf`` for the debug sentinels)."""
        neg = np.isneginf(sv)
        with np.errstate(invalid="ignore"):
            lo = np.where(neg, np.float32(-np.inf), _round_f32(sv - sd, "down")).astype(np.float32)
            hi = np.where(neg, np.float32(-np.inf), _round_f32(sv + sd, "up")).astype(np.float32)
        return lo, hi

    def _set_keys(
        self, lo: np.ndarray, hi: np.ndarray, n_queries: int, span: float, device: torch.device
    ) -> None:
        """float64 keys ``q*C + edge`` of every edge (see _key_span); edges clamped to
        +-(C/2 - 1), still beyond every possible score, so a clamped edge decides nothing
        wrongly."""
        lim = span / 2 - 1.0
        qoff = self.sorted_q.astype(np.float64) * span
        lo_k = qoff + np.where(
            np.isneginf(lo), -span / 2, np.clip(lo.astype(np.float64), -lim, lim)
        )
        hi_k = qoff + np.where(
            np.isneginf(hi), -span / 2, np.clip(hi.astype(np.float64), -lim, lim)
        )
        if self.size and ((np.diff(lo_k) < 0).any() or (np.diff(hi_k) < 0).any()):
            raise AssertionError("internal error: threshold edges are not sorted")
        self.lo_keys = torch.from_numpy(lo_k).to(device)
        self.lo_keys_padded = torch.from_numpy(np.concatenate([lo_k, [np.inf]])).to(device)
        self.hi_keys = torch.from_numpy(hi_k).to(device)
        self.span = span
        self.qoff = torch.arange(n_queries, dtype=torch.float64, device=device) * span

    def _set_tables(
        self, lo: np.ndarray, hi: np.ndarray, n_queries: int, device: torch.device
    ) -> None:
        """``[Q, T]`` float32 edges of each query's thresholds in its own row, +inf padded."""
        m = self.size
        t = max(self.tmax, 1)
        col = np.arange(m) - self.off[self.sorted_q]
        hi_tab = np.full((n_queries, t), np.inf, dtype=np.float32)
        lo_tab = np.full((n_queries, t + 1), np.inf, dtype=np.float32)
        hi_tab[self.sorted_q, col] = hi
        lo_tab[self.sorted_q, col] = lo
        self.hi_tab = torch.from_numpy(hi_tab).to(device)
        self.lo_tab = torch.from_numpy(lo_tab[:, :t]).to(device)
        self.lo_next = torch.from_numpy(lo_tab.reshape(-1)).to(device)  # row stride t + 1
        self.first = torch.from_numpy(self.off[:-1]).to(device)

    def locate(self, qg: torch.Tensor, vals: torch.Tensor):
        """``(bucket, amb, b_hi, b_lo)`` for survivors of query ``qg`` with score ``vals``.

        ``bucket = b_hi + q`` indexes the histogram; ``amb`` lists the survivors with
        ambiguous thresholds (global merged indices ``[b_hi, b_lo)``), or is ``None``.
        """
        if self.use_table:
            return self._locate_in_rows(qg, vals)
        return self._locate_by_keys(qg, vals)

    def _locate_in_rows(self, qg: torch.Tensor, vals: torch.Tensor):
        """:meth:`locate` by a batched sorted search of each score in its query's table row."""
        b = torch.searchsorted(self.hi_tab.index_select(0, qg), vals[:, None], right=False).squeeze(
            1
        )
        t = self.hi_tab.shape[1]
        # ambiguous iff the next threshold's lower edge is <= the score (+inf past the row's end)
        near = self.lo_next.index_select(0, qg * (t + 1) + b) <= vals
        bucket = self.rowoff.index_select(0, qg) + b
        if not bool(near.any()):
            return bucket, None, None, None
        amb = torch.nonzero(near).squeeze(1)
        qa = qg.index_select(0, amb)
        b_lo = torch.searchsorted(
            self.lo_tab.index_select(0, qa), vals.index_select(0, amb)[:, None], right=True
        ).squeeze(1)
        first = self.first.index_select(0, qa)
        return bucket, amb, first + b.index_select(0, amb), first + b_lo

    def _locate_by_keys(self, qg: torch.Tensor, vals: torch.Tensor):
        """:meth:`locate` by one sorted search over all queries' edges on float64 keys."""
        keys = vals.to(torch.float64) + self.qoff.index_select(0, qg)
        b_hi = torch.searchsorted(self.hi_keys, keys, right=False)
        # ambiguous iff the next threshold's lower edge is <= the score (lower edges are
        # sorted like the thresholds; the key's query offset keeps the next query out)
        near = self.lo_keys_padded.index_select(0, b_hi) <= keys
        bucket = b_hi + qg
        if not bool(near.any()):
            return bucket, None, None, None
        amb = torch.nonzero(near).squeeze(1)
        b_lo = torch.searchsorted(self.lo_keys, keys.index_select(0, amb), right=True)
        return bucket, amb, b_hi.index_select(0, amb), b_lo


def _survivors(S: torch.Tensor, lm: torch.Tensor, use_tiles: bool = True):
    """Entries with ``S[r, c] >= lm[r]``: ``(rows, cols, values, tile_fraction)`` or ``None``.

    With ``use_tiles``, tiles of ``_TILE`` columns whose maximum is below the row's
    bound are skipped (one max-reduction over the block) and only the others are
    compared and scanned; when most tiles are touched the whole block is scanned
    directly.  ``tile_fraction`` (the share of touched tiles, or ``None`` without
    tiles) lets the caller skip the tile pass on dense data.  Entries come out in
    row-major order.
    """
    R, B = S.shape
    bt = (B // _TILE) * _TILE if use_tiles else 0
    frac = None
    if bt:
        nt = bt // _TILE
        tiles = S[:, :bt].reshape(R, nt, _TILE)
        hit = tiles.amax(dim=2) >= lm[:, None]
        tr, tc = nonzero_2d(hit)
        frac = tr.numel() / float(R * nt)
        if frac <= 0.25:
            parts = []
            if tr.numel():
                sel = tiles[tr, tc]  # [n, TILE] copy
                a, b = nonzero_2d(sel >= lm.index_select(0, tr)[:, None])
                parts.append(
                    (
                        tr.index_select(0, a),
                        tc.index_select(0, a) * _TILE + b,
                        sel.view(-1).index_select(0, a * _TILE + b),
                    )
                )
            if bt < B:
                rest = S[:, bt:]
                rr, cc = nonzero_2d(rest >= lm[:, None])
                if rr.numel():
                    parts.append((rr, cc + bt, rest[rr, cc]))
            if not parts:
                return None
            if len(parts) == 1:
                r, c, v = parts[0]
            else:
                r, c, v = (torch.cat([p[i] for p in parts]) for i in range(3))
            return (r, c, v, frac) if r.numel() else None
    r, c, flat = nonzero_2d(rows_at_least(S, lm), with_flat=True)
    if r.numel() == 0:
        return None
    return r, c, S.reshape(-1).index_select(0, flat), frac


@dataclass(frozen=True)
class Segmentations:
    """The distinct segmentations of the curves (shared by curves with equal order and counts,
    :func:`raycompat.backfill.grid.segments`).

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


class _SidePass:
    """The scoring pass over one side X and gallery rows ``g0:g1``: per score block, the
    survivors and their histogram.

    One histogram ``[segment, bucket]`` (int64, ``bucket`` as in :meth:`_Merged.locate`)
    per distinct *non-constant* segmentation of the curves X serves; a constant
    segmentation (a static curve: every item in one segment) is the segment sum of
    any other one, so it is counted only when it is alone.  Each worker of
    :func:`raycompat.backfill.blocks.map_score_blocks` owns an accumulator
    (``slot``), summed after the pass.
    """

    def __init__(
        self,
        mx: _Merged,
        seg_ids: list[int],
        segs: Segmentations,
        seg_rows: Sequence[np.ndarray],
        workers: int,
        device: torch.device,
        g0: int = 0,
    ):
        self.mx = mx
        self.n_segs = segs.sizes
        self.constant = {si: segs.constant[si] for si in seg_ids if segs.constant[si] is not None}
        counted = [si for si in seg_ids if si not in self.constant] or seg_ids[:1]
        # the block's own rows of each counted segmentation, int64 on the pass device
        self.seg_t = {
            si: torch.from_numpy(seg_rows[si].astype(np.int64)).to(device) for si in counted
        }
        self.base: dict[int, int] = {}
        size = 0
        for si in counted:
            self.base[si] = size
            size += self.n_segs[si] * mx.width
        self.size = size
        self.offset = int(g0)
        self.total = float(mx.lo_min.size * len(seg_rows[0]))
        self.workers = workers if device.type == "cpu" else 1
        self.acc = [
            torch.zeros(size, dtype=torch.int64, device=device) for _ in range(self.workers)
        ]
        self.ones = torch.ones(1, dtype=torch.int64, device=device)
        self.lo_min = torch.from_numpy(mx.lo_min.copy()).to(device)
        self.device = device
        self.band: list[tuple[np.ndarray, ...]] = []
        self.progress = None
        self._lock = threading.Lock()
        self._done = 0
        self._w = [
            {
                "survivors": 0,
                "band_entries": 0,
                "blocks": 0,
                "tile_frac": 0.0,
                "seconds_matmul": 0.0,
                "seconds_filter": 0.0,
                "seconds_count": 0.0,
                "t_end": 0.0,
            }
            for _ in range(self.workers)
        ]

    def begin(self) -> None:
        """Start the stage clocks (a worker's matrix-product time runs until its block arrives)."""
        now = time.perf_counter()
        for w in self._w:
            w["t_end"] = now

    def block(self, slot: int, q0: int, q1: int, g0: int, g1: int, S: torch.Tensor) -> None:
        """Histogram the survivors of score block ``S`` (rows ``q0:q1``, items ``g0:g1`` of
        the pass's rows, i.e. ``offset + g0 : offset + g1`` of the gallery)."""
        w = self._w[slot]
        tb = time.perf_counter()
        w["seconds_matmul"] += tb - w["t_end"]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # tile filter unless the last blocks were dense (then scan directly; retry every 8)
        use_tiles = w["tile_frac"] <= 0.25 or w["blocks"] % 8 == 0
        if w["blocks"] % 4 == 3:
            release_memory()
        w["blocks"] += 1
        found = _survivors(S, self.lo_min[q0:q1], use_tiles)
        tc = time.perf_counter()
        w["seconds_filter"] += tc - tb
        if found is None:
            w["tile_frac"] = 0.0 if use_tiles else w["tile_frac"]
        else:
            r, col, vals, frac = found
            if frac is not None:
                w["tile_frac"] = frac
            w["survivors"] += int(r.numel())
            self._count(slot, r + q0, col, g0, g1, vals)  # rows of the block, not global
        w["seconds_count"] += time.perf_counter() - tc
        if self.progress is not None:
            with self._lock:
                self._done += (q1 - q0) * (g1 - g0)
                self.progress(self._done / self.total)
        w["t_end"] = time.perf_counter()

    def _count(
        self, slot: int, qg: torch.Tensor, col: torch.Tensor, g0: int, g1: int, vals: torch.Tensor
    ):
        """Add survivors (query ``qg``, item ``g0 + col`` of the block, score ``vals``) to the
        histograms; keep the ambiguous ones (as gallery indices) for the exact resolution after
        the pass."""
        mx = self.mx
        bucket, amb, b_hi, b_lo = mx.locate(qg, vals)
        acc = self.acc[slot]
        for si, base in self.base.items():
            # the score block's segments (a small array) gathered per survivor
            flat = (self.seg_t[si][g0:g1] * mx.width + base).index_select(0, col) + bucket
            acc.index_add_(0, flat, self.ones.expand(flat.numel()))
        if amb is not None:
            self._w[slot]["band_entries"] += int(amb.numel())
            first = g0 + self.offset
            self.band.append(
                tuple(
                    z.cpu().numpy()
                    for z in (
                        col.index_select(0, amb) + first,
                        vals.index_select(0, amb),
                        b_hi,
                        b_lo,
                    )
                )
            )

    def histogram(self, si: int) -> np.ndarray:
        """int64 ``[segments, width]`` histogram of segmentation ``si`` (summed over workers)."""
        if si in self.base:
            nseg = self.n_segs[si]
            tot = self.acc[0][self.base[si] : self.base[si] + nseg * self.mx.width].clone()
            for acc in self.acc[1:]:
                tot += acc[self.base[si] : self.base[si] + nseg * self.mx.width]
            return tot.cpu().numpy().reshape(nseg, self.mx.width)
        other = next(iter(self.base))
        c0 = self.constant[si]
        H = np.zeros((self.n_segs[si], self.mx.width), dtype=np.int64)
        H[c0] = self.histogram(other).sum(axis=0)
        return H

    def stats(self) -> dict[str, Any]:
        """Survivors, band entries and stage seconds (summed over workers)."""
        return {k: sum(w[k] for w in self._w) for k in _PASS_STAT_KEYS}


#: per-pass counters of :meth:`_SidePass.stats` (summed over workers, and over blocks)
_PASS_STAT_KEYS = ("survivors", "band_entries", "seconds_matmul", "seconds_filter", "seconds_count")


# ----------------------------------------------------------------------------- plan
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
    values: dict[str, _SideValues]  # per side: canonical threshold values
    merged: dict[str, _Merged]  # per pass side: its merged thresholds
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


@dataclass(frozen=True)
class SideSummary:
    """What a plan needs of one side's gallery without holding it: the side's ``queries``,
    the gallery rows of the positive pairs (``positive_rows[p]`` is the row of pair ``p``'s
    item, pairs as from :func:`positive_pairs`) and an upper bound of every gallery row norm."""

    queries: np.ndarray
    positive_rows: np.ndarray
    max_norm: float


def summarize_side(side: Side, pairs_i: np.ndarray) -> SideSummary:
    """The :class:`SideSummary` of an in-memory side."""
    return SideSummary(side.queries, side.gallery[pairs_i], _max_row_norm(side.gallery))


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
    segmentations and the block sizes (arguments as in :func:`compute_ranks`).  A side may be
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
    norms = {s: (_row_norms(summaries[s].queries), summaries[s].max_norm) for s in used}
    values = {s: _SideValues(summaries[s], pq, sentinel, band_scale, *norms[s]) for s in used}
    span = _key_span(list(norms.values()))
    segs = _segmentations(curves, n_items)
    merged = {x: _Merged(_sides_sharing(curves, x), values, pq, n_q, span, dev) for x in used}
    targets = {
        x: [
            (ci, role)
            for ci, c in enumerate(curves)
            for role, name in ((0, c.old_side), (1, c.new_side))
            if name == x
        ]
        for x in used
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
        targets=targets,
        segs=segs,
        device=dev,
        query_rows=qc,
        gallery_rows=gb,
        workers=n_workers,
        queries={s: summaries[s].queries for s in used},
    )


# ----------------------------------------------------------------------------- (a) block pass
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
    plan: RankPlan, sides: Mapping[str, Side], g0: int = 0, g1: int | None = None, *, progress=None
) -> BlockCounts:
    """Score gallery rows ``g0:g1`` against every query for each pass side, histogram the
    scores against the positives' thresholds per segment, and resolve the near-ties exactly
    (see the module docstring).  Blocks that cover the gallery add up
    (:func:`ranks_from_counts`) to the counts of one pass over the whole gallery."""
    g1 = plan.n_items if g1 is None else int(g1)
    if not 0 <= g0 < g1 <= plan.n_items:
        raise ValueError(f"gallery block {g0}:{g1} is not inside 0:{plan.n_items}")
    rows = {x: sides[x].gallery[g0:g1] for x in plan.used}
    return block_pass_rows(plan, rows, g0, plan.segs.rows(g0, g1), progress=progress)


def block_pass_rows(
    plan: RankPlan,
    gallery_rows: Mapping[str, np.ndarray],
    g0: int,
    seg_rows: Sequence[np.ndarray],
    *,
    progress=None,
) -> BlockCounts:
    """:func:`block_pass` given only the block: ``gallery_rows[x]`` holds gallery rows
    ``g0:g0+n`` of pass side ``x`` (float32 ``[n, D]``), ``seg_rows[si]`` their segment in
    segmentation ``si``.  What a remote task runs (with :meth:`RankPlan.for_blocks`)."""
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
        out[xname] = _side_block_pass(plan, xname, rows, int(g0), seg_rows, report)
    return BlockCounts(g0=int(g0), g1=g1, sides=out)


def _side_block_pass(
    plan: RankPlan, xname: str, rows: np.ndarray, g0: int, seg_rows, progress
) -> SideCounts:
    """:func:`block_pass_rows` for one side: the blockwise float32 pass, then the exact ties."""
    t0 = time.perf_counter()
    seg_ids = plan.seg_ids(xname)
    sp = _SidePass(plan.merged[xname], seg_ids, plan.segs, seg_rows, plan.workers, plan.device, g0)
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


# ----------------------------------------------------------------------------- (b) counts -> ranks
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
            self.ties[xname].append((part.tie_items, part.tie_thresholds))
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
        counts_m: dict[tuple[int, int], np.ndarray] = {}  # (curve, role) -> [nseg, M] int32
        for xname in plan.used:
            tie_items = np.concatenate([t[0] for t in self.ties[xname]])
            tie_thresholds = np.concatenate([t[1] for t in self.ties[xname]])
            for ci, role in plan.targets[xname]:
                si = plan.segs.of_curve[ci]
                cm = _threshold_counts(plan.merged[xname], self.hist[xname][si])
                if tie_items.size:
                    np.add.at(cm, (plan.segs.arrays[si][tie_items], tie_thresholds), 1)
                counts_m[(ci, role)] = cm
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
        ranks = _curve_ranks(plan, ci, counts_m)
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
        for key in ("seconds",) + _PASS_STAT_KEYS:
            out[key] += p[key]
    return out


def _threshold_counts(mx: _Merged, H: np.ndarray) -> np.ndarray:
    """int32 ``[segments, M]``: per segment, the decided items that precede each merged
    threshold (survivors of its query whose bucket lies above it), from histogram ``H``."""
    W = mx.width
    tq = mx.sorted_q
    tpos = np.arange(mx.size, dtype=np.int64)
    RC = np.zeros((H.shape[0], W + 1), dtype=np.int64)
    RC[:, :W] = np.cumsum(H[:, ::-1], axis=1)[:, ::-1]
    return (RC[:, tpos + tq + 1] - RC[:, mx.off[tq + 1] + tq + 1]).astype(np.int32)


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


def _curve_ranks(plan: RankPlan, ci: int, counts_m) -> np.ndarray:
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


def _check_items_counted(items_counted: dict[Any, np.ndarray], n_items: int) -> None:
    """Debug: at every grid point every item precedes the sentinel once (one vector per item)."""
    for key, cnt in items_counted.items():
        if not (cnt == n_items).all():
            raise AssertionError(
                f"curve {key!r}: an item was counted {cnt.min()}..{cnt.max()} "
                f"times instead of once per grid point ({n_items} items)"
            )


# ----------------------------------------------------------------------------- main entry
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
            :func:`raycompat.backfill.blocks.map_score_blocks`); 1 on other devices.
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


# ----------------------------------------------------------------------------- metrics
def full_ap_from_ranks(ranks: np.ndarray, pairs_q: np.ndarray, npos: np.ndarray) -> np.ndarray:
    """Revisited-protocol AP per query (trapezoids, docs/methods.md, "Metrics") for stacked grid
    points.

    ``ranks``: ``[J, P]`` 0-based ranks of the positive pairs (pairs grouped by
    query, as from :func:`positive_pairs`).  Returns float64 ``[J, Q]`` with
    ``nan`` for queries without positives.  Bit-identical to
    :func:`raycompat.metrics.average_precision_from_ranks` (same elementwise
    formula and the same row-wise summation, grouped by number of positives).
    """
    ranks = np.atleast_2d(ranks)
    J = ranks.shape[0]
    n_q = npos.size
    out = np.full((J, n_q), np.nan)
    off = np.concatenate([[0], np.cumsum(npos)])
    for n in np.unique(npos[npos > 0]):
        qs = np.flatnonzero(npos == n)
        idx = off[qs][:, None] + np.arange(n)[None, :]
        # C-contiguous rows: numpy then sums each row pairwise exactly like a 1-D sum
        r = np.ascontiguousarray(np.sort(ranks[:, idx].astype(np.float64), axis=-1))  # [J, |qs|, n]
        j = np.arange(n, dtype=np.float64)
        prec0 = np.where(r == 0, 1.0, j / np.where(r == 0, 1.0, r))
        prec1 = (j + 1.0) / (r + 1.0)
        terms = np.ascontiguousarray((prec0 + prec1) / 2.0)
        out[:, qs] = terms.sum(axis=-1) / int(n)
    return out


def _mean_valid(x: np.ndarray, valid: np.ndarray) -> float:
    v = x[valid]
    return float(v.mean()) if v.size else float("nan")


def metrics_from_ranks(
    ranks: np.ndarray,
    pairs_q: np.ndarray,
    npos: np.ndarray,
    k: int,
    reference_correct: np.ndarray | None = None,
    *,
    return_per_query: bool = False,
):
    """Curve metrics at every grid point from the positives' ranks ``[J, P]``.

    * ``mAP@k`` -- :func:`raycompat.metrics.mean_average_precision_at_k` on the
      top-k relevance rebuilt from the ranks (GLDv2 AP@k);
    * ``mAP``   -- revisited full mAP (:func:`full_ap_from_ranks`), queries
      without positives excluded;
    * ``top1``  -- CMC top-1 over queries with positives;
    * ``NFR@1`` -- RACT Eq.12 against ``reference_correct`` (top-1 correctness
      under old-old), :func:`raycompat.metrics.negative_flip_rate`; ``nan``
      without a reference.

    Returns ``{metric: float64 [J]}`` (and per-query arrays with
    ``return_per_query``: ``ap@k`` [J, Q], ``ap`` [J, Q], ``correct1`` [J, Q]).
    """
    ranks = np.atleast_2d(ranks)
    J = ranks.shape[0]
    n_q = npos.size
    valid = npos > 0
    names = METRIC_NAMES(k)
    out = {n: np.empty(J) for n in names}
    aps_full = full_ap_from_ranks(ranks, pairs_q, npos)
    per = {"ap@k": np.empty((J, n_q)), "ap": aps_full, "correct1": np.empty((J, n_q), dtype=bool)}
    for j in range(J):
        rel = np.zeros((n_q, k), dtype=bool)
        sel = ranks[j] < k
        rel[pairs_q[sel], ranks[j][sel]] = True
        out[names[0]][j] = mean_average_precision_at_k(rel, npos, k)
        if return_per_query:
            from raycompat.metrics import average_precision_at_k

            per["ap@k"][j] = average_precision_at_k(rel, npos, k)
        out[names[1]][j] = _mean_valid(aps_full[j], valid)
        c1 = correct_at_k(rel, 1)
        per["correct1"][j] = c1
        out[names[2]][j] = _mean_valid(c1.astype(np.float64), valid)
        out[names[3]][j] = (
            negative_flip_rate(reference_correct, c1)
            if reference_correct is not None
            else float("nan")
        )
    return (out, per) if return_per_query else out
