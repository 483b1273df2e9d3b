"""Each option of an upgrade on the wall clock: when it reaches each fraction of the gallery,
what that costs, and the search quality it serves at every hour (docs/planning.md, "How each
number is computed").

An option is a candidate (model x policy x query mode), a cold refresh of a model (the old
system serves until every item is re-embedded, then the new model), or staying on the old
model. For ``N`` items on ``d`` devices at ``r`` items/s per device after a start-up ``s0``:

* the adapted mode first refreshes every stored old vector with psi, ``P = N / (psi * d)``
  seconds, serving the old system meanwhile;
* fraction ``f`` of the items hold their new vector at ``P + s0 + w(f) * N / (r * d)`` seconds,
  ``w(f)`` the share of the re-embedding done by then (``f`` itself unless the order is
  cost-aware);
* cost at ``h`` hours: ``h * (d + e) * price``, ``e`` the extra devices a second search per
  query keeps busy (:class:`~raycompat.planning.rates.SearchLoad`);
* quality: the curve's mAP@k (with its band) at each grid point, linear in between, the old
  system's value (old-old) before an option serves anything new, and the last value held after
  its end. Quality-hours: the trapezoid integral of it over ``[0, H]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from raycompat.planning.inputs import Curve, Estimate, Simulation
from raycompat.planning.rates import EmbeddingRate, PsiRate, SearchLoad
from raycompat.upgrade.modes import mode_spec

__all__ = [
    "MILESTONES",
    "REFERENCE_POLICIES",
    "Hardware",
    "Milestone",
    "Option",
    "Timeline",
    "candidate_option",
    "cold_refresh_option",
    "FixedCosts",
    "end_and_cost_on",
    "stay_on_old_option",
]

#: the fractions of the gallery each option is reported at: the switch-on point (0 %: the new
#: model deployed, nothing re-embedded yet) first
MILESTONES = (0.0, 0.25, 0.5, 0.9, 1.0)
#: policies that know what a deployment cannot (hinge-benefit reads every item's new
#: embedding; docs/methods.md, "Backfill policies"): planned and shown, never recommended
REFERENCE_POLICIES = ("hinge-benefit",)
#: the option kinds
CANDIDATE, COLD, STAY = "candidate", "cold refresh", "stay on old"
#: modes that first transform every stored old vector (psi for adapted, FCT's h for fct), at
#: the rate of --psi-per-s, before the new model serves
GALLERY_TRANSFORM_MODES = ("adapted", "fct")


@dataclass(frozen=True)
class FixedCosts:
    """What an upgrade costs beyond re-embedding (docs/planning.md, "Fixed costs"), each 0 when
    not given: ``training_hours`` and ``index_build_hours`` (device-hours at the device price),
    the second vector set held until the end (``storage_gib`` at ``storage_price`` per
    GiB-hour), and ``new_items_per_hour`` arriving during the backfill, each embedded once more
    (by the model the gallery is leaving)."""

    training_hours: float = 0.0
    index_build_hours: float = 0.0
    storage_gib: float = 0.0
    storage_price: float = 0.0
    new_items_per_hour: float = 0.0
    #: ``(model, device-hours)``: a candidate's own training, read from its bundle (it takes
    #: the place of ``training_hours`` for that candidate), with what the report says of it
    training_by_model: tuple[tuple[str, float], ...] = ()
    training_notes: tuple[str, ...] = ()

    def training_for(self, model: str | None) -> float:
        """The training device-hours of candidate ``model``."""
        return dict(self.training_by_model).get(model, self.training_hours)

    def parts(
        self, end_hours: float, price: float, rate: EmbeddingRate, model: str | None = None
    ) -> dict[str, float]:
        """Each fixed cost of an upgrade to ``model`` that ends at ``end_hours``."""
        arrivals_h = self.new_items_per_hour * end_hours / (rate.items_per_s * 3600.0)
        return {
            "training": self.training_for(model) * price,
            "index build": self.index_build_hours * price,
            "storage": self.storage_gib * end_hours * self.storage_price,
            "arrivals": arrivals_h * price,
        }


@dataclass(frozen=True)
class Hardware:
    """What the plan runs on: ``items`` to re-embed on ``devices`` devices of ``device_kind`` at
    ``price`` per device-hour, with the query load that prices second searches (or None), the
    store's write rate that bounds the backfill (items/s, or None) and the fixed costs."""

    items: int
    devices: int
    device_kind: str
    price: float
    search: SearchLoad | None = None
    store_items_per_s: float | None = None
    fixed: FixedCosts = FixedCosts()

    def extra_devices(self, mode: str) -> float:
        return 0.0 if self.search is None else self.search.extra_devices(mode)


@dataclass(frozen=True)
class Timeline:
    """Quality on the wall clock: points ``(hours, quality, low, high, nfr)``, linear between
    points (two points at one hour: a step); ``old``: the point serves the old system itself."""

    hours: np.ndarray
    quality: np.ndarray
    low: np.ndarray
    high: np.ndarray
    nfr: np.ndarray
    old: np.ndarray

    @staticmethod
    def of(points: list[tuple]) -> Timeline:
        """From ``(hours, Estimate, nfr, old)`` tuples in time order."""
        cols = list(zip(*points, strict=True))
        est = cols[1]
        return Timeline(
            hours=np.asarray(cols[0], dtype=np.float64),
            quality=np.asarray([e.value for e in est], dtype=np.float64),
            low=np.asarray([e.low for e in est], dtype=np.float64),
            high=np.asarray([e.high for e in est], dtype=np.float64),
            nfr=np.asarray(cols[2], dtype=np.float64),
            old=np.asarray(cols[3], dtype=bool),
        )

    def _held(self, horizon: float, q: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(hours, quality)`` (or ``q``, one value per point) cut at ``horizon``, the last
        value held up to it."""
        h = self.hours
        q = self.quality if q is None else np.asarray(q, np.float64)
        keep = h <= horizon
        hours, values = list(h[keep]), list(q[keep])
        if h[-1] > horizon:  # cut inside the segment that crosses the horizon
            values.append(self.value_at(horizon, q))
            hours.append(horizon)
        elif hours[-1] < horizon:
            hours.append(horizon)
            values.append(values[-1])
        return np.asarray(hours), np.asarray(values)

    def value_at(self, hour: float, values: np.ndarray | None = None) -> float:
        """Quality (or ``values``, one per point) at ``hour``: the later side of a step,
        linear between points, the last value after the end."""
        q = self.quality if values is None else values
        i = int(np.searchsorted(self.hours, hour, side="right")) - 1
        if i < 0:
            return float(q[0])
        if i >= len(self.hours) - 1:
            return float(q[-1])
        h0, h1 = self.hours[i], self.hours[i + 1]
        return float(q[i] + (q[i + 1] - q[i]) * (hour - h0) / (h1 - h0))

    def estimate_at(self, hour: float) -> Estimate:
        """Quality with its band at ``hour``."""
        return Estimate(*(self.value_at(hour, a) for a in (self.quality, self.low, self.high)))

    def quality_hours(self, horizon: float, values: np.ndarray | None = None) -> float:
        """The trapezoid integral of quality (or ``values``, one per point: the integral is
        linear in them) over ``[0, horizon]`` hours."""
        h, q = self._held(horizon, values)
        return float(((q[1:] + q[:-1]) / 2.0 * np.diff(h)).sum())

    def lower(self) -> np.ndarray:
        """The lower bound at every point (the value where there is no interval)."""
        return np.where(np.isfinite(self.low), self.low, self.quality)

    def first_pass(self, old_value: float) -> float | None:
        """The first hour the lower bound rises above ``old_value`` (linear between points, the
        later side of a step), or None; points serving the old system never pass."""
        low = self.lower()
        passes = (low > old_value) & ~self.old
        for j in np.flatnonzero(passes):
            if j == 0:
                return float(self.hours[0])
            if passes[j - 1]:
                continue
            h0, h1, m0, m1 = self.hours[j - 1], self.hours[j], low[j - 1], low[j]
            if self.old[j - 1] or h1 == h0:
                return float(h1)
            return float(h0 + (h1 - h0) * (old_value - m0) / (m1 - m0))
        return None


@dataclass(frozen=True)
class Milestone:
    """An option at one fraction of the gallery: when (hours; None: never), at what cost, and
    the quality it serves then (``interpolated``: between two grid points of the curve)."""

    fraction: float
    hours: float | None
    cost: float
    quality: Estimate
    #: NFR@1 then, with its interval (none for a reference's exact zero)
    nfr: Estimate
    interpolated: bool = False
    #: top-1 served then, with its interval (NaN: the simulation did not measure it)
    top1: Estimate = Estimate(math.nan)


@dataclass(frozen=True)
class Option:
    """One way to upgrade (or not): its milestones, timeline and price.

    ``end_hours``: when every item holds its new vector (None: never); ``prep_hours``: the psi
    refresh before the adapted mode serves; ``devices_busy``: devices paid per hour until the
    end (the backfill's plus a second search's)."""

    model: str
    policy: str
    mode: str
    kind: str
    deployable: bool
    milestones: tuple[Milestone, ...]
    timeline: Timeline
    end_hours: float | None
    prep_hours: float
    devices_busy: float
    price: float
    rate: EmbeddingRate | None
    psi: PsiRate | None = None
    #: the fixed costs of this option (:class:`FixedCosts`; empty for staying on the old model)
    fixed_costs: tuple[tuple[str, float], ...] = ()
    #: ``end_hours`` and ``total_cost`` at the fastest and the slowest of the rate's timed
    #: windows (None: a rate without windows); see :func:`end_and_cost_range`
    end_range: tuple[float, float] | None = None
    cost_range: tuple[float, float] | None = None

    @property
    def label(self) -> str:
        if self.kind == STAY:
            return "stay on old"
        if self.kind == COLD:
            return f"{self.model} / cold refresh"
        return f"{self.model} / {self.policy} / {self.mode}"

    def cost_at(self, hours: float | None) -> float:
        """What the devices cost up to ``hours`` (capped at the end: nothing runs after it)."""
        if hours is None or self.end_hours is None:
            return 0.0
        return min(hours, self.end_hours) * self.devices_busy * self.price

    @property
    def fixed_cost(self) -> float:
        return float(sum(v for _, v in self.fixed_costs))

    @property
    def total_cost(self) -> float:
        """The devices' cost to the end plus the fixed costs."""
        return self.cost_at(self.end_hours) + self.fixed_cost


def _hours_at(work: float, prep_s: float, rate: EmbeddingRate, hw: Hardware) -> float:
    """Hours until ``work`` of the gallery is re-embedded: the devices' rate, bounded by the
    store's write rate when one is given."""
    per_s = rate.items_per_s * hw.devices
    if hw.store_items_per_s is not None:
        per_s = min(per_s, hw.store_items_per_s)
    return (prep_s + rate.startup_s + work * hw.items / per_s) / 3600.0


def _with_fixed(option: Option, hw: Hardware) -> Option:
    parts = hw.fixed.parts(option.end_hours, option.price, option.rate, option.model)
    option = replace(option, fixed_costs=tuple((k, v) for k, v in parts.items() if v))
    ranges = end_and_cost_range(option, hw)
    if ranges is None:
        return option
    return replace(option, end_range=ranges[0], cost_range=ranges[1])


def end_and_cost_range(option: Option, hw: Hardware):
    """``((end, end), (cost, cost))`` of an option that re-embeds, at the fastest and at the
    slowest of its rate's timed windows (:attr:`EmbeddingRate.window_range`), by the plan's own
    arithmetic; None when the rate has no windows (given, or measured as one number)."""
    rate = option.rate
    if rate is None or rate.window_range is None or option.end_hours is None:
        return None
    slow, fast = rate.window_range
    at = [end_and_cost_on(replace(option, rate=rate.at(r)), hw, hw.devices) for r in (fast, slow)]
    return (at[0][0], at[1][0]), (at[0][1], at[1][1])


def end_and_cost_on(option: Option, hw: Hardware, devices: int) -> tuple[float, float]:
    """``(end_hours, total_cost)`` of an option that re-embeds (a candidate or a cold refresh)
    on ``devices`` devices instead of ``hw.devices``, by the same arithmetic as a plan made with
    that many: what ``--devices`` advice is checked against."""
    on = replace(hw, devices=devices)
    prep_s = option.psi.seconds(on.items, devices) if option.psi is not None else 0.0
    end = _hours_at(1.0, prep_s, option.rate, on)
    fixed = sum(hw.fixed.parts(end, option.price, option.rate, option.model).values())
    return end, end * (devices + on.extra_devices(option.mode)) * option.price + fixed


def candidate_option(
    sim: Simulation, curve: Curve, hw: Hardware, rate: EmbeddingRate, psi: PsiRate | None
) -> Option:
    """A hot refresh: ``curve``'s policy and mode for model ``sim`` (the gallery transform
    first in a mode that serves transformed old vectors: psi for adapted, FCT's h for fct)."""
    transform = curve.mode in GALLERY_TRANSFORM_MODES
    prep_s = psi.seconds(hw.items, hw.devices) if transform else 0.0
    points = []
    if prep_s > 0:  # the old system serves until psi has refreshed every stored vector
        points += [(0.0, sim.old_old, 0.0, True), (prep_s / 3600.0, sim.old_old, 0.0, True)]
    # a mode that scores old items with the old query (naive_merge) is the old system at t = 0
    old_at_start = mode_spec(curve.mode).old_side == "old-old"
    first, nfr0, _ = curve.at(0.0)
    points.append((prep_s / 3600.0, first, nfr0, old_at_start))
    for j in range(len(curve.fractions)):
        est = Estimate(float(curve.quality[j]), float(curve.low[j]), float(curve.high[j]))
        old = old_at_start and curve.fractions[j] == 0
        points.append((_hours_at(curve.work[j], prep_s, rate, hw), est, curve.nfr[j], old))
    option = Option(
        model=sim.model,
        policy=curve.policy,
        mode=curve.mode,
        kind=CANDIDATE,
        deployable=curve.policy not in REFERENCE_POLICIES,
        milestones=(),
        timeline=Timeline.of(points),
        end_hours=_hours_at(1.0, prep_s, rate, hw),
        prep_hours=prep_s / 3600.0,
        devices_busy=hw.devices + hw.extra_devices(curve.mode),
        price=hw.price,
        rate=rate,
        psi=psi if transform else None,
    )
    milestones = []
    for f in MILESTONES:
        quality, _, interpolated = curve.at(f)
        h = _hours_at(curve.work_at(f), prep_s, rate, hw)
        milestones.append(
            Milestone(
                f, h, option.cost_at(h), quality, curve.nfr_at(f), interpolated, curve.top1_at(f)
            )
        )
    return replace(_with_fixed(option, hw), milestones=tuple(milestones))


def cold_refresh_option(sim: Simulation, hw: Hardware, rate: EmbeddingRate) -> Option:
    """Re-embed everything while the old system serves, then switch to ``sim``'s model."""
    end = _hours_at(1.0, 0.0, rate, hw)
    points = [
        (0.0, sim.old_old, 0.0, True),
        (end, sim.old_old, 0.0, True),
        (end, sim.new_new, sim.new_new_nfr.value, False),
    ]
    option = Option(
        model=sim.model,
        policy="any",
        mode="cold",
        kind=COLD,
        deployable=True,
        milestones=(),
        timeline=Timeline.of(points),
        end_hours=end,
        prep_hours=0.0,
        devices_busy=float(hw.devices),
        price=hw.price,
        rate=rate,
    )
    milestones = []
    for f in MILESTONES:
        h = _hours_at(f, 0.0, rate, hw)
        done = f >= 1.0
        quality = sim.new_new if done else sim.old_old
        nfr = sim.new_new_nfr if done else Estimate(0.0)
        top1 = sim.new_new_top1 if done else sim.old_old_top1
        milestones.append(Milestone(f, h, option.cost_at(h), quality, nfr, top1=top1))
    return replace(_with_fixed(option, hw), milestones=tuple(milestones))


def stay_on_old_option(
    old_old: Estimate, hw: Hardware, old_old_top1: Estimate = Estimate(math.nan)
) -> Option:
    """Keep the old model: old-old at every hour, nothing re-embedded, nothing paid."""
    timeline = Timeline.of([(0.0, old_old, 0.0, True)])
    milestones = tuple(
        Milestone(f, None, 0.0, old_old, Estimate(0.0), top1=old_old_top1) for f in MILESTONES
    )
    return Option(
        model="old",
        policy="none",
        mode="old",
        kind=STAY,
        deployable=True,
        milestones=milestones,
        timeline=timeline,
        end_hours=None,
        prep_hours=0.0,
        devices_busy=0.0,
        price=hw.price,
        rate=None,
    )


def horizon_hours(options: list[Option]) -> float:
    """H: the end of the slowest option (0 when none ends)."""
    ends = [o.end_hours for o in options if o.end_hours is not None]
    return max(ends) if ends else 0.0


def finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)
