"""The plan: every option of every candidate model on one clock, assessed against the
constraints, with the recommendation (:func:`make_plan`), and the notes that say where each
number came from."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from raycompat.config import ConfigError
from raycompat.planning.inputs import Estimate, Simulation
from raycompat.planning.paired import SAMPLES_FILE, compare_options
from raycompat.planning.rates import (
    EmbeddingRate,
    PsiRate,
    check_rate_device,
    rate_from_cost_model,
)
from raycompat.planning.recommend import (
    Assessment,
    Constraints,
    Recommendation,
    assess,
    ranked,
    recommend,
)
from raycompat.planning.timeline import (
    CANDIDATE,
    COLD,
    GALLERY_TRANSFORM_MODES,
    Hardware,
    candidate_option,
    cold_refresh_option,
    horizon_hours,
    stay_on_old_option,
)

__all__ = ["Plan", "candidates", "make_plan", "model_rates"]


@dataclass(frozen=True)
class Plan:
    """Everything the report shows: the inputs, the hardware, the rate each model uses, the
    options assessed (candidates, then each model's cold refresh, then staying on the old
    model), the horizon, the recommendation and the notes."""

    simulations: tuple[Simulation, ...]
    hardware: Hardware
    rates: dict[str, EmbeddingRate]
    psi: PsiRate | None
    constraints: Constraints
    metric: str
    old_old: Estimate
    horizon: float
    assessed: tuple[Assessment, ...]
    recommendation: Recommendation
    notes: tuple[str, ...]
    #: the gallery-size check (:class:`raycompat.planning.size_check.SizeCheck`), when asked
    size_check: Any = None


def model_rates(
    sims, given: EmbeddingRate | None, device_kind: str | None = None
) -> dict[str, EmbeddingRate]:
    """The embedding rate of each model: the given one, else its simulation's cost model
    (checked against ``device_kind`` when given: :func:`check_rate_device`)."""
    out = {}
    for s in sims:
        rate = given or rate_from_cost_model(s.cost_model, s.path)
        if rate is None:
            raise ConfigError(
                f"--results {s.path}: no embedding rate recorded; give --items-per-s, "
                "--rate-summary or --rate-model"
            )
        if given is None and device_kind is not None:
            check_rate_device(rate, device_kind, s.path)
        out[s.model] = rate
    return out


def candidates(sims, policies=(), modes=(), psi: PsiRate | None = None) -> list[tuple]:
    """``(simulation, curve)`` of every candidate the ``policies`` / ``modes`` filters keep;
    ``ConfigError`` when none is left, or for the adapted mode without a psi rate."""
    keep = [
        (s, c)
        for s in sims
        for c in s.curves
        if (not policies or c.policy in policies) and (not modes or c.mode in modes)
    ]
    if not keep:
        raise ConfigError("no candidate left: --policies / --modes keep no curve of --results")
    if psi is None and any(c.mode in GALLERY_TRANSFORM_MODES for _, c in keep):
        raise ConfigError(
            "the adapted and fct modes need the gallery transform's rate (psi, FCT's h): give "
            "--psi-per-s or --psi-model, or leave them out with --modes"
        )
    return keep


def _notes(sims, hw: Hardware, psi, adapted: bool) -> list[str]:
    first = sims[0]
    notes = []
    if hw.items != first.n_items:
        notes.append(
            f"The curves come from a simulation of {first.n_items:,} gallery items and "
            f"{first.n_queries:,} queries; the plan applies them, per fraction of the gallery, "
            f"to {hw.items:,} items (it assumes the quality at each fraction does not change "
            "with the gallery's size)."
        )
    for s in sims:
        if s.orders > 1:
            notes.append(
                f"{s.model}: {s.orders} random orders (the simulations "
                f"{', '.join(s.order_paths)}, each with its own --seed): every curve is their "
                "mean, and its intervals resample the orders beside the query classes."
            )
    if hw.search is None:
        notes.append(
            "Second searches per query (rank_merge, naive_merge) are not counted: no "
            "--queries-per-s was given."
        )
    else:
        notes.append(
            f"Second searches: {hw.search.queries_per_s:g} queries/s at "
            f"{hw.search.searches_per_s:g} searches/s per device (given)."
        )
    if adapted and psi is not None:
        notes.append(
            f"gallery transform (psi for adapted, h for fct): {psi.vectors_per_s:,.0f} "
            "vectors/s per device, "
            f"{psi.source}."
        )
    if not first.has_intervals:
        notes.append("The simulations carry no intervals: every check compares values.")
    return notes


def option_sources(option, sim, curve_index: int | None):
    """The sample behind each point of ``option``'s timeline (see
    :func:`raycompat.planning.timeline.candidate_option` and the baselines), or None when the
    simulation wrote no samples for it."""
    qs = sim.samples
    if qs is None:
        return None
    oo, nn = qs.references.get("old-old"), qs.references.get("new-new")
    if option.kind == CANDIDATE:
        cs = qs.curves[curve_index] if curve_index is not None else None
        if cs is None:
            return None
        prep = [(oo, None), (oo, None)] if option.prep_hours > 0 else []
        pts = prep + [(cs, 0)] + [(cs, j) for j in range(cs.num.shape[2])]
    elif option.kind == COLD:
        if nn is None:
            return None
        pts = [(oo, None), (oo, None), (nn, None)]
    else:
        pts = [(oo, None)]
    return pts if len(pts) == len(option.timeline.hours) else None


def _plain_values(option, sim, curve) -> np.ndarray | None:
    """The unweighted quality at each point of ``option``'s timeline (as :func:`option_sources`
    lays the points out), or None when ``sim`` is not weighted."""
    refs = sim.plain_references
    if not sim.weighted or refs is None:
        return None
    oo, nn = refs["old-old"], refs["new-new"]
    if option.kind == CANDIDATE:
        prep = [oo, oo] if option.prep_hours > 0 else []
        return np.asarray(prep + [curve.plain[0], *curve.plain], np.float64)
    if option.kind == COLD:
        return np.asarray([oo, oo, nn], np.float64)
    return np.asarray([oo], np.float64)


def _with_plain(assessed, plain, horizon: float) -> list[Assessment]:
    out = []
    for a, values in zip(assessed, plain, strict=True):
        qh = None if values is None else a.option.timeline.quality_hours(horizon, values)
        out.append(replace(a, plain_quality_hours=qh))
    return out


def _compared(assessed, sources, sims, horizon: float) -> tuple[list[Assessment], str]:
    """Every option with its paired comparison to the best deployable option that meets the
    constraints (else the best deployable one), and the note that says how it was made."""
    with_samples = [s.samples for s in sims]
    if any(q is None for q in with_samples):
        missing = next(s.path for s in sims if s.samples is None)
        return assessed, (
            f"No paired intervals: {missing} has no {SAMPLES_FILE} beside it (a simulation "
            "without a bootstrap, or written before samples were kept); options are ranked by "
            "their values alone."
        )
    first = with_samples[0]
    if any(not np.array_equal(q.query_labels, first.query_labels) for q in with_samples[1:]):
        return assessed, "No paired intervals: the simulations' query classes differ."
    pool = [a for a in assessed if a.recommendable] or [a for a in assessed if a.option.deployable]
    best = assessed.index(ranked(pool)[0])
    comps = compare_options(
        assessed, sources, best, horizon=horizon, options=first.options, labels=first.query_labels
    )
    if comps is None:
        return assessed, "No paired intervals: an option's curve has no samples."
    o = first.options
    note = (
        f"Quality-hours carry {100 * o.confidence:g} % bootstrap intervals over the query classes "
        f"({o.resamples} resamples, the simulation's); each option is compared with "
        f"{assessed[best].option.label} on the same resamples (paired)."
    )
    return [replace(a, comparison=c) for a, c in zip(assessed, comps, strict=True)], note


def make_plan(
    sims: list[Simulation],
    hw: Hardware,
    constraints: Constraints,
    *,
    rate: EmbeddingRate | None = None,
    psi: PsiRate | None = None,
    policies=(),
    modes=(),
    rate_device_check: bool = True,
) -> Plan:
    """Every option of ``sims`` (filtered by ``policies`` / ``modes``), both baselines,
    assessed, and the recommendation. ``rate``: the embedding rate per device (None: each
    simulation's own); ``psi``: needed when an adapted-mode option is planned."""
    chosen = candidates(sims, policies, modes, psi)
    rates = model_rates(sims, rate, hw.device_kind if rate_device_check else None)
    options = [candidate_option(s, c, hw, rates[s.model], psi) for s, c in chosen]
    sources = [option_sources(o, s, c.index) for o, (s, c) in zip(options, chosen, strict=True)]
    options += [cold_refresh_option(s, hw, rates[s.model]) for s in sims]
    colds = options[len(chosen) :]
    sources += [option_sources(o, s, None) for o, s in zip(colds, sims, strict=True)]
    options.append(stay_on_old_option(sims[0].old_old, hw, sims[0].old_old_top1))
    sources.append(option_sources(options[-1], sims[0], None))
    horizon = horizon_hours(options)
    old_value = sims[0].old_old.value
    assessed = assess(options, constraints, old_value, horizon)
    curve_of = [c for _, c in chosen] + [None] * (len(options) - len(chosen))
    sim_of = [s for s, _ in chosen] + list(sims) + [sims[0]]
    plain = [_plain_values(o, s, c) for o, s, c in zip(options, sim_of, curve_of, strict=True)]
    assessed = _with_plain(assessed, plain, horizon)
    assessed, paired_note = _compared(assessed, sources, sims, horizon)
    rec = recommend(assessed, constraints, metric=sims[0].metric, horizon=horizon, hardware=hw)
    notes = _notes(sims, hw, psi, any(c.mode in GALLERY_TRANSFORM_MODES for _, c in chosen))
    notes.append(paired_note)
    if sims[0].weighted:
        notes.append(
            f"Ranked on the frequency-weighted curves (each query of the simulation's query log "
            f"counted by how often it is searched); the {sims[0].metric}-hours of the unweighted "
            "curves (every query once) are shown beside."
        )
    return Plan(
        simulations=tuple(sims),
        hardware=hw,
        rates=rates,
        psi=psi,
        constraints=constraints,
        metric=sims[0].metric,
        old_old=sims[0].old_old,
        horizon=horizon,
        assessed=tuple(assessed),
        recommendation=rec,
        notes=tuple(notes),
    )
