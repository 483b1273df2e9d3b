"""The positives' thresholds: canonical values, error bands, merged per pass side and located.

A positive pair's threshold on a score side is its canonical score ``v64``
(:func:`raycompat.index.canonical.pair_scores`); every float32 pass score lies within a
guaranteed band ``delta`` of its own canonical score
(:func:`raycompat.index.canonical.float32_score_error`), so a score is either decided against a
threshold at once or kept as a near-tie to be resolved exactly after the pass (docs/methods.md,
"Ranking rule and the canonical score").  A pass over side X compares its scores with the
thresholds of every side that shares a curve with X, merged and sorted per query
(:class:`MergedThresholds`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch

from raycompat.index.canonical import float32_score_error, pair_scores_at
from raycompat.upgrade.score_sides import SideSummary

__all__ = ["TABLE_MAX", "key_span", "ThresholdValues", "MergedThresholds"]

#: most thresholds per query for which survivors are located in per-query float32 tables
#: (beyond it the [survivors, thresholds] gather costs more than one float64 sorted search)
TABLE_MAX = 32


# With more than TABLE_MAX thresholds per query, a survivor (query q, score v) is located
# among the thresholds of all queries at once with one sorted search on the float64 key
# fl(q * C + v).  For a fixed q the key is
# non-decreasing in v (rounding is monotone), and |v| < C/2 keeps queries apart.  Keys
# may merge two close values; that can only turn a decided comparison into an ambiguous
# one (resolved exactly after the pass), never into a wrong decision:
#   key(v) > key(hi)  =>  v > hi;      v >= lo  =>  key(v) >= key(lo).


def key_span(norms: Sequence[tuple[np.ndarray, float]]) -> float:
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


class ThresholdValues:
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


class MergedThresholds:
    """All thresholds a pass over side X is compared with (those of every side that
    shares a curve with X), merged per query and sorted by value.

    An item of X's pass is located among its query's thresholds by its score:
    ``b_hi`` thresholds have an upper edge below the score (decided: the item
    precedes them), thresholds in ``[b_hi, b_lo)`` are ambiguous (resolved exactly
    after all passes), the others are decided above it.  With at most
    ``TABLE_MAX`` thresholds per query the search runs in the query's own row of
    a float32 edge table (a few comparisons, exact float32 edges); with more, one
    sorted search over all queries' edges on float64 keys (see key_span), whose
    cost grows only with the logarithm of the number of thresholds.
    """

    def __init__(
        self,
        ynames: list[str],
        values: dict[str, ThresholdValues],
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
        # float32 edges in merged order (what the fused kernel searches per query)
        self.lo_edges, self.hi_edges = np.ascontiguousarray(lo), np.ascontiguousarray(hi)
        self.lo_min = np.full(n_queries, np.inf, dtype=np.float32)
        has = self.off[1:] > self.off[:-1]
        self.lo_min[has] = lo[self.off[:-1][has]]
        self.width = m + n_queries
        self.rowoff = torch.from_numpy(self.off[:-1] + np.arange(n_queries)).to(device)
        self.tmax = int((self.off[1:] - self.off[:-1]).max(initial=0))
        self._set_keys(lo, hi, n_queries, span, device)
        self.use_table = self.tmax <= TABLE_MAX
        if self.use_table:
            self._set_tables(lo, hi, n_queries, device)

    def to(self, device: torch.device) -> MergedThresholds:
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
        """float64 keys ``q*C + edge`` of every edge (see key_span); edges clamped to
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
