"""Quality-hours with their bootstrap intervals, and each option against the best by a paired
interval (docs/planning.md, "Comparing options").

An option's quality-hours are a weighted sum of the values at its timeline's points (the
trapezoid rule is linear in them): :func:`point_weights`.  Each point's value is a metric of
the simulation (a curve's value at one grid point, or the old-old / new-new reference), whose
per-query terms the simulation wrote to ``samples.npz``.  Resampling the query classes once
(:class:`~raycompat.metrics.bootstrap.Bootstrap`) and computing every option's quality-hours on
the same resamples gives each option's interval and the *paired* interval of its difference to
the best option: the classes that make one option look good make the other look good too, so
the difference is measured far more sharply than the two intervals side by side suggest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from raycompat.config import ConfigError
from raycompat.metrics.bootstrap import Bootstrap, BootstrapOptions, Interval, Sample

__all__ = [
    "SAMPLES_FILE",
    "QualitySamples",
    "Comparison",
    "compare_options",
    "point_weights",
    "read_samples",
    "with_seeds",
]

SAMPLES_FILE = "samples.npz"
QUERIES = "queries"


@dataclass(frozen=True)
class QualitySamples:
    """One simulation's per-query terms of its quality metric: ``curves[i]`` for the i-th curve
    of its ``curves.json``, ``references`` by name (``old-old``, ``new-new``)."""

    query_labels: np.ndarray
    curves: tuple[Sample | None, ...]
    references: dict[str, Sample]
    options: BootstrapOptions


def read_samples(
    curves_path: str, metric: str, n_curves: int, bootstrap: dict | None, weighted: bool = False
):
    """The ``samples.npz`` beside ``curves_path`` (None when there is none, or the simulation
    had no bootstrap; ``weighted``: the frequency-weighted terms, the log's queries resampled);
    a file that does not match its ``curves.json`` is a ConfigError."""
    path = os.path.join(os.path.dirname(os.path.abspath(curves_path)), SAMPLES_FILE)
    if not bootstrap or not os.path.isfile(path):
        return None
    try:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--results {path}: cannot read it: {exc}".splitlines()[0]) from None

    prefix = "weighted:" if weighted else ""

    def sample(key: str) -> Sample | None:
        key = prefix + key
        if f"{key}|{metric}|num" not in arrays:
            return None
        return Sample(QUERIES, arrays[f"{key}|{metric}|num"], arrays[f"{key}|{metric}|den"])

    labels = arrays.get("query_labels")
    if weighted and f"weighted:ref:old-old|{metric}|num" in arrays:  # each log query its own
        labels = np.arange(arrays[f"weighted:ref:old-old|{metric}|num"].shape[1])
    refs = {n: sample(f"ref:{n}") for n in ("old-old", "new-new")}
    if labels is None or refs["old-old"] is None:
        raise ConfigError(f"--results {path}: no query_labels or old-old samples of {metric}")
    curves = tuple(sample(f"curve{i}") for i in range(n_curves))
    if any(s is not None and s.num.shape[1] != len(labels) for s in curves):
        raise ConfigError(f"--results {path}: samples of another query set than its labels")
    options = BootstrapOptions(
        resamples=int(bootstrap["resamples"]),
        confidence=float(bootstrap["confidence"]),
        bootstrap_seed=int(bootstrap["bootstrap_seed"]),
    )
    return QualitySamples(labels, curves, {n: s for n, s in refs.items() if s}, options)


def point_weights(timeline, horizon: float) -> np.ndarray:
    """``w`` with ``quality_hours = w @ values`` for any values at the timeline's points."""
    eye = np.eye(len(timeline.hours))
    return np.array([timeline.quality_hours(horizon, values=e) for e in eye])


@dataclass(frozen=True)
class Comparison:
    """An option's quality-hours with its interval, and its paired difference to the best
    option (``None`` for the best itself) with the verdict: ``worse`` (the interval is below
    0), ``better`` (above 0: a reference or an option that breaks a constraint can beat the best
    deployable one) or ``indistinguishable``."""

    quality_hours: Interval
    vs_best: Interval | None
    verdict: str


def compare_options(
    assessed, sources, best_index: int, *, horizon: float, options: BootstrapOptions, labels
) -> list[Comparison] | None:
    """Every assessed option's :class:`Comparison` against option ``best_index``, on the
    query classes ``labels`` resampled once; ``sources[i]``: for option ``i``, the sample
    behind each timeline point as ``(Sample, grid index or None)``, or None when a point of it
    has no sample (then no comparison is made: None)."""
    if any(s is None for s in sources):
        return None
    # one draw of the seeds for all: a candidate over several random orders has them as seeds,
    # every other sample repeats its one (docs/planning.md, "Several random orders")
    seeds = max(sample.seeds for point_sources in sources for sample, _ in point_sources)
    widened: dict[int, Sample] = {}
    for point_sources in sources:
        for s, _ in point_sources:
            if id(s) not in widened:
                widened[id(s)] = with_seeds(s, seeds)
    sources = [[(widened[id(s)], j) for s, j in point_sources] for point_sources in sources]
    samples = {id(sample): sample for point_sources in sources for sample, _ in point_sources}
    boot = Bootstrap(options, seeds=seeds)
    boot.add_query_set(QUERIES, labels)
    keys = {k: f"s{n}" for n, k in enumerate(samples)}
    named = {keys[k]: s for k, s in samples.items()}
    weights = [point_weights(a.option.timeline, horizon) for a in assessed]

    def quality_hours(i: int, m: dict):
        cols = [m[keys[id(s)]] if j is None else m[keys[id(s)]][..., j] for s, j in sources[i]]
        return sum(w * c for w, c in zip(weights[i], cols, strict=True))

    def used(*options: int) -> dict:  # only the samples these options read: each is resampled
        return {keys[id(s)]: named[keys[id(s)]] for i in options for s, _ in sources[i]}

    out = []
    for i in range(len(assessed)):
        own = boot.interval(lambda i=i, **m: quality_hours(i, m), **used(i))
        if i == best_index:
            out.append(Comparison(own, None, "best"))
            continue
        diff = boot.interval(
            lambda i=i, **m: quality_hours(i, m) - quality_hours(best_index, m),
            **used(i, best_index),
        )
        verdict = "worse" if diff.high < 0 else "better" if diff.low > 0 else "indistinguishable"
        out.append(Comparison(own, diff, verdict))
    return out


def with_seeds(sample: Sample, seeds: int) -> Sample:
    """``sample`` with ``seeds`` seeds: a one-seed sample repeated (the same terms in every
    draw: a curve that does not depend on the order), so that it resamples beside the curves of
    several random orders."""
    if sample.seeds == seeds:
        return sample
    if sample.seeds != 1:
        raise ValueError(f"a sample of {sample.seeds} seeds cannot stand beside {seeds}")
    return Sample(
        sample.query_set,
        np.repeat(sample.num, seeds, axis=0),
        np.repeat(sample.den, seeds, axis=0),
    )
