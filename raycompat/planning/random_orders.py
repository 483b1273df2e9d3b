"""Several random orders of one candidate (docs/planning.md, "Several random orders").

A random order is one draw: two seeds of ``random`` on one gallery give quality-hours that
differ by as much as two policies do. ``--results NAME=A,NAME=B,...`` (one name, several
simulations of one gallery that differ only in ``--seed``) plans them as one candidate:

* each curve's values (quality, NFR@1, top-1, the work axis) are the mean over the orders;
* its per-query terms are stacked with the orders as the bootstrap's seeds
  (:meth:`raycompat.metrics.bootstrap.Sample.stacked`), so every interval and paired
  comparison resamples the orders and the query classes (a hierarchical bootstrap); a curve
  whose order does not depend on the seed has identical terms in every order and keeps its
  interval;
* its quality band is that bootstrap's; NFR@1's and top-1's bands are the envelope of the
  orders' bands (their per-query terms are not kept).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np

from raycompat.config import ConfigError
from raycompat.metrics.bootstrap import Bootstrap, Sample
from raycompat.planning.paired import QUERIES

__all__ = ["merge_orders"]


def _seed(sim) -> int | None:
    with open(sim.path) as fh:
        return (json.load(fh).get("config") or {}).get("seed")


def _check(sims) -> None:
    """The simulations of one candidate: one gallery, one set of curves, distinct seeds."""
    first, name = sims[0], sims[0].model
    seeds = [_seed(s) for s in sims]
    for i, (s, seed) in enumerate(zip(sims, seeds, strict=True)):
        if seed in seeds[:i]:
            raise ConfigError(
                f"--results {name}: {s.path} and {sims[seeds.index(seed)].path} are both seed "
                f"{seed}: the same random order twice (simulate the others with --seed)"
            )
    for s in sims[1:]:
        same = (s.n_items, s.n_queries, s.k, s.metric, s.weighted) == (
            first.n_items,
            first.n_queries,
            first.k,
            first.metric,
            first.weighted,
        )
        curves = [(c.policy, c.mode, tuple(c.fractions)) for c in s.curves]
        if not same or curves != [(c.policy, c.mode, tuple(c.fractions)) for c in first.curves]:
            raise ConfigError(
                f"--results {name}: {s.path} is not {first.path} with another seed (its gallery, "
                "queries, k, metric, curves or grid differ): name another candidate otherwise"
            )
        for ref in ("old_old", "new_new"):
            a, b = getattr(s, ref).value, getattr(first, ref).value
            if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15):
                raise ConfigError(
                    f"--results {name}: {s.path}'s {ref.replace('_', '-')} {first.metric} is "
                    f"{a:.6g}, {first.path}'s {b:.6g}: another gallery or model, not another seed"
                )


def _mean(arrays) -> np.ndarray | None:
    if any(a is None for a in arrays):
        return None
    return np.mean(np.stack(arrays), axis=0)


def _envelope(bands):
    if any(b is None for b in bands):
        return None
    return np.min([b[0] for b in bands], axis=0), np.max([b[1] for b in bands], axis=0)


def _stack(samples) -> Sample | None:
    if any(s is None for s in samples):
        return None
    out = samples[0]
    for s in samples[1:]:
        out = out.stacked(s)
    return out


def _merged_samples(sims):
    """The orders' samples stacked as seeds (None when one of them has none)."""
    all_samples = [s.samples for s in sims]
    if any(q is None for q in all_samples):
        return None
    first = all_samples[0]
    if any(not np.array_equal(q.query_labels, first.query_labels) for q in all_samples[1:]):
        return None
    curves = tuple(_stack(c) for c in zip(*(q.curves for q in all_samples), strict=True))
    refs = {
        n: _stack([q.references.get(n) for q in all_samples])
        for n in first.references
        if all(n in q.references for q in all_samples)
    }
    return replace(first, curves=curves, references=refs)


def _quality_band(sample: Sample | None, samples, fallback):
    """The bootstrap band of a stacked curve sample; ``fallback`` without samples."""
    if sample is None or samples is None:
        return fallback
    boot = Bootstrap(samples.options, seeds=sample.seeds)
    boot.add_query_set(QUERIES, samples.query_labels)
    band = boot.interval(curve=sample)
    return np.asarray(band["low"], np.float64), np.asarray(band["high"], np.float64)


def merge_orders(sims) -> object:
    """One :class:`~raycompat.planning.inputs.Simulation` from several simulations of one
    candidate that differ only in their seed (module docstring)."""
    if len(sims) == 1:
        return sims[0]
    _check(sims)
    samples = _merged_samples(sims)
    curves = []
    for parts in zip(*(s.curves for s in sims), strict=True):
        c = parts[0]
        sample = None if samples is None else samples.curves[c.index]
        low, high = _quality_band(
            sample, samples, _envelope([(p.low, p.high) for p in parts]) or (c.low, c.high)
        )
        curves.append(
            replace(
                c,
                work=_mean([p.work for p in parts]),
                quality=_mean([p.quality for p in parts]),
                low=low,
                high=high,
                nfr=_mean([p.nfr for p in parts]),
                plain=_mean([p.plain for p in parts]),
                top1=_mean([p.top1 for p in parts]),
                nfr_band=_envelope([p.nfr_band for p in parts]),
                top1_band=_envelope([p.top1_band for p in parts]),
            )
        )
    return replace(
        sims[0],
        curves=tuple(curves),
        samples=samples,
        order_paths=tuple(s.path for s in sims),
    )
