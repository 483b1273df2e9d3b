"""Bootstrap intervals over queries (and training seeds) for every retrieval number in a report.

docs/methods.md, "Uncertainty". A retrieval metric is a ratio of two sums over the queries of a
query set: ``mAP@k = sum(AP_q) / #valid``, ``top1 = sum(correct_q) / #valid``,
``NFR@1 = sum(flip_q) / sum(old-old correct_q)`` (RACT Eq.12). A :class:`Sample` holds those
per-query terms, one row per training seed. :class:`Bootstrap` draws the resamples once per
query set (seeded): classes are drawn with replacement and every query of a drawn class comes
with it (queries of one class share its gallery positives, so they are not independent), and
with more than one seed the seeds are drawn with replacement too (hierarchical bootstrap).
Statistics of several samples of the same query set use the same draws: comparisons are paired.
The interval is the percentile interval of the statistic over the resamples. A resample whose
statistic is undefined (NaN: e.g. no old-old success drawn for NFR) is dropped and counted
(``dropped``); when more than :data:`MAX_DROPPED_FRACTION` of the resamples were dropped there
is no interval: ``low``/``high`` are NaN, verdicts read it as inconclusive and reports print
"no interval".
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from raycompat.config import option, positive

__all__ = ["MAX_DROPPED_FRACTION", "Bootstrap", "BootstrapOptions", "Interval", "Sample"]

#: the largest fraction of resamples an interval may drop for an undefined statistic
MAX_DROPPED_FRACTION = 0.01


@dataclass(frozen=True)
class BootstrapOptions:
    """How intervals are computed: resamples, confidence level, seed of the draws."""

    resamples: int = positive(1000, help="bootstrap resamples of every interval")
    confidence: float = option(0.95, help="confidence level of the intervals", min=0.5)
    bootstrap_seed: int = option(0, help="seed of the bootstrap draws", min=0)

    def __post_init__(self):
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"confidence must be in [0.5, 1), got {self.confidence}")


@dataclass(frozen=True)
class Sample:
    """Per-query terms of one metric on query set ``query_set``: the metric of seed s is
    ``num[s].sum(0) / den[s].sum()``. ``num``: ``[S, n, *shape]`` (``shape``: e.g. the grid
    points of a curve); ``den``: ``[S, n]`` (1 for a query that counts, 0 for one that does
    not: no positive in the gallery, or for NFR not correct under old-old)."""

    query_set: str
    num: np.ndarray
    den: np.ndarray

    @classmethod
    def mean(cls, query_set: str, values) -> Sample:
        """The mean of per-query ``values`` (``[n, ...]``, one seed; :meth:`stacked` adds
        seeds); ``nan`` marks a query that does not count (the metrics' convention for queries
        without positives)."""
        v = np.asarray(values, dtype=np.float64)[None]
        valid = np.isfinite(v).reshape(1, v.shape[1], -1).all(axis=2)
        return cls(query_set, np.where(np.isfinite(v), v, 0.0), valid.astype(np.float64))

    @classmethod
    def rate(cls, query_set: str, hits, base) -> Sample:
        """``sum(hits & base) / sum(base)``: NFR with ``hits`` the flips (``[n, ...]``) and
        ``base`` old-old top-1 correctness (``[n]``); one seed."""
        h = np.asarray(hits, dtype=np.float64)[None]
        b = np.asarray(base, dtype=np.float64)[None]
        bb = b.reshape(b.shape + (1,) * (h.ndim - b.ndim))
        return cls(query_set, h * bb, b)

    @property
    def seeds(self) -> int:
        return int(self.num.shape[0])

    def value(self) -> np.ndarray:
        """``[S, *shape]``: the metric of every seed."""
        return _ratio(self.num.sum(axis=1), self.den.sum(axis=1))

    def stacked(self, other: Sample) -> Sample:
        """``self`` and ``other`` (the same queries, another seed) as one sample."""
        if other.query_set != self.query_set or other.num.shape[1:] != self.num.shape[1:]:
            raise ValueError(
                f"cannot stack samples of {self.query_set!r} {self.num.shape} and "
                f"{other.query_set!r} {other.num.shape}"
            )
        return Sample(
            self.query_set,
            np.concatenate([self.num, other.num]),
            np.concatenate([self.den, other.den]),
        )


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    den = den.reshape(den.shape + (1,) * (num.ndim - den.ndim))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


@dataclass(frozen=True)
class Interval:
    """A statistic with its bootstrap interval: ``estimate`` (the mean over seeds of the
    statistic on all queries), ``low``/``high`` (the ``confidence`` percentile interval),
    ``queries`` and ``classes`` behind it, ``seeds`` and the per-seed values; ``dropped`` of the
    ``resamples`` had an undefined statistic (:attr:`refused`: too many, no interval)."""

    estimate: float
    low: float
    high: float
    confidence: float
    queries: int
    classes: int
    seeds: int = 1
    per_seed: tuple = ()
    dropped: int = 0
    resamples: int = 0

    @property
    def refused(self) -> bool:
        """More than :data:`MAX_DROPPED_FRACTION` of the resamples were dropped: no interval."""
        return bool(too_many_dropped(self.dropped, self.resamples))

    @property
    def spread(self) -> float:
        """Standard deviation of the statistic across seeds (0 with one seed)."""
        v = np.asarray(self.per_seed, dtype=np.float64)
        return float(v.std(ddof=1)) if v.size > 1 else 0.0

    def to_dict(self) -> dict:
        out = dict(
            value=self.estimate,
            low=self.low,
            high=self.high,
            confidence=self.confidence,
            queries=self.queries,
            classes=self.classes,
            seeds=self.seeds,
            resamples=self.resamples,
            dropped=self.dropped,
        )
        if self.refused:
            out["refused"] = True
        if self.seeds > 1:
            out.update(per_seed=list(self.per_seed), seed_std=self.spread)
        return out

    def text(self, digits: int = 3) -> str:
        """``0.412 [0.398, 0.427]`` (with ``± std`` across seeds when there are several, and the
        resamples dropped when there were any); ``0.412 [no interval: ...]`` when refused."""
        f = f"{{:.{digits}f}}"
        dropped = f"{self.dropped} of {self.resamples} resamples undefined"
        if self.refused:
            return f"{f.format(self.estimate)} [no interval: {dropped}]"
        s = f"{f.format(self.estimate)} [{f.format(self.low)}, {f.format(self.high)}]"
        s += f" ±{f.format(self.spread)} sd" if self.seeds > 1 else ""
        return s + (f" ({dropped})" if self.dropped else "")


def too_many_dropped(dropped, resamples):
    """Whether ``dropped`` of ``resamples`` is more than :data:`MAX_DROPPED_FRACTION` (arrays
    elementwise)."""
    return np.asarray(dropped) > MAX_DROPPED_FRACTION * resamples if resamples else False


def name_seed(name: str) -> int:
    """A stable 128-bit seed from the whole of ``name`` (SHA-256; Python's ``hash`` is salted
    per process)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:16], "little")


@dataclass
class _Draws:
    groups: np.ndarray
    weights: np.ndarray  # [B, n]: how often each query is drawn
    classes: int


@dataclass
class Bootstrap:
    """Seeded resampling of query sets and seeds (see the module docstring). Register each
    query set with its query labels (:meth:`add_query_set`), then ask for intervals."""

    options: BootstrapOptions = field(default_factory=BootstrapOptions)
    seeds: int = 1
    _sets: dict = field(default_factory=dict)
    _seed_weights: np.ndarray | None = None

    def __post_init__(self):
        rng = np.random.default_rng([self.options.bootstrap_seed, 1])
        B, S = self.options.resamples, max(1, int(self.seeds))
        self._seed_weights = (
            rng.multinomial(S, np.full(S, 1.0 / S), size=B).astype(np.float64) / S
            if S > 1
            else np.ones((B, 1))
        )

    def add_query_set(self, name: str, query_labels) -> None:
        """Draw the resamples of query set ``name`` (seeded by its name, so the draws do not
        depend on the order the sets are added). Re-adding the same labels is a no-op."""
        groups = np.asarray(query_labels)
        known = self._sets.get(name)
        if known is not None:
            if not np.array_equal(known.groups, groups):
                raise ValueError(f"query set {name!r} was registered with other query labels")
            return
        _, inverse = np.unique(groups, return_inverse=True)
        n_classes = int(inverse.max()) + 1 if inverse.size else 0
        rng = np.random.default_rng([self.options.bootstrap_seed, 2, name_seed(name)])
        counts = rng.multinomial(
            n_classes, np.full(n_classes, 1.0 / max(1, n_classes)), size=self.options.resamples
        )
        self._sets[name] = _Draws(groups, counts[:, inverse].astype(np.float64), n_classes)

    def _draws(self, sample: Sample) -> _Draws:
        d = self._sets.get(sample.query_set)
        if d is None:
            raise KeyError(f"query set {sample.query_set!r} is not registered (add_query_set)")
        if sample.num.shape[1] != d.groups.shape[0]:
            raise ValueError(
                f"sample of {sample.query_set!r} has {sample.num.shape[1]} queries, the query "
                f"set {d.groups.shape[0]}"
            )
        if sample.seeds != self._seed_weights.shape[1]:
            raise ValueError(
                f"sample of {sample.query_set!r} has {sample.seeds} seeds, the bootstrap "
                f"{self._seed_weights.shape[1]}"
            )
        return d

    def resampled(self, sample: Sample) -> np.ndarray:
        """``[B, S, *shape]``: the metric of every seed on every resample of the queries."""
        w = self._draws(sample).weights
        num = np.einsum("bn,sn...->bs...", w, sample.num)
        den = np.einsum("bn,sn->bs", w, sample.den)
        return _ratio(num, den)

    def interval(self, statistic: Callable[..., np.ndarray] | None = None, **samples: Sample):
        """The interval of ``statistic(**metrics)`` where each metric is the value of one
        sample (arrays whose leading axes are broadcast: per seed, per resample). Without
        ``statistic`` there must be exactly one sample and the interval is of its metric.
        Returns an :class:`Interval` for a scalar statistic, else a dict of arrays
        ``{estimate, low, high, dropped}`` (curves; ``dropped`` per point). Resamples with an
        undefined (NaN) statistic are dropped and counted; past :data:`MAX_DROPPED_FRACTION` of
        them the bounds are NaN (no interval)."""
        if statistic is None:
            if len(samples) != 1:
                raise ValueError("without a statistic, give exactly one sample")
            (only,) = samples

            def statistic(**m):
                return m[only]

        point = np.asarray(statistic(**{k: s.value() for k, s in samples.items()}))  # [S, ...]
        boot = np.asarray(statistic(**{k: self.resampled(s) for k, s in samples.items()}))
        sw = self._seed_weights.reshape(self._seed_weights.shape + (1,) * (boot.ndim - 2))
        boot = (boot * sw).sum(axis=1)  # [B, ...]: seeds drawn with replacement
        alpha = (1.0 - self.options.confidence) / 2.0
        with warnings.catch_warnings(), np.errstate(invalid="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN statistic stays NaN
            low, high = np.nanquantile(boot, [alpha, 1.0 - alpha], axis=0)
        dropped = np.isnan(boot).sum(axis=0)
        refused = too_many_dropped(dropped, boot.shape[0])
        low, high = np.where(refused, np.nan, low), np.where(refused, np.nan, high)
        estimate = point.mean(axis=0)
        if estimate.ndim:
            return dict(estimate=estimate, low=low, high=high, dropped=dropped)
        sets = [self._sets[name] for name in sorted({s.query_set for s in samples.values()})]
        return Interval(
            estimate=float(estimate),
            low=float(low),
            high=float(high),
            confidence=self.options.confidence,
            queries=sum(int(d.groups.shape[0]) for d in sets),
            classes=sum(d.classes for d in sets),
            seeds=int(point.shape[0]),
            per_seed=tuple(float(x) for x in np.atleast_1d(point)),
            dropped=int(dropped),
            resamples=int(boot.shape[0]),
        )
