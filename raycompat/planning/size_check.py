"""The gallery-size check (docs/planning.md, "The gallery-size check"): the plan applies curves
of a simulated gallery, per fraction, to a gallery of any size; this re-runs each candidate's
simulation on nested subsamples of its gallery (every smaller one inside the larger ones, the
queries kept) and plans each size the same way, so that the plan can say whether its options'
quality-hours and ranking move with the gallery's size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from raycompat.config import ConfigError

__all__ = ["SizeCheck", "nested_subsample", "size_check"]

#: the gallery fractions re-simulated by default
SIZE_FRACTIONS = (0.25, 0.5, 1.0)
#: the seed of the nested subsamples
SUBSAMPLE_SEED = 0


@dataclass(frozen=True)
class SizeCheck:
    """Per gallery size (items): every option's quality-hours (by label) and the recommended
    option's label (None: nothing recommended); ``skipped``: curves not re-simulated, and why."""

    sizes: tuple[int, ...]
    quality_hours: dict[str, tuple[float | None, ...]]
    recommended: tuple[str | None, ...]
    skipped: tuple[str, ...]
    #: each option's bootstrap interval of its quality-hours at every size (None: no interval)
    intervals: dict[str, tuple[tuple[float, float] | None, ...]] = dataclasses.field(
        default_factory=dict
    )

    @property
    def recommendation_changes(self) -> bool:
        return len(set(self.recommended)) > 1

    def ranks(self) -> dict[str, tuple[int | None, ...]]:
        """Each option's rank (1: most quality-hours) at every size."""
        out = {label: [] for label in self.quality_hours}
        for j in range(len(self.sizes)):
            values = {k: v[j] for k, v in self.quality_hours.items() if v[j] is not None}
            order = sorted(values, key=lambda k: -values[k])
            for label in out:
                out[label].append(order.index(label) + 1 if label in values else None)
        return {k: tuple(v) for k, v in out.items()}


def nested_subsample(data, fraction: float, seed: int = SUBSAMPLE_SEED):
    """``data`` with the first ``round(fraction * N)`` items of one seeded permutation (so a
    smaller subsample is inside every larger one), in their original order; the queries kept."""
    n = data.n_items
    keep = np.sort(np.random.default_rng(seed).permutation(n)[: max(1, round(fraction * n))])
    fields = {}
    for f in dataclasses.fields(data):
        value = getattr(data, f.name)
        if f.name.startswith("gallery_") or f.name == "item_costs":
            value = None if value is None else np.asarray(value)[keep]
        fields[f.name] = value
    fields.pop("checked_finite", None)
    return type(data)(**fields)


def _embeddings_of(sim) -> str:
    with open(sim.path) as fh:
        config = json.load(fh).get("config") or {}
    source = config.get("source")
    if not source or source == "memory" or not os.path.exists(str(source)):
        raise ConfigError(
            f"--size-check re-simulates {sim.path}, whose embeddings are not on disk (its "
            f"config's source is {source!r}): simulate from a parquet gallery"
        )
    return str(source)


def _load(sim):
    """``(gallery, head)``: ``sim``'s parquet gallery, with the gallery-side modules of its new
    model bundle (psi, h, rho) applied and its classifier head as the uncertainty policies' head
    when its simulation had one (the same inputs as the simulation it re-runs)."""
    from raycompat.embeddings.gallery import load_parquet

    data = load_parquet(_embeddings_of(sim))
    from raycompat.planning.inputs import simulation_bundle

    path = simulation_bundle(sim)
    if path is None:
        return data, None
    from raycompat.models import ModelBundle
    from raycompat.models.uncertainty_head import UncertaintyHead
    from raycompat.upgrade.modes import apply_bundle_modules

    bundle = ModelBundle.load(path)
    data = apply_bundle_modules(data, bundle)
    head = None
    if "head" in bundle.modules:
        head = UncertaintyHead.from_classifier_head(bundle.head)
    return data, head


def _simulate(sim, data, head, tmp: str, skipped: list, order: int = 0) -> str:
    """Re-simulate ``sim``'s runnable curves on ``data`` with the settings of its simulation
    (k, grid, seed, bootstrap, learned sample, rank-merge distance); returns the curves.json
    written."""
    from raycompat.metrics.bootstrap import BootstrapOptions
    from raycompat.simulator import simulate_backfill
    from raycompat.simulator.report import write_samples
    from raycompat.upgrade.modes import available_modes
    from raycompat.upgrade.policies import check_policy_inputs
    from raycompat.upgrade.policies.base import PolicyInputs

    with open(sim.path) as fh:
        curves = json.load(fh)
    config = curves.get("config") or {}
    boot = curves.get("bootstrap")
    settings = {
        "bootstrap": None if not boot else BootstrapOptions(**boot),
        "head": head,
    }
    if "learned_sample_fraction" in config:
        settings["learned_sample_fraction"] = config["learned_sample_fraction"]
    if "rank_merge_distance" in config:
        settings["rank_merge_distance"] = config["rank_merge_distance"]
    policies, modes = [], []
    available = available_modes(data)
    for c in sim.curves:
        try:
            check_policy_inputs(
                [c.policy], PolicyInputs(n_items=data.n_items, data=data, head=head)
            )
        except ValueError as exc:
            skipped.append(f"{sim.model} / {c.policy}: {exc}")
            continue
        if c.mode not in available:
            skipped.append(f"{sim.model} / {c.mode}: its vectors are not in the gallery's file")
            continue
        policies.append(c.policy)
        modes.append(c.mode)
    policies, modes = sorted(set(policies)), sorted(set(modes))
    res = simulate_backfill(
        data,
        policies,
        modes,
        k=sim.k,
        fractions=list(sim.curves[0].fractions),
        seed=int(config.get("seed", 0)),
        **settings,
    )
    folder = os.path.join(tmp, f"{sim.model.replace('/', '_')}-{data.n_items}-{order}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "curves.json")
    payload = res.to_dict()
    payload["cost_model"] = sim.cost_model
    with open(path, "w") as fh:
        json.dump(payload, fh)
    write_samples(res, folder)  # the per-query terms: the plan's paired intervals at this size
    return path


def size_check(sims, plan_at, fractions=SIZE_FRACTIONS, log=print) -> SizeCheck:
    """Re-simulate every candidate on nested subsamples of its gallery (``fractions`` of it)
    and plan each size with ``plan_at(simulations) -> Plan`` (the plan's own settings)."""

    loaded = {s.model: _load(s) for s in sims}
    galleries = {m: data for m, (data, _) in loaded.items()}
    sizes, table, bands, recommended, skipped = [], {}, {}, [], []
    with tempfile.TemporaryDirectory() as tmp:
        for j, f in enumerate(sorted(fractions)):
            subs = {m: nested_subsample(d, f) for m, d in galleries.items()}
            sizes.append(next(iter(subs.values())).n_items)
            log(f"size check: {sizes[-1]:,} items ({100 * f:g} % of the gallery)")
            resim = [_resimulate(s, subs[s.model], loaded[s.model][1], tmp, skipped) for s in sims]
            plan = plan_at(resim)
            for a in plan.assessed:
                table.setdefault(a.option.label, [None] * len(fractions))[j] = a.quality_hours
                bands.setdefault(a.option.label, [None] * len(fractions))[j] = _interval(a)
            chosen = plan.recommendation.chosen
            recommended.append(None if chosen is None else chosen.option.label)
    return SizeCheck(
        tuple(sizes),
        {k: tuple(v) for k, v in table.items()},
        tuple(recommended),
        tuple(dict.fromkeys(skipped)),
        {k: tuple(v) for k, v in bands.items()},
    )


def _resimulate(sim, data, head, tmp: str, skipped: list):
    """``sim`` re-simulated on ``data``: each of its random orders (its simulations' seeds),
    merged as the plan merged them."""
    from raycompat.planning.inputs import read_simulation
    from raycompat.planning.random_orders import merge_orders

    paths = sim.order_paths or (sim.path,)
    parts = [
        read_simulation(
            _simulate(dataclasses.replace(sim, path=p), data, head, tmp, skipped, k), sim.model
        )
        for k, p in enumerate(paths)
    ]
    return merge_orders(parts)


def _interval(assessment) -> tuple[float, float] | None:
    """The quality-hours interval of a planned option (None where it has none)."""
    c = assessment.comparison
    if c is None or not c.quality_hours.low == c.quality_hours.low:  # NaN: no interval
        return None
    return float(c.quality_hours.low), float(c.quality_hours.high)
