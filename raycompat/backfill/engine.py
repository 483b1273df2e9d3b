"""Exact backfill curves from one scoring pass per score side.

Problem (METHODS.md, "Query strategies while the gallery is partly backfilled").
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
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

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


def METRIC_NAMES(k: int) -> Tuple[str, str, str, str]:
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
    new_side: Optional[str]
    counts: np.ndarray
    order: Optional[np.ndarray] = None

    def sides(self) -> List[str]:
        out = [self.old_side]
        if self.new_side is not None and self.new_side != self.old_side:
            out.append(self.new_side)
        return out


@dataclass
class CurveRanks:
    """Ranks of every positive pair at every grid point of one curve."""

    key: Any
    counts: np.ndarray            # [J]
    seg: np.ndarray               # [N] int32 segment of each item
    ranks: np.ndarray             # [J, P] int64, 0-based rank in the mixed gallery

    def states(self, j: int) -> np.ndarray:
        """int8 [N]: 1 = item holds its new vector at grid point j, 0 = old (one vector each)."""
        return (self.seg <= j).astype(np.int8)


@dataclass
class EngineResult:
    pairs_q: np.ndarray           # [P] query of each positive pair (sorted by query, then item)
    pairs_i: np.ndarray           # [P] gallery index of each positive pair
    npos: np.ndarray              # [Q] positives per query
    n_items: int
    curves: List[CurveRanks]
    stats: Dict[str, Any] = field(default_factory=dict)
    debug: Dict[str, Any] = field(default_factory=dict)

    def curve(self, key) -> CurveRanks:
        for c in self.curves:
            if c.key == key:
                return c
        raise KeyError(key)


# ----------------------------------------------------------------------------- pairs
def positive_pairs(query_labels, gallery_labels) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
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
        ql, gl = both[: ql.size], both[ql.size:]
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


def _key_span(norms: Sequence[Tuple[np.ndarray, float]]) -> float:
    """C: a power of two with every score (and error band) strictly inside (-C/2, C/2).

    ``norms``: per side, (query row norms, an upper bound of the gallery row norms).
    """
    bound = 0.0
    for qn, gmax in norms:
        bound = max(bound, float(qn.max(initial=0.0)) * gmax)
    if not bound * 1.001 < float(np.finfo(np.float32).max):
        # the passes rely on finite scores (a +inf score would pass every threshold table)
        raise ValueError(f"scores may overflow float32 (|q| * |g| up to {bound:.3g}); rescale the embeddings")
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
        b = a[s:s + chunk].astype(np.float64)
        out[s:s + chunk] = np.sqrt(np.einsum("ij,ij->i", b, b))
    return out


def _max_row_norm(a: np.ndarray, chunk: int = 8192) -> float:
    """Largest row norm, as an upper bound (float32 sums, inflated by a safe relative margin)."""
    m = 0.0
    for s in range(0, a.shape[0], chunk):
        b = a[s:s + chunk]
        m = max(m, float(np.einsum("ij,ij->i", b, b).max(initial=0.0)))
    # float32 sum of squares: relative error <= D * 2^-24 (< 1e-3 for D < 16000)
    return float(np.sqrt(m * (1.0 + 1e-3 + a.shape[1] * 2.0 ** -23))) if a.size else 0.0


# ----------------------------------------------------------------------------- thresholds
class _SideValues:
    """Threshold values of one side Y: for positive pair p, the canonical score
    ``v64 = c_Y(q_p, i_p)`` (:func:`raycompat.index.canonical.pair_scores`), and
    ``delta_q[q]``, a guaranteed bound on ``|float32 pass score - canonical score|`` of
    query q on Y (:func:`raycompat.index.canonical.float32_score_error`).
    """

    def __init__(self, side: Side, pq: np.ndarray, pi: np.ndarray, sentinel: np.ndarray,
                 band_scale: float, qn: np.ndarray, gmax: float):
        n_pairs = pq.size
        real = np.flatnonzero(~sentinel)
        self.v64 = np.full(n_pairs, -np.inf)
        self.v64[real] = pair_scores_at(side.queries, pq[real], side.gallery, pi[real])
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

    def __init__(self, ynames: List[str], values: Dict[str, _SideValues], pq: np.ndarray,
                 n_queries: int, span: float, device: torch.device):
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
        order = np.lexsort((src_y, src_p, v, q))                 # query, value, pair, side
        self.src_y, self.src_p = src_y[order], src_p[order]
        self.sorted_q = q[order]
        m = order.size
        self.size = m
        off = np.zeros(n_queries + 1, dtype=np.int64)
        np.add.at(off, self.sorted_q + 1, 1)
        self.off = np.cumsum(off)
        sv, sd = v[order], d[order]
        neg = np.isneginf(sv)
        with np.errstate(invalid="ignore"):
            lo = np.where(neg, np.float32(-np.inf), _round_f32(sv - sd, "down")).astype(np.float32)
            hi = np.where(neg, np.float32(-np.inf), _round_f32(sv + sd, "up")).astype(np.float32)
        self.lo_min = np.full(n_queries, np.inf, dtype=np.float32)
        has = self.off[1:] > self.off[:-1]
        self.lo_min[has] = lo[self.off[:-1][has]]
        self.width = m + n_queries
        self.rowoff = torch.from_numpy(self.off[:-1] + np.arange(n_queries)).to(device)
        self.tmax = int((self.off[1:] - self.off[:-1]).max(initial=0))
        # float64 keys q*C + edge (see _key_span); edges clamped to +-(C/2 - 1), still
        # beyond every possible score, so a clamped edge decides nothing wrongly
        lim = span / 2 - 1.0
        qoff = self.sorted_q.astype(np.float64) * span
        lo_k = qoff + np.where(np.isneginf(lo), -span / 2, np.clip(lo.astype(np.float64), -lim, lim))
        hi_k = qoff + np.where(np.isneginf(hi), -span / 2, np.clip(hi.astype(np.float64), -lim, lim))
        if m and ((np.diff(lo_k) < 0).any() or (np.diff(hi_k) < 0).any()):
            raise AssertionError("internal error: threshold edges are not sorted")
        self.lo_keys = torch.from_numpy(lo_k).to(device)
        self.lo_keys_padded = torch.from_numpy(np.concatenate([lo_k, [np.inf]])).to(device)
        self.hi_keys = torch.from_numpy(hi_k).to(device)
        self.span = span
        self.qoff = torch.arange(n_queries, dtype=torch.float64, device=device) * span
        self.use_table = self.tmax <= _TABLE_MAX
        if self.use_table:
            # [Q, T] float32 edges of each query's thresholds in its own row, +inf padded
            t = max(self.tmax, 1)
            col = np.arange(m) - self.off[self.sorted_q]
            hi_tab = np.full((n_queries, t), np.inf, dtype=np.float32)
            lo_tab = np.full((n_queries, t + 1), np.inf, dtype=np.float32)
            hi_tab[self.sorted_q, col] = hi
            lo_tab[self.sorted_q, col] = lo
            self.hi_tab = torch.from_numpy(hi_tab).to(device)
            self.lo_tab = torch.from_numpy(lo_tab[:, :t]).to(device)
            self.lo_next = torch.from_numpy(lo_tab.reshape(-1)).to(device)   # row stride t + 1
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
        b = torch.searchsorted(self.hi_tab.index_select(0, qg), vals[:, None], right=False).squeeze(1)
        t = self.hi_tab.shape[1]
        # ambiguous iff the next threshold's lower edge is <= the score (+inf past the row's end)
        near = self.lo_next.index_select(0, qg * (t + 1) + b) <= vals
        bucket = self.rowoff.index_select(0, qg) + b
        if not bool(near.any()):
            return bucket, None, None, None
        amb = torch.nonzero(near).squeeze(1)
        qa = qg.index_select(0, amb)
        b_lo = torch.searchsorted(self.lo_tab.index_select(0, qa), vals.index_select(0, amb)[:, None],
                                  right=True).squeeze(1)
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
                sel = tiles[tr, tc]                               # [n, TILE] copy
                a, b = nonzero_2d(sel >= lm.index_select(0, tr)[:, None])
                parts.append((tr.index_select(0, a), tc.index_select(0, a) * _TILE + b,
                              sel.view(-1).index_select(0, a * _TILE + b)))
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


class _SidePass:
    """The scoring pass over one side X: per score block, the exact float32 scores of
    X's positives (its thresholds), the survivors, and their histogram.

    One histogram ``[segment, bucket]`` (int64, ``bucket`` as in :meth:`_Merged.locate`)
    per distinct *non-constant* segmentation of the curves X serves; a constant
    segmentation (a static curve: every item in one segment) is the segment sum of
    any other one, so it is counted only when it is alone.  Each worker of
    :func:`raycompat.backfill.blocks.map_score_blocks` owns an accumulator
    (``slot``), summed after the pass.
    """

    def __init__(self, mx: _Merged, seg_ids: List[int], seg_np: List[np.ndarray], seg_t: List[torch.Tensor],
                 n_segs: List[int], pq: np.ndarray, pi: np.ndarray, query_rows: int, workers: int,
                 device: torch.device):
        self.mx = mx
        self.seg_np, self.seg_t, self.n_segs = seg_np, seg_t, n_segs
        self.constant = {si: int(seg_np[si][0]) for si in seg_ids if seg_np[si].min() == seg_np[si].max()}
        counted = [si for si in seg_ids if si not in self.constant] or seg_ids[:1]
        self.base: Dict[int, int] = {}
        size = 0
        for si in counted:
            self.base[si] = size
            size += n_segs[si] * mx.width
        self.size = size
        self.workers = workers if device.type == "cpu" else 1
        self.acc = [torch.zeros(size, dtype=torch.int64, device=device) for _ in range(self.workers)]
        self.ones = torch.ones(1, dtype=torch.int64, device=device)
        self.lo_min = torch.from_numpy(mx.lo_min).to(device)
        self.device = device
        self.band: List[Tuple[np.ndarray, ...]] = []
        self.progress = None
        self._lock = threading.Lock()
        self._done = 0
        self._w = [{"survivors": 0, "band_entries": 0, "blocks": 0, "tile_frac": 0.0, "seconds_matmul": 0.0,
                    "seconds_filter": 0.0, "seconds_count": 0.0, "t_end": 0.0} for _ in range(self.workers)]

    def begin(self) -> None:
        """Start the stage clocks (a worker's matrix-product time runs until its block arrives)."""
        now = time.perf_counter()
        for w in self._w:
            w["t_end"] = now

    def block(self, slot: int, q0: int, q1: int, g0: int, g1: int, S: torch.Tensor) -> None:
        """Histogram the survivors of score block ``S`` (rows ``q0:q1``, items ``g0:g1``)."""
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
            self._count(slot, r + q0, col, g0, g1, vals)
        w["seconds_count"] += time.perf_counter() - tc
        if self.progress is not None:
            with self._lock:
                self._done += (q1 - q0) * (g1 - g0)
                self.progress(self._done / float(self.mx.lo_min.size * self.seg_np[0].size))
        w["t_end"] = time.perf_counter()

    def _count(self, slot: int, qg: torch.Tensor, col: torch.Tensor, g0: int, g1: int, vals: torch.Tensor):
        """Add survivors (query ``qg``, item ``g0 + col``, score ``vals``) to the histograms;
        keep the ambiguous ones for the exact resolution after the pass."""
        mx = self.mx
        bucket, amb, b_hi, b_lo = mx.locate(qg, vals)
        acc = self.acc[slot]
        for si, base in self.base.items():
            # the block's segments (a small array) gathered per survivor
            flat = (self.seg_t[si][g0:g1] * mx.width + base).index_select(0, col) + bucket
            acc.index_add_(0, flat, self.ones.expand(flat.numel()))
        if amb is not None:
            self._w[slot]["band_entries"] += int(amb.numel())
            self.band.append(tuple(z.cpu().numpy() for z in (
                col.index_select(0, amb) + g0, vals.index_select(0, amb), b_hi, b_lo)))

    def histogram(self, si: int) -> np.ndarray:
        """int64 ``[segments, width]`` histogram of segmentation ``si`` (summed over workers)."""
        if si in self.base:
            nseg = self.n_segs[si]
            tot = self.acc[0][self.base[si]: self.base[si] + nseg * self.mx.width].clone()
            for acc in self.acc[1:]:
                tot += acc[self.base[si]: self.base[si] + nseg * self.mx.width]
            return tot.cpu().numpy().reshape(nseg, self.mx.width)
        other = next(iter(self.base))
        c0 = self.constant[si]
        H = np.zeros((self.n_segs[si], self.mx.width), dtype=np.int64)
        H[c0] = self.histogram(other).sum(axis=0)
        return H

    def stats(self) -> Dict[str, Any]:
        """Survivors, band entries and stage seconds (summed over workers)."""
        keys = ("survivors", "band_entries", "seconds_matmul", "seconds_filter", "seconds_count")
        return {k: sum(w[k] for w in self._w) for k in keys}


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
    workers: Optional[int] = None,
) -> EngineResult:
    """Ranks of every positive pair at every grid point of every curve (see module docstring).

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
    dev = resolve_device(device)
    t_start = time.perf_counter()
    ql = np.asarray(query_labels)
    gl = np.asarray(gallery_labels)
    n_q, n_items = ql.shape[0], gl.shape[0]
    if n_items == 0:
        raise ValueError("the gallery is empty")
    used: List[str] = []
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
        if side.queries.shape[0] != n_q or side.gallery.shape[0] != n_items:
            raise ValueError(
                f"side {s!r} has {side.queries.shape[0]} queries x {side.gallery.shape[0]} items, "
                f"labels say {n_q} x {n_items}")

    pq, pi, npos = positive_pairs(ql, gl)
    n_real = pq.size
    if debug:
        pq = np.concatenate([pq, np.arange(n_q, dtype=np.int64)])
        pi = np.concatenate([pi, np.full(n_q, n_items, dtype=np.int64)])
    sentinel = np.zeros(pq.size, dtype=bool)
    sentinel[n_real:] = True
    n_pairs = pq.size

    norms = {s: (_row_norms(sides[s].queries), _max_row_norm(sides[s].gallery)) for s in used}
    values = {s: _SideValues(sides[s], pq, pi, sentinel, band_scale, *norms[s]) for s in used}
    span = _key_span(list(norms.values()))

    # segments per curve (shared when order and counts are the same)
    seg_np: List[np.ndarray] = []
    seg_t: List[torch.Tensor] = []
    seg_n: List[int] = []                                     # segments of each: grid points + 1
    cache: Dict[Tuple[int, bytes], int] = {}
    curve_seg: List[int] = []
    for c in curves:
        counts = np.asarray(c.counts, dtype=np.int64)
        key = (id(c.order), counts.tobytes())
        if key not in cache:
            seg = segments(c.order, counts, n_items)
            cache[key] = len(seg_np)
            seg_np.append(seg)
            seg_t.append(torch.from_numpy(seg.astype(np.int64)).to(dev))
            seg_n.append(len(counts) + 1)
        curve_seg.append(cache[key])

    # per pass side X: merged thresholds and histogram targets (curve, role)
    merged: Dict[str, _Merged] = {}
    targets: Dict[str, List[Tuple[int, int]]] = {}            # X -> [(curve, role)]
    passes: Dict[str, _SidePass] = {}
    qc, gb = block_rows(n_q, n_items, block_bytes)
    n_workers = default_workers(dev) if workers is None else max(1, int(workers))
    for xname in used:
        ys: List[str] = []
        for c in curves:
            if xname in c.sides():
                for y in c.sides():
                    if y not in ys:
                        ys.append(y)
        merged[xname] = _Merged(ys, values, pq, n_q, span, dev)
        targets[xname] = [(ci, role) for ci, c in enumerate(curves)
                          for role, name in ((0, c.old_side), (1, c.new_side)) if name == xname]
        passes[xname] = _SidePass(merged[xname], sorted({curve_seg[ci] for ci, _ in targets[xname]}),
                                  seg_np, seg_t, seg_n, pq[:n_real], pi[:n_real], qc, n_workers, dev)

    stats: Dict[str, Any] = {"sides": {}, "device": str(dev), "pairs": int(n_real)}
    with fp32_matmul(), torch.no_grad():
        for xname in used:
            t0 = time.perf_counter()
            side = sides[xname]
            sp = passes[xname]
            if progress is not None:
                sp.progress = lambda frac, _x=xname: progress(_x, frac)
            sp.begin()
            map_score_blocks(side.queries, side.gallery, sp.block, device=dev, query_rows=qc,
                             gallery_rows=gb, workers=n_workers)
            release_memory()
            stats["sides"][xname] = {"seconds": time.perf_counter() - t0, "dim": int(side.queries.shape[1]),
                                     "thresholds_per_query": merged[xname].tmax, "workers": sp.workers,
                                     **sp.stats()}

    # ------------------------------------------------------------ histograms -> counts
    counts_m: Dict[Tuple[int, int], np.ndarray] = {}          # (curve, role) -> [nseg, M] int32
    for xname in used:
        mx = merged[xname]
        W = mx.width
        tq = mx.sorted_q
        tpos = np.arange(mx.size, dtype=np.int64)
        for ci, role in targets[xname]:
            H = passes[xname].histogram(curve_seg[ci])
            nseg = H.shape[0]
            RC = np.zeros((nseg, W + 1), dtype=np.int64)
            RC[:, :W] = np.cumsum(H[:, ::-1], axis=1)[:, ::-1]
            counts_m[(ci, role)] = (RC[:, tpos + tq + 1] - RC[:, mx.off[tq + 1] + tq + 1]).astype(np.int32)
            del H, RC
    band = {x: passes[x].band for x in used if passes[x].band}

    # ------------------------------------------------------------ band resolution (exact)
    for xname, parts in band.items():
        mx = merged[xname]
        x_b, _, bhi_b, blo_b = (np.concatenate([p[i] for p in parts]) for i in range(4))
        n_amb = blo_b - bhi_b                     # ambiguous thresholds: merged indices [b_hi, b_lo)
        rep = np.repeat(np.arange(x_b.size), n_amb)
        first = np.repeat(np.cumsum(n_amb) - n_amb, n_amb)
        t = bhi_b[rep] + (np.arange(rep.size) - first)
        ys = mx.src_y[t]
        ps = mx.src_p[t]
        thr = np.empty(t.size, dtype=np.float64)            # canonical threshold values
        for yi, yname in enumerate(mx.ynames):
            m = ys == yi
            thr[m] = values[yname].v64[ps[m]]
        # canonical scores of the ambiguous survivors (their query: that of their thresholds)
        side = sides[xname]
        cand = pair_scores_at(side.queries, mx.sorted_q[bhi_b], side.gallery, x_b)
        cv, xx = cand[rep], x_b[rep]
        above = (cv > thr) | ((cv == thr) & (xx < pi[ps]))
        xs, ts = xx[above], t[above]
        for ci, role in targets[xname]:
            np.add.at(counts_m[(ci, role)], (seg_np[curve_seg[ci]][xs], ts), 1)

    # ------------------------------------------------------------ ranks per curve
    out_curves: List[CurveRanks] = []
    items_counted = {}
    for ci, c in enumerate(curves):
        seg = seg_np[curve_seg[ci]]
        J = len(c.counts)
        per = {}
        for role, xname in ((0, c.old_side), (1, c.new_side)):
            if xname is None:
                continue
            mx = merged[xname]
            cm = counts_m[(ci, role)]
            for yi, yname in enumerate(mx.ynames):
                sel = np.flatnonzero(mx.src_y == yi)
                pair_counts = np.zeros((J + 1, n_pairs), dtype=np.int32)
                pair_counts[:, mx.src_p[sel]] = cm[:, sel]
                per[(role, yname)] = pair_counts
        zero = np.zeros((J + 1, n_pairs), dtype=np.int32)

        def rank_with(yname):
            new_c = per.get((1, yname), zero)
            old_c = per.get((0, yname), zero)
            pn = np.cumsum(new_c, axis=0, dtype=np.int64)[:J]    # sum_{s <= j} new-state items
            co = np.cumsum(old_c, axis=0, dtype=np.int64)
            so = co[-1][None, :] - co[:J]                        # sum_{s > j} old-state items
            return pn + so

        r_old = rank_with(c.old_side)
        r_new = rank_with(c.new_side) if c.new_side is not None else r_old
        pseg = np.where(sentinel, np.iinfo(np.int32).max, seg[np.minimum(pi, n_items - 1)])
        is_new = pseg[None, :] <= np.arange(J)[:, None]
        ranks = np.where(is_new, r_new, r_old)
        if debug:
            items_counted[c.key] = ranks[:, n_real:].copy()      # sentinel: every item precedes it
        out_curves.append(CurveRanks(key=c.key, counts=np.asarray(c.counts, dtype=np.int64), seg=seg,
                                     ranks=np.ascontiguousarray(ranks[:, :n_real])))
    stats["seconds"] = time.perf_counter() - t_start
    result = EngineResult(pairs_q=pq[:n_real], pairs_i=pi[:n_real], npos=npos, n_items=n_items,
                          curves=out_curves, stats=stats)
    if debug:
        result.debug["items_counted"] = items_counted
        for key, cnt in items_counted.items():
            if not (cnt == n_items).all():
                raise AssertionError(f"curve {key!r}: an item was counted {cnt.min()}..{cnt.max()} "
                                     f"times instead of once per grid point ({n_items} items)")
    return result


# ----------------------------------------------------------------------------- metrics
def full_ap_from_ranks(ranks: np.ndarray, pairs_q: np.ndarray, npos: np.ndarray) -> np.ndarray:
    """Revisited-protocol AP per query (trapezoids, METHODS.md "Metrics") for stacked grid points.

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
    reference_correct: Optional[np.ndarray] = None,
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
        out[names[3]][j] = (negative_flip_rate(reference_correct, c1)
                            if reference_correct is not None else float("nan"))
    return (out, per) if return_per_query else out
