"""Exact backfill curves from one scoring pass per score side.

Problem (METHODS.md, "Query strategies while the gallery is partly backfilled").
A query mode fixes two *score sides*: old-state items are scored with
``s_o(q, x) = <q_o, g_o(x)>`` and new-state items with ``s_n(q, x) = <q_n, g_n(x)>``
(``raycompat.backfill.modes`` reduces every mode to such float32 arrays).  At
grid point ``j`` the items of the policy's order up to ``n_j`` hold their new
vector, the others their old vector -- exactly one vector per item
(``raycompat.backfill.grid``).  The union is ranked by score.

Tie rule (the same as :func:`raycompat.index.exact_search`): descending score,
and among equal scores ascending *gallery index* (the item's row in the
gallery, not its position in the policy order).  Item ``x`` precedes item ``i``
iff ``s(x) > s(i)`` or ``s(x) == s(i) and x < i``.

Brute force would re-run a masked exact search at each grid point.  This engine
instead observes that every metric of the curve (mAP@k, revisited full mAP,
top-1, NFR@1) is a function of the *ranks of the positives* (same-label
gallery items) at each grid point, and that a positive ``i`` of query ``q``
only ever has two scores, ``s_o(q, i)`` and ``s_n(q, i)``.  Its rank at grid
point ``j`` is

    rank_j(i) = sum_{s <= j} A_new[s](v) + sum_{s > j} A_old[s](v),
    v = s_n(q, i) if seg(i) <= j else s_o(q, i),

where ``A_side[s](v)`` counts the items of segment ``s`` whose ``side`` score
precedes the threshold ``(v, i)``.  So one pass over the gallery per score side
(a blockwise float32 matrix product, :mod:`raycompat.backfill.blocks`) that
histograms every score against the (few) positive thresholds of its query, per
segment, gives every grid point at once.  Nothing gallery-sized is kept per
grid point: the per-grid-point state is ``O(J * (P + Q))`` integers
(P = number of positive pairs), the output itself being ``J * P`` ranks.

Only scores at or above a query's lowest threshold can precede a positive, so
a block row is touched beyond its max-reduction only if it has such a score.

Exactness.  Scores are float32 matmul results; a threshold is the float32
score of a positive computed in the same pass as every other score of its
side.  Thresholds are needed before their block is reached, so the pass
compares against float64 estimates ``v64`` with a guaranteed error band
``|v - v64| <= delta`` (:func:`raycompat.backfill.blocks.dot_error_bound`):
scores outside the band are decided at once, scores inside it (near-ties and
exact ties) are kept and resolved after the pass against the exact float32
value and the index tie rule.  The result is therefore identical to ranking
the float32 scores of the pass with the tie rule above.

Side passes are shared: curves of several policies and modes that use the same
score side (same name) are served by one pass, so a simulation costs one
matrix product per distinct side.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from raycompat.backfill.blocks import (
    DEFAULT_BLOCK_BYTES,
    block_rows,
    dot_error_bound,
    fp32_matmul,
    iter_score_blocks,
    resolve_device,
)
from raycompat.backfill.grid import segments
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

_TWO32 = 1 << 32
_TWO31 = 1 << 31


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
def _ordered_keys_np(q: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """int64 key ``q * 2^32 + ord(v)``; ord is a monotone map of float32 onto [0, 2^32)."""
    v = (np.asarray(vals, dtype=np.float32) + np.float32(0.0)).view(np.int32).astype(np.int64)
    o = np.where(v >= 0, v + _TWO31, -1 - v)
    return np.asarray(q, dtype=np.int64) * _TWO32 + o


def _ordered_keys_t(q: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    v = (vals + 0.0).view(torch.int32).to(torch.int64)   # +0.0 maps -0.0 to +0.0
    o = torch.where(v >= 0, v + _TWO31, -1 - v)
    return q * _TWO32 + o


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


def _row_norms(a: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    out = np.empty(a.shape[0], dtype=np.float64)
    for s in range(0, a.shape[0], chunk):
        b = a[s:s + chunk].astype(np.float64)
        out[s:s + chunk] = np.sqrt(np.einsum("ij,ij->i", b, b))
    return out


def _max_row_norm(a: np.ndarray, chunk: int = 1 << 16) -> float:
    m = 0.0
    for s in range(0, a.shape[0], chunk):
        b = a[s:s + chunk]
        m = max(m, float(np.sqrt(np.einsum("ij,ij->i", b, b, dtype=np.float64).max(initial=0.0))))
    return m


# ----------------------------------------------------------------------------- thresholds
class _Thresholds:
    """The positive thresholds of one side Y: for pair p, the score s_Y(q_p, i_p)."""

    def __init__(self, name: str, side: Side, pq: np.ndarray, pi: np.ndarray, n_queries: int,
                 n_items: int, sentinel: np.ndarray, band_scale: float, device: torch.device):
        self.name = name
        n_pairs = pq.size
        real = ~sentinel
        v64 = np.full(n_pairs, -np.inf)
        rq, ri = pq[real], pi[real]
        for s in range(0, rq.size, 1 << 15):
            a = side.queries[rq[s:s + (1 << 15)]].astype(np.float64)
            b = side.gallery[ri[s:s + (1 << 15)]].astype(np.float64)
            v64[np.flatnonzero(real)[s:s + (1 << 15)]] = np.einsum("ij,ij->i", a, b)
        # error band: |fl32(<a,b>) - v64| <= gamma_D * |a| |b| (+ float64 error), x2 safety
        qn = _row_norms(side.queries)
        gmax = _max_row_norm(side.gallery) * (1.0 + 1e-6)
        delta_q = 2.0 * dot_error_bound(side.queries.shape[1]) * qn * gmax * float(band_scale)
        delta_q = delta_q + 1e-30
        delta = np.where(real, delta_q[pq], 0.0)
        order = np.lexsort((np.arange(n_pairs), v64, pq))      # by query, then value
        self.perm = order                                        # sorted position -> pair
        self.inv = np.empty(n_pairs, dtype=np.int64)
        self.inv[order] = np.arange(n_pairs)
        sq = pq[order]
        self.sorted_q = sq
        self.off = np.zeros(n_queries + 1, dtype=np.int64)
        np.add.at(self.off, sq + 1, 1)
        self.off = np.cumsum(self.off)
        sv = v64[order]
        sd = delta[order]
        with np.errstate(invalid="ignore"):
            lo = np.where(np.isneginf(sv), np.float32(-np.inf), _round_f32(sv - sd, "down"))
            hi = np.where(np.isneginf(sv), np.float32(-np.inf), _round_f32(sv + sd, "up"))
        lo = lo.astype(np.float32)
        hi = hi.astype(np.float32)
        self.lo_keys = torch.from_numpy(_ordered_keys_np(sq, lo)).to(device)
        self.hi_keys = torch.from_numpy(_ordered_keys_np(sq, hi)).to(device)
        lo_min = np.full(n_queries, np.inf, dtype=np.float32)
        has = self.off[1:] > self.off[:-1]
        lo_min[has] = lo[self.off[:-1][has]]                     # first (smallest) of each query
        self.lo_min = lo_min
        self.sorted_item = pi[order]
        # exact float32 values, filled during the side's own pass (sentinels: -inf)
        self.canon = np.full(n_pairs, np.nan, dtype=np.float32)
        self.canon[sentinel] = -np.inf
        self.width = n_pairs + n_queries                         # histogram buckets


@dataclass
class _Target:
    curve: int
    role: int          # 0 = old-state items, 1 = new-state items
    slot: int          # index of the threshold side in the curve's sides()
    tname: str         # threshold side name
    base: int          # offset in the flat histogram
    nseg: int          # J + 1


# ----------------------------------------------------------------------------- main entry
def compute_ranks(
    sides: Mapping[str, Side],
    curves: Sequence[CurveSpec],
    query_labels,
    gallery_labels,
    *,
    device=None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    debug: bool = False,
    band_scale: float = 1.0,
    progress=None,
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
        progress: optional callable ``(side_name, fraction_done)``.
    """
    dev = resolve_device(device)
    t_start = time.perf_counter()
    ql = np.asarray(query_labels)
    gl = np.asarray(gallery_labels)
    n_q, n_items = ql.shape[0], gl.shape[0]
    if n_items == 0:
        raise ValueError("the gallery is empty")
    used = []
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

    thr = {s: _Thresholds(s, sides[s], pq, pi, n_q, n_items, sentinel, band_scale, dev) for s in used}
    W = n_pairs + n_q

    # segments per curve (shared when order and counts are the same objects/values)
    seg_np: List[np.ndarray] = []
    seg_t: List[torch.Tensor] = []
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
        curve_seg.append(cache[key])

    # histogram targets: (curve, role, threshold side)
    targets_by_side: Dict[str, List[_Target]] = {s: [] for s in used}
    all_targets: List[_Target] = []
    base = 0
    for ci, c in enumerate(curves):
        nseg = len(c.counts) + 1
        csides = c.sides()
        roles = [(0, c.old_side)] + ([(1, c.new_side)] if c.new_side is not None else [])
        for role, xname in roles:
            for slot, yname in enumerate(csides):
                t = _Target(ci, role, slot, yname, base, nseg)
                base += nseg * W
                targets_by_side[xname].append(t)
                all_targets.append(t)
    acc = torch.zeros(base, dtype=torch.int64, device=dev)
    # band entries per (X side, Y side): lists of numpy arrays
    band: Dict[Tuple[str, str], List[Tuple[np.ndarray, ...]]] = {}

    stats: Dict[str, Any] = {"sides": {}, "device": str(dev), "pairs": int(n_real)}
    qc, gb = block_rows(n_q, n_items, block_bytes)
    # pairs are sorted by query: per query chunk, a contiguous range; sort it by item for blocks
    poff = np.zeros(n_q + 1, dtype=np.int64)
    np.add.at(poff, pq[:n_real] + 1, 1)
    poff = np.cumsum(poff)

    with fp32_matmul(), torch.no_grad():
        for xname in used:
            t0 = time.perf_counter()
            side = sides[xname]
            tx = thr[xname]
            targets = targets_by_side[xname]
            ynames = []
            for t in targets:
                if t.tname not in ynames:
                    ynames.append(t.tname)
            lo_min = np.min(np.stack([thr[y].lo_min for y in ynames]), axis=0)
            lo_min_t = torch.from_numpy(lo_min).to(dev)
            n_surv = 0
            n_band = 0
            rows_touched = 0
            canon_parts = []
            cur_chunk = (-1, -1)
            chunk_items = chunk_pids = None
            for q0, q1, g0, g1, S in iter_score_blocks(side.queries, side.gallery, device=dev,
                                                       query_rows=qc, gallery_rows=gb):
                if (q0, q1) != cur_chunk:
                    cur_chunk = (q0, q1)
                    pids = np.arange(poff[q0], poff[q1], dtype=np.int64)
                    o = np.argsort(pi[pids], kind="stable")
                    chunk_pids = pids[o]
                    chunk_items = pi[chunk_pids]
                # exact float32 thresholds of this side: the pass's own scores of the positives
                a, b = np.searchsorted(chunk_items, [g0, g1])
                if b > a:
                    sel = chunk_pids[a:b]
                    rq = torch.from_numpy(pq[sel] - q0).to(dev)
                    rc = torch.from_numpy(pi[sel] - g0).to(dev)
                    canon_parts.append((sel, S[rq, rc]))
                lm = lo_min_t[q0:q1]
                rows = torch.nonzero(S.amax(dim=1) >= lm).squeeze(1)
                if rows.numel() == 0:
                    continue
                rows_touched += int(rows.numel())
                if rows.numel() == S.shape[0]:
                    sub, lmr = S, lm
                else:
                    sub, lmr = S.index_select(0, rows), lm.index_select(0, rows)
                r, col = torch.nonzero(sub >= lmr[:, None], as_tuple=True)
                if r.numel() == 0:
                    continue
                vals = sub[r, col]
                qg = (rows.index_select(0, r) + q0).to(torch.int64)
                xg = (col + g0).to(torch.int64)
                n_surv += int(r.numel())
                keys = _ordered_keys_t(qg, vals)
                flats = []
                for yname in ynames:
                    ty = thr[yname]
                    b_hi = torch.searchsorted(ty.hi_keys, keys, right=False)
                    b_lo = torch.searchsorted(ty.lo_keys, keys, right=True)
                    bucket = b_hi + qg
                    for t in targets:
                        if t.tname == yname:
                            flats.append(t.base + seg_t[curve_seg[t.curve]].index_select(0, xg) * W + bucket)
                    amb = torch.nonzero(b_lo > b_hi).squeeze(1)
                    if amb.numel():
                        n_band += int(amb.numel())
                        band.setdefault((xname, yname), []).append(tuple(
                            z.index_select(0, amb).cpu().numpy()
                            for z in (qg, xg, vals, b_hi, b_lo)))
                if flats:
                    flat = torch.cat(flats) if len(flats) > 1 else flats[0]
                    acc.index_add_(0, flat, torch.ones_like(flat))
                if progress is not None:
                    progress(xname, (q0 * n_items + (q1 - q0) * g1) / float(n_q * n_items))
            for sel, vals in canon_parts:
                tx.canon[sel] = vals.cpu().numpy()
            stats["sides"][xname] = {
                "seconds": time.perf_counter() - t0, "survivors": n_surv, "band_entries": n_band,
                "rows_touched": rows_touched, "dim": int(side.queries.shape[1]),
            }
    if n_real and any(np.isnan(thr[s].canon).any() for s in used):
        raise RuntimeError("internal error: a positive's score was not seen in its side's pass")

    # ------------------------------------------------------------ histograms -> counts
    acc_np = acc.cpu().numpy()
    del acc
    counts_sorted: Dict[int, np.ndarray] = {}   # id(target) -> [nseg, P] in Y-sorted space
    for t in all_targets:
        ty = thr[t.tname]
        H = acc_np[t.base: t.base + t.nseg * W].reshape(t.nseg, W)
        RC = np.zeros((t.nseg, W + 1), dtype=np.int64)
        RC[:, :W] = np.cumsum(H[:, ::-1], axis=1)[:, ::-1]
        tq = ty.sorted_q
        tpos = np.arange(n_pairs, dtype=np.int64)
        counts_sorted[id(t)] = RC[:, tpos + tq + 1] - RC[:, ty.off[tq + 1] + tq + 1]

    # ------------------------------------------------------------ band resolution
    for (xname, yname), parts in band.items():
        ty = thr[yname]
        # ambiguous thresholds of an entry: sorted indices [b_hi, b_lo)
        q_b, x_b, v_b, bhi_b, blo_b = (np.concatenate([p[i] for p in parts]) for i in range(5))
        n_amb = blo_b - bhi_b
        rep = np.repeat(np.arange(q_b.size), n_amb)
        first = np.repeat(np.cumsum(n_amb) - n_amb, n_amb)
        tsorted = bhi_b[rep] + (np.arange(rep.size) - first)
        v = ty.canon[ty.perm[tsorted]]
        item = ty.sorted_item[tsorted]
        vv = v_b[rep]
        above = (vv > v) | ((vv == v) & (x_b[rep] < item))
        xs = x_b[rep][above]
        ts = tsorted[above]
        for t in targets_by_side[xname]:
            if t.tname != yname:
                continue
            segs = seg_np[curve_seg[t.curve]][xs]
            np.add.at(counts_sorted[id(t)], (segs, ts), 1)

    # ------------------------------------------------------------ ranks per curve
    out_curves: List[CurveRanks] = []
    items_counted = {}
    for ci, c in enumerate(curves):
        seg = seg_np[curve_seg[ci]]
        J = len(c.counts)
        csides = c.sides()
        per = {}
        for t in all_targets:
            if t.curve == ci:
                per[(t.role, t.slot)] = counts_sorted[id(t)][:, thr[t.tname].inv]   # pair space
        zero = np.zeros((J + 1, n_pairs), dtype=np.int64)

        def rank_with(slot):
            new_c = per.get((1, slot), zero)
            old_c = per.get((0, slot), zero)
            pn = np.cumsum(new_c, axis=0)[:J]                    # sum_{s <= j} new
            co = np.cumsum(old_c, axis=0)
            so = co[-1][None, :] - co[:J]                        # sum_{s > j} old
            return pn + so

        r_old = rank_with(csides.index(c.old_side))
        r_new = rank_with(csides.index(c.new_side)) if c.new_side is not None else r_old
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
