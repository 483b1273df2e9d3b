"""Constraints on an upgrade, each option's standing against them, and the recommendation
(docs/planning.md, "The recommendation").

* ``never_below_old``: at every point where an option serves something new, the lower bound of
  its mAP@k interval is at least old-old's value (by value where there are no intervals);
* ``max_nfr``: NFR@1 at every point at most this (its value);
* ``deadline_hours``: every item re-embedded by then (staying on the old model never is);
* ``budget``: the total cost at most this.

The best option is the deployable option that meets every constraint with the most
quality-hours (ties: the better quality after the horizon, the cheaper, the earlier); with
paired intervals (:mod:`raycompat.planning.paired`) the recommendation is the simplest option
not worse than the best by its paired interval (:func:`simplicity`), else the best. When
none meets them, the constraints that bind are those whose removal alone would admit an option,
each with what would relax it as flags and values to type, rounded up so that typing them admits
the option: the devices that would meet the deadline (with the budget they need), the deadline
that would, the budget that would, the ``--max-nfr`` that would. When no single one admits an
upgrade, every constraint the nearest upgrade breaks, with the values that together admit it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any

import numpy as np

from raycompat.planning.inputs import Estimate
from raycompat.planning.timeline import Hardware, Option, end_and_cost_on

__all__ = [
    "CONSTRAINT_FLAGS",
    "Assessment",
    "Binding",
    "Constraints",
    "Recommendation",
    "assess",
    "recommend",
]

#: each constraint's flag, in the order the plan lists them
CONSTRAINT_FLAGS = {
    "never_below_old": "--never-below-old",
    "max_nfr": "--max-nfr",
    "deadline_hours": "--deadline-hours",
    "budget": "--budget",
}


@dataclass(frozen=True)
class Constraints:
    """The plan's constraints (None / False: not set)."""

    never_below_old: bool = False
    max_nfr: float | None = None
    deadline_hours: float | None = None
    budget: float | None = None

    def active(self) -> list[str]:
        return [c for c in CONSTRAINT_FLAGS if getattr(self, c) not in (None, False)]


@dataclass(frozen=True)
class Assessment:
    """An option with its quality-hours up to the horizon, mean quality over it, quality at the
    deadline (or the horizon), first hour above old-old, and ``violations``: constraint -> how
    the option breaks it."""

    option: Option
    quality_hours: float
    mean_quality: float
    quality_at_deadline: Estimate
    passes_old_at_hours: float | None
    violations: dict[str, str]
    #: quality-hours with their interval and the paired difference to the best option
    #: (:mod:`raycompat.planning.paired`), or None without the simulations' samples
    comparison: Any = None
    #: on frequency-weighted curves: the quality-hours of the unweighted ones (every query
    #: counted once), shown beside; None otherwise
    plain_quality_hours: float | None = None

    @property
    def meets(self) -> bool:
        return not self.violations

    @property
    def recommendable(self) -> bool:
        return self.meets and self.option.deployable


@dataclass(frozen=True)
class Binding:
    """A constraint that binds, and what would relax it: the flags and values to type.
    ``together``: the constraints it binds with when no one of them alone admits an upgrade
    (each of them carries the same advice); empty when it binds alone."""

    constraint: str
    advice: str
    together: tuple[str, ...] = ()


@dataclass(frozen=True)
class Recommendation:
    """The chosen option (None when nothing meets the constraints), the one-sentence reason,
    and the binding constraints when nothing was chosen."""

    chosen: Assessment | None
    reason: str
    binding: tuple[Binding, ...] = ()


def _violations(option: Option, c: Constraints, old_value: float) -> dict[str, str]:
    t, out = option.timeline, {}
    if c.never_below_old:
        low = t.lower()
        below = np.flatnonzero(~t.old & (low < old_value))
        if below.size:
            j = below[0]
            out["never_below_old"] = (
                f"at {t.hours[j]:.3g} h its lower bound {100 * low[j]:.2f} % is below "
                f"old-old's {100 * old_value:.2f} %"
            )
    if c.max_nfr is not None and float(t.nfr.max()) > c.max_nfr:
        out["max_nfr"] = f"NFR@1 reaches {100 * float(t.nfr.max()):.2f} %"
    if c.deadline_hours is not None:
        end = option.end_hours
        if end is None:
            out["deadline_hours"] = "it never re-embeds the gallery"
        elif end > c.deadline_hours:
            out["deadline_hours"] = f"it re-embeds the gallery at {end:.3g} h"
    if c.budget is not None and option.total_cost > c.budget:
        out["budget"] = f"it costs {option.total_cost:,.2f}"
    return out


def assess(
    options: list[Option], constraints: Constraints, old_value: float, horizon: float
) -> list[Assessment]:
    """Every option's numbers up to the common ``horizon`` (hours) and its violations."""
    at = constraints.deadline_hours if constraints.deadline_hours is not None else horizon
    out = []
    for o in options:
        qh = o.timeline.quality_hours(horizon)
        out.append(
            Assessment(
                option=o,
                quality_hours=qh,
                mean_quality=qh / horizon if horizon > 0 else o.timeline.value_at(0.0),
                quality_at_deadline=o.timeline.estimate_at(at),
                passes_old_at_hours=o.timeline.first_pass(old_value),
                violations=_violations(o, constraints, old_value),
            )
        )
    return out


def ranked(assessed: list[Assessment]) -> list[Assessment]:
    """Most quality-hours first (to 12 digits); ties: the better quality served after the
    horizon (a cold refresh's new model against staying on the old one), the cheaper, the
    earlier end, then plan order."""
    return sorted(
        assessed,
        key=lambda a: (
            -round(a.quality_hours, 12),
            -float(a.option.timeline.quality[-1]),
            a.option.total_cost,
            a.option.end_hours or math.inf,
        ),
    )


#: what an option needs beyond the new model's embedder, simplest first (docs/planning.md,
#: "Comparing options"): a mode that needs a second search or a gallery transform
MODE_NEEDS = {"compatible": 0, "cold": 0, "old": 0}


def simplicity(a: Assessment) -> tuple[int, int]:
    """``(policy's needs, mode's needs)``: an order that needs no model (0) beats one that
    needs the gallery's embeddings (1) or the new model's head (2); ``compatible`` (and a cold
    refresh) beats a mode that needs a second search or a transform (1)."""
    from raycompat.upgrade.policies import policy_class

    o = a.option
    try:
        cls = policy_class(o.policy)
        policy = 2 if cls.needs_head else int(cls.needs_embeddings)
    except (KeyError, ValueError):  # "any" (a cold refresh), "none" (staying on the old model)
        policy = 0
    return policy, MODE_NEEDS.get(o.mode, 1)


def simplest(tied: list[Assessment]) -> Assessment:
    """The simplest of options indistinguishable by their intervals (then the most
    quality-hours: ``tied`` is ranked)."""
    return min(tied, key=lambda a: (simplicity(a), tied.index(a)))


def _paired_reason(chosen, best, tied, metric: str, horizon: float) -> str:
    c = chosen.comparison.quality_hours
    others = [a.option.label for a in tied if a is not chosen]
    same = (
        f"; indistinguishable from it by their paired intervals: {', '.join(others)}"
        if others
        else "; every other option that meets the constraints is worse by its paired interval"
    )
    if chosen is best:
        lead = "it meets every constraint and has the most quality-hours"
    else:
        d = chosen.comparison.vs_best
        lead = (
            f"it meets every constraint and is the simplest of the options not worse than the "
            f"best, {best.option.label} ({best.quality_hours:.4g}), by their paired interval "
            f"({d.estimate:+.4g} [{d.low:+.4g}, {d.high:+.4g}] {metric}-hours)"
        )
    return (
        f"{chosen.option.label}: {lead}; {chosen.quality_hours:.4g} [{c.low:.4g}, {c.high:.4g}] "
        f"{metric}-hours over the {horizon:.3g} h horizon{same}."
    )


def _passes_text(a: Assessment) -> str:
    h = a.passes_old_at_hours
    return "never passes old-old" if h is None else f"passes old-old at {h:.3g} h"


def _chosen_reason(best: Assessment, ranked: list[Assessment], metric: str, horizon: float):
    o = best.option
    done = (
        "never re-embeds anything"
        if o.end_hours is None
        else f"re-embeds the gallery in {o.end_hours:.3g} h for {o.total_cost:,.2f}"
    )
    runner = next((a for a in ranked if a is not best), None)
    after = (
        ""
        if runner is None
        else f"; the next best, {runner.option.label}, has {runner.quality_hours:.4g}"
    )
    return (
        f"{o.label}: it meets every constraint and has the most quality-hours, "
        f"{best.quality_hours:.4g} {metric}-hours over the {horizon:.3g} h horizon (mean "
        f"{100 * best.mean_quality:.2f} %); it {_passes_text(best)} and {done}{after}."
    )


def _typed(x: float, *, sig: int | None = None, places: int | None = None) -> str:
    """``x`` written as a limit to type back: rounded up to ``sig`` significant digits or
    ``places`` decimal places, in plain notation, so that the value typed is never below ``x``
    and a constraint ``value <= limit`` admits it (0.0243902 -> 0.02440 -> ``0.0244``)."""
    d = Decimal(repr(float(x)))  # the shortest text that reads back as x
    if d <= 0:
        return "0"
    step = Decimal(1).scaleb(-places if places is not None else d.adjusted() - sig + 1)
    up = (d / step).to_integral_value(rounding=ROUND_CEILING) * step
    return format(up.normalize(), "f")


def _limit_fix(name: str, o: Option) -> tuple[str, str | None]:
    """The flag and value that would stop ``o`` breaking constraint ``name`` (value None: the
    flag left out)."""
    if name == "max_nfr":
        return "--max-nfr", _typed(float(o.timeline.nfr.max()), sig=4)
    if name == "deadline_hours":
        return "--deadline-hours", _typed(o.end_hours, sig=4)
    if name == "budget":
        return "--budget", _typed(o.total_cost, places=2)
    return CONSTRAINT_FLAGS[name], None


def _devices_for(o: Option, deadline: float, hw: Hardware) -> int | None:
    """The fewest devices on which ``o`` ends by ``deadline`` (None: none does, its start-up
    alone takes that long)."""
    startup = o.rate.startup_s
    spare = deadline * 3600.0 - startup
    if spare <= 0:
        return None
    work = (o.end_hours * 3600.0 - startup) * hw.devices  # device-seconds of psi + embedding
    n = max(1, math.ceil(work / spare))
    while end_and_cost_on(o, hw, n)[0] > deadline:  # the estimate checked by the plan's own
        n += 1  # arithmetic, so that typing --devices n admits the option
    while n > 1 and end_and_cost_on(o, hw, n - 1)[0] <= deadline:
        n -= 1
    return n


def _devices_fix(o: Option, c: Constraints, hw: Hardware):
    """``(devices, end_hours, fix)``: the fewest devices on which ``o`` meets the deadline, when
    it ends then, and the flags to type: ``--devices`` and, where the cost on that many breaks
    the budget, the ``--budget`` it needs there (None when no device count meets it)."""
    n = _devices_for(o, c.deadline_hours, hw)
    if n is None:
        return None
    end, cost = end_and_cost_on(o, hw, n)
    fix = [("--devices", str(n))]
    if c.budget is not None and cost > c.budget:
        fix.append(("--budget", _typed(cost, places=2)))
    return n, end, fix


def _said(fix: list[tuple[str, str | None]]) -> str:
    """``[('--devices', '10'), ('--never-below-old', None)]`` -> ``--devices 10 and without
    --never-below-old``."""
    given = " ".join(f"{flag} {value}" for flag, value in fix if value is not None)
    left_out = " ".join(f"without {flag}" for flag, value in fix if value is None)
    return " and ".join(part for part in (given, left_out) if part)


def _deadline_advice(admitted: list[Assessment], c: Constraints, hw: Hardware) -> str:
    upgrading = [a for a in admitted if a.option.end_hours is not None]
    if not upgrading:
        return (
            "without --deadline-hours only staying on the old model is admitted, and it never "
            "upgrades"
        )
    best = ranked(upgrading)[0].option
    fastest = min(ranked(upgrading), key=lambda a: a.option.end_hours).option
    on = _devices_fix(best, c, hw)
    more = (
        f"no device count meets it: {best.label}'s start-up alone takes {best.rate.startup_s:.0f} s"
        if on is None
        else f"{best.label} would meet it with {_said(on[2])} (it ends at {on[1]:.4g} h on "
        f"{on[0]} devices, {best.end_hours:.4g} h on {hw.devices}; about the same device-hours)"
    )
    deadline = _said([_limit_fix("deadline_hours", fastest)])
    return f"{more}; or {deadline} would admit {fastest.label}"


def _advice(name: str, admitted: list[Assessment], c: Constraints, hw: Hardware) -> str:
    """What would relax constraint ``name``, for the options it alone keeps out."""
    if name == "deadline_hours":
        return _deadline_advice(admitted, c, hw)
    if name == "budget":
        cheapest = min(admitted, key=lambda a: a.option.total_cost).option
        return (
            f"{_said([_limit_fix(name, cheapest)])} would admit {cheapest.label}; more devices "
            "do not lower it (the same device-hours), a lower price per device-hour would"
        )
    if name == "max_nfr":
        best = min(admitted, key=lambda a: float(a.option.timeline.nfr.max())).option
        return f"{_said([_limit_fix(name, best)])} would admit {best.label}"
    closest = ranked(admitted)[0]
    return (
        f"{closest.option.label} meets the others, but {closest.violations[name]}; without "
        "--never-below-old it would be admitted (more queries would narrow the intervals)"
    )


def _together(nearest: Assessment, c: Constraints, hw: Hardware) -> str:
    """The changes that together admit ``nearest``: a limit for every constraint it breaks
    and, for a deadline, the devices (with the budget they need) as the other way."""
    o = nearest.option
    broken = [n for n in CONSTRAINT_FLAGS if n in nearest.violations]
    ways = [[_limit_fix(n, o) for n in broken]]
    on = _devices_fix(o, c, hw) if "deadline_hours" in broken else None
    if on is not None:
        kept = [_limit_fix(n, o) for n in broken if n not in ("deadline_hours", "budget")]
        ways.append(kept + on[2])
    said = f"{o.label} would be admitted with {_said(ways[0])}"
    if on is not None:
        said += f"; or with {_said(ways[1])} (it ends at {on[1]:.4g} h on {on[0]} devices)"
    return said


def _binding(assessed: list[Assessment], c: Constraints, hw: Hardware) -> tuple[Binding, ...]:
    """The constraints whose removal alone admits an option, each with its advice. When none
    of them admits an upgrade (only dropping the deadline does, for staying on the old model),
    every constraint the nearest upgrade breaks, with the changes that together admit it."""
    pool = [a for a in assessed if a.option.deployable]
    out = []
    for name in c.active():
        admitted = [a for a in pool if set(a.violations) <= {name}]
        if admitted:
            out.append(Binding(name, _advice(name, admitted, c, hw)))
    upgrades = [a for a in pool if a.option.end_hours is not None]
    if not upgrades or any(set(a.violations) <= {b.constraint} for a in upgrades for b in out):
        return tuple(out)
    nearest = min(ranked(upgrades), key=lambda a: len(a.violations))
    broken = tuple(n for n in CONSTRAINT_FLAGS if n in nearest.violations)
    advice = _together(nearest, c, hw)
    return tuple(Binding(n, advice, together=broken) for n in broken)


def recommend(
    assessed: list[Assessment],
    constraints: Constraints,
    *,
    metric: str,
    horizon: float,
    hardware: Hardware,
) -> Recommendation:
    """The option to take and why, or the binding constraints and what would relax them.
    With paired intervals (``Assessment.comparison``): the simplest option among those that
    meet every constraint and are not worse than the best by their interval (:func:`simplest`)."""
    eligible = ranked([a for a in assessed if a.recommendable])
    if eligible and eligible[0].comparison is not None:
        tied = [a for a in eligible if a.comparison.verdict != "worse"]
        chosen = simplest(tied)
        return Recommendation(chosen, _paired_reason(chosen, eligible[0], tied, metric, horizon))
    if eligible:
        return Recommendation(eligible[0], _chosen_reason(eligible[0], eligible, metric, horizon))
    binding = _binding(assessed, constraints, hardware)
    flags = " and ".join(CONSTRAINT_FLAGS[b.constraint] for b in binding)
    if binding[0].together:
        why = f"{flags} bind together: {binding[0].advice}"
    else:
        why = f"{flags} {'binds' if len(binding) == 1 else 'bind'}: " + "; ".join(
            f"{CONSTRAINT_FLAGS[b.constraint]}: {b.advice}" for b in binding
        )
    return Recommendation(None, f"No option meets every constraint; {why}.", binding)
