"""Constraints on an upgrade, each option's standing against them, and the recommendation
(docs/planning.md, "The recommendation").

* ``never_below_old``: at every point where an option serves something new, the lower bound of
  its mAP@k interval is at least old-old's value (by value where there are no intervals);
* ``max_nfr``: NFR@1 at every point at most this (its value);
* ``deadline_hours``: every item re-embedded by then (staying on the old model never is);
* ``budget``: the total cost at most this.

The recommendation is the deployable option that meets every constraint with the most
quality-hours (ties: the better quality after the horizon, the cheaper, the earlier). When
none meets them, the constraints that bind are those whose removal alone would admit an option,
each with what would relax it: the devices that would meet the deadline, the deadline that
would, the budget that would, the ``--max-nfr`` that would (or, when no single one does, every
constraint the nearest option breaks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from raycompat.planning.inputs import Estimate
from raycompat.planning.timeline import Option

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

    @property
    def meets(self) -> bool:
        return not self.violations

    @property
    def recommendable(self) -> bool:
        return self.meets and self.option.deployable


@dataclass(frozen=True)
class Binding:
    """A constraint that binds, and what would relax it."""

    constraint: str
    advice: str


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


def _ranked(assessed: list[Assessment]) -> list[Assessment]:
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


def _deadline_advice(admitted: list[Assessment], deadline: float, devices: int):
    upgrading = [a for a in admitted if a.option.end_hours is not None]
    if not upgrading:
        return "only staying on the old model meets the other constraints, and it never upgrades"
    best = _ranked(upgrading)[0].option
    fastest = min(_ranked(upgrading), key=lambda a: a.option.end_hours).option
    startup = best.rate.startup_s
    work = (best.end_hours * 3600.0 - startup) * devices  # device-seconds of psi + re-embedding
    spare = deadline * 3600.0 - startup
    more = (
        f"{best.label} would meet it on {math.ceil(work / spare - 1e-9)} devices (it ends at "
        f"{best.end_hours:.3g} h on {devices}; about the same device-hours)"
        if spare > 0
        else f"no device count meets it: {best.label}'s start-up alone takes {startup:.0f} s"
    )
    return f"{more}; or a deadline of {fastest.end_hours:.3g} h would admit {fastest.label}"


def _advice(name: str, admitted: list[Assessment], c: Constraints, devices: int):
    """What would relax constraint ``name``, for the options it alone keeps out."""
    if name == "deadline_hours":
        return _deadline_advice(admitted, c.deadline_hours, devices)
    if name == "budget":
        cheapest = min(admitted, key=lambda a: a.option.total_cost).option
        return (
            f"a budget of {cheapest.total_cost:,.2f} would admit {cheapest.label}; more devices "
            "do not lower it (the same device-hours), a lower price per device-hour would"
        )
    if name == "max_nfr":
        best = min(admitted, key=lambda a: float(a.option.timeline.nfr.max())).option
        worst = float(best.timeline.nfr.max())
        return f"--max-nfr {worst:.4g} would admit {best.label}"
    closest = _ranked(admitted)[0]
    return (
        f"{closest.option.label} meets the others, but {closest.violations[name]}; without "
        "--never-below-old it would be admitted (more queries would narrow the intervals)"
    )


def _binding(assessed: list[Assessment], c: Constraints, devices: int):
    """The constraints whose removal alone admits an option, each with its advice; when there
    is none, every constraint the nearest option breaks."""
    pool = [a for a in assessed if a.option.deployable]
    out = []
    for name in c.active():
        admitted = [a for a in pool if set(a.violations) <= {name}]
        if admitted:
            out.append(Binding(name, _advice(name, admitted, c, devices)))
    if out:
        return tuple(out)
    nearest = min(_ranked(pool), key=lambda a: len(a.violations))
    return tuple(
        Binding(n, f"{nearest.option.label} breaks it together with the others: {why}")
        for n, why in nearest.violations.items()
    )


def recommend(
    assessed: list[Assessment],
    constraints: Constraints,
    *,
    metric: str,
    horizon: float,
    devices: int,
) -> Recommendation:
    """The option to take and why, or the binding constraints and what would relax them."""
    eligible = _ranked([a for a in assessed if a.recommendable])
    if eligible:
        return Recommendation(eligible[0], _chosen_reason(eligible[0], eligible, metric, horizon))
    binding = _binding(assessed, constraints, devices)
    flags = " and ".join(CONSTRAINT_FLAGS[b.constraint] for b in binding)
    return Recommendation(
        None,
        f"No option meets every constraint; {flags} "
        f"{'binds' if len(binding) == 1 else 'bind'}: "
        + "; ".join(f"{CONSTRAINT_FLAGS[b.constraint]}: {b.advice}" for b in binding)
        + ".",
        binding,
    )
