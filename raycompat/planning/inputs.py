"""The planner's inputs: the backfill curves of candidate new models of one old model.

A result is a ``simulate-backfill`` report folder (its ``curves.json``), that file itself, or
the main job's report folder (``report.json`` beside ``backfill/<model>/curves.json``, one
candidate per model); ``NAME=PATH`` names the candidate (default: the folder's name; in a main
job's folder, the model's, prefixed ``NAME/``). Every candidate must share the old model and
the gallery: the same gallery size, queries and cut-off, and the same old-old reference (same
old model, same queries). Curves are read per fraction of the gallery, so a plan may scale
them to any gallery size (docs/planning.md, "How each number is computed").

Each problem raises one :class:`~raycompat.config.ConfigError` naming the file and what is
wrong.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from raycompat.config import ConfigError

__all__ = [
    "CURVES_FILE",
    "Curve",
    "Estimate",
    "Simulation",
    "load_results",
    "read_simulation",
    "split_name",
]

CURVES_FILE = "curves.json"
MAIN_JOB_REPORT = "report.json"
#: the metric NFR@1 (RACT Eq.12) in ``curves.json``
NFR_METRIC = "NFR@1"
#: the share of queries whose first result is relevant, shown at every milestone
TOP1_METRIC = "top1"
#: relative tolerance of "the same old-old reference" across candidates
SAME_REFERENCE_RTOL = 1e-9


@dataclass(frozen=True)
class Estimate:
    """A value with its bootstrap interval (``low``/``high`` NaN without one)."""

    value: float
    low: float = math.nan
    high: float = math.nan

    @property
    def has_interval(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)


def _interpolated(fraction: float, grid, values, band) -> Estimate:
    """``values`` (and its ``(low, high)`` band, or None) at ``fraction``, linear between grid
    points."""
    pick = lambda a: float(np.interp(fraction, grid, a))  # noqa: E731
    if band is None:
        return Estimate(pick(values))
    return Estimate(pick(values), pick(band[0]), pick(band[1]))


@dataclass(frozen=True)
class Curve:
    """One (policy, mode) curve: the quality metric (mAP@k) with its band and NFR@1 at each grid
    fraction; ``work``: the share of the whole re-embedding done at each point (its time over
    the time of the whole gallery: items, or summed item cost under a cost-aware order)."""

    policy: str
    mode: str
    fractions: np.ndarray
    work: np.ndarray
    quality: np.ndarray
    low: np.ndarray
    high: np.ndarray
    nfr: np.ndarray
    #: its position in ``curves.json`` (its samples' key in ``samples.npz``)
    index: int = -1
    #: with ``quality`` frequency-weighted (a query log): the unweighted quality, shown beside
    plain: np.ndarray | None = None
    #: top-1 (unweighted) at each grid fraction, when the simulation measured it
    top1: np.ndarray | None = None
    #: NFR@1's and top-1's bootstrap bands (``low``, ``high``), when the simulation has them
    nfr_band: tuple[np.ndarray, np.ndarray] | None = None
    top1_band: tuple[np.ndarray, np.ndarray] | None = None

    def at(self, fraction: float) -> tuple[Estimate, float, bool]:
        """``(quality, NFR@1, interpolated)`` at ``fraction``: linear between grid points."""
        f = self.fractions
        interpolated = not bool(np.isclose(f, fraction, rtol=0, atol=1e-12).any())
        quality = _interpolated(fraction, f, self.quality, (self.low, self.high))
        return quality, float(np.interp(fraction, f, self.nfr)), interpolated

    def nfr_at(self, fraction: float) -> Estimate:
        """NFR@1 at ``fraction`` with its band (linear between grid points)."""
        return _interpolated(fraction, self.fractions, self.nfr, self.nfr_band)

    def top1_at(self, fraction: float) -> Estimate:
        """Top-1 at ``fraction`` with its band; NaN when the simulation did not measure it."""
        if self.top1 is None:
            return Estimate(math.nan)
        return _interpolated(fraction, self.fractions, self.top1, self.top1_band)

    def work_at(self, fraction: float) -> float:
        """The share of the whole re-embedding done when ``fraction`` of the items hold their
        new vector (linear between grid points)."""
        return float(np.interp(fraction, self.fractions, self.work))


@dataclass(frozen=True)
class Simulation:
    """One candidate new model: its backfill curves, the old-old and new-new references,
    and the embedding rate its simulation recorded (``cost_model``, or None)."""

    model: str
    path: str
    n_items: int
    n_queries: int
    k: int
    metric: str
    old_old: Estimate
    new_new: Estimate
    #: NFR@1 of new-new against old-old, with its interval (NaN: not measured)
    new_new_nfr: Estimate
    curves: tuple[Curve, ...]
    cost_model: dict | None
    #: the per-query terms of ``metric`` (``samples.npz``), or None
    samples: Any = None
    #: whether the quality is weighted by the query log's frequencies (``plain_references``:
    #: then the unweighted old-old and new-new values)
    weighted: bool = False
    plain_references: dict | None = None
    #: top-1 (unweighted) of the old-old and new-new references; NaN when not measured
    old_old_top1: Estimate = Estimate(math.nan)
    new_new_top1: Estimate = Estimate(math.nan)
    #: the curves.json of each random order merged into this candidate (one: empty;
    #: :func:`raycompat.planning.random_orders.merge_orders`)
    order_paths: tuple[str, ...] = ()

    @property
    def orders(self) -> int:
        """How many random orders (simulations with other seeds) this candidate averages."""
        return max(1, len(self.order_paths))

    @property
    def has_intervals(self) -> bool:
        return self.old_old.has_interval


def _bad(path: str, message: str) -> ConfigError:
    return ConfigError(f"--results {path}: {message}")


def _array(values, path: str, what: str) -> np.ndarray:
    try:
        return np.asarray([math.nan if v is None else float(v) for v in values], dtype=np.float64)
    except (TypeError, ValueError):
        raise _bad(path, f"{what} is not a list of numbers") from None


def _plain_reference(payload: dict, name: str, metric: str) -> Estimate:
    """A reference's unweighted ``metric`` with its interval; NaN when the simulation has none."""
    value = (payload.get("references") or {}).get(name, {}).get(metric)
    if value is None:
        return Estimate(math.nan)
    return _reference(payload, name, metric, "")


def _reference(payload: dict, name: str, metric: str, path: str) -> Estimate:
    value = (payload.get("references") or {}).get(name, {}).get(metric)
    if value is None:
        raise _bad(path, f"no {name} reference of {metric}")
    iv = (payload.get("reference_intervals") or {}).get(name, {}).get(metric) or {}
    low, high = iv.get("low"), iv.get("high")
    return Estimate(
        float(value),
        math.nan if low is None else float(low),
        math.nan if high is None else float(high),
    )


def _work(raw: dict, n_items: int, path: str) -> np.ndarray:
    """The share of the re-embedding at each point: the curve's simulated seconds over its
    last (a cost-aware time axis), else the items re-embedded over the gallery."""
    seconds = raw.get("seconds")
    if seconds and seconds[-1]:
        return _array(seconds, path, "seconds") / float(seconds[-1])
    if raw.get("items_backfilled") is not None:
        return _array(raw["items_backfilled"], path, "items_backfilled") / float(n_items)
    return _array(raw["fractions"], path, "fractions")


def _weighted_of(raw: dict, metric: str) -> dict | None:
    """A curve's frequency-weighted ``{"metrics", "bands"}`` when it has ``metric`` and NFR@1."""
    w = raw.get("weighted") or {}
    have = w.get("metrics") or {}
    return w if metric in have and NFR_METRIC in have else None


def _curve(raw: dict, metric: str, n_items: int, path: str, index: int, weighted: bool) -> Curve:
    """One ``curves[]`` entry of ``curves.json`` (``weighted``: its frequency-weighted metrics,
    the unweighted quality kept as ``plain``)."""
    from raycompat.upgrade.modes import MODES
    from raycompat.upgrade.policies import POLICIES

    policy, mode = raw.get("policy"), raw.get("mode")
    if mode not in MODES:
        raise _bad(path, f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    if mode != "cold" and policy not in POLICIES:
        raise _bad(path, f"unknown policy {policy!r}; allowed: {', '.join(POLICIES)}")
    metrics = raw.get("metrics") or {}
    top1 = _array(metrics[TOP1_METRIC], path, TOP1_METRIC) if TOP1_METRIC in metrics else None
    if metric not in metrics or NFR_METRIC not in metrics:
        raise _bad(path, f"curve {policy} / {mode} has no {metric} or {NFR_METRIC}")
    fractions = _array(raw["fractions"], path, "fractions")
    plain = _array(metrics[metric], path, metric)
    source = _weighted_of(raw, metric) if weighted else None
    if source is not None:
        metrics = source["metrics"]
    quality = _array(metrics[metric], path, metric)
    bands = (source or raw).get("bands") or {}
    band = bands.get(metric) or {}
    nan = np.full_like(quality, math.nan)
    low = _array(band["low"], path, "band") if band.get("low") else nan
    high = _array(band["high"], path, "band") if band.get("high") else nan
    if not (len(fractions) == len(quality) == len(low) == len(high)) or len(fractions) < 2:
        raise _bad(path, f"curve {policy} / {mode}: grid and values differ in length")
    if fractions[0] != 0 or fractions[-1] != 1 or np.any(np.diff(fractions) <= 0):
        raise _bad(path, f"curve {policy} / {mode}: its grid must rise from 0 to 1")
    return Curve(
        policy=str(policy),
        mode=str(mode),
        fractions=fractions,
        work=_work(raw, n_items, path),
        quality=quality,
        low=low,
        high=high,
        nfr=_array(metrics[NFR_METRIC], path, NFR_METRIC),
        index=index,
        plain=plain if source is not None else None,
        top1=top1 if top1 is not None and len(top1) == len(fractions) else None,
        nfr_band=_band(bands, NFR_METRIC, len(fractions), path),
        top1_band=_band(raw.get("bands") or {}, TOP1_METRIC, len(fractions), path),
    )


def _band(bands: dict, metric: str, n: int, path: str) -> tuple[np.ndarray, np.ndarray] | None:
    """``metric``'s ``(low, high)`` band of a curve; None without one (or of another length)."""
    band = bands.get(metric) or {}
    if not band.get("low") or not band.get("high"):
        return None
    low, high = _array(band["low"], path, "band"), _array(band["high"], path, "band")
    return (low, high) if len(low) == len(high) == n else None


def _new_new_nfr(refs: dict, cold: list[Curve], path: str) -> Estimate:
    """New-new's NFR@1 with its interval: its reference, else the cold curve's last point."""
    if ((refs.get("references") or {}).get("new-new") or {}).get(NFR_METRIC) is not None:
        return _reference(refs, "new-new", NFR_METRIC, path)
    return cold[0].nfr_at(1.0) if cold else Estimate(math.nan)


def read_simulation(path: str, model: str, quality: str = "auto") -> Simulation:
    """One ``curves.json`` as the candidate ``model`` (with its ``samples.npz`` when there is
    one: :func:`raycompat.planning.paired.read_samples`)."""
    from raycompat.planning.paired import read_samples

    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, ValueError) as exc:
        raise _bad(path, f"cannot read it: {exc}".splitlines()[0]) from None
    if not isinstance(payload, dict) or not payload.get("curves") or not payload.get("metrics"):
        raise _bad(path, "not a simulate-backfill curves.json (no 'curves' or 'metrics')")
    metric = payload["metrics"][0]
    n_items = int(payload["n_items"])
    weighted = _use_weighted(payload, metric, quality, path)
    curves = tuple(
        _curve(c, metric, n_items, path, i, weighted) for i, c in enumerate(payload["curves"])
    )
    cold = [c for c in curves if c.mode == "cold"]
    refs = _weighted_payload(payload) if weighted else payload
    nn = _reference(refs, "new-new", metric, path)
    nn_nfr = _new_new_nfr(refs, cold, path)
    return Simulation(
        model=model,
        path=path,
        n_items=n_items,
        n_queries=int(payload["n_queries"]),
        k=int(payload["k"]),
        metric=metric,
        old_old=_reference(refs, "old-old", metric, path),
        new_new=nn,
        new_new_nfr=nn_nfr,
        curves=tuple(c for c in curves if c.mode != "cold"),
        cost_model=payload.get("cost_model"),
        samples=read_samples(path, metric, len(curves), payload.get("bootstrap"), weighted),
        weighted=weighted,
        old_old_top1=_plain_reference(payload, "old-old", TOP1_METRIC),
        new_new_top1=_plain_reference(payload, "new-new", TOP1_METRIC),
        plain_references={
            n: _reference(payload, n, metric, path).value for n in ("old-old", "new-new")
        }
        if weighted
        else None,
    )


def _use_weighted(payload: dict, metric: str, quality: str, path: str) -> bool:
    """Whether to plan on the frequency-weighted curves: ``auto`` when every curve and both
    references have them (a simulation with a query log), ``weighted`` requires them."""
    curves = payload.get("curves") or []
    refs = payload.get("weighted_references") or {}
    have = all(_weighted_of(c, metric) for c in curves if c.get("mode") != "cold") and all(
        metric in (refs.get(n) or {}) for n in ("old-old", "new-new")
    )
    if quality == "weighted" and not have:
        raise _bad(
            path,
            f"--quality weighted: no frequency-weighted {metric} (simulate with --query-log or "
            "--zipf-exponent)",
        )
    return have and quality != "unweighted"


def _weighted_payload(payload: dict) -> dict:
    """The weighted references in the shape :func:`_reference` reads."""
    refs, intervals = {}, {}
    for name, metrics in (payload.get("weighted_references") or {}).items():
        refs[name] = {m: v.get("value") for m, v in metrics.items()}
        intervals[name] = {
            m: {"low": v.get("low"), "high": v.get("high")} for m, v in metrics.items()
        }
    return {"references": refs, "reference_intervals": intervals}


def split_name(entry: str) -> tuple[str | None, str]:
    """``NAME=PATH`` -> ``(NAME, PATH)``; a bare path -> ``(None, PATH)``."""
    name, sep, path = entry.partition("=")
    if sep and name and os.sep not in name:
        return name.strip(), path.strip()
    return None, entry.strip()


def _main_job_models(folder: str) -> list[tuple[str, str]]:
    """``(model, curves.json)`` of each model of a main job's report folder."""
    root = os.path.join(folder, "backfill")
    if not os.path.isdir(root):
        return []
    return [
        (m, os.path.join(root, m, CURVES_FILE))
        for m in sorted(os.listdir(root))
        if os.path.isfile(os.path.join(root, m, CURVES_FILE))
    ]


def _entries(entry: str) -> list[tuple[str, str]]:
    """``(model, curves.json)`` of one ``--results`` entry."""
    name, path = split_name(entry)
    if os.path.isfile(path):
        return [(name or os.path.basename(os.path.dirname(os.path.abspath(path))), path)]
    if not os.path.isdir(path):
        raise _bad(path, "not found")
    if os.path.isfile(os.path.join(path, CURVES_FILE)):
        return [(name or os.path.basename(os.path.abspath(path)), os.path.join(path, CURVES_FILE))]
    models = _main_job_models(path) if os.path.isfile(os.path.join(path, MAIN_JOB_REPORT)) else []
    if not models:
        raise _bad(
            path,
            f"holds no simulation: no {CURVES_FILE} (a simulate-backfill report) and no "
            f"{MAIN_JOB_REPORT} with backfill/<model>/{CURVES_FILE} (a main-job report)",
        )
    return [(f"{name}/{m}" if name else m, p) for m, p in models]


def _check_same_old_and_gallery(sims: list[Simulation]) -> None:
    """Every candidate measured on the first one's gallery, queries and old model."""
    first = sims[0]
    for s in sims[1:]:
        if (s.n_items, s.n_queries, s.k) != (first.n_items, first.n_queries, first.k):
            raise _bad(
                s.path,
                f"{s.n_items:,} gallery items, {s.n_queries:,} queries, k={s.k}; "
                f"{first.path}: {first.n_items:,}, {first.n_queries:,}, k={first.k}: "
                "curves of different galleries",
            )
        a, b = s.old_old.value, first.old_old.value
        if not math.isclose(a, b, rel_tol=SAME_REFERENCE_RTOL, abs_tol=1e-15):
            raise _bad(
                s.path,
                f"old-old {s.metric} {a:.6g}, {first.path}: {b:.6g}: curves of different old "
                "models (or query sets)",
            )


def load_results(entries, quality: str = "auto") -> list[Simulation]:
    """Every candidate of the ``--results`` entries, checked to share one old model and one
    gallery. A name given to several simulations (``NAME=A,NAME=B``) is one candidate over
    several random orders (:func:`raycompat.planning.random_orders.merge_orders`); a bare
    path that names a candidate twice is an error. ``quality``: ``auto`` (frequency-weighted
    when every simulation has a query log), ``weighted`` or ``unweighted``."""
    from raycompat.planning.random_orders import merge_orders

    found = [(named, pair) for entry in entries for named, pair in _named_entries(entry)]
    if not found:
        raise ConfigError("--results: give at least one simulation")
    names = [m for _, (m, _) in found]
    twice = sorted({m for named, (m, _) in found if not named and names.count(m) > 1})
    if twice:
        raise ConfigError(
            f"--results: candidate {twice[0]!r} named twice; name them with NAME=PATH (one "
            "name on several simulations of one gallery with other --seed: its random orders)"
        )
    pairs = [pair for _, pair in found]
    sims = [read_simulation(path, model, quality) for model, path in pairs]
    if quality == "auto" and len({s.weighted for s in sims}) > 1:
        sims = [read_simulation(path, model, "unweighted") for model, path in pairs]
    grouped = {}
    for s in sims:
        grouped.setdefault(s.model, []).append(s)
    sims = [merge_orders(group) for group in grouped.values()]
    _check_same_old_and_gallery(sims)
    return sims


def _named_entries(entry: str) -> list[tuple[bool, tuple[str, str]]]:
    """:func:`_entries`, each marked with whether its entry gave a name (``NAME=PATH``)."""
    named = split_name(entry)[0] is not None
    return [(named, pair) for pair in _entries(entry)]


#: a bundle's training time, beside its manifest (raycompat.train.loop.TRAINING)
TRAINING_FILE = "training.json"


def simulation_bundle(sim: Simulation) -> str | None:
    """The ``--new-model`` bundle that ``sim``'s simulation used (its folder's job.json), when
    it is still on disk."""
    job = os.path.join(os.path.dirname(sim.path), "job.json")
    if not os.path.isfile(job):
        return None
    with open(job) as fh:
        path = (json.load(fh).get("config") or {}).get("new_model")
    return path if path and os.path.isdir(str(path)) else None


def bundle_training(sims, device_kind: str, new_model: str | None = None):
    """``((model, device-hours), ...), notes``: each candidate's training read from its
    bundle's ``training.json`` (the bundle of its simulation, or ``new_model``), counted when it
    trained on ``device_kind`` (device-hours of another kind of device are not these)."""
    found, notes = [], []
    for s in sims:
        bundle = new_model or simulation_bundle(s)
        path = None if bundle is None else os.path.join(bundle, TRAINING_FILE)
        if path is None or not os.path.isfile(path):
            continue
        try:
            with open(path) as fh:
                rec = json.load(fh)
            hours, kind = float(rec["device_hours"]), str(rec["device"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not a training record ({exc})") from None
        if kind != device_kind:
            notes.append(
                f"{s.model}: its bundle trained {hours:.3g} device-hours on {kind}, the plan is "
                f"for {device_kind}: not counted (give --training-hours)"
            )
            continue
        found.append((s.model, hours))
        notes.append(
            f"{s.model}: training {hours:.3g} device-hours on {kind} ({rec.get('epochs')} "
            f"epochs, {rec.get('workers')} worker(s)), read from {path}"
        )
    return tuple(found), tuple(notes)
